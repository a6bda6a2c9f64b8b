"""Distributed datasets: how a global batch becomes one slice per replica.

``strategy.experimental_distribute_dataset(ds)`` expects ``ds`` to be batched by
the GLOBAL batch size. For every batch of size b it gives replica r the rows
``[r*k, min((r+1)*k, b))`` with ``k = ceil(b / N)``: TensorFlow's rebatching
rule. So 6 rows over 2 replicas -> 3 + 3; 6 over 4 -> 2 + 2 + 2 + 0; the last,
partial batch of an epoch may leave a replica an EMPTY slice, which every layer
above must handle (a replica with no rows contributes zero gradient).

Each slice is copied to its replica's device, as a ``PerReplica`` value of
``mirrored.Tensor``s that ``strategy.run`` unpacks. ``iter(dist_dataset)`` is a
``DistributedIterator`` (``next``, ``get_next``, ``get_next_as_optional``), and
``dist_dataset.element_spec`` says what a step's value looks like (``PerReplicaSpec``).

``strategy.distribute_datasets_from_function(fn)`` is the other road: ``fn``
builds a dataset that is already batched per replica; replica r takes batch
``step * N + r``.

Across workers (``MultiWorkerMirroredStrategy``) every worker reads the same
global batches, cuts each into slices for ALL replicas by the same rule, and
keeps the slices of its own (``local_bounds``): TensorFlow's DATA sharding.

Keeping the data set on the devices. Copying every batch from the host
costs a copy per step (on a GPU: a host-to-device transfer of 64 x 784 float32 =
200 KB for the lab's batch). With

    options = mirrored.distribute.InputOptions(experimental_place_dataset_on_device=True)
    dist = strategy.experimental_distribute_dataset(ds, options)
    model.fit(dist, epochs=5)           # or: for x, y in dist: strategy.run(step, (x, y))

the rows of the data set are copied ONCE to every replica device (``ResidentRows``)
and each step sends only the batch's row numbers; each replica gathers its rows
where they already are (``kernels/gather.py`` on a GPU, ``np.take`` on a CPU). It
applies when the epoch is a stream of rows we hold: ``from_tensor_slices(...)`` or a
filled ``cache()``, then ``shuffle``/``repeat``/``take``, then ``batch`` last (before
``prefetch``) — the lab's ``map(scale).cache().shuffle(...).batch(...)`` is resident
from its second epoch (the first one fills the cache). Otherwise the batches are
copied as usual and a warning says why. (TensorFlow has this option for
``distribute_datasets_from_function`` only; here it is for
``experimental_distribute_dataset``, whose batches we can plan by row number.)

Unasked, on GPUs: ``model.fit(ds)`` and ``evaluate(ds)`` with a plain ``Dataset`` (or a
distributed one without options) do the same by themselves, silently, whenever the epoch
can be planned so and the rows fit in ``AUTO_SHARE_OF_FREE_MEMORY`` of each GPU's free
memory (``Residence``, ``fits_on_devices``); the copy is freed when ``fit`` returns, and
the weights are bitwise those of the copied batches. Never on CPUs, where a gather costs
what a copy costs. ``AUTO_PLACE_ON_GPUS = False`` turns it off.

Neighbours: ``data.py`` (the Dataset), ``strategy.py``, ``values.py``.
"""
import warnings

import numpy as np

from kernels.launch import ceil_div
from mirrored import data as _data
from mirrored import nest
from mirrored.program import recording
from mirrored.errors import OutOfRangeError, ResourceExhaustedError
from mirrored.tensor import Tensor, TensorSpec, constant
from mirrored.values import PerReplica


class Optional:
    """``tf.experimental.Optional``: a value or nothing (``get_next_as_optional``)."""

    def __init__(self, value=None, has_value=False, spec_fn=None):
        self._value, self._has, self._spec_fn = value, has_value, spec_fn

    @property
    def element_spec(self):
        return self._spec_fn() if self._spec_fn is not None else None

    def has_value(self):
        """A bool scalar tensor, as TF's."""
        return constant(self._has)

    def get_value(self):
        if not self._has:
            raise OutOfRangeError("Optional.get_value(): the optional has no value (the "
                                  "iterator was at its end); test has_value() first.")
        return self._value

    def __repr__(self):
        return f"<Optional has_value={self._has}>"


