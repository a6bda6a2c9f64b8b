"""What ``fit``, ``evaluate`` and ``predict`` accept, turned into global batches the step splits.

Keras takes NumPy arrays (with ``batch_size``), a batched ``Dataset``, or
``strategy.experimental_distribute_dataset(ds, options)``; so do we. Whatever came
in, the step (``step.py``) sees one of two kinds of global batch:

    (x, y)          host arrays: x (B, features) float32, y (B,) integer labels —
                    each replica's slice is copied into its device's input buffers
    ResidentBatch   row numbers (B,) of a data set kept on the devices
                    (``InputOptions(experimental_place_dataset_on_device=True)``, or
                    unasked on GPUs when it fits: ``DatasetBatches``):
                    each replica gathers its rows on its own device

``batches(model, x, y, ...)`` picks the adapter; ``prepare`` (``host_batch`` for host
data) checks and converts one element, and builds the model from the first one, as
Keras does.

Labels are checked on the host, on every backend, before any step uses them: one class
index in [0, classes) per example (``check_label_shape``; ``kernels.softmax_xent.
check_labels``). Arrays are checked whole before the first step, a dataset batch by
batch, a data set kept on the devices once when it is placed. (A kernel cannot raise: on
a GPU a bad label would only poison its row with NaN.)

Neighbours: ``models.py`` (fit/evaluate/predict call these), ``step.py`` (splits the
batches), ``mirrored/input_lib.py`` (distributed data sets, resident rows).
"""
import numbers
import weakref

import numpy as np

from kernels.launch import ceil_div
from kernels.softmax_xent import LABEL_DTYPE, check_labels
from mirrored import nest
from mirrored import random as _random
from mirrored import input_lib
from mirrored.input_lib import DistributedDataset, Residence
from mirrored.keras import sample_weights
from mirrored.keras.losses import counts_accuracy, takes_targets
from mirrored.tensor import Tensor


def batches(model, x, y, batch_size, shuffle, sample_weight=None, class_weight=None):
    """An epoch-iterable of global batches for ``model``, and its length (None if unknown).
    ``sample_weight`` (arrays) or ``class_weight``: each batch an (x, y, weights) triple
    (``sample_weights.py``), as is each element of a data set of triples."""
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)) and not hasattr(x, "batch"):
        if y is None:
            raise ValueError("fit/evaluate with arrays needs y (the labels).")
        x, y = np.asarray(x), np.asarray(y)
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} examples but y has {len(y)}.")
        model.accept_inputs(x.shape, x.dtype)  # every example and label checked once, before any step
        if takes_targets(model.loss):
            targets(model, y, len(y))            # MSE, BCE: float targets
        else:
            check_label_shape(model, y.shape, len(y))
            check_labels(class_indices(y.reshape(-1), model), model.step.programs[0].classes)
        weights = None
        if sample_weight is not None or class_weight is not None:    # (N,) float32, checked here
            weights = sample_weights.for_arrays(y, len(y), sample_weight, class_weight)
        adapter = ArrayBatches(x, y, batch_size or 32, shuffle, model.distribute_strategy.extended, weights)
        return adapter, len(adapter)
    if y is not None:
        raise ValueError("y must be None when x is a dataset (it yields (x, y) pairs).")
    if sample_weight is not None:
        sample_weights.refuse_for_dataset(sample_weight)
    if isinstance(x, DistributedDataset):
        adapter, steps = distributed_batches(model, x, class_weight is None)
    elif not hasattr(x, "__iter__"):
        raise TypeError(f"x must be a NumPy array or a mirrored.data.Dataset, got {type(x).__name__}.")
    else:
        try:
            steps = len(x)
        except TypeError:
            steps = None
        adapter = DatasetBatches(x, model, place=class_weight is None)    # weighted batches: host ones
    return (adapter if class_weight is None else sample_weights.ByClass(adapter, class_weight)), steps


