"""Losses: ``SparseCategoricalCrossentropy`` (the course lab's), ``CategoricalCrossentropy``
(one-hot labels, keras.io's examples), ``MeanSquaredError`` and ``BinaryCrossentropy`` (the
distributed-training guide's), each with Keras's ``Reduction``.

Each is computed by one fused kernel with its gradient: the class-index loss by
``kernels/softmax_xent.py``, the one-hot one by ``kernels/categorical_xent.py``, the two
losses against float targets by ``kernels/regression_losses.py`` (``kind`` below names
which). All but the first take targets of the model's output shape, (B, C) float, as Keras
does; ``(B,)`` is read as (B, 1).

``SparseCategoricalCrossentropy``:

Integer labels, per-example loss ``-log softmax(logits)[label]``.
``from_logits=True``: the model outputs logits (the lab's last ``Dense(10)``).
``from_logits=False``: the model outputs probabilities; as in Keras, when they
come from a ``softmax`` layer the loss is computed from that layer's logits
(numerically stable, and the same numbers Keras gets).

Reductions: ``'sum_over_batch_size'`` (the default: the mean over the batch
this call sees), ``'sum'``, ``'none'`` (the per-example vector — what a custom
loop under a strategy wants, to divide by the GLOBAL batch with
``mirrored.nn.compute_average_loss``).

Called on a model's output inside a ``GradientTape``, the result remembers
where it came from, so ``tape.gradient`` can run the backward kernels. Called on anything
else (NumPy predictions, as TF's quickstart does: ``loss_fn(y_train[:1], predictions)``, or
tensors made by ops), the same math is written in ops (``per_example_in_ops``) and returns a
tensor, differentiable by the tape.
"""
import enum

import numpy as np

from mirrored import ops
from mirrored.keras.custom_losses import Loss, LossFunctionWrapper  # noqa: F401 (keras.losses.Loss)
from mirrored.keras.custom_losses import (MAE, MSE, mae, mean_absolute_error,  # noqa: F401 (Keras 3's
                                         mean_squared_error, mse)             # loss functions)
from mirrored.keras.tape import ModelOutput, loss_from_model_output, replica_scale
from mirrored.tensor import Tensor

REDUCTIONS = ("sum_over_batch_size", "sum", "none", "auto")


class Reduction(str, enum.Enum):
    """``tf.keras.losses.Reduction``: how a loss object reduces its per-example values.

    ``NONE``: the per-example vector (a custom loop under a strategy then divides by the
    GLOBAL batch with ``mirrored.nn.compute_average_loss``); ``SUM``; ``SUM_OVER_BATCH_SIZE``
    (the mean over the batch this call sees: Keras's default); ``AUTO`` (that default).
    Each member equals its string, so ``reduction='none'`` means the same."""

    AUTO = "auto"
    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"

    @classmethod
    def all(cls):
        return tuple(cls)

    @classmethod
    def validate(cls, key):
        if getattr(key, "value", key) not in REDUCTIONS:
            raise ValueError(f"Invalid Reduction Key: {key!r}. Expected keys are {REDUCTIONS}.")


class SparseCategoricalCrossentropy:
    def __init__(self, from_logits=False, reduction="sum_over_batch_size", name="sparse_categorical_crossentropy",
                 ignore_class=None):
        reduction = getattr(reduction, "value", reduction)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        if ignore_class is not None:
            raise NotImplementedError("ignore_class is not implemented.")
        self.from_logits = from_logits
        self.reduction = "sum_over_batch_size" if reduction == "auto" else reduction
        self.name = name

    def __call__(self, y_true, y_pred, sample_weight=None):
        if sample_weight is not None:
            raise NotImplementedError("sample_weight is not implemented for this loss.")
        if not from_model(y_pred):
            return reduce_in_ops(self, per_example_in_ops(self, y_true, y_pred))
        return loss_from_model_output(self, y_true, y_pred, kernel_mode)

    def get_config(self):
        return {"from_logits": self.from_logits, "reduction": self.reduction, "name": self.name}


class _TargetLoss:
    """A loss against float targets of the output's shape (``kernels/regression_losses.py``)."""

    def __init__(self, reduction, name):
        reduction = getattr(reduction, "value", reduction)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        self.reduction = "sum_over_batch_size" if reduction == "auto" else reduction
        self.name = name

    def __call__(self, y_true, y_pred, sample_weight=None):
        if sample_weight is not None:
            raise NotImplementedError(f"sample_weight is not implemented for {type(self).__name__}.")
        if not from_model(y_pred):
            return reduce_in_ops(self, per_example_in_ops(self, y_true, y_pred))
        return loss_from_model_output(self, y_true, y_pred, kernel_mode)

    def get_config(self):
        return {"reduction": self.reduction, "name": self.name}


