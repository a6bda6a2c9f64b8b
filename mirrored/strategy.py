"""Strategies: ``MirroredStrategy``, ``OneDeviceStrategy`` and the default strategy.

What ``tf.distribute.MirroredStrategy`` does, in the order a student meets it:

1. ``strategy = MirroredStrategy()`` picks the devices (every logical GPU, else
   every logical CPU) and logs TensorFlow's ``Using MirroredStrategy with devices (...)``
   to standard error, as TensorFlow's INFO log does.
2. ``with strategy.scope():`` makes it the current strategy, so that
   ``mirrored.Variable(...)`` (and every Keras weight) becomes a
   ``MirroredVariable``: one copy per device, all from one initial value.
3. ``strategy.run(fn, args)`` calls ``fn`` once per replica, each replica in its
   own thread bound to its device (TensorFlow's design). ``PerReplica``
   arguments are unpacked so each replica gets its own component.
4. Inside ``fn``, ``get_replica_context().all_reduce(...)`` or an optimizer's
   ``apply_gradients`` is a *merge point*: every replica thread stops there, one
   thread runs the merge function in cross-replica context (where the
   cross-device ops sum the values), then every replica continues with its own
   copy of the result. Under a ``GradientTape`` the all-reduce is differentiable
   (``ReplicaContext._gradient_rule``): ``BatchNormalization(synchronized=True)``'s
   global batch statistics are made this way (``keras/normalization.py``).
5. ``strategy.reduce(op, per_replica, axis)`` combines the replicas' results on
   the host.

Replica threads are kept alive between calls (one worker per device), so a
training step does not pay for starting threads; they and the merge points live
in ``mirrored_run.py``. ``StrategyExtended`` carries what the rest of the library
needs of a strategy: its ``devices``, its ``cross_device_ops`` and its worker pool.

Neighbours: ``mirrored_run.py`` (replica threads, merge points), ``values.py``
(PerReplica, MirroredVariable), ``cross_device_ops.py`` and ``ring.py`` (the sums), ``context.py``
(which strategy/replica this thread is in), ``input_lib.py`` (distributed datasets),
``multi_worker.py`` (``MultiWorkerMirroredStrategy``: this strategy across MPI processes;
``StrategyExtended.replica_offset`` / ``num_workers`` are where it differs).
"""
import contextlib
import sys
import threading
import warnings

import numpy as np

from mirrored import autodiff, backends, context, nest
from mirrored.program import recording
from mirrored import devices as _dev
from mirrored.traced_function import reduce_in_trace
from mirrored.cross_device_ops import CrossDeviceOps, ReduceOp, ReductionToOneDevice
from mirrored.mirrored_run import ReplicaWorkers
from mirrored.tensor import HostTensor, Tensor, constant
from mirrored.values import (DistributedValues, Mirrored, MirroredVariable, PerReplica, Variable,
                             VariableAggregation, regroup, select_replica)


# --- contexts ------------------------------------------------------------------------

class ValueContext:
    """What ``experimental_distribute_values_from_function``'s ``value_fn`` is told."""

    def __init__(self, replica_id_in_sync_group=0, num_replicas_in_sync=1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self):
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class InputContext:
    """What ``distribute_datasets_from_function``'s ``dataset_fn`` is told."""

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size):
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The `global_batch_size` {global_batch_size} is not divisible by "
                             f"`num_replicas_in_sync` {self.num_replicas_in_sync}.")
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self):
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
                f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})")