def train_validation_split(x, y, validation_split, structured=False):
    """``fit(x, y, validation_split=f)``: Keras's split, ``((x_train, y_train), (x_val, y_val))``.

    The validation set is the LAST fraction ``f`` of the arrays, taken before any shuffling
    (``split_at = floor(n * (1 - f))``); only arrays can be split (a data set has no end to
    take it from). ``structured``: x and y are lists or dicts of arrays (a model of several
    inputs or outputs, ``multi_io.py``), each array cut the same way."""
    if not isinstance(validation_split, (int, float)) or not 0 < validation_split < 1:
        raise ValueError(f"validation_split must be a fraction between 0 and 1, got {validation_split!r}.")
    if not (isinstance(x, np.ndarray) or isinstance(x, (list, tuple)) and not hasattr(x, "batch")):
        raise ValueError(f"validation_split is only supported for NumPy arrays, got x of type "
                         f"{type(x).__name__}: split the data set yourself (ds.take / ds.skip) and pass "
                         f"validation_data=.")
    if y is None:
        raise ValueError("fit with arrays needs y (the labels).")
    if structured:                         # a model of several inputs/outputs: lists or dicts of arrays
        n = len(nest.flatten(x)[0])
        split_at = int(np.floor(n * (1.0 - validation_split)))
        cut = [nest.map_structure(lambda a, s=s: np.asarray(a)[s], v) for v in (x, y)
               for s in (slice(None, split_at), slice(split_at, None))]
        if split_at in (0, n):
            raise ValueError(f"validation_split={validation_split} of {n} examples leaves one side empty.")
        return (cut[0], cut[2]), (cut[1], cut[3])
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} examples but y has {len(y)}.")
    n = len(x)
    split_at = int(np.floor(n * (1.0 - validation_split)))
    if split_at == 0 or split_at == n:
        raise ValueError(f"Training data contains {n} samples, which is not sufficient to split it into a "
                         f"validation and training set as specified by validation_split={validation_split}. "
                         f"Either provide more data, or a different value for validation_split.")
    return (x[:split_at], y[:split_at]), (x[split_at:], y[split_at:])


def distributed_batches(model, dist, place=True):
    """fit/evaluate on ``strategy.experimental_distribute_dataset(ds, options)``.

    Without options: the same as passing ``ds`` (the step splits each global batch
    itself, into its reusable device buffers; on GPUs it may keep the data set there,
    ``DatasetBatches``). With ``experimental_place_dataset_on_device``: epochs the data
    set can plan by row number yield ``ResidentBatch``es, gathered on the devices from
    the copy kept there (``input_lib.ResidentRows``); with options that do not ask for
    it, the batches are copied. ``place=False`` (class weights to add on the host): copied.
    """
    if dist.strategy is not model.distribute_strategy:
        raise ValueError(f"this distributed dataset was made by {dist.strategy!r}, but the model "
                         f"was built under {model.distribute_strategy!r}: distribute the dataset with the "
                         f"strategy whose scope created the model.")
    try:
        steps = len(dist.dataset)
    except TypeError:
        steps = None
    if not place and dist.place_on_device:
        raise NotImplementedError("class_weight with experimental_place_dataset_on_device is not implemented "
                                  "(the rows kept on the devices carry no weights): distribute the data set "
                                  "without that option, or map it to (x, y, weight) triples.")
    return DatasetBatches(dist.dataset, model, dist, place), steps


def prepare(model, batch):
    """A batch from ``batches`` as the step takes it (host arrays via ``host_batch``, or
    the ``ResidentBatch`` itself), the model built from it if need be."""
    if isinstance(batch, ResidentBatch):
        if takes_targets(model.loss):
            raise NotImplementedError(f"{type(model.loss).__name__} with experimental_place_dataset_on_device "
                                      f"is not implemented (resident rows hold class labels); "
                                      f"distribute the dataset without that option.")
        batch.loader(model)                    # builds the model from the resident rows' shape
        return batch
    return host_batch(model, batch)


