"""Keras metrics for custom training loops: ``SparseCategoricalAccuracy``,
``CategoricalAccuracy``, ``Mean``; and which accuracy ``compile(metrics=[...])`` reports.

``model.fit`` keeps its loss and accuracy on the devices (``engine.py``); these
objects are for the custom loop of the MirroredStrategy tutorial, where each
replica calls ``update_state`` and the host calls ``result()``. They accumulate
on the host under a lock, so replica threads can update them concurrently. Inside a
``@function`` their ``update_state`` is host work that every replay does again
(``recording.host_work``): it reads the values that replay computed.
"""
import threading

import numpy as np

from mirrored import recording
from mirrored.keras import initializers
from mirrored.tensor import Tensor
from mirrored.values import Variable


def _host(value):
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
        recording.unrecordable("it reads a metric's result(), a host value a trace would freeze "
                               "(read it outside the function)")
        from mirrored.tensor import HostTensor
        return HostTensor.wrap(np.float32(self._total / self._count if self._count else 0.0))

    def __call__(self, *args, **kwargs):
        self.update_state(*args, **kwargs)
        return self.result()


class Mean(Metric):
    """The running mean of the values given to ``update_state``."""

    @recording.host_work
    def update_state(self, values, sample_weight=None):
        v = _host(values).astype(np.float64)
        with self._lock:
            self._total += float(v.sum())
            self._count += v.size


class SparseCategoricalAccuracy(Metric):
    """The fraction of examples whose argmax prediction equals the integer label."""

    def __init__(self, name="sparse_categorical_accuracy", dtype=None):
        super().__init__(name, dtype)

    @recording.host_work
    def update_state(self, y_true, y_pred, sample_weight=None):
        labels = _host(y_true).reshape(-1)
        preds = _host(y_pred)
        hits = (preds.argmax(axis=-1).reshape(-1) == labels).sum() if labels.size else 0
        with self._lock:
            self._total += float(hits)
            self._count += labels.size


class CategoricalAccuracy(Metric):
    """The fraction of examples whose argmax prediction equals the argmax of their one-hot
    (or soft) label row, Keras's ``CategoricalAccuracy``."""

    def __init__(self, name="categorical_accuracy", dtype=None):
        super().__init__(name, dtype)

    def update_state(self, y_true, y_pred, sample_weight=None):
        labels = _host(y_true)
        preds = _host(y_pred)
        if labels.shape != preds.shape:
            raise ValueError(f"CategoricalAccuracy: labels {labels.shape} and predictions {preds.shape} "
                             f"must have the same shape (one-hot labels: keras.utils.to_categorical); "
                             f"for class indices use SparseCategoricalAccuracy.")
        hits = (labels.argmax(axis=-1) == preds.argmax(axis=-1)).sum() if labels.size else 0
        with self._lock:
            self._total += float(hits)
            self._count += int(np.prod(labels.shape[:-1]))      # one row per example


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
