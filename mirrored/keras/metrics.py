"""Keras's metrics: ``Mean``, ``MeanAbsoluteError`` ("mae"), ``MeanSquaredError`` ("mse"),
``BinaryAccuracy``, ``SparseCategoricalAccuracy``, ``CategoricalAccuracy``, functions as metrics
(``MeanMetricWrapper``), ``Metric`` subclasses of one's own (``add_weight``), ``get`` (what
``compile(metrics=[...])`` takes), ``CompileMetrics`` (the compiled ones as one entry of
``model.metrics``); and which accuracy ``compile`` lets the loss kernel count on the devices.

``model.fit`` keeps its loss and that accuracy on the devices (``engine.py``); every other
metric is one of these objects, updated on the host: by a custom loop (each replica calls
``update_state``, the host calls ``result()``), by a model's own ``train_step``, or by fit's
own step from each step's outputs (``custom_step.update_from_programs``). The built-in ones
compute Keras's per-example values in float64 NumPy and keep a weighted sum and count, under a
lock, so replica threads can update them concurrently. Inside a ``@function`` their
``update_state`` is host work that every replay does again (``recording.host_work``): it reads
the values that replay computed.
"""
import threading

import numpy as np

from mirrored.program import recording
from mirrored.keras import initializers
from mirrored.tensor import HostTensor, Tensor, TraceTimeValue
from mirrored.values import Variable


def host_array(value):
    """``value`` (a tensor, a variable, an array or a number) as a NumPy array on the host."""
    if isinstance(value, Tensor) or hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(value)


class MetricVariable(Variable):
    """A metric's state (``Metric.add_weight``): one copy, on the device it was made on, even
    inside a strategy's scope (the metric accumulates what the replicas give it)."""


class Metric:
    """Keras's ``keras.metrics.Metric``. A subclass makes its state with ``add_weight`` in
    ``__init__``, adds to it in ``update_state(y_true, y_pred, sample_weight=None)`` (with ops:
    ``self.tp.assign_add(...)``) and returns it from ``result()``; ``reset_state`` puts every
    ``add_weight`` variable back to its initial value."""

    def __init__(self, name=None, dtype=None):
        self.name = name or type(self).__name__.lower()
        self._lock = threading.Lock()
        self._state = []                 # [(variable, initial value)] made by add_weight
        Metric.reset_state(self)         # a subclass's own reset_state needs its weights, made later

    def add_weight(self, name=None, shape=(), dtype=None, initializer="zeros", aggregation="sum",
                   synchronization="on_read"):
        """A new state variable (float32), initialised by ``initializer`` (a name or a callable)."""
        if dtype is not None and np.dtype(getattr(dtype, "as_numpy_dtype", dtype)) != np.float32:
            raise NotImplementedError(f"metric {self.name!r}: add_weight(dtype={dtype!r}); metric state is "
                                      f"float32 here: leave dtype out.")
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        value = np.asarray(initializers.get(initializer, f"metric {self.name!r} initializer")(shape), np.float32)
        var = MetricVariable(value, trainable=False, name=f"{self.name}/{name or 'variable'}")
        self._state.append((var, value))
        return var

    @property
    def variables(self):
        return [v for v, _ in self._state]

    def reset_state(self):
        self._total = 0.0
        self._count = 0.0
        for var, value in getattr(self, "_state", ()):
            var.assign(value)

    reset_states = reset_state

    def result(self):
        """The current value as a host scalar (has ``.numpy()``). Inside a ``@function``'s
        trace it would be frozen: that function then runs eagerly (with a warning)."""
        active = recording.active()
        if active is not None and active.results_read_after:     # fit reads it after each replay
            return TraceTimeValue.wrap(self._value())
        recording.unrecordable("it reads a metric's result(), a host value a trace would freeze "
                               "(read it outside the function)")
        return HostTensor.wrap(self._value())

    def _value(self):
        return np.float32(self._total / self._count if self._count else 0.0)

    def __call__(self, *args, **kwargs):
        """``update_state``, then the result, as Keras's. Inside a ``@function``'s trace
        (``train_loss(loss)`` in TF's quickstart) the update is host work every replay does
        again, and the result, read now, comes as a ``TraceTimeValue``: the function may
        ignore it, and returning it refuses the trace (a replay would return it unchanged)."""
        self.update_state(*args, **kwargs)
        if recording.active() is not None and type(self).result is Metric.result:   # not one's own
            return TraceTimeValue.wrap(self._value())
        return self.result()


def _weighted(values, sample_weight):
    """Keras's weighted sum and count of ``values`` (float64): ``sample_weight`` broadcast to
    their shape (a (B,) weight over (B, d) values weighs each row); None counts each value once."""
    if sample_weight is None:
        return float(values.sum()), float(values.size)
    w = host_array(sample_weight).astype(np.float64)
    while w.ndim > values.ndim and w.shape[-1:] == (1,):       # (B, 1) weights of (B,) values
        w = w.reshape(w.shape[:-1])
    while w.ndim < values.ndim:                                # (B,) weights of (B, d) values
        w = w[..., None]
    w = np.broadcast_to(w, values.shape)
    return float((values * w).sum()), float(w.sum())