def host_batch(model, batch):
    """One dataset element or array pair as the step takes it: ``(x (B, features) float32,
    y (B,) integers)``, C-contiguous. Builds the model from it if need be."""
    if isinstance(batch, dict):
        batch = (batch.get("image"), batch.get("label"))
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError("each dataset element must be an (x, y) pair: load with "
                         "as_supervised=True or map to (image, label).")
    if len(batch) > 3:
        raise ValueError(f"each dataset element must be an (x, y) pair or an (x, y, sample_weight) triple, "
                         f"got {len(batch)} items.")
    xb, yb = (b.numpy() if isinstance(b, Tensor) else np.asarray(b) for b in batch[:2])
    if yb.ndim == 0:
        raise ValueError(f"the dataset yields single examples (x of shape {xb.shape}, one label "
                         f"{yb!r:.20}), but fit and evaluate take batches: call .batch(batch_size) "
                         f"on the dataset first, e.g. ds.batch(128).")
    model.accept_inputs(xb.shape, xb.dtype)
    xb = np.ascontiguousarray(xb, np.float32).reshape(xb.shape[0], -1)     # Flatten: (B, features)
    in_dim = model.step.in_dim
    if xb.shape[1] != in_dim:
        raise ValueError(f"examples have {xb.shape[1]} features, the model expects "
                         f"{in_dim} (input shape {model.input_shape[1:]}).")
    weights = () if len(batch) < 3 else (sample_weights.check(batch[2], xb.shape[0]),)   # (B,) float32
    if takes_targets(model.loss):
        return (xb, targets(model, yb, xb.shape[0])) + weights
    check_label_shape(model, yb.shape, xb.shape[0])
    yb = class_indices(yb.reshape(-1), model)
    check_labels(yb, model.step.programs[0].classes)    # on the host, before any device sees them
    return (xb, np.ascontiguousarray(yb)) + weights


def targets(model, y, examples):
    """Float targets for MSE, BCE and one-hot labels: (B, outputs) float32, C-contiguous; (B,)
    is read as (B, 1), as Keras does for a one-output model."""
    outputs = model.step.programs[0].classes
    y = np.asarray(y)
    if y.shape[:1] != (examples,) or int(np.prod(y.shape[1:], dtype=np.int64)) != outputs:
        hint = (" These look like class indices: one-hot them with keras.utils.to_categorical(y, "
                f"{outputs}), or use loss='sparse_categorical_crossentropy'."
                if y.shape[1:] in ((), (1,)) and outputs > 1 and counts_accuracy(model.loss) else "")
        raise ValueError(f"targets of shape {y.shape} for {examples} examples: the loss "
                         f"{type(model.loss).__name__} compares each example's {outputs} outputs with as "
                         f"many targets: give shape ({examples}, {outputs}).{hint}")
    return np.ascontiguousarray(y.reshape(examples, outputs), np.float32)


def class_indices(y, model):
    """Labels ``y`` (B,) as class indices of ``LABEL_DTYPE`` (int64), the one label type
    the loss kernels are given on every backend: uint8 (``keras.datasets``), int16, uint32...
    are converted here, once per batch (no copy when they are int64 already).

    Float labels are accepted when every one is a whole number (3.0), as Keras casts
    them; 0.5 or NaN would be truncated to a class silently, so they are refused."""
    if y.dtype.kind in "iu":
        if y.dtype == np.uint64 and y.size and y.max() > np.iinfo(LABEL_DTYPE).max:
            raise ValueError(f"labels of dtype {y.dtype} up to {y.max()}: class indices must be "
                             f"below the number of classes; check the label encoding.")
        return y.astype(LABEL_DTYPE, copy=False)
    if y.dtype.kind not in "bf":
        raise TypeError(f"labels of dtype {y.dtype}: the loss {type(model.loss).__name__} expects "
                        f"integer class indices; convert them with y.astype(np.int64).")
    whole = np.isfinite(y) & (y == np.floor(y)) if y.dtype.kind == "f" else np.ones(y.shape, bool)
    if not whole.all():
        bad = np.flatnonzero(~whole)
        raise ValueError(f"labels of dtype {y.dtype} with values that are not whole numbers (at "
                         f"{bad[:5].tolist()}: {y[bad[:5]].tolist()}): the loss {type(model.loss).__name__} "
                         f"expects class indices, one integer per example. Round or fix the labels; "
                         f"for soft or one-hot targets use a categorical loss.")
    return y.astype(LABEL_DTYPE)


