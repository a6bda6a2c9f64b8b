"""``SparseCategoricalCrossentropy``: the loss of the course lab.

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
where it came from, so ``tape.gradient`` can run the backward kernels.
"""
from mirrored.keras.tape import loss_from_model_output
from mirrored.tensor import Tensor

REDUCTIONS = ("sum_over_batch_size", "sum", "none", "auto")


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
        if not isinstance(y_pred, Tensor) or y_pred._node is None:
            raise TypeError("SparseCategoricalCrossentropy here is computed from a mirrored.keras "
                            "model's output: call it as loss(labels, model(images, training=True)).")
        return loss_from_model_output(self, y_true, y_pred, kernel_mode)

    def get_config(self):
        return {"from_logits": self.from_logits, "reduction": self.reduction, "name": self.name}


def kernel_mode(loss, softmax_output):
    """Which fused loss kernel a model's output takes: "logits" (softmax cross-entropy)
    or "probs" (cross-entropy of probabilities). ``softmax_output``: the model's last
    layer has activation='softmax' (its logits are used, as Keras does)."""
    if softmax_output:
        if loss.from_logits:
            raise NotImplementedError(
                "the last layer has activation='softmax' but the loss says from_logits=True: "
                "drop the softmax (the lab's Dense(10) outputs logits) or use from_logits=False.")
        return "logits"
    return "logits" if loss.from_logits else "probs"


def get(identifier):
    """A loss object from Keras's string names or the object itself."""
    if isinstance(identifier, SparseCategoricalCrossentropy):
        return identifier
    if identifier in ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy"):
        return SparseCategoricalCrossentropy()
    raise NotImplementedError(f"loss {identifier!r} is not implemented; use "
                              f"'sparse_categorical_crossentropy' or losses.SparseCategoricalCrossentropy(...).")