class Mean(Metric):
    """The running (weighted) mean of the values given to ``update_state``: Keras's
    ``sum(values * sample_weight) / sum(sample_weight)``, each value weighing 1 without one."""

    def __init__(self, name="mean", dtype=None):
        super().__init__(name, dtype)

    @recording.host_work
    def update_state(self, values, sample_weight=None):
        self.add(host_array(values).astype(np.float64), sample_weight)

    def add(self, values, sample_weight=None):
        """Add float64 host ``values`` (weighted) to the running sums, under the lock."""
        total, count = _weighted(values, sample_weight)
        with self._lock:
            self._total += total
            self._count += count


def _same_rank(y_true, y_pred):
    """Keras's ``squeeze_or_expand_to_same_rank`` on host arrays: (B,) targets against (B, 1)
    outputs get the axis, and back."""
    if y_true.ndim == y_pred.ndim - 1 and y_pred.shape[-1:] == (1,):
        y_true = y_true[..., None]
    elif y_pred.ndim == y_true.ndim - 1 and y_true.shape[-1:] == (1,):
        y_true = y_true.reshape(y_true.shape[:-1])
    return y_true, y_pred


class MeanMetricWrapper(Mean):
    """Keras's: the running mean of ``fn(y_true, y_pred)``, the values a function returns for
    each batch (one per example, or one per batch: then the mean over batches). ``compile
    (metrics=[fn])`` wraps a plain function so; Keras's own metrics below are such functions
    on host arrays, in float64."""

    def __init__(self, fn, name=None, dtype=None, **kwargs):
        super().__init__(name or getattr(fn, "__name__", "metric"), dtype)
        self.fn, self.fn_kwargs = fn, kwargs

    @recording.host_work
    def update_state(self, y_true, y_pred, sample_weight=None):
        self.add(self.values(y_true, y_pred), sample_weight)

    def values(self, y_true, y_pred):
        """The function's values for a batch, as float64 host numbers."""
        return host_array(self.fn(y_true, y_pred, **self.fn_kwargs)).astype(np.float64)


class _HostMetric(MeanMetricWrapper):
    """A Keras metric whose per-example values are computed here on the host (``per_example``)."""

    def __init__(self, name, dtype=None):
        super().__init__(None, name, dtype)

    def values(self, y_true, y_pred):
        y_true, y_pred = _same_rank(host_array(y_true).astype(np.float64), host_array(y_pred).astype(np.float64))
        if y_true.shape != y_pred.shape and y_true.size != y_pred.size:
            raise ValueError(f"{type(self).__name__} {self.name!r}: targets of shape {y_true.shape} for "
                             f"predictions of shape {y_pred.shape}; give one target per output.")
        return self.per_example(y_true.reshape(y_pred.shape), y_pred)


class MeanAbsoluteError(_HostMetric):
    """``mean(|y_true - y_pred|)`` over the last axis, averaged over examples (``"mae"``)."""

    def __init__(self, name="mean_absolute_error", dtype=None):
        super().__init__(name, dtype)

    def per_example(self, y_true, y_pred):
        return np.abs(y_true - y_pred).mean(axis=-1)


class MeanSquaredError(_HostMetric):
    """``mean((y_true - y_pred) ** 2)`` over the last axis, averaged over examples (``"mse"``)."""

    def __init__(self, name="mean_squared_error", dtype=None):
        super().__init__(name, dtype)

    def per_example(self, y_true, y_pred):
        return np.square(y_true - y_pred).mean(axis=-1)


class BinaryAccuracy(_HostMetric):
    """The fraction of outputs on the right side of ``threshold``: ``y_true == (y_pred >
    threshold)``, averaged over the last axis, then over examples."""

    def __init__(self, name="binary_accuracy", dtype=None, threshold=0.5):
        super().__init__(name, dtype)
        self.threshold = float(threshold)

    def per_example(self, y_true, y_pred):
        return (y_true == (y_pred > self.threshold)).astype(np.float64).mean(axis=-1)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """The fraction of examples whose argmax prediction equals the integer label."""

    def __init__(self, name="sparse_categorical_accuracy", dtype=None):
        super().__init__(None, name, dtype)

    def values(self, y_true, y_pred):
        preds = host_array(y_pred)
        labels = host_array(y_true).reshape(preds.shape[:-1]) if preds.ndim else host_array(y_true)
        return (preds.argmax(axis=-1) == labels).astype(np.float64)


class CategoricalAccuracy(MeanMetricWrapper):
    """The fraction of examples whose argmax prediction equals the argmax of their one-hot
    (or soft) label row, Keras's ``CategoricalAccuracy``."""

    def __init__(self, name="categorical_accuracy", dtype=None):
        super().__init__(None, name, dtype)

    def values(self, y_true, y_pred):
        labels = host_array(y_true)
        preds = host_array(y_pred)
        if labels.shape != preds.shape:
            raise ValueError(f"CategoricalAccuracy: labels {labels.shape} and predictions {preds.shape} "
                             f"must have the same shape (one-hot labels: keras.utils.to_categorical); "
                             f"for class indices use SparseCategoricalAccuracy.")
        return (labels.argmax(axis=-1) == preds.argmax(axis=-1)).astype(np.float64)


