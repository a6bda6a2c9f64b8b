"""``mirrored.keras.regularizers``: weight penalties (``L2``), and where they enter training.

    layers.Dense(64, activation="relu", kernel_regularizer=regularizers.L2(1e-4))
    model.losses        # [l2 * sum(kernel ** 2)] per regularized layer, scalar tensors

``L2(l2)(w) = l2 * sum(w ** 2)``; its gradient is ``2 * l2 * w``. As in Keras the
penalty enters training in two ways:

- ``fit``: each replica adds ``1/N`` of the gradient (N: ``num_replicas_in_sync``), so
  the all-reduce SUM counts it once, and the reported loss is the mean data loss plus
  the penalty (``keras/engine.py``: ``ReplicaProgram.add_penalty_gradients`` and
  ``loss``).
- a custom loop: ``loss + tf.nn.scale_regularization_loss(tf.add_n(model.losses))``
  inside a ``GradientTape``: the tape sees the penalty terms (``keras/tape.py``) and
  adds their gradients. Leave ``model.losses`` out of the loss and the penalty does not
  train, as in TensorFlow.

The math runs on the weight's device with the elementwise and reduction kernels
(``ops.binary``, ``ops.sum_all``; NumPy on a CPU), so nothing goes to the host.
Neighbours: ``layers.py`` (``kernel_regularizer=``), ``engine.py``, ``tape.py``.
"""
import numpy as np

from mirrored.keras.custom_loop import index_of, pack_of
from mirrored.keras.tape import penalty_node
from mirrored.tensor import Tensor, constant
from mirrored.values import Variable, components


class Regularizer:
    """Base class: ``__call__(weight)`` -> scalar penalty (``tf.keras.regularizers.Regularizer``)."""

    def __call__(self, x):
        raise NotImplementedError

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class L2(Regularizer):
    """``l2 * sum(x ** 2)`` (Keras's default factor ``l2=0.01``)."""

    def __init__(self, l2=0.01):
        l2 = float(l2)
        if not np.isfinite(l2) or l2 < 0:
            raise ValueError(f"L2: the factor l2 must be a finite number >= 0, got {l2!r}.")
        self.l2 = l2

    def __call__(self, x):
        """The penalty of ``x`` (a variable, tensor or array) as a float32 scalar Tensor.

        For a model's weight the result is taken on the copy this replica sees (inside
        ``strategy.run``) and remembers it for ``GradientTape``."""
        if isinstance(x, Variable):
            var = x
            x = x.value()                             # this replica's copy inside run
            pack = pack_of(var)
            if pack is not None:
                k = index_of(pack, var)
                r = next(i for i, c in enumerate(components(pack.variables[k])) if c.value() is x)
                out = self._value(x.dev, x.buf)
                return Tensor(out.reshape(()), x.dev, penalty_node(self, pack, k, r))
        if not isinstance(x, Tensor):
            arr = np.asarray(x, np.float32)
            return constant(np.float32(self.l2 * np.sum(arr * arr)))
        return Tensor(self._value(x.dev, x.buf).reshape(()), x.dev)

    def _value(self, dev, w):
        """A new (1,) float32 buffer on ``dev``: l2 * sum(w ** 2)."""
        with dev.activate():
            out = dev.empty((1,), np.float32)
            self.value_into(dev, w, out)
        return out

    def value_into(self, dev, w, out):
        """``out`` ((1,) float32 on ``dev``) = l2 * sum(w ** 2): a square, a sum, a scale."""
        flat = w.reshape(-1)
        sq = dev.scratch("l2 penalty squares", flat.shape, np.float32)
        dev.ops.binary("mul", flat, flat, sq)
        dev.ops.sum_all(sq, out)
        dev.ops.binary_scalar("mul", out, self.l2, out)

    def add_gradient(self, dev, w, g, factor):
        """``g += factor * 2 * l2 * w`` on ``dev`` (w, g: the weight's and its gradient's views)."""
        if not self.l2 or not factor:
            return
        flat_w, flat_g = w.reshape(-1), g.reshape(-1)
        tmp = dev.scratch("l2 penalty gradient", flat_w.shape, np.float32)
        dev.ops.binary_scalar("mul", flat_w, 2.0 * self.l2 * factor, tmp)
        dev.ops.binary("add", flat_g, tmp, flat_g)

    def get_config(self):
        return {"l2": self.l2}

    def __repr__(self):
        return f"L2(l2={self.l2})"


l2 = L2                     # Keras keeps the lowercase alias: regularizers.l2(1e-4)
L2Regularizer = L2


def serialize(regularizer):
    """Keras's config of ``regularizer`` (None stays None), as a layer's ``get_config`` writes it."""
    if regularizer is None:
        return None
    return {"module": "keras.regularizers", "class_name": type(regularizer).__name__,
            "config": regularizer.get_config(), "registered_name": None}


def get(identifier):
    """A regularizer from ``None``, a Regularizer, ``'l2'``, or Keras's config dict."""
    if identifier is None or isinstance(identifier, Regularizer):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in ("l2", "l2regularizer"):
        return L2()
    if isinstance(identifier, dict) and identifier.get("class_name") in ("L2", "l2"):
        return L2(**identifier.get("config", {}))
    raise NotImplementedError(f"regularizer {identifier!r} is not implemented here; use "
                              f"regularizers.L2(factor) (or None).")
