"""Keras metrics for custom training loops: ``SparseCategoricalAccuracy``, ``Mean``.

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
from mirrored.tensor import Tensor


def _host(value):
    if isinstance(value, Tensor) or hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(value)


class Metric:
    def __init__(self, name=None, dtype=None):
        self.name = name or type(self).__name__.lower()
        self._lock = threading.Lock()
        self.reset_state()

    def reset_state(self):
        self._total = 0.0
        self._count = 0.0

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


ACCURACY_NAMES = ("accuracy", "acc", "sparse_categorical_accuracy")