#: Why a ``@function`` that takes a batch from an iterator inside runs eagerly (``traced_function.py``).
NEXT_IN_TRACE = ("it takes the next batch from a distributed iterator inside the function, which a "
                 "trace would freeze to this batch (call next() outside and pass the batch in)")


class DistributedIterator:
    """``iter(dist_dataset)``: TensorFlow's distributed iterator, a real iterator object.

    ``next(it)`` (StopIteration at the end, so ``for`` loops work), ``it.get_next()``
    (``tf.errors.OutOfRangeError`` at the end, as TF's eager iterator),
    ``it.get_next_as_optional()`` and ``it.element_spec``."""

    def __init__(self, batches, element_spec):
        self._batches = batches
        self._spec = element_spec

    def __iter__(self):
        return self

    def __next__(self):
        recording.unrecordable(NEXT_IN_TRACE)
        return next(self._batches)

    def get_next(self):
        recording.unrecordable(NEXT_IN_TRACE)
        try:
            return next(self._batches)
        except StopIteration:
            raise OutOfRangeError("End of sequence: the distributed dataset's iterator has no "
                                  "more batches (use get_next_as_optional() to test first).") from None

    def get_next_as_optional(self):
        recording.unrecordable(NEXT_IN_TRACE)
        try:
            return Optional(next(self._batches), True, self._spec)
        except StopIteration:
            return Optional(None, False, self._spec)

    @property
    def element_spec(self):
        return self._spec()


class PerReplicaSpec:
    """The spec of a ``PerReplica`` value: one ``TensorSpec`` per replica (TF's ``PerReplicaSpec``)."""

    def __init__(self, *specs):
        self._value_specs = tuple(specs)

    def __eq__(self, other):
        return isinstance(other, PerReplicaSpec) and self._value_specs == other._value_specs

    def __repr__(self):
        return f"PerReplicaSpec({', '.join(repr(s) for s in self._value_specs)})"


def _distributed_spec(spec, num_replicas):
    """A global batch's spec, as each replica sees it: the batch axis unknown (the last
    batch may split unevenly); a PerReplicaSpec over several replicas."""
    def per_leaf(leaf):
        shape = (None,) + tuple(leaf.shape)[1:] if len(leaf.shape) else ()
        one = TensorSpec(shape, leaf.dtype)
        return one if num_replicas == 1 else PerReplicaSpec(*[one] * num_replicas)
    return nest.map_structure(per_leaf, spec)


class InputOptions:
    """``tf.distribute.InputOptions``: how a distributed dataset feeds its replicas.

    ``experimental_place_dataset_on_device=True``: keep the whole data set on every
    replica device and gather each batch there (see the module docstring). As in
    TensorFlow it cannot be combined with ``experimental_fetch_to_device=True``.
    The other fields are accepted for compatibility (batches always go to the
    devices; there is no prefetch buffer).
    """

    def __init__(self, experimental_fetch_to_device=None, experimental_replication_mode=None,
                 experimental_place_dataset_on_device=False, experimental_per_replica_buffer_size=1):
        if experimental_place_dataset_on_device and experimental_fetch_to_device:
            raise ValueError("`experimental_place_dataset_on_device` can not be set to True when "
                             "experimental_fetch_to_device is True: the data is on the device "
                             "already, there is nothing to fetch. Leave experimental_fetch_to_device unset.")
        self.experimental_place_dataset_on_device = bool(experimental_place_dataset_on_device)
        self.experimental_fetch_to_device = (not self.experimental_place_dataset_on_device
                                             if experimental_fetch_to_device is None
                                             else bool(experimental_fetch_to_device))
        self.experimental_replication_mode = experimental_replication_mode
        self.experimental_per_replica_buffer_size = experimental_per_replica_buffer_size

    def __repr__(self):
        return (f"InputOptions(experimental_place_dataset_on_device="
                f"{self.experimental_place_dataset_on_device}, experimental_fetch_to_device="
                f"{self.experimental_fetch_to_device})")


def rebatch_bounds(batch_size, num_replicas):
    """[(start, stop)] per replica for one global batch (TensorFlow's rule)."""
    per = ceil_div(batch_size, num_replicas)
    return [(min(r * per, batch_size), min((r + 1) * per, batch_size)) for r in range(num_replicas)]