class ReplicaContext:
    """The replica's view inside ``strategy.run`` (TensorFlow's ``tf.distribute.ReplicaContext``)."""

    def __init__(self, strategy, replica_id, merge_point=None):
        self._strategy = strategy
        self._replica_id = replica_id
        self._merge_point = merge_point

    @property
    def strategy(self):
        return self._strategy

    @property
    def local_replica_id(self):
        """This replica's index among this worker's devices, a Python int (which copy of a
        MirroredVariable, which replica program it uses); not a TensorFlow name."""
        return self._replica_id

    @property
    def replica_id_in_sync_group(self):
        """This replica's index among ALL replicas (every worker's) as an int32 scalar
        Tensor on its device; on one machine, its index among the devices."""
        ext = self._strategy.extended
        dev = ext.devices[self._replica_id]
        return constant(ext._replica_offset + self._replica_id, dtype=np.int32, device=dev)

    @property
    def num_replicas_in_sync(self):
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self):
        return (self._strategy.extended.devices[self._replica_id].name,)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Meet every other replica here; run ``merge_fn(strategy, *args, **kwargs)`` once.

        Each replica's ``args`` are regrouped into ``PerReplica`` values (a value
        that is the same object on every replica stays itself). The merge
        function runs in cross-replica context; each replica gets its own
        component of what it returns.
        """
        kwargs = kwargs or {}
        strategy = self._strategy

        def merge(calls):
            fn = calls[0][0]
            _same_structure_on_every_replica(calls)   # before regroup: name the replicas
            grouped_args = regroup([c[1] for c in calls])
            grouped_kwargs = regroup([c[2] for c in calls])
            context.push(strategy, None)
            try:
                return fn(strategy, *grouped_args, **grouped_kwargs)
            finally:
                context.pop()

        if self._merge_point is None:             # one replica: merge on the spot
            return select_replica(0, merge([(merge_fn, tuple(args), kwargs)]))
        result = self._merge_point.arrive(self._replica_id, (merge_fn, tuple(args), kwargs), merge)
        return select_replica(self._replica_id, result)

    def all_reduce(self, reduce_op, value, options=None):
        """Sum (or average) ``value`` over every replica; each gets the result on its device.

        ``value`` may be a nested structure; all its tensors go through one
        fused cross-device reduction. Every replica must call this. Under a
        ``GradientTape`` it is differentiable (``_gradient_rule``): the backward all-reduces
        the gradients, so every replica must then take the gradient too.
        """
        reduce_op = ReduceOp.validate(reduce_op)
        dev = self._strategy.extended.devices[self._replica_id]
        local = nest.map_structure(lambda v: to_tensor_on(v, dev), value)

        def merge(strategy, per_replica, op):
            ops = op.values if isinstance(op, DistributedValues) else (op,) * len(strategy.extended.devices)
            if len(set(ops)) > 1:
                named = ", ".join(f"replica {i}: {o}" for i, o in enumerate(ops))
                raise ValueError(f"all_reduce was called with different reduce ops ({named}); "
                                 f"every replica must pass the same op, or the result would "
                                 f"depend on which replica arrived first.")
            leaves = nest.flatten(per_replica)
            comps = [list(l.values) if isinstance(l, DistributedValues) else [l] for l in leaves]
            reduced = strategy.extended.cross_device_ops.all_reduce_components(reduce_op, comps)
            return nest.pack_sequence_as(per_replica, [Mirrored(r) for r in reduced])

        result = self.merge_call(merge, args=(local, reduce_op))
        for x, y in zip(nest.flatten(local), nest.flatten(result)):     # differentiable, as TF's
            if y is not x:                       # (one replica may hand back x itself: the identity)
                autodiff.record("all_reduce", [x], y, self._gradient_rule(reduce_op))
        return result

    def _gradient_rule(self, reduce_op):
        """TensorFlow's rule for ``all_reduce`` under a tape: every replica's output depends on
        every replica's input with weight 1 (SUM) or 1/N (MEAN), so the gradient of each input
        is the all-reduce SUM (MEAN) of the replicas' upstream gradients. It is a merge point
        too: every replica's ``tape.gradient`` meets the others there, and a replica that
        raises instead releases them with its error (``mirrored_run.MergePoint``)."""
        return lambda g: (self.all_reduce(reduce_op, g),)

    def __repr__(self):
        return f"<ReplicaContext replica {self._replica_id} of {self.num_replicas_in_sync}>"


def _same_structure_on_every_replica(calls):
    """Refuse merge calls whose arguments are nested differently on different replicas,
    naming which replicas passed which structure (regrouping them would fail with a bare
    count of leaves)."""
    shapes = [nest.structure_of((c[1], c[2])) for c in calls]
    if any(shape != shapes[0] for shape in shapes):
        groups = {}
        for i, shape in enumerate(shapes):
            groups.setdefault(shape, []).append(i)
        named = "; ".join(f"replicas {ids} passed {nest.describe(shape)}" for shape, ids in groups.items())
        raise ValueError(f"the replicas passed differently nested values to the same merge call "
                         f"(all_reduce, merge_call): {named}. Every replica must pass the same "
                         f"structure (same nesting, same number of values).")


def to_tensor_on(value, dev):
    """A Tensor on ``dev`` for a Tensor, Variable, NumPy value or Python number."""
    if isinstance(value, Variable):
        value = value.value()
    if isinstance(value, Tensor):
        if value.dev is dev:
            return value
        with dev.activate():
            return Tensor(dev.copy_from(value.buf, value.dev), dev)
    if isinstance(value, DistributedValues):
        raise TypeError(f"expected this replica's own value, got a {type(value).__name__}; "
                        f"pass PerReplica values as arguments of strategy.run instead.")
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"cannot reduce a value of type {type(value).__name__} ({value!r:.60}): "
                        f"only numbers and numeric tensors can be reduced across replicas.")
    return constant(arr if isinstance(value, (np.ndarray, np.generic)) else value, device=dev)


# --- the extended object (TensorFlow's StrategyExtended) ----------------------------------

class StrategyExtended:
    """Lower-level strategy API, and what the rest of the library needs of a strategy.

    ``devices``: the replicas' devices, in replica order. ``cross_device_ops``: how
    values are summed across them (the ring, ``RingAllReduce``, by default).
    ``worker_pool()``: the replica threads of ``strategy.run`` (made on first use).

    Across workers (``MultiWorkerMirroredStrategy``, ``multi_worker.py``) ``devices``
    are this worker's replicas only, which are replicas ``replica_offset`` ..
    ``replica_offset + len(devices) - 1`` of ``num_replicas`` in all; on one
    machine the offset is 0 and every replica is local. ``num_workers``,
    ``sum_across_workers`` and ``broadcast_from_chief`` are what the rest of the
    library asks of the other workers (one worker here: nothing to ask).
    """

    _replica_offset = 0          # this worker's first replica among all workers' replicas
    _num_workers = 1

    def __init__(self, strategy, devices, cross_device_ops):
        self._strategy = strategy
        self.devices = list(devices)
        self.cross_device_ops = cross_device_ops
        self._pool = None
        self._pool_lock = threading.Lock()

    def worker_pool(self):
        """The ``mirrored_run.ReplicaWorkers`` of this strategy: one long-lived thread per device."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ReplicaWorkers(self._strategy)
        return self._pool

    @property
    def worker_devices(self):
        return tuple(d.name for d in self.devices)

    @property
    def replica_offset(self):
        """This worker's first replica among every worker's replicas (0 on one machine):
        its local replica ``i`` is replica ``replica_offset + i``."""
        return self._replica_offset

    @property
    def num_workers(self):
        """How many workers (processes) train together: 1 on one machine."""
        return self._num_workers

    @property
    def num_replicas(self):
        """Replicas over every worker (``num_replicas_in_sync``)."""
        return len(self.devices) * self._num_workers

    # TensorFlow's answers for the one worker there is (the chief): it writes checkpoints
    # and summaries and initialises variables. ``multi_worker.py`` answers per worker.
    should_checkpoint = property(lambda self: True)
    should_save_summary = property(lambda self: True)
    should_init = property(lambda self: True)
    experimental_should_init = should_init

    def _in_multi_worker_mode(self):
        return self._num_workers > 1

    def sum_across_workers(self, values, what="a sum"):
        """Host float64 ``values`` summed over every worker (here: this one only).
        ``what`` names the sum in a timeout's error (across workers it is a collective)."""
        return np.asarray(values, np.float64)

    def broadcast_from_chief(self, value, what="a broadcast"):
        """The chief's ``value`` (picklable) on every worker (here: ``value`` itself)."""
        return value

    @property
    def parameter_devices(self):
        return self.worker_devices

    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduce ``value`` across replicas to ``destinations`` (a device, a variable...)."""
        reduce_op = ReduceOp.validate(reduce_op)
        n = self._strategy.num_replicas_in_sync
        if not isinstance(value, DistributedValues):
            # TensorFlow's rule for a value that is the same on every replica.
            if reduce_op == ReduceOp.SUM and n > 1:
                raise ValueError(f"A non-DistributedValues value {value!r:.60} cannot be reduced "
                                 f"with the given reduce op SUM over {n} replicas.")
            tensor = to_tensor_on(value, self.devices[0])
            return _single(self.cross_device_ops.broadcast(tensor, destinations))
        if isinstance(value, Mirrored) and reduce_op == ReduceOp.MEAN:
            return _single(self.cross_device_ops.broadcast(value, destinations))
        comps = [to_tensor_on(v, d) for v, d in zip(value.values, self.devices)]
        return _single(self.cross_device_ops.reduce(reduce_op, PerReplica(comps), destinations))

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        return [self.reduce_to(reduce_op, v, d, options) for v, d in value_destination_pairs]


def _single(mirrored):
    return mirrored.values[0] if len(mirrored.values) == 1 else mirrored


# --- strategies ---------------------------------------------------------------------------

class Strategy:
    """What every strategy shares; subclasses choose devices and variable creation."""

    _extended_type = StrategyExtended

    def __init__(self, devices, cross_device_ops):
        self._extended = self._extended_type(self, devices, cross_device_ops)

    # -- properties
    @property
    def extended(self):
        return self._extended

    @property
    def num_replicas_in_sync(self):
        return self._extended.num_replicas

    @property
    def cluster_resolver(self):
        return None

    # -- scope
    @contextlib.contextmanager
    def scope(self):
        """Make this the current strategy (variables created inside are distributed)."""
        current, _ = context.top()
        if current is not None and current is not self:
            raise RuntimeError(
                f"Mixing different tf.distribute.Strategy objects: {self!r} is not {current!r}. "
                f"Leave the other strategy's scope first (variables belong to one strategy).")
        context.push(self, None)
        try:
            yield self
        finally:
            context.pop()

    def __enter__(self):  # pragma: no cover - TF does not support `with strategy:` either
        raise TypeError("use `with strategy.scope():`, not `with strategy:`.")

    # -- variables
    def _create_variable(self, initial_value=None, trainable=True, name=None, dtype=None,
                         aggregation=VariableAggregation.NONE, **kwargs):
        return _plain_variable(initial_value, trainable=trainable, name=name, dtype=dtype,
                               aggregation=aggregation, device=self._extended.devices[0])

    # -- running replicas
    def run(self, fn, args=(), kwargs=None, options=None):
        """Call ``fn(*args, **kwargs)`` once per replica; returns PerReplica (or plain) values.
        The replicas run under the CPU's BLAS-thread policy, as ``fit``'s steps do
        (``backends.blas_threads``)."""
        kwargs = kwargs or {}
        strategy, replica_ctx = context.top()
        if replica_ctx is not None and strategy is not None and not isinstance(strategy, DefaultStrategy):
            raise RuntimeError("strategy.run was called inside a replica function; call it from "
                               "the outer (cross-replica) code.")
        if strategy is not None and strategy is not self and not isinstance(strategy, DefaultStrategy):
            raise RuntimeError(
                f"Mixing different tf.distribute.Strategy objects: {self!r}.run was called inside "
                f"the scope of {strategy!r}. Call run outside that scope, or enter "
                f"{self!r}.scope() instead (variables and replicas belong to one strategy).")
        outer = [e for e in context.stack() if e[1] is None]
        with backends.blas_threads():    # the CPU's BLAS-thread policy, as fit's (nested: free)
            if len(self._extended.devices) == 1:
                dev = self._extended.devices[0]
                context.push(self, ReplicaContext(self, 0))
                try:
                    with _dev.device_scope(dev):
                        return fn(*select_replica(0, args), **select_replica(0, kwargs))
                finally:
                    context.pop()
            results = self._extended.worker_pool().run(fn, args, kwargs, outer or [(self, None)], ReplicaContext)
        return regroup(results)

    # -- combining results
    def experimental_local_results(self, value):
        """The per-replica components as a tuple; ``(value,)`` for a plain value."""
        if isinstance(value, DistributedValues):
            return value.values
        return (value,)

    def reduce(self, reduce_op, value, axis=None):
        """Combine ``value`` across replicas on the host.

        ``axis=None``: across replicas only (SUM adds the components, MEAN
        averages them). ``axis=0`` (or another axis): also across that axis of
        each component, so MEAN divides by the true number of elements — with an
        uneven last batch each replica counts what it really had. MEAN divides as
        ``/`` (integers average to floats, as in TensorFlow). A tuple or dict of
        PerReplica values (what ``run`` returns for a tuple) is reduced leaf by leaf.
        """
        reduce_op = ReduceOp.validate(reduce_op)
        _, replica_ctx = context.top()
        if replica_ctx is not None and not isinstance(self, DefaultStrategy):
            raise RuntimeError("strategy.reduce is for cross-replica context; inside the replica "
                               "function use get_replica_context().all_reduce(...).")
        if nest.is_nested(value) and any(isinstance(leaf, DistributedValues) for leaf in nest.flatten(value)):
            # a tuple/dict of per-replica results (what `run` returns for a tuple):
            # each leaf reduced on its own, the nest kept, as TensorFlow's reduce does
            return nest.map_structure(lambda leaf: self.reduce(reduce_op, leaf, axis), value)
        n = self.num_replicas_in_sync
        if not isinstance(value, DistributedValues):
            if reduce_op == ReduceOp.SUM and n > 1:
                raise ValueError(f"A non-DistributedValues value {value!r:.60} cannot be reduced "
                                 f"with the given reduce op SUM over {n} replicas; return it from "
                                 f"strategy.run so that each replica contributes its own.")
        if recording.active() is not None:     # inside @function's trace: stays on the device
            return reduce_in_trace(self.extended.devices[0], reduce_op, value, axis,
                                   lambda: reduce_on_host(reduce_op, host_components(value, "reduce"), axis)
                                   if isinstance(value, DistributedValues) or axis is not None
                                   else host_components(value, "reduce")[0])
            if axis is None:
                return HostTensor.wrap(host_components(value, "reduce")[0])
        return HostTensor.wrap(reduce_on_host(reduce_op, host_components(value, "reduce"), axis))

    def gather(self, value, axis):
        """Every replica's value concatenated along ``axis``, on the host."""
        comps = host_components(value, "gather")
        return HostTensor.wrap(np.concatenate([np.atleast_1d(c) for c in comps], axis=axis))

    # -- distributing inputs
    def experimental_distribute_values_from_function(self, value_fn):
        """``value_fn(ValueContext)`` once per replica; tensors and arrays placed on each
        device. Python numbers stay as they are, as TensorFlow keeps them
        (``experimental_local_results`` gives ``(2, 2)``); ops that take them convert them."""
        n = self.num_replicas_in_sync
        offset = self._extended._replica_offset
        comps = []
        for i, dev in enumerate(self._extended.devices):
            with _dev.device_scope(dev):
                v = value_fn(ValueContext(offset + i, n))
                comps.append(nest.map_structure(
                    lambda x: to_tensor_on(x, dev) if isinstance(x, (Tensor, np.ndarray, np.generic))
                    else x, v))
        return nest.map_structure(lambda *c: PerReplica(c), *comps) if nest.is_nested(comps[0]) \
            else PerReplica(comps)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Each global batch split over the replicas (TensorFlow's rebatching rule)."""
        from mirrored.input_lib import DistributedDataset
        return DistributedDataset(dataset, self, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``dataset_fn(InputContext)`` once; each replica takes its own batch per step."""
        from mirrored.input_lib import DistributedDatasetsFromFunction
        ext = self._extended
        ctx = InputContext(ext._num_workers, ext._replica_offset // len(ext.devices),
                           self.num_replicas_in_sync)
        return DistributedDatasetsFromFunction(dataset_fn(ctx), self, options)

    def experimental_make_numpy_dataset(self, numpy_input):
        from mirrored.data import Dataset
        return Dataset.from_tensor_slices(numpy_input)

    def __repr__(self):
        return f"<{type(self).__name__} on {[d.short_name for d in self._extended.devices]}>"


def host_components(value, what):
    """A value's per-replica components as NumPy arrays (numbers only)."""
    comps = value.values if isinstance(value, DistributedValues) else (value,)
    out = []
    for c in comps:
        arr = np.asarray(c.numpy()) if isinstance(c, (Tensor, Variable)) else np.asarray(c)
        if arr.dtype.kind not in "fiub":
            raise TypeError(f"{what}: cannot reduce a value of type {type(c).__name__} "
                            f"({c!r:.60}): only numbers and numeric tensors.")
        out.append(arr)
    return out


def reduce_on_host(reduce_op, comps, axis):
    """``strategy.reduce``'s math on the replicas' arrays ``comps`` (see its docstring)."""
    if axis is None:
        total = comps[0].copy()
        for c in comps[1:]:
            if c.shape != total.shape:
                raise ValueError(f"reduce: replicas returned shapes {[x.shape for x in comps]}; "
                                 f"with axis=None they must match (or pass axis=0).")
            total = total + c
        if reduce_op == ReduceOp.MEAN:
            # MEAN divides as `/` (TensorFlow: replica ids 0 and 1 average to 0.5):
            # floats keep their dtype, integers become float64
            mean = total / len(comps)
            return mean.astype(comps[0].dtype) if comps[0].dtype.kind == "f" else mean
        return total.astype(comps[0].dtype, copy=False)
    for i, c in enumerate(comps):
        if not -c.ndim <= axis < c.ndim:
            what = "a scalar, which has no axes" if c.ndim == 0 else f"shape {c.shape} ({c.ndim} axes)"
            raise ValueError(f"reduce(axis={axis}): replica {i}'s value is {what}. Pass an axis in "
                             f"[{-c.ndim}, {c.ndim}) to reduce across it too (axis=0: the batch), "
                             f"or axis=None to reduce across replicas only.")
    sums = [c.sum(axis=axis, dtype=c.dtype) for c in comps]
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    if reduce_op == ReduceOp.SUM:
        return total
    count = sum(c.shape[axis] for c in comps)
    mean = total / count if count else total * np.nan
    return mean.astype(comps[0].dtype) if comps[0].dtype.kind == "f" else mean


def _plain_variable(initial_value, **kwargs):
    """A single-device Variable, bypassing the scope's redirection."""
    var = object.__new__(Variable)
    Variable.__init__(var, initial_value, **kwargs)
    return var


def _default_cross_device_ops(devices):
    """Our ring all-reduce; reduce-to-one-device when CPUs and GPUs are mixed (as TF)."""
    from mirrored.ring import RingAllReduce
    if len({d.device_type for d in devices}) > 1:
        return ReductionToOneDevice()
    return RingAllReduce()


class MirroredStrategy(Strategy):
    """Synchronous data parallelism on one machine: one replica per device.

    ``devices``: device strings (any TensorFlow spelling); ``None`` means every
    logical GPU, or every logical CPU if there is none (TensorFlow's choice). ``cross_device_ops``: how gradients
    are summed; the default is our ring all-reduce (``RingAllReduce``).
    """

    def __init__(self, devices=None, cross_device_ops=None):
        chosen = choose_devices(devices, every_cpu=True)
        if cross_device_ops is None:
            cross_device_ops = _default_cross_device_ops(chosen)
        if not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"cross_device_ops must be a CrossDeviceOps such as RingAllReduce(), "
                            f"got {cross_device_ops!r}.")
        super().__init__(chosen, cross_device_ops)
        # TensorFlow logs this line at INFO level, to standard error (absl's logger)
        print(f"INFO:mirrored:Using MirroredStrategy with devices {tuple(d.name for d in chosen)}",
              file=sys.stderr)

    def _create_variable(self, initial_value=None, trainable=True, name=None, dtype=None,
                         aggregation=VariableAggregation.NONE, **kwargs):
        if callable(initial_value):
            initial_value = initial_value()         # called once: every copy starts equal
        base = name or "Variable"
        components = []
        for i, dev in enumerate(self._extended.devices):
            comp = _plain_variable(initial_value, trainable=trainable, name=base, dtype=dtype,
                                   aggregation=aggregation, device=dev)
            if i:
                comp._handle_name = f"{base}/replica_{i}:0"
            components.append(comp)
        return MirroredVariable._build(self, components, aggregation)


def choose_devices(devices, every_cpu=False):
    """MirroredStrategy's devices: ``None`` = every logical GPU, else the CPU (``every_cpu``:
    every logical CPU, as TensorFlow's ``MirroredStrategy()``; a worker of
    ``MultiWorkerMirroredStrategy`` takes CPU:0 only, as TensorFlow's); or the named ones.
    Named GPUs this machine lacks run on logical CPUs (``_soft_place``)."""
    if devices is None:
        all_devices = _dev.logical_devices()
        cpus = [d for d in all_devices if d.device_type == "CPU"]
        chosen = [d for d in all_devices if d.device_type == "GPU"] or (cpus if every_cpu else cpus[:1])
    else:
        if isinstance(devices, str):
            devices = [devices]
        devices = list(devices)
        if not devices:
            raise ValueError("MirroredStrategy needs at least one device; devices=[] was given.")
        names = [_dev.canonical_name(d) for d in devices]
        dup = [n for n in names if names.count(n) > 1]
        if dup:
            raise ValueError(f"No duplicates allowed in `devices` argument: {devices} "
                             f"({dup[0]} appears twice).")
        chosen = _soft_place(devices, names)
    return chosen


_SOFT_PLACED_WARNED = set()


def _soft_place(devices, names):
    """The named devices; GPUs that are not here stand in on CPU devices.

    TensorFlow accepts ``MirroredStrategy(devices=["/gpu:0", "/gpu:1"])`` on a machine
    without those GPUs (soft placement: the replicas' ops run on the CPU). Here each
    replica needs a device of its own, so every missing GPU takes the next logical CPU
    that is not named, then extra CPU devices (``devices.cpu_stand_ins``); it warns once,
    saying where the replicas run."""
    present = {d.name: d for d in _dev.logical_devices()}
    missing = [n for n in names if n not in present and "/device:GPU:" in n]
    if not missing or [d for d in present.values() if d.device_type == "GPU"]:
        return [_dev.get_device(d) for d in devices]          # as before: ValueError names what exists
    spare = [d for d in present.values() if d.device_type == "CPU" and d.name not in names]
    spare += _dev.cpu_stand_ins(max(0, len(missing) - len(spare)))
    stand_in = dict(zip(missing, spare))
    key = tuple(sorted((m, id(d)) for m, d in stand_in.items()))      # once per device layout
    if key not in _SOFT_PLACED_WARNED:
        _SOFT_PLACED_WARNED.add(key)
        where = ", ".join(f"{m.rsplit('/', 1)[-1]} on {d.short_name}" for m, d in stand_in.items())
        warnings.warn(f"MirroredStrategy: no GPU here; the replicas for the missing GPUs run on the "
                      f"CPU ({where}), as TensorFlow's soft placement runs them there.", stacklevel=4)
    return [present[n] if n in present else stand_in[n] for n in names]


class CentralStorageStrategy(MirroredStrategy):
    """``tf.distribute.experimental.CentralStorageStrategy``, run as a ``MirroredStrategy``.

    TensorFlow keeps ONE copy of each variable on ``parameter_device`` (the CPU when there
    are several GPUs) and mirrors the computation on ``compute_devices`` (every GPU, else
    the CPU). Here every replica keeps its own copy (a MirroredVariable) and the gradients
    are summed by the ring all-reduce: the same synchronous updates and the same numbers,
    with more device memory for the copies. Said once, as a warning."""

    def __init__(self, compute_devices=None, parameter_device=None):
        if compute_devices is None:                       # TF's default: every GPU, else CPU:0
            compute_devices = [d.name for d in choose_devices(None)]
        super().__init__(compute_devices)
        warnings.warn("CentralStorageStrategy runs as MirroredStrategy here: each replica keeps a "
                      "copy of the variables (not one copy on the parameter device); the updates "
                      "and the results are the same.", stacklevel=2)


class OneDeviceStrategy(Strategy):
    """Everything on one device: one replica, plain variables there."""

    def __init__(self, device):
        # a GPU this machine lacks runs on the CPU, as TensorFlow's soft placement (warned once)
        super().__init__(_soft_place([device], [_dev.canonical_name(device)]), ReductionToOneDevice())

    @contextlib.contextmanager
    def scope(self):
        with super().scope(), _dev.device_scope(self._extended.devices[0]):
            yield self


class DefaultStrategy(Strategy):
    """The strategy in force outside every scope: one replica on the current device."""

    def __init__(self):
        self._extended = None

    @property
    def extended(self):
        return StrategyExtended(self, [_dev.current_device()], ReductionToOneDevice())

    @property
    def num_replicas_in_sync(self):
        return 1

    def _create_variable(self, initial_value=None, **kwargs):
        return _plain_variable(initial_value, **kwargs)

    def run(self, fn, args=(), kwargs=None, options=None):
        return fn(*args, **(kwargs or {}))

    def __repr__(self):
        return "<default strategy>"


_DEFAULT = None


def _default_strategy():
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = DefaultStrategy()
    return _DEFAULT


# --- module-level functions (tf.distribute.*) ------------------------------------------

def get_strategy():
    """The strategy whose scope we are in (or whose replica is running), else the default."""
    strategy, _ = context.top()
    return strategy if strategy is not None else _default_strategy()


def has_strategy():
    return context.top()[0] is not None


def get_replica_context():
    """The ReplicaContext inside ``run``; ``None`` in cross-replica context (a scope, outside run)."""
    strategy, replica_ctx = context.top()
    if strategy is None:
        return _DefaultReplicaContext()
    return replica_ctx


def in_cross_replica_context():
    """True inside a strategy's scope but outside ``run`` (and inside merge functions)."""
    strategy, replica_ctx = context.top()
    return strategy is not None and replica_ctx is None


class _DefaultReplicaContext(ReplicaContext):
    def __init__(self):
        super().__init__(_default_strategy(), 0)

    @property
    def replica_id_in_sync_group(self):
        return constant(0, dtype=np.int32)

    @property
    def devices(self):
        return (_dev.current_device().name,)

    def all_reduce(self, reduce_op, value, options=None):
        ReduceOp.validate(reduce_op)
        return value

    def merge_call(self, merge_fn, args=(), kwargs=None):
        return merge_fn(self._strategy, *args, **(kwargs or {}))
