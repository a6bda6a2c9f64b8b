"""``fit``, ``evaluate`` and ``predict`` running the user's own step: Keras 3's
``train_step(self, data)``, ``test_step(self, data)`` and ``predict_step(self, data)``
overrides (keras.io, "Customizing what happens in fit() with TensorFlow")::

    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    model = CustomModel(inputs, outputs)          # a functional subclass, or define call
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, epochs=3)

What fit does per batch (``run_step``), as Keras's TensorFlow trainer does it: the global
batch cut into the replicas' shares by the rebatching rule (``input_lib.split_batch``), then
``strategy.run(model.train_step, args=(share,))``: the step runs once per replica, on its
device. ``self(x)`` runs that replica's program, ``tape.gradient`` its backward, and
``optimizer.apply`` is the merge point of the custom loop (``optimizers.py``): the last replica
to arrive all-reduces the packed gradients and updates every copy once (``Step.apply_gradients``,
fit's own steps 3-4). So the copies stay bitwise equal and N replicas train as one on the
global batch.

``compute_loss`` divides each replica's summed loss by the GLOBAL batch (fit tells it, here),
so the all-reduced SUM is the mean over the whole batch even when the shares are uneven
(Keras 3 divides each replica's mean by the replica count: the same for even shares). With
``sample_weight`` each example's loss is weighed first and the sum still divided by the number
of examples (Keras 3's ``reduce_weighted_values``); ``fit(sample_weight=/class_weight=)`` hands
the step ``(x, y, sample_weight)`` triples, as Keras's data adapters do. Outside
fit it divides by this replica's batch times the replica count (``tf.nn.compute_average_loss``'s
default). The model's loss tracker (``model.metrics[0]``, named "loss") multiplies what a replica
gives it by the replica count (Keras's ``unscale_loss_for_distribution``), so the loss fit prints
is the global batch's, whatever the replica count.

The logs: the dict ``train_step`` returns, nested dicts flattened and the keys sorted (Keras's
``pythonify_logs``). When its keys are those of ``model.metrics`` (the compiled metrics' dict
flattened), the logs are those metrics' results, read after every replica has updated them (the
metrics here are one host copy that every replica adds to: ``metrics.py``), as Keras's
``_get_metrics_result_or_logs`` does; otherwise each value is the mean over the replicas (Keras
3's ``reduce_per_replica(reduction="auto")``, "mean" under MirroredStrategy: a metric's result,
the same on every replica here, stays itself).

fit's step is traced and replayed as Keras wraps it in ``tf.function`` (``traced_step.py``: its
Python once per input signature; ``compile(run_eagerly=True)``: every batch); evaluate's and
predict's run as Python every batch.

Neighbours: ``trainer.py`` (fit's loop calls ``train``), ``model_api.py`` (evaluate, predict,
``compute_loss``, ``metrics``), ``metrics.py`` (the metric objects), ``compile_utils.py`` (a
loss's share; losses and metrics per output), ``multi_io.py`` (models of several inputs or
outputs, which run here), ``traced_step.py`` (fit's step as a tf.function), ``tape.py``,
``input_lib.py`` (``split_batch``).
"""
import weakref

import numpy as np

from mirrored import context, nest
from mirrored.program import recording
from mirrored.input_lib import split_batch
from mirrored.keras import compile_utils, metrics as _metrics
from mirrored.keras import sample_weights
from mirrored.keras.data_adapters import ArrayBatches, ResidentBatch
from mirrored.keras.tape import GradientTape, scale_regularization_loss
from mirrored.keras.traced_step import TracedStep, flatten, read_on_host
from mirrored.values import DistributedValues

_DEFAULTS = set()                              # the library's own train_step, test_step, predict_step
_GLOBAL_BATCH = weakref.WeakKeyDictionary()    # model -> the global batch fit's step is on now
_COMPILED = weakref.WeakKeyDictionary()        # model -> (its LossTracker, its CompileMetrics)