def local_bounds(batch_size, extended):
    """This worker's replicas' [(start, stop)] of one global batch: the rebatching rule
    over every worker's replicas, then the slices of ours (TensorFlow's DATA sharding).
    On one machine that is every slice."""
    offset, local = extended.replica_offset, len(extended.devices)
    return rebatch_bounds(batch_size, extended.num_replicas)[offset:offset + local]


def _to_device(leaf, dev):
    arr = np.asarray(leaf)
    with dev.activate():
        return Tensor(dev.from_numpy(arr), dev)


def _share_to_device(share, dev):
    """One replica's share of a batch (a structure of host arrays) on ``dev``, as Tensors in
    the same structure. Numeric leaves are views of ONE allocation that one host-to-device
    copy fills (``Device.empty_parts``/``upload_parts``): a custom loop's (image, label) step
    made an allocation and a copy per leaf before. Fresh buffers every step: the caller may
    keep the tensors, as TensorFlow's. Any other leaf (strings for a lookup layer) goes alone."""
    leaves = [np.asarray(leaf, order="C") for leaf in nest.flatten(share)]
    if len(leaves) < 2 or any(a.dtype.kind not in "biuf" for a in leaves):
        return nest.pack_sequence_as(share, [_to_device(a, dev) for a in leaves])
    with dev.activate():
        bufs = dev.empty_parts([(a.shape, a.dtype) for a in leaves])
        dev.upload_parts(bufs, leaves)
    return nest.pack_sequence_as(share, [Tensor(buf, dev) for buf in bufs])


# --- a data set kept on the devices ----------------------------------------------------

def split_batch(batch, extended, devices):
    """One global batch (a structure of host arrays or tensors with one leading batch axis)
    as each replica's share on its device, by the rebatching rule: a ``PerReplica`` structure
    (one device: the share itself). ``experimental_distribute_dataset``'s step, and ``fit``'s
    when it runs the user's ``train_step`` (``keras/custom_step.py``)."""
    leaves = nest.flatten(batch)
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError("experimental_distribute_dataset needs a batched dataset: every "
                         "component must have the same leading (batch) dimension; call "
                         ".batch(GLOBAL_BATCH_SIZE) first.")
    b = sizes.pop()
    bounds = local_bounds(b, extended)
    per = [_share_to_device(nest.map_structure(lambda leaf, lo=lo, hi=hi: np.asarray(leaf)[lo:hi], batch), dev)
           for (lo, hi), dev in zip(bounds, devices)]
    return per[0] if len(devices) == 1 else nest.map_structure(lambda *c: PerReplica(c), *per)


class ResidentRows:
    """One data set's rows, copied once to each of ``devices``, gathered by row number.

    ``leaves[r]`` are device r's copies of the data set's arrays (in
    ``nest.flatten`` order of ``rows.columns``), each viewed as 2-D (n, row size) so
    that one gather kernel serves images and labels alike. The memory is charged to
    each device like any tensor (``get_memory_info`` shows it).
    """

    def __init__(self, rows, devices):
        self.rows = rows                                   # keeps the host rows identifiable
        self.devices = list(devices)
        host = nest.flatten(rows.columns)
        self.shapes = [a.shape[1:] for a in host]          # one element's shape per leaf
        self.dtypes = [a.dtype for a in host]
        self.row_sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.rows_count = len(host[0])                     # n: valid row numbers are [0, n)
        self.leaves = []
        for dev in self.devices:
            with dev.activate():
                self.leaves.append([dev.from_numpy(np.ascontiguousarray(a).reshape(len(a), size))
                                    for a, size in zip(host, self.row_sizes)])   # (n, row size) per leaf
        self._idx = {}                      # (replica, b, k) -> (b,) int64 [, (k,) float32] on its device

    def caches(self):
        """The row-number buffers, made on first use: a training step that fails drops
        what it added (``keras/step.py``'s ``rolled_back_on_error``)."""
        return [self._idx]

    def gather(self, r, idx, targets, scalars=None):
        """Rows ``idx`` (host int64, (b,)) of each leaf k into its ``out`` on device r,
        for ``(k, out)`` in ``targets`` (out: (b, row size of k)). The b row numbers go
        up once — the step's only upload, with ``scalars`` (a training step's optimizer
        vector, ``Step.host_part``) in the same copy — and serve every leaf. Returns the
        scalars' buffer on the device (None where none went up)."""
        from kernels.gather import check_rows          # (lazily: kernels import numba.cuda)
        check_rows("ResidentRows.gather", idx, self.rows_count)   # the kernel cannot check
        dev = self.devices[r]
        k = len(scalars) if scalars is not None and len(idx) else 0
        key = (r, len(idx), k)
        bufs = self._idx.get(key)
        if bufs is None:
            with dev.activate():                        # views of one allocation (devices.py)
                bufs = self._idx[key] = dev.empty_parts([((len(idx),), np.int64)] +
                                                        [((k,), np.float32)] * bool(k))
        if len(idx):
            with dev.activate():
                dev.upload_parts(bufs, (idx, scalars)[:len(bufs)])
                for k_leaf, out in targets:
                    dev.ops.gather_rows(self.leaves[r][k_leaf], bufs[0],
                                        out.reshape(len(idx), self.row_sizes[k_leaf]))
        return bufs[1] if k else None

    def element(self, r, idx):
        """The batch ``idx`` as the dataset's structure of fresh Tensors on device r."""
        dev = self.devices[r]
        with dev.activate():
            bufs = [dev.empty((len(idx),) + tuple(shape), dtype) for shape, dtype in zip(self.shapes, self.dtypes)]
        self.gather(r, idx, list(enumerate(bufs)))
        return nest.pack_sequence_as(self.rows.columns, [Tensor(buf, dev) for buf in bufs])


