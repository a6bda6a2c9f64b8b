"""Losses written in ops: ``keras.losses.Loss`` subclasses (``call(y_true, y_pred)``) and plain
functions ``fn(y_true, y_pred)``, in ``model.compile(loss=...)`` and called on their own.

    def my_huber(y_true, y_pred):
        error = y_true - y_pred
        small = tf.abs(error) <= 1
        return tf.where(small, tf.square(error) / 2, tf.abs(error) - 0.5)

    model.compile(loss=my_huber, optimizer="sgd")

Keras's reduction (``sum_over_batch_size``, the default): the mean of every value ``call``
returns, called inside ``strategy.run`` (or a strategy's scope) times 1/N replicas, as Keras 3
scales it (``tape.replica_scale``). In ``fit`` each replica's share of it is its sum divided by the GLOBAL count (the
engine's rule, ``engine.py``), so N replicas train exactly like one on the global batch.

In the step such a loss is the program's loss mode (``engine.ReplicaProgram.loss`` calls
``run_in``): the model's output (probabilities where its last layer has
``activation='softmax'``, as Keras gives the loss the model's output) and the targets as
Tensors, the loss under a private tape, the per-example mean into the loss metric's buffer,
d(this replica's share)/d(logits) into ``dlogits``; the usual backward follows. ``fit``
gives it float targets of the output's shape (``data_adapters.targets``), as MSE gets.

Neighbours: ``losses.py`` (the fused losses; ``get`` and ``kernel_mode`` send these here),
``mirrored/ops.py``, ``keras/tape.py``, ``call_layers.py`` (the same private tape for layers).
"""
import re

import numpy as np

from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored import ops
from mirrored.keras.call_layers import private_tapes
from mirrored.keras.tape import GradientTape, replica_scale
from mirrored.tensor import Tensor
from mirrored.values import Variable

FLOAT = np.dtype(np.float32)
REDUCTIONS = ("sum_over_batch_size", "sum", "none", "auto")


def same_rank(y_true, y_pred):
    """Keras's ``squeeze_or_expand_to_same_rank``: targets (B,) against outputs (B, 1) get the
    axis, and back; targets take the outputs' dtype."""
    if y_true.ndim == y_pred.ndim - 1 and y_pred.shape[-1:] == (1,):
        y_true = ops.expand_dims(y_true, -1)
    elif y_pred.ndim == y_true.ndim - 1 and y_true.shape[-1:] == (1,):
        y_true = ops.squeeze(y_true, -1)
    if y_true.dtype != y_pred.dtype:
        y_true = ops.cast(y_true, y_pred.dtype)
    return y_true, y_pred


def _tensor(x):
    if isinstance(x, (Tensor, Variable)):
        return ops.as_tensor(x)
    return ops.as_tensor(np.asarray(x, FLOAT))