class MeanSquaredError(_TargetLoss):
    """``mean((y_pred - y_true) ** 2)`` over the last axis, per example (``loss='mse'``)."""

    kind = "mse"

    def __init__(self, reduction="sum_over_batch_size", name="mean_squared_error"):
        super().__init__(reduction, name)


class BinaryCrossentropy(_TargetLoss):
    """Binary cross-entropy over the last axis, per example. ``from_logits=True``: the model
    outputs logits (TensorFlow's ``sigmoid_cross_entropy_with_logits``, stable); ``False``:
    probabilities, clipped to [1e-7, 1 - 1e-7] as Keras does."""

    def __init__(self, from_logits=False, label_smoothing=0.0, axis=-1, reduction="sum_over_batch_size",
                 name="binary_crossentropy"):
        super().__init__(reduction, name)
        if label_smoothing or axis != -1:
            raise NotImplementedError("BinaryCrossentropy: label_smoothing and axis other than -1 "
                                      "are not implemented here.")
        self.from_logits = bool(from_logits)

    @property
    def kind(self):
        return "bce_logits" if self.from_logits else "bce_probs"

    def get_config(self):
        return dict(super().get_config(), from_logits=self.from_logits, label_smoothing=0.0, axis=-1)


#: ``CategoricalCrossentropy``'s kernel mode is the pair (CATEGORICAL, label_smoothing):
#: the smoothing is a scalar the kernel takes (``kernels/categorical_xent.py``).
CATEGORICAL = "categorical"


class CategoricalCrossentropy(_TargetLoss):
    """Cross-entropy against one-hot (or soft) targets of the output's shape, per example:
    ``-sum_j y_s[j] log softmax(z)[j]`` with ``y_s = y (1 - label_smoothing) + label_smoothing / C``
    (``loss='categorical_crossentropy'``; labels from ``keras.utils.to_categorical``).

    ``from_logits=True``: the model outputs logits. ``from_logits=False``: probabilities from
    a last layer with ``activation='softmax'``, whose logits are used, as Keras does (stable,
    and Keras's numbers). A model with neither is refused (``kernel_mode``). Accuracy, with
    ``metrics=['accuracy']``, is Keras's categorical one: argmax of the output against argmax
    of the label row, counted on the device by the same kernel."""

    def __init__(self, from_logits=False, label_smoothing=0.0, axis=-1, reduction="sum_over_batch_size",
                 name="categorical_crossentropy"):
        super().__init__(reduction, name)
        if axis != -1:
            raise NotImplementedError("CategoricalCrossentropy: only axis=-1 (classes last) is implemented.")
        if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}.")
        self.from_logits = bool(from_logits)
        self.label_smoothing = float(label_smoothing)

    @property
    def kind(self):
        return (CATEGORICAL, self.label_smoothing)

    def get_config(self):
        return dict(super().get_config(), from_logits=self.from_logits,
                    label_smoothing=self.label_smoothing, axis=-1)


# --- the same losses written in ops: for predictions that are not a model's output ----------

#: Keras's clip of probabilities before a log (``backend.epsilon()``).
EPSILON = 1e-7


def from_model(y_pred):
    """True when ``y_pred`` is a model's output (the fused kernels' path, keras/tape.py)."""
    return isinstance(y_pred, Tensor) and isinstance(y_pred.node, ModelOutput)


def per_example_in_ops(loss, y_true, y_pred):
    """Keras's per-example values of ``loss`` (a vector over the batch), in ops."""
    p = ops.as_tensor(y_pred)
    if p.dtype.kind != "f":
        p = ops.cast(p, np.float32)
    if isinstance(loss, SparseCategoricalCrossentropy):
        labels = ops.reshape(ops.as_tensor(np.asarray(y_true, np.int64) if not isinstance(y_true, Tensor)
                                           else y_true, device=p.dev), (-1,))
        if labels.dtype.kind not in "iu":
            labels = ops.cast(labels, np.int64)
        if loss.from_logits:
            return ops.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=p)
        q = ops.clip_by_value(p / ops.reduce_sum(p, axis=-1, keepdims=True), EPSILON, 1 - EPSILON)
        return ops.negative(ops.reduce_sum(ops.one_hot(labels, p.shape[-1], dtype=p.dtype) * ops.log(q), axis=-1))
    y = ops.as_tensor(y_true, dtype=p.dtype, device=p.dev)
    if y.shape != p.shape and y.ndim == 1 and p.ndim == 2 and p.shape[1] == 1:
        y = ops.reshape(y, p.shape)
    if isinstance(loss, MeanSquaredError):
        return ops.reduce_mean(ops.square(p - y), axis=-1)
    if isinstance(loss, BinaryCrossentropy):
        if loss.from_logits:
            return ops.reduce_mean(ops.sigmoid_cross_entropy_with_logits(labels=y, logits=p), axis=-1)
        q = ops.clip_by_value(p, EPSILON, 1 - EPSILON)
        return ops.negative(ops.reduce_mean(y * ops.log(q) + (1.0 - y) * ops.log(1.0 - q), axis=-1))
    if isinstance(loss, CategoricalCrossentropy):
        if loss.label_smoothing:
            y = y * (1.0 - loss.label_smoothing) + loss.label_smoothing / p.shape[-1]
        if loss.from_logits:
            return ops.softmax_cross_entropy_with_logits(y, p)
        q = ops.clip_by_value(p / ops.reduce_sum(p, axis=-1, keepdims=True), EPSILON, 1 - EPSILON)
        return ops.negative(ops.reduce_sum(y * ops.log(q), axis=-1))
    raise TypeError(f"{type(loss).__name__} has no ops form.")