def default(method):
    """Mark ``method`` as the library's own step (``overrides`` tells a user's from it)."""
    _DEFAULTS.add(method)
    return method


def overrides(model, name):
    """True when ``model``'s class defines its own ``name`` (``train_step``, ``test_step``,
    ``predict_step``): fit, evaluate or predict then run it (this file) instead of the
    library's fused step."""
    return getattr(type(model), name, None) not in _DEFAULTS


def runs_keras_step(model, name):
    """True when ``fit`` (``name="train_step"``), ``evaluate`` (``"test_step"``) or ``predict``
    (``"predict_step"``) runs under ``strategy.run`` here, a replica thread per device, rather
    than as the fused step (``step.py``, every replica in turn in one thread): the model defines
    its own step, or one of its layers must talk to the other replicas inside its forward (a
    layer with ``cross_replica = True``, such as ``BatchNormalization(synchronized=True)``,
    whose batch statistics are all-reduced: only replica threads can wait for each other), or
    it has several inputs or outputs (``multi_io.py``: the fused step takes one of each).
    A model that does not define the step runs Keras 3's default (``keras_train_step``,
    ``ModelAPI.test_step``, ``ModelAPI.predict_step``)."""
    if overrides(model, name) or getattr(model, "structured_io", False):
        return True
    return name != "predict_step" and any(getattr(layer, "cross_replica", False) for layer in layers_within(model))


def layers_within(model):
    """Every layer of ``model``, nested models' layers included (each once), in order."""
    found, todo = [], list(getattr(model, "layers", ()))
    while todo:
        layer = todo.pop(0)
        if any(layer is f for f in found):
            continue
        found.append(layer)
        todo[:0] = list(getattr(layer, "layers", ()))
    return found


def step_function(model, name):
    """What ``run_step`` calls on each replica for ``name``: the model's own method where it
    defines one, else Keras 3's default (``keras_train_step`` for fit; the model's
    ``test_step``/``predict_step``, which are Keras's defaults already)."""
    if name == "train_step" and not overrides(model, name):
        return lambda data: keras_train_step(model, data)
    return getattr(model, name)


def keras_train_step(model, data):
    """Keras 3's default ``train_step(self, data)`` (its TensorFlow trainer), run on one
    replica's share: forward under a tape, ``compute_loss``, the loss tracker, the
    gradients, ``optimizer.apply`` (the merge point: the last replica all-reduces and
    updates every copy), then the compiled metrics."""
    x, y, sample_weight = unpack_x_y_sample_weight(data)
    with GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    model.metrics[0].update_state(loss, sample_weight=rows(x))     # Keras weighs it by the batch's rows
    variables = model.trainable_variables
    if variables:
        model.optimizer.apply(tape.gradient(loss, variables), variables)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def rows(x):
    """The number of examples in ``x`` (its first leaf's first dimension)."""
    leaf = nest.flatten(x)[0]
    return int(leaf.shape[0] if hasattr(leaf, "shape") else len(leaf))   # no host read of a tensor


def unpack_x_y_sample_weight(data):
    """Keras's ``unpack_x_y_sample_weight``: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``
    (a list as a tuple); anything else is ``x`` alone."""
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple):
        return data, None, None
    if len(data) == 1:
        return data[0], None, None
    if len(data) == 2:
        return data[0], data[1], None
    if len(data) == 3:
        return data
    raise ValueError(f"Data is expected to be in format `x`, `(x,)`, `(x, y)`, or `(x, y, sample_weight)`, "
                     f"found a tuple of {len(data)} elements.")