class Loss:
    """Keras's ``keras.losses.Loss``: subclasses define ``call(y_true, y_pred)`` returning the
    loss values (one per example, or per element); ``__call__`` reduces them."""

    def __init__(self, name=None, reduction="sum_over_batch_size", dtype=None):
        reduction = getattr(reduction, "value", reduction)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        if dtype is not None and np.dtype(getattr(dtype, "as_numpy_dtype", dtype)) != FLOAT:
            raise NotImplementedError(f"{type(self).__name__}(dtype={dtype!r}): losses compute in "
                                      f"float32 here; leave dtype out.")
        self.name = name or _snake(type(self).__name__)
        self.reduction = "sum_over_batch_size" if reduction == "auto" else reduction

    def call(self, y_true, y_pred):
        raise NotImplementedError(f"{type(self).__name__} defines no call(self, y_true, y_pred): a "
                                  f"subclass of keras.losses.Loss returns the loss values there.")

    def values(self, y_true, y_pred):
        """``call`` on Tensors of one rank and dtype (Keras's conversions)."""
        y_pred = _tensor(y_pred)
        y_true, y_pred = same_rank(_tensor(y_true), y_pred)
        out = ops.as_tensor(self.call(y_true, y_pred))
        if out.dtype != FLOAT:
            raise TypeError(f"loss {self.name!r} returned a {out.dtype} tensor; losses compute in "
                            f"float32 here: cast it, tf.cast(values, tf.float32).")
        return out

    def __call__(self, y_true, y_pred, sample_weight=None):
        if sample_weight is not None:
            raise NotImplementedError(f"loss {self.name!r}: sample_weight is not implemented here.")
        values = self.values(y_true, y_pred)
        if self.reduction == "none":
            return values
        total = ops.reduce_sum(values)
        if self.reduction == "sum" or values.ndim == 0:       # Keras: a scalar comes back as it is
            return total
        count = int(np.prod(values.shape, dtype=np.int64))
        if not count:
            return total
        mean, scale = total / float(count), replica_scale()   # Keras 3: times 1/N replicas (tape.py)
        return mean if scale == 1.0 else mean * scale

    def get_config(self):
        return {"name": self.name, "reduction": self.reduction}

    # -- as fit's loss mode (engine.ReplicaProgram.loss)
    def run_in(self, program, labels, buf, grad, scale):
        """The loss of the program's last forward against ``labels`` (b, outputs) float32:
        per-example means into ``buf.loss``, zeros into ``buf.correct`` (no accuracy), and,
        when ``grad`` is given, d(scale x the sum of the per-example means)/d logits into it.
        Its ops' Python runs when fit's step is recorded, its launches are replayed after
        with the step's (``mirrored/program/passes.py``), as Keras traces its train step."""
        dev, b = program.dev, program.last_b
        logits = Tensor(program.logits, dev)
        y_true = Tensor(view(labels, logits.shape), dev)
        tape = GradientTape()
        with private_tapes(), dev.activate():
            with tape:
                tape.watch(logits)
                y_pred = ops.softmax(logits) if program.softmax_output else logits
                per_example, total = self.shares(y_true, y_pred, b, scale)
            dev.copy_into(buf.loss, per_example.buf)
            dev.ops.fill(buf.correct, 0.0)
            if grad is not None:
                g = tape.gradient(total, logits)
                if g is None:
                    dev.ops.fill(grad, 0.0)
                else:
                    dev.copy_into(grad, g.buf)

    def shares(self, y_true, y_pred, b, scale):
        """(per-example loss (b,), this replica's share of the reduced loss) for the step."""
        values = self.values(y_true, y_pred)
        if values.ndim == 0:                     # call reduced already: the mean of this share
            per_example = values * ops.ones((b,), device=values.dev)
            return per_example, values * float(b * scale)
        if values.shape[0] != b:
            raise ValueError(f"loss {self.name!r} returned values of shape {values.shape} for a batch "
                             f"of {b}: return one value per example or per element (batch axis first).")
        per_example = values
        if values.ndim > 1:
            per_example = (ops.reduce_sum(values, axis=list(range(1, values.ndim)))
                           if self.reduction == "sum" else
                           ops.reduce_mean(values, axis=list(range(1, values.ndim))))
        if self.reduction == "sum":
            return per_example, ops.reduce_sum(per_example)
        return per_example, ops.reduce_sum(per_example) * float(scale)


class LossFunctionWrapper(Loss):
    """A function ``fn(y_true, y_pred)`` as a ``Loss`` (what ``compile(loss=fn)`` makes)."""

    def __init__(self, fn, reduction="sum_over_batch_size", name=None, **kwargs):
        super().__init__(name=name or getattr(fn, "__name__", None), reduction=reduction)
        self.fn, self.fn_kwargs = fn, kwargs

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred, **self.fn_kwargs)


def _snake(name):
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


# --- Keras 3's loss functions (keras.losses.mean_squared_error, ...): per-example values ----

def mean_squared_error(y_true, y_pred):
    """Keras 3's ``mean_squared_error(y_true, y_pred)``: the mean of (y_true - y_pred)**2 over
    the last axis (one value per example; a scalar for rank-1 inputs, as Keras gives it)."""
    y_true, y_pred = same_rank(_tensor(y_true), _tensor(y_pred))
    return ops.reduce_mean(ops.squared_difference(y_true, y_pred), axis=-1)


def mean_absolute_error(y_true, y_pred):
    """Keras 3's ``mean_absolute_error``: the mean of |y_true - y_pred| over the last axis."""
    y_true, y_pred = same_rank(_tensor(y_true), _tensor(y_pred))
    return ops.reduce_mean(ops.abs(y_true - y_pred), axis=-1)


mse, MSE, mae, MAE = mean_squared_error, mean_squared_error, mean_absolute_error, mean_absolute_error


class AddedLossesOnly(Loss):
    """``compile(optimizer)`` with no loss, for a model whose layers call ``add_loss`` (keras.io's
    subclassing guide: "the model already has a loss to minimize"): the compiled part is zero
    (its values 0 x the output, so the gradient flows as zeros), fit trains on the added losses
    and reports them (``call_layers.AddedLosses``). A model that adds none has nothing to train:
    the first step says so, as Keras's "No loss to compute"."""

    def __init__(self, model):
        super().__init__(name="loss")
        self.model = model

    def call(self, y_true, y_pred):
        nodes = self.model.nodes or ()
        if not any(node.layer.reported_losses or node.layer.regularized for node in nodes):
            raise ValueError(f"No loss to compute: {self.model.name!r} was compiled with no loss and none of "
                             f"its layers calls add_loss or has a regularizer. Give compile a loss, e.g. "
                             f"model.compile(optimizer='adam', loss='mse').")
        return 0.0 * ops.reduce_mean(y_pred, axis=-1)            # (b,): zeros, connected to y_pred
