"""``mirrored.GradientTape``: gradients of our models' losses, by their backward kernels.

TensorFlow's tape records every op and differentiates any program. Ours knows
exactly the computations the course's custom training loop makes, and records
them as it goes:

    with mirrored.GradientTape() as tape:
        predictions = model(images, training=True)          # a ModelOutput node
        per_example = loss_object(labels, predictions)      # a _Loss node (reduction='none')
        loss = mirrored.nn.compute_average_loss(per_example, global_batch_size=GLOBAL)  # _Scaled
    grads = tape.gradient(loss, model.trainable_variables)

``tape.gradient`` walks back from ``loss``: a scaled sum of per-example cross
entropies of the model's last forward pass on this replica. It then runs the
replica program's fused loss gradient (scaled by the same factor) and its
layers' backward kernels (``engine.ReplicaProgram.loss`` and ``backward``), and
returns the model's packed gradient buffers as tensors, one per requested
variable. ``optimizer.apply_gradients`` recognises them (``ParameterPack.matches``)
and makes fit's two calls: ``all_reduce`` of the packed buffer, then ``update``. Anything else raises an error that says
what is supported.
"""
import numpy as np

from mirrored import context
from mirrored.tensor import Tensor


class ModelOutput:
    """``model(x)`` on one replica: which program ran, on which input."""

    def __init__(self, model, program, x):
        self.model, self.program, self.x = model, program, x


class _Loss:
    """Per-example cross-entropy of a model output against labels."""

    def __init__(self, output_node, labels, mode):
        self.output, self.labels, self.mode = output_node, labels, mode


class _Scaled:
    """``scale * sum(per-example loss)``."""

    def __init__(self, loss_node, scale):
        self.loss, self.scale = loss_node, scale


def _labels_on(dev, y_true):
    if isinstance(y_true, Tensor):
        if y_true._device is not dev:
            raise ValueError(f"labels are on {y_true.device} but the predictions on {dev.name}: "
                             f"use the labels of the same replica (inside strategy.run).")
        labels = y_true._buf
        if np.dtype(labels.dtype).kind not in "iu":
            with dev.activate():
                out = dev.empty(labels.shape, np.int32)
                dev.ops.cast(labels, out)
            labels = out
        return labels.reshape(labels.shape[0]) if len(labels.shape) == 2 else labels
    arr = np.asarray(y_true).reshape(-1)
    arr = arr.astype(np.int64) if arr.dtype.kind not in "iu" else arr
    with dev.activate():
        return dev.from_numpy(arr)


def loss_from_model_output(loss_obj, y_true, y_pred, kernel_mode):
    """Forward of a SparseCategoricalCrossentropy on a model output; keeps a node for the tape.
    ``kernel_mode``: ``losses.kernel_mode``, which fused loss kernel the loss takes (the loss
    passes it in: ``losses.py`` calls this module, not the other way round)."""
    node = y_pred._node
    if not isinstance(node, ModelOutput):
        raise TypeError("the loss must be computed on a model's output: loss(labels, model(x)).")
    program = node.program
    dev = program.dev
    mode = kernel_mode(loss_obj, program.softmax_output)
    labels = _labels_on(dev, y_true)
    b = program.last_b
    if labels.shape[0] != b:
        raise ValueError(f"{labels.shape[0]} labels for a batch of {b} predictions.")
    with dev.activate():
        per_example = dev.empty((b,), np.float32)          # the caller's: a new tensor each call
        correct = dev.scratch("xent correct", (b,), np.float32)   # nobody reads it here: reused
        if b:
            op = dev.ops.prob_xent if mode == "probs" else dev.ops.softmax_xent
            op(program.logits, labels, per_example, None, correct, 1.0)
        loss_node = _Loss(node, labels, mode)
        vec = Tensor(per_example, dev, loss_node)
        if loss_obj.reduction == "none":
            return vec
        scale = 1.0 / b if (loss_obj.reduction == "sum_over_batch_size" and b) else 1.0
        return _scaled_sum(vec, scale)


def _scaled_sum(per_example, scale):
    """scale * sum(per_example) as a scalar Tensor that remembers how it was made."""
    dev = per_example._device
    with dev.activate():
        total = dev.empty((1,), np.float32)
        dev.ops.sum_all(per_example._buf, total)
        dev.ops.binary_scalar("mul", total, scale, total)
    node = per_example._node
    if isinstance(node, _Scaled):
        node = _Scaled(node.loss, node.scale * scale)
    elif isinstance(node, _Loss):
        node = _Scaled(node, scale)
    else:
        node = None
    return Tensor(total.reshape(()), dev, node)


class GradientTape:
    """Records our models' forward passes and losses; ``gradient`` runs the backward kernels."""

    def __init__(self, persistent=False, watch_accessed_variables=True):
        self.persistent = persistent
        self._used = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def watch(self, tensor):
        """Accepted for compatibility: model variables are always watched."""

    def gradient(self, target, sources, output_gradients=None):
        if self._used and not self.persistent:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one set "
                               "of gradients; create it with persistent=True for more.")
        self._used = True
        node = getattr(target, "_node", None)
        if isinstance(node, _Loss):
            node = _Scaled(node, 1.0)          # the gradient of a vector is that of its sum
        if not isinstance(node, _Scaled):
            raise TypeError(
                "GradientTape here differentiates losses computed from a mirrored.keras model: "
                "loss = loss_object(labels, model(x, training=True)) (optionally through "
                "mirrored.nn.compute_average_loss). Got a target that was not made that way.")
        out = node.loss.output
        program = out.program
        if program.x is not out.x:
            raise RuntimeError("the model was called again after this loss's predictions were "
                               "computed; compute the loss and its gradient right after the call.")
        with program.dev.activate():
            program.loss(node.loss.labels, node.loss.mode, node.scale, with_grad=True)
            program.backward()
        grads = program.pack.grad_tensors(program.r)
        single = not isinstance(sources, (list, tuple))
        wanted = [sources] if single else list(sources)
        result = []
        for var in wanted:
            k = program.pack.index_of(var)
            result.append(grads[k] if k is not None else None)
        return result[0] if single else result


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None,
                         regularization_losses=None):
    """``sum(per_example_loss) / global_batch_size`` (TensorFlow's ``tf.nn.compute_average_loss``).

    Under a strategy every replica divides by the GLOBAL batch, so the all-reduce
    SUM of the replicas' losses (and gradients) is the mean over the whole batch.
    Default ``global_batch_size``: this replica's batch × ``num_replicas_in_sync``.
    """
    if sample_weight is not None or regularization_losses:
        raise NotImplementedError("sample_weight and regularization_losses are not implemented.")
    if not isinstance(per_example_loss, Tensor):
        per_example_loss = np.asarray(per_example_loss, np.float32)
        n = global_batch_size or per_example_loss.shape[0] * _replicas()
        return np.float32(per_example_loss.sum() / n) if n else np.float32(0)
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * _replicas()
    scale = 1.0 / global_batch_size if global_batch_size else 0.0
    return _scaled_sum(per_example_loss, scale)


def _replicas():
    strategy, _ = context.top()
    return strategy.num_replicas_in_sync if strategy is not None else 1