def check_batch_size(batch_size, what):
    """Refuse a ``batch_size`` that is not None or a positive integer (-1 gave an empty
    predict and a negative length; 2.5 and True were taken as 2 and 1)."""
    if batch_size is None:
        return
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, numbers.Integral) \
            or batch_size < 1:
        raise ValueError(f"{what}: batch_size must be a positive integer (or None for 32), "
                         f"got {batch_size!r}.")


def check_label_shape(model, shape, examples):
    """Refuse labels of ``shape`` for ``examples`` examples unless they are class indices,
    one per example: (B,) or (B, 1), as Keras's sparse losses take them. One-hot labels
    (B, classes) would otherwise be read as B * classes labels."""
    shape = tuple(shape)
    loss = type(model.loss).__name__
    classes = model.step.programs[0].classes
    if shape[1:] not in ((), (1,)):
        looks = (f"; they look one-hot (one row of {classes} per example)"
                 if shape[1:] == (classes,) else "")
        raise ValueError(
            f"labels of shape {shape}: the loss {loss} expects class indices, one integer in "
            f"[0, {classes}) per example (shape ({shape[0]},) or ({shape[0]}, 1)){looks}. Pass "
            f"y.argmax(axis=-1), or map the dataset to (image, argmax of the label); or compile with "
            f"loss='categorical_crossentropy', Keras's loss for one-hot labels.")
    if shape[0] != examples:
        raise ValueError(f"a batch has {examples} examples but {shape[0]} labels.")


def predict_batches(x, batch_size):
    """(batches of inputs, how many) for ``predict``: arrays in chunks, or a dataset as is."""
    if isinstance(x, (np.ndarray, list)):
        arr = np.asarray(x)
        bs = batch_size or 32
        chunks = [(arr[i:i + bs],) for i in range(0, len(arr), bs)]
        return chunks, len(chunks)
    try:
        return x, len(x)
    except TypeError:
        return x, None


class ArrayBatches:
    """Batches of in-memory arrays, reshuffled every epoch when ``shuffle`` (Keras's fit).

    Across workers (``MultiWorkerMirroredStrategy``) every worker must cut the same
    global batches, so the chief's permutation is used everywhere (``extended``'s
    ``broadcast_from_chief``), whatever each worker's seed, and every worker must hold
    as many examples (``check_example_count``, before the first step).
    """

    def __init__(self, x, y, batch_size, shuffle, extended=None, sample_weight=None):
        self.x, self.y, self.bs, self.shuffle = x, y, int(batch_size), shuffle
        self.w = sample_weight                    # (N,) float32 or None: batches are then triples
        self.extended = extended
        agree = getattr(extended, "check_example_count", None)     # across workers: same length
        if agree is not None:
            agree(len(x), "fit/evaluate with arrays")

    def __iter__(self):
        n = len(self.x)
        order = _random.generator().permutation(n) if self.shuffle else None    # (n,) int64
        if order is not None and self.extended is not None and self.extended.num_workers > 1:
            order = self.extended.broadcast_from_chief(order, "the epoch's shuffle of the arrays")
        for i in range(0, n, self.bs):
            idx = order[i:i + self.bs] if order is not None else slice(i, i + self.bs)
            yield (self.x[idx], self.y[idx]) if self.w is None else (self.x[idx], self.y[idx], self.w[idx])

    def __len__(self):
        return ceil_div(len(self.x), self.bs)