# -- the data --------------------------------------------------------------------------------
def batches(model, x, y, batch_size, shuffle, sample_weight=None, class_weight=None):
    """The global batches of an epoch as the user's step takes them (Keras's ``data``): (x, y)
    slices of arrays, in their own shapes and dtypes, or a data set's elements as it yields
    them; and the number of batches (None if unknown). A model of several inputs or outputs
    (``multi_io.py``) takes x and y as lists or dicts of arrays (``Columns``). ``sample_weight``
    (arrays: one weight per example) or ``class_weight`` ({class: weight}): each batch an (x, y,
    sample_weight) triple, as Keras's data adapters hand them to ``train_step``
    (``sample_weights.py``); a data set carries its own weights as the third item of its elements."""
    if not hasattr(x, "batch") and (isinstance(x, dict) or isinstance(y, dict) or _several(model, x, "inputs")
                                    or _several(model, y, "outputs")):
        if sample_weight is not None or class_weight is not None:
            raise NotImplementedError("sample_weight/class_weight for a model of several inputs or outputs is "
                                      "not implemented here: weigh each output's loss in a train_step of the "
                                      "model's own.")
        x = Columns(x, "x") if isinstance(x, (list, tuple, dict)) else np.asarray(x)
        y = y if y is None else Columns(y, "y") if isinstance(y, (list, tuple, dict)) else np.asarray(y)
        if y is not None and len(x) != len(y):
            raise ValueError(f"x has {len(x)} examples but y has {len(y)}.")
        adapter = ArrayBatches(x, y if y is not None else np.zeros(len(x)), batch_size or 32, shuffle,
                               model.distribute_strategy.extended)
        return (_XOnly(adapter) if y is None else adapter), len(adapter)
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)) and not hasattr(x, "batch"):
        x = np.asarray(x)
        if y is not None:
            y = np.asarray(y)
            if len(x) != len(y):
                raise ValueError(f"x has {len(x)} examples but y has {len(y)}.")
        weights = None
        if sample_weight is not None or class_weight is not None:
            if y is None:
                raise ValueError("sample_weight/class_weight need y (the labels) beside x.")
            weights = sample_weights.for_arrays(y, len(y), sample_weight, class_weight)   # (N,) float32
        adapter = ArrayBatches(x, y if y is not None else np.zeros(len(x)), batch_size or 32, shuffle,
                               model.distribute_strategy.extended, weights)
        if y is None:
            return _XOnly(adapter), len(adapter)
        return adapter, len(adapter)
    if y is not None:
        raise ValueError("y must be None when x is a dataset (it yields (x, y) pairs).")
    sample_weights.refuse_for_dataset(sample_weight)
    dataset = getattr(x, "dataset", x)          # a DistributedDataset: its global batches
    if not hasattr(dataset, "__iter__"):
        raise TypeError(f"x must be a NumPy array or a mirrored.data.Dataset, got {type(x).__name__}.")
    try:
        steps = len(dataset)
    except TypeError:
        steps = None
    return (dataset if class_weight is None else sample_weights.ByClass(dataset, class_weight)), steps


def _several(model, data, what):
    """True when ``data`` is a list or tuple of the several inputs (outputs) of ``model``."""
    return isinstance(data, (list, tuple)) and len(getattr(model, what, None) or ()) > 1


class Columns:
    """A list or dict of arrays with one example per row (a model's several inputs or outputs),
    sliced as one array: ``columns[rows]`` is the same structure of those rows (a tuple is
    taken as a list: a tuple of data is Keras's (x, y))."""

    def __init__(self, arrays, what):
        arrays = list(arrays) if isinstance(arrays, tuple) else arrays
        self.arrays = nest.map_structure(np.asarray, arrays)
        sizes = [len(a) for a in nest.flatten(self.arrays)]
        if len(set(sizes)) != 1:
            raise ValueError(f"{what}: the arrays have different numbers of examples, {sizes}; give every "
                             f"input (output) the same number of rows.")
        self.n = sizes[0]

    def __len__(self):
        return self.n

    def __getitem__(self, rows):
        return nest.map_structure(lambda a: a[rows], self.arrays)


class _XOnly:
    """Batches of x alone (``predict``; ``fit(x)`` with a step that needs no y)."""

    def __init__(self, adapter):
        self.adapter = adapter

    def __iter__(self):
        several = isinstance(self.adapter.x, Columns)           # a list of inputs: Keras's (x,)
        return ((x,) if several else x for x, _ in self.adapter)

    def __len__(self):
        return len(self.adapter)