#: ``fit``/``evaluate`` on a plain ``Dataset`` keep it on the GPUs by themselves when
#: they can (``Residence``'s docstring; ``keras/data_adapters.py``'s ``DatasetBatches``
#: asks). Set to False to copy every batch, as before.
AUTO_PLACE_ON_GPUS = True

#: The share of a GPU's free memory (as ``Device.memory_info`` reports it, within any
#: ``memory_limit``) a data set may take there unasked. Half, because the step's own
#: buffers (activations, gradients, the ring's staging) are made by the first step, after
#: the rows of a ``from_tensor_slices`` data set are placed: they need the rest.
AUTO_SHARE_OF_FREE_MEMORY = 0.5


def fits_on_devices(rows, devices):
    """True if a copy of ``rows`` on each of ``devices`` takes at most
    ``AUTO_SHARE_OF_FREE_MEMORY`` of the free memory it comes from. Logical GPUs without
    a ``memory_limit`` share their card's free memory: their copies are counted together."""
    nbytes = sum(int(a.nbytes) for a in nest.flatten(rows.columns))
    need, free = {}, {}
    for dev in devices:
        pool = ("device", id(dev)) if dev.memory_limit is not None else ("card", dev.gpu_id)
        need[pool] = need.get(pool, 0) + nbytes
        free[pool] = dev.memory_info()[0]
    return all(f is not None and need[pool] <= AUTO_SHARE_OF_FREE_MEMORY * f for pool, f in free.items())


class Residence:
    """Where one data set's rows stay on the devices from epoch to epoch.

    ``epoch(dataset)`` plans the epoch by row number (``data.index_batches``) and
    returns ``(ResidentRows, batches of row numbers, None)``; the rows go up the first
    time and are reused while the dataset holds the same rows (a cache is filled once).
    When the epoch cannot be planned it returns ``(None, None, why)``, having changed
    nothing: iterate the dataset instead.

    Asked for (``InputOptions(experimental_place_dataset_on_device=True)``,
    ``DistributedDataset``), the rows always go up. Unasked (``accept`` given: ``fit``
    and ``evaluate`` on GPUs, ``keras/data_adapters.py``), only when ``accept(rows)``
    and they fit (``fits_on_devices``), and the upload runs out of memory quietly;
    otherwise it returns ``(None, host batches, why)``: the same epoch, planned already
    (its shuffle drawn), gathered on the host — the batches the dataset would have given.
    """

    def __init__(self, devices):
        self.devices = list(devices)
        self.resident = None               # ResidentRows, made on the first resident epoch

    def epoch(self, dataset, accept=None):
        rows, batches = _data.index_batches(dataset)
        if rows is None:
            return None, None, batches                      # batches: why not
        if self.resident is None or self.resident.rows is not rows:
            self.resident = None                            # free the old copies first
            if accept is None:
                self.resident = ResidentRows(rows, self.devices)
            elif not accept(rows):
                return None, _host_batches(rows, batches), "fit cannot take these rows from the devices"
            elif not fits_on_devices(rows, self.devices):
                return None, _host_batches(rows, batches), "the rows do not fit on the devices"
            else:
                try:
                    self.resident = ResidentRows(rows, self.devices)
                except ResourceExhaustedError:              # outside any step: nothing else changed
                    return None, _host_batches(rows, batches), "the rows ran out of device memory"
        return self.resident, batches, None

    def release(self):
        """Drop the devices' copies (their memory is freed when nothing else holds them)."""
        self.resident = None