class DatasetBatches:
    """The elements of a batched ``mirrored.data.Dataset``, one epoch per iteration.

    When the model's replicas run on GPUs (``replica_devices``: its weights' devices, not
    the current device's), an epoch that the data set can plan by row number (``data.index_batches``:
    ``from_tensor_slices``, or a filled ``cache()``, then shuffle/repeat/take, then
    batch) is played from a copy of its rows kept on the devices (``ResidentBatch``es),
    when the rows fit (``input_lib.fits_on_devices``) and are an (x, y) pair the
    resident loader takes (``_loadable``); otherwise the batches are copied, silently:
    it is an optimisation, not a request. Same batches, same order, same weights.
    The copy is dropped when this object goes (when ``fit``/``evaluate`` return).
    ``input_lib.AUTO_PLACE_ON_GPUS = False`` turns it off.

    ``dist``: a ``DistributedDataset`` of the model's strategy, with its options:
    asked to stay on the devices, it does (``dist.resident_epoch``: with a warning
    when it cannot); with options that do not ask, it is copied.
    """

    def __init__(self, dataset, model, dist=None, place=True):
        self.dataset, self.dist = dataset, dist
        self.residence = None            # input_lib.Residence when fit may place the data unasked
        devices = replica_devices(model)
        # Never on CPUs, where a gather costs what a copy costs (read here, not asked of
        # input_lib: a CPU fit's step stays out of that file, tests/test_step_path.py)
        on_gpus = input_lib.AUTO_PLACE_ON_GPUS and all(dev.device_type == "GPU" for dev in devices)
        if place and on_gpus and (dist is None or dist.options is None) and not takes_targets(model.loss):
            self.residence = Residence(devices)
            weakref.finalize(self, _release, model, self.residence).atexit = False

    def __iter__(self):
        if self.dist is not None and self.dist.place_on_device:
            epoch = self.dist.resident_epoch()
            return iter(self.dataset) if epoch is None else resident_batches(*epoch)
        if self.residence is None:
            return iter(self.dataset)
        resident, batches, _ = self.residence.epoch(self.dataset, _loadable)
        if resident is not None:
            return resident_batches(resident, batches)
        return iter(self.dataset) if batches is None else batches    # host batches, already planned


def replica_devices(model):
    """The devices ``model``'s replicas run on: those of its weights once it is built
    (a model made under ``tf.device("/cpu:0")`` with no strategy runs there, wherever
    ``fit`` is called), else those its strategy will build it on. A data set kept on the
    devices goes exactly there (issue 51: lab 01's CPU model on a machine with a GPU
    once found its data uploaded to GPU:0 and could not train)."""
    if model.step is not None:
        return model.step.devices
    return model.distribute_strategy.extended.devices


def resident_batches(resident, batches):
    """One epoch of ``ResidentBatch``es: ``batches`` of row numbers of ``resident``."""
    return (ResidentBatch(resident, idx) for idx in batches)


def _loadable(rows):
    """True if ``ResidentLoader`` can feed a model from ``rows`` as the host path would:
    an (x, y) pair, x float32 or uint8 (cast to float32 on the device, as the host casts
    it), y one int64 or int32 class index per row (the gather's and cast's dtypes)."""
    columns = rows.columns
    if isinstance(columns, dict) and set(columns) == {"image", "label"}:
        columns = (columns["image"], columns["label"])
    if not (isinstance(columns, tuple) and len(columns) == 2
            and all(isinstance(c, np.ndarray) for c in columns)):
        return False
    x, y = columns
    return (x.dtype in (np.float32, np.uint8) and x.ndim >= 2 and y.dtype in (np.int64, np.int32)
            and y.shape[1:] in ((), (1,)))


def _release(model, residence):
    """When a ``DatasetBatches`` goes: its data set leaves the devices (the step's
    loader, which holds it too, is dropped if it is this data set's)."""
    held = residence.resident
    residence.release()
    step = model.step
    if held is not None and step is not None and step.resident_loader is not None \
            and step.resident_loader.resident is held:
        step.resident_loader = None
        model.forget_programs()                     # they read the buffers it held