def _devices(model):
    if model.step is not None:
        return model.step.devices
    return model.distribute_strategy.extended.devices


def _global_size(batch):
    leaves = [leaf for leaf in nest.flatten(batch) if np.ndim(leaf)]
    return int(np.shape(leaves[0])[0]) if leaves else 0


# -- one step -----------------------------------------------------------------------------------
def run_step(model, name, batch):
    """``model.<name>(data)`` once per replica on its share of the global ``batch``; the
    per-replica results (PerReplica leaves; the result itself on one replica)."""
    if isinstance(batch, dict):
        batch = tuple(batch.values()) if name != "predict_step" else batch
    if isinstance(batch, list):
        batch = tuple(batch)
    strategy = model.distribute_strategy
    shares = split_batch(batch, strategy.extended, _devices(model))
    _GLOBAL_BATCH[model] = _global_size(batch)
    try:
        if name == "train_step" and not model.run_eagerly:      # Keras's tf.function (traced_step.py)
            traced = getattr(model, "train_function", None)       # Keras's name; compile resets it
            if traced is None:
                traced = model.train_function = TracedStep(model, step_function(model, name))
            if not traced.eager:
                return traced(shares, lambda: metric_results(model).keys())
        return strategy.run(step_function(model, name), args=(shares,))
    finally:
        _GLOBAL_BATCH.pop(model, None)


def train(model, batches):
    """One execution of fit: the user's ``train_step`` on each batch in turn; the logs of the last."""
    for batch in batches:
        model.step_logs = logs(model, run_step(model, "train_step", batch))


def evaluate(model, data_batches):
    """evaluate over ``data_batches`` with the user's ``test_step``: (the logs, batches seen)."""
    reset_metrics(model)
    out, seen = None, 0
    for batch in data_batches:
        out = logs(model, run_step(model, "test_step", batch))
        seen += 1
    return out, seen


def predict(model, data_batches, most=None):
    """predict with the user's ``predict_step``: its outputs, the replicas' concatenated along
    the batch axis, then the batches'."""
    outs = []
    for batch in data_batches:
        if most is not None and len(outs) >= most:
            break
        result = run_step(model, "predict_step", batch)
        outs.append(nest.map_structure(_concat, result) if not isinstance(result, DistributedValues)
                    else _concat(result))
    if not outs:
        return np.zeros((0,), np.float32)
    return nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outs)


def _concat(value):
    parts = value.values if isinstance(value, DistributedValues) else (value,)
    return np.concatenate([np.atleast_1d(_metrics.host_array(p)) for p in parts], axis=0)


# -- the logs -----------------------------------------------------------------------------------
def metric_results(model):
    """{name: float} of every metric in ``model.metrics`` (the compiled ones' dict flattened)."""
    return {k: _to_float(v) for k, v in flatten({m.name: m.result() for m in model.metrics}).items()}


def logs(model, result):
    """The logs of one step's ``result`` (the dict every replica returned, module docstring)."""
    if result is None:
        return {}
    if not isinstance(result, dict):
        raise TypeError(f"{type(model).__name__}.train_step/test_step returned {type(result).__name__}; "
                        f"return a dict of metric names to values, e.g. "
                        f"{{m.name: m.result() for m in self.metrics}}.")
    flat = flatten(result)
    known = metric_results(model)
    if set(known) == set(flat):                  # Keras's _get_metrics_result_or_logs
        return {key: known[key] for key in flat}
    # a metric's result() read inside the step, by each replica while the others may still be
    # adding to it: read once more now that every replica is done (one value, whatever the timing)
    return {key: known[key] if key in known and read_on_host(value) else _replica_mean(value)
            for key, value in flat.items()}