def _host_batches(rows, batches):
    """The batches of row numbers ``batches`` gathered from ``rows`` on the host."""
    return (rows.gather(idx) for idx in batches)


class DistributedDataset:
    """Iterating gives, per step, the global batch split into PerReplica slices."""

    def __init__(self, dataset, strategy, options=None):
        self.dataset = dataset             # the global-batch dataset it splits
        self.strategy = strategy           # whose replicas it feeds
        self.options = options             # InputOptions, or None (fit may place it itself)
        self._residence = Residence(strategy.extended.devices)
        self._warned = False

    @property
    def place_on_device(self):
        return bool(self.options is not None and self.options.experimental_place_dataset_on_device)

    @property
    def resident(self):
        """The ``ResidentRows`` kept on the devices now, or None."""
        return self._residence.resident

    def resident_epoch(self):
        """``(ResidentRows, batches of row numbers)`` for one epoch, or None (copy batches).

        The rows are uploaded to the devices the first time and reused while the
        dataset keeps the same rows (a cache is filled once).
        """
        resident, batches, why = self._residence.epoch(self.dataset)
        if resident is None:
            if not self._warned:
                self._warned = True
                warnings.warn(f"experimental_place_dataset_on_device: this epoch's batches are "
                              f"copied from the host, because {why}.", stacklevel=3)
            return None
        return resident, batches

    def _split(self, batch):
        return split_batch(batch, self.strategy.extended, self.strategy.extended.devices)

    def __iter__(self):
        return DistributedIterator(self._batches(), lambda: self.element_spec)

    @property
    def element_spec(self):
        """The spec of one step's value: the dataset's spec with the batch axis per replica."""
        return _distributed_spec(self.dataset.element_spec, len(self.strategy.extended.devices))

    def _batches(self):
        epoch = self.resident_epoch() if self.place_on_device else None
        if epoch is None:
            for batch in self.dataset:
                yield self._split(batch)
            return
        resident, batches = epoch
        n = len(resident.devices)
        for idx in batches:
            bounds = local_bounds(len(idx), self.strategy.extended)
            if n == 1:
                yield resident.element(0, idx[bounds[0][0]:bounds[0][1]])
                continue
            parts = [resident.element(r, idx[lo:hi]) for r, (lo, hi) in enumerate(bounds)]
            yield nest.map_structure(lambda *c: PerReplica(c), *parts)

    def __repr__(self):
        where = ", resident on the devices" if self.place_on_device else ""
        return f"<DistributedDataset over {self.strategy.num_replicas_in_sync} replicas{where}>"


class DistributedDatasetsFromFunction:
    """Per step, replica r gets the next per-replica batch from one shared dataset."""

    def __init__(self, dataset, strategy, options=None):
        self._dataset = dataset
        self._strategy = strategy

    def __iter__(self):
        return DistributedIterator(self._batches(), lambda: self.element_spec)

    @property
    def element_spec(self):
        return _distributed_spec(self._dataset.element_spec, len(self._strategy.extended.devices))

    def _batches(self):
        devices = self._strategy.extended.devices
        n = len(devices)
        it = iter(self._dataset)
        while True:
            batches = []
            for _ in range(n):
                try:
                    batches.append(next(it))
                except StopIteration:
                    return          # a step needs one batch per replica
            per = [_share_to_device(bt, dev) for bt, dev in zip(batches, devices)]
            yield per[0] if n == 1 else nest.map_structure(lambda *c: PerReplica(c), *per)