class ResidentBatch:
    """One global batch of a data set kept on the devices: its row numbers, (B,) int64."""

    __slots__ = ("resident", "idx")

    def __init__(self, resident, idx):
        self.resident, self.idx = resident, idx

    def loader(self, model):
        """The ``ResidentLoader`` of this data set for ``model`` (made once, kept by the step)."""
        step = model.step
        if step is None or step.resident_loader is None or step.resident_loader.resident is not self.resident:
            loader = ResidentLoader(model, self.resident)       # builds the model if need be
            model.step.resident_loader = loader
        return model.step.resident_loader


class ResidentLoader:
    """Gathers a replica's rows of a resident data set into its program's input buffers.

    Per step and replica: the row numbers go up (b int64), then one gather for x
    and one for y on the device; a cast follows only when the stored dtype is not
    what the model takes (uint8 images: float32; labels of any other dtype: int64).
    """

    def __init__(self, model, resident):
        self.resident = resident
        leaf = nest.pack_sequence_as(resident.rows.columns, list(range(len(resident.dtypes))))
        if isinstance(leaf, dict):
            leaf = (leaf.get("image"), leaf.get("label"))
        if not (isinstance(leaf, (tuple, list)) and len(leaf) == 2 and all(isinstance(k, int) for k in leaf)):
            raise ValueError("each dataset element must be an (x, y) pair: load with "
                             "as_supervised=True or map to (image, label).")
        self.kx, self.ky = leaf
        model.build((None,) + tuple(resident.shapes[self.kx]))
        model.check_example_shape(resident.shapes[self.kx])
        in_dim = model.step.in_dim
        if resident.row_sizes[self.kx] != in_dim:
            raise ValueError(f"examples have {resident.row_sizes[self.kx]} features, the model expects "
                             f"{in_dim} (input shape {model.input_shape[1:]}).")
        for p, dev in zip(model.step.programs, resident.devices):
            if p.dev is not dev:
                raise ValueError(f"the resident data set lives on {dev.name} but replica {p.r} runs on "
                                 f"{p.dev.name}: distribute the dataset with the model's strategy.")
        check_label_shape(model, (resident.rows_count,) + tuple(resident.shapes[self.ky]),
                          resident.rows_count)
        labels = nest.flatten(resident.rows.columns)[self.ky].reshape(-1)   # every label, once
        check_labels(class_indices(labels, model), model.step.programs[0].classes)
        self.y_dtype = LABEL_DTYPE        # stored labels of another dtype are cast on the device
        self._scratch = {}                      # (replica, leaf, b) -> (b, row) in the stored dtype

    def caches(self):
        """The buffers made on first use, here and in the resident rows (``Step.rolled_back_on_error``)."""
        return [self._scratch] + self.resident.caches()

    def load(self, p, idx, scalars=None):
        """Replica program ``p``'s rows ``idx`` (b,) into its input buffers, ``scalars`` (a
        training step's optimizer vector) up with the row numbers: (x_dev, y_dev, its buffer)."""
        # a copied step's buffers (their scalars' view unused: the scalars go with the row numbers)
        x_dev, y_dev = p.input_buffers(len(idx), self.y_dtype, (), scalars)[:2]
        wanted = [(self.kx, x_dev), (self.ky, y_dev)]
        landing = [(k, self._landing(p, k, len(idx), out)) for k, out in wanted]
        sent = self.resident.gather(p.r, idx, landing, scalars)  # one upload: row numbers, scalars
        for (_, out), (_, land) in zip(wanted, landing):
            if land is not out and len(idx):
                p.dev.ops.cast(land.reshape(out.shape), out)     # e.g. uint8 images -> float32
        return x_dev, y_dev, sent

    def _landing(self, p, k, b, out):
        """Where leaf k's rows are gathered: ``out`` itself when the stored dtype is
        what the model takes, else a scratch buffer in the stored dtype (cast after)."""
        if np.dtype(self.resident.dtypes[k]) == np.dtype(out.dtype):
            return out
        key = (p.r, k, b)
        tmp = self._scratch.get(key)
        if tmp is None:
            tmp = self._scratch[key] = p.dev.empty((b, self.resident.row_sizes[k]), self.resident.dtypes[k])
        return tmp