def in_keras_order(model, logs):
    """evaluate's list of values in Keras 3's order (``_flatten_metrics_in_order``): those of
    ``model.metrics`` by name first (a compiled metrics container by its metrics' own names,
    so "mae" but not "o1_mae"), then the other logs in sorted order."""
    names = []
    for metric in model.metrics:
        inner = metric.metrics if isinstance(metric, (_metrics.CompileMetrics, compile_utils.OutputMetrics)) \
            else [metric]
        names += [m.name for m in inner]
    return [logs[n] for n in names if n in logs] + [logs[k] for k in sorted(logs) if k not in names]


def _replica_mean(value):
    """Keras 3's "auto" reduction of a step's returned value: the mean over the replicas."""
    parts = value.values if isinstance(value, DistributedValues) else (value,)
    mean = sum(_to_float(p) for p in parts) / len(parts)
    return float(mean) if np.ndim(mean) == 0 else mean


def _to_float(value):
    arr = _metrics.host_array(value)
    return float(arr) if arr.size == 1 else arr


def reset_metrics(model):
    """Keras's ``reset_metrics``: every metric of ``model.metrics`` back to its start."""
    for metric in model.metrics:
        metric.reset_state()


# -- the model's loss and metrics ------------------------------------------------------------------
class LossTracker(_metrics.Mean):
    """The model's own "loss" metric (Keras's ``_loss_tracker``). A replica's loss from
    ``compute_loss`` is its share of the global loss (summed over the replicas, it is the
    loss); this tracker multiplies it by the replica count (Keras's
    ``unscale_loss_for_distribution``), so its mean over the replicas is the global loss.
    Keras's default steps weigh each replica's value by its rows (``sample_weight=rows(x)``):
    then the share is turned into that replica's own mean (times global batch / its rows), so
    the weighted mean is the global loss even when the shares are uneven (7 rows: 4 + 3)."""

    def __init__(self, model=None, name="loss"):
        super().__init__(name)
        self.model = None if model is None else weakref.ref(model)

    def update_state(self, values, sample_weight=None):
        """The factor (from the replica context and the batch: Python, decided when a step
        traces), then the values added (host work: a traced step's replay adds its own)."""
        strategy, replica_ctx = context.top()
        factor = strategy.num_replicas_in_sync if replica_ctx is not None and strategy is not None else 1
        model = self.model() if self.model is not None else None
        global_batch = _GLOBAL_BATCH.get(model) if model is not None else None
        if global_batch and sample_weight is not None and np.ndim(sample_weight) == 0 and sample_weight > 0:
            factor = global_batch / float(sample_weight)      # the replica's mean of its own rows
        self.add_scaled(values, factor, sample_weight)

    @recording.host_work
    def add_scaled(self, values, factor, sample_weight=None):
        """``values`` (read on the host now) times ``factor`` into the running mean."""
        super().update_state(_metrics.host_array(values).astype(np.float64) * factor, sample_weight)


def compile_metrics(model, metrics):
    """What ``compile`` makes: the model's loss tracker and ``CompileMetrics`` of ``metrics``
    (metric objects, or the container itself: ``compile_utils.OutputMetrics``); returns the latter."""
    compiled = metrics if isinstance(metrics, _metrics.Metric) else _metrics.CompileMetrics(metrics)
    _COMPILED[model] = (LossTracker(model), compiled)
    return compiled


def compiled_metrics(model):
    """The ``CompileMetrics`` of the last ``compile`` (None before it)."""
    return _COMPILED.get(model, (None, None))[1]


def model_metrics(model):
    """Keras 3's ``model.metrics``: the loss tracker and the compiled metrics once compiled, each
    output's loss tracker (several outputs), then the metrics set as the model's attributes
    (``self.mae = keras.metrics.MAE()``)."""
    tracker, compiled = _COMPILED.get(model, (None, None))
    found = [] if tracker is None else [tracker]
    if compiled is not None and compiled.metrics:
        found.append(compiled)
    if isinstance(model.loss, compile_utils.CompileLoss):     # each output's loss: "o1_loss", ...
        found += model.loss.metrics
    found += [m for k, m in vars(model).items() if not k.startswith("_") and isinstance(m, _metrics.Metric)
              and all(m is not f for f in found)]
    return found