#: The accuracy names compile accepts: Keras's "accuracy" and "acc" follow the labels
#: (categorical when they have the output's shape, i.e. with CategoricalCrossentropy),
#: the others name their kind.
SPARSE_ACCURACY = "sparse_categorical_accuracy"
CATEGORICAL_ACCURACY = "categorical_accuracy"
ACCURACY_NAMES = ("accuracy", "acc", SPARSE_ACCURACY, CATEGORICAL_ACCURACY)


def accuracy_name(metric, categorical):
    """The log name of ``compile``'s accuracy ``metric`` (a name or a metric object), counted on
    the devices by the loss kernel. ``categorical``: the loss takes one-hot labels (B, C), or
    None for a loss that counts no accuracy (compile refuses it then). A metric of the other
    kind than the labels (sparse accuracy on one-hot labels) is refused with what to use."""
    kinds = {SparseCategoricalAccuracy: SPARSE_ACCURACY, CategoricalAccuracy: CATEGORICAL_ACCURACY}
    name, kind = (metric, metric) if isinstance(metric, str) else (getattr(metric, "name", None),
                                                                   kinds.get(type(metric)))
    if not (isinstance(metric, str) and metric in ACCURACY_NAMES or kind is not None):
        raise NotImplementedError(f"metric {metric!r} is not implemented; use metrics=['accuracy'].")
    wanted = CATEGORICAL_ACCURACY if categorical else SPARSE_ACCURACY
    if categorical is not None and kind in (SPARSE_ACCURACY, CATEGORICAL_ACCURACY) and kind != wanted:
        labels = "one-hot labels (CategoricalCrossentropy)" if categorical else "class-index labels"
        raise ValueError(f"metric {metric!r} does not fit {labels}: use metrics=['accuracy'] (Keras "
                         f"picks the kind from the labels) or {wanted!r}.")
    return name


class _Accuracy(MeanMetricWrapper):
    """``compile(metrics=["accuracy"])`` computed on the host: Keras picks the kind from the
    shapes (``compile_utils.get_metric``): binary for one output, sparse for class-index
    labels, categorical for one-hot labels."""

    def __init__(self, name="accuracy"):
        super().__init__(None, name)

    def values(self, y_true, y_pred):
        y_true, y_pred = host_array(y_true), host_array(y_pred)
        if y_pred.shape[-1:] == (1,):
            kind = BinaryAccuracy
        elif y_true.ndim < y_pred.ndim or y_true.shape[-1:] == (1,):
            kind = SparseCategoricalAccuracy
        else:
            kind = CategoricalAccuracy
        return kind().values(y_true, y_pred)


#: Keras's metric names that ``compile(metrics=[...])`` and ``keras.metrics.get`` take.
BY_NAME = {"mae": MeanAbsoluteError, "mean_absolute_error": MeanAbsoluteError,
           "mse": MeanSquaredError, "mean_squared_error": MeanSquaredError,
           "binary_accuracy": BinaryAccuracy, SPARSE_ACCURACY: SparseCategoricalAccuracy,
           CATEGORICAL_ACCURACY: CategoricalAccuracy, "accuracy": _Accuracy, "acc": _Accuracy}


def get(identifier):
    """A metric object from what ``compile(metrics=[...])`` takes, as Keras 3 makes it: a name
    (the log shows the name as given: ``"mae"``), a ``Metric`` object or class (user-written:
    ``update_state``, ``result``, ``reset_state``), or a function ``fn(y_true, y_pred)``
    (``MeanMetricWrapper``: the mean of what it returns)."""
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, str) and identifier in BY_NAME:
        metric = BY_NAME[identifier]()
        metric.name = identifier
        return metric
    if callable(identifier) and not isinstance(identifier, (str, type)):
        return MeanMetricWrapper(identifier)
    raise NotImplementedError(f"metric {identifier!r} is not implemented; use one of {sorted(BY_NAME)}, "
                              f"a keras.metrics.Metric (a subclass with update_state and result), or a "
                              f"function fn(y_true, y_pred) returning one value per example.")


class CompileMetrics(Metric):
    """Keras 3's container of the metrics given to ``compile`` (one entry of ``model.metrics``,
    named ``"compile_metrics"``): ``update_state(y, y_pred)`` updates each, ``result()`` is
    the dict of their results, which fit's logs flatten (Keras's ``pythonify_logs``)."""

    def __init__(self, metrics):
        super().__init__("compile_metrics")
        self.metrics = list(metrics)

    def update_state(self, y_true, y_pred, sample_weight=None):
        for metric in self.metrics:
            metric.update_state(y_true, y_pred, sample_weight=sample_weight)

    def result(self):
        return {metric.name: metric.result() for metric in self.metrics}

    def reset_state(self):
        for metric in self.metrics:
            metric.reset_state()

    @property
    def variables(self):
        return [v for metric in self.metrics for v in metric.variables]