def reduce_in_ops(loss, per_example):
    """Keras's reduction of the per-example values: 'none', 'sum', or their mean (times 1/N under
    a strategy of N replicas, Keras 3's ``scale_loss_for_distribution``: ``tape.replica_scale``)."""
    if loss.reduction == "none":
        return per_example
    total = ops.reduce_sum(per_example)
    if loss.reduction == "sum":
        return total
    n = int(np.prod(per_example.shape))
    return _distributed(total / float(n)) if n else total


def _distributed(mean):
    scale = replica_scale()
    return mean if scale == 1.0 else mean * scale


def takes_targets(loss):
    """True for losses against float targets of the output's shape (MSE, BCE, categorical
    cross-entropy, losses written in ops), False for class-index losses."""
    return isinstance(loss, (_TargetLoss, Loss))


def counts_accuracy(loss):
    """True for the losses whose kernel also counts correct predictions (the two
    cross-entropies), so ``metrics=['accuracy']`` can be reported."""
    return not takes_targets(loss) or isinstance(loss, CategoricalCrossentropy)


def kernel_mode(loss, softmax_output):
    """Which fused loss kernel a model's output takes: "logits" (softmax cross-entropy),
    "probs" (cross-entropy of probabilities), (CATEGORICAL, label_smoothing) (one-hot
    targets), or a regression kind ("mse", "bce_logits", "bce_probs"). ``softmax_output``:
    the model's last layer has activation='softmax' (its logits are used, as Keras does); a
    loss written in ops is its own mode (``custom_losses.Loss.run_in``)."""
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, CategoricalCrossentropy):
        if softmax_output and loss.from_logits:
            raise NotImplementedError(
                "the last layer has activation='softmax' but the loss says from_logits=True: "
                "drop the softmax or use from_logits=False.")
        if not softmax_output and not loss.from_logits:
            raise NotImplementedError(
                "CategoricalCrossentropy(from_logits=False) needs probabilities from a last layer "
                "with activation='softmax' (its logits are used); this model's last layer has none. "
                "Add activation='softmax' to it, or pass from_logits=True if it outputs logits.")
        return loss.kind
    if takes_targets(loss):
        if softmax_output:
            raise NotImplementedError(
                f"{type(loss).__name__} on a layer with activation='softmax' is not implemented: "
                f"the softmax is fused into the cross-entropy here. Drop the softmax.")
        return loss.kind
    if softmax_output:
        if loss.from_logits:
            raise NotImplementedError(
                "the last layer has activation='softmax' but the loss says from_logits=True: "
                "drop the softmax (the lab's Dense(10) outputs logits) or use from_logits=False.")
        return "logits"
    return "logits" if loss.from_logits else "probs"


_BY_NAME = {"sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
            "SparseCategoricalCrossentropy": SparseCategoricalCrossentropy,
            "categorical_crossentropy": CategoricalCrossentropy,
            "CategoricalCrossentropy": CategoricalCrossentropy,
            "mse": MeanSquaredError, "mean_squared_error": MeanSquaredError, "MeanSquaredError": MeanSquaredError,
            "binary_crossentropy": BinaryCrossentropy, "BinaryCrossentropy": BinaryCrossentropy}


def get(identifier):
    """A loss object from Keras's string names or the object itself."""
    if isinstance(identifier, (SparseCategoricalCrossentropy, _TargetLoss, Loss)):
        return identifier
    if isinstance(identifier, str) and identifier in _BY_NAME:
        return _BY_NAME[identifier]()
    if identifier in ("mae", "mean_absolute_error"):      # Keras's function, written in ops
        return LossFunctionWrapper(mean_absolute_error)
    if callable(identifier) and not isinstance(identifier, (str, type)):
        return LossFunctionWrapper(identifier)          # fn(y_true, y_pred), written in ops
    raise NotImplementedError(f"loss {identifier!r} is not implemented; use one of {sorted(_BY_NAME) + ['mae']} "
                              f"or the classes losses.SparseCategoricalCrossentropy, CategoricalCrossentropy, "
                              f"MeanSquaredError, BinaryCrossentropy, or a function fn(y_true, y_pred) "
                              f"or keras.losses.Loss subclass written in ops.")