def compute_loss(model, y, y_pred, sample_weight=None):
    """Keras 3's ``model.compute_loss``: the compiled loss of ``y_pred`` against ``y`` plus the
    layers' weight penalties, as this replica's share (module docstring). ``sample_weight``
    (one weight per example, (b,) or (b, 1)) weighs each example's loss: Keras 3's
    ``reduce_weighted_values``, ``sum_i w_i l_i`` divided by the number of EXAMPLES, not by the
    weights' sum (here by the global batch: the replicas' shares sum to that)."""
    terms = []
    loss = model.loss
    if loss is not None:
        if y_pred is None or y is None:
            raise ValueError("compute_loss needs y and y_pred: self.compute_loss(y=y, y_pred=self(x)).")
        if isinstance(loss, compile_utils.CompileLoss):          # several outputs: compile_utils.py
            if sample_weight is not None:
                raise NotImplementedError("compute_loss(sample_weight=...) for a model of several outputs is "
                                          "not implemented here: weigh each output's loss in a train_step "
                                          "of the model's own.")
            terms.append(loss(y, y_pred, _GLOBAL_BATCH.get(model)))
        else:
            terms.append(compile_utils.share(loss, y, y_pred, _GLOBAL_BATCH.get(model), sample_weight))
    if model.losses:
        terms.append(scale_regularization_loss(model.losses))
    if not terms:
        raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


# -- compiled metrics on fit's own step -------------------------------------------------------------
def update_from_programs(model, batch):
    """fit's and evaluate's own step (no override): each replica's last forward output and its
    share of the labels into the compiled host metrics (``compile(metrics=["mae", fn, M()])``;
    the accuracy the loss kernel counts stays on the devices). The outputs are read as the
    model gives them: softmax applied where its last layer has it."""
    if isinstance(batch, ResidentBatch):
        raise NotImplementedError("compile(metrics=...) other than accuracy with a data set kept on the "
                                  "devices (experimental_place_dataset_on_device) is not implemented: "
                                  "distribute the data set without that option.")
    compiled = compiled_metrics(model)
    parts, _, _ = model.step.split(batch)
    out_shape = tuple(model.output_shape[1:])
    for program, part in zip(model.step.programs, parts):
        y, weights = part[1], (part[2] if len(part) > 2 else None)      # Keras's sample_weight, if any
        if not len(y):
            continue
        out = program.dev.to_numpy(program.logits)                         # (b, outputs) float32
        if program.softmax_output:
            e = np.exp(out - out.max(axis=-1, keepdims=True, initial=-np.inf))
            out = e / e.sum(axis=-1, keepdims=True)
        compiled.update_state(y, out.reshape((len(y),) + out_shape), sample_weight=weights)   # host arrays


def host_logs(model, prefix=""):
    """The compiled host metrics' results for fit's and evaluate's logs."""
    compiled = compiled_metrics(model)
    if compiled is None:
        return {}
    return {prefix + k: _to_float(v) for k, v in flatten({m.name: m.result() for m in compiled.metrics}).items()}


def reset_compiled(model):
    """The compiled host metrics back to their start (each epoch, each evaluate)."""
    compiled = compiled_metrics(model)
    if compiled is not None:
        compiled.reset_state()


class RMSpropNotImplemented(NotImplementedError, AttributeError):
    """An attribute of ``NoRMSprop`` (an AttributeError too: ``hasattr`` answers False)."""


class NoRMSprop:
    """``compile()`` with Keras's default optimizer, RMSprop, which is not implemented here:
    accepted for a model with its own ``train_step`` (``super().compile()`` in a custom
    ``compile`` that sets its own optimizers), refused when the step uses it."""

    name = "rmsprop"

    def __getattr__(self, attribute):
        raise RMSpropNotImplemented(f"optimizer.{attribute}: the model was compiled with Keras's default "
                                  f"optimizer, RMSprop, which is not implemented here; pass "
                                  f"compile(optimizer='adam') or 'sgd'.")
