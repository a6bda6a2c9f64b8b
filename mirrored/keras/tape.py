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

from kernels.elementwise import CAST_DTYPES      # the dtypes the device cast is compiled for
from kernels.softmax_xent import LABEL_DTYPE      # the one label type the loss kernels take
from mirrored import context
from mirrored.keras import custom_loop
from mirrored.tensor import Tensor, add_n


class ModelOutput:
    """``model(x)`` on one replica: which program ran, on which input."""

    def __init__(self, model, program, x):
        self.model, self.program, self.x = model, program, x


class _Loss:
    """``weight`` x the per-example loss of a model output against labels (a vector)."""

    def __init__(self, output_node, labels, mode, weight=1.0):
        self.output, self.labels, self.mode, self.weight = output_node, labels, mode, weight

    def scaled(self, factor):
        return _Loss(self.output, self.labels, self.mode, self.weight * factor)

    def summed(self):
        return _Scaled(((self, 1.0),))

    def plus(self, other):
        return None                       # vector + vector: not a loss this tape knows


class _Scaled:
    """A scalar loss: ``sum_i scale_i * sum(loss_i) + sum_j factor_j * penalty_j``.

    ``losses``: ((_Loss, scale), ...). ``penalties``: ((regularizer, pack, k, r, factor), ...),
    each ``factor * regularizer(variable k of pack, replica r's copy)`` (``model.losses``,
    keras/regularizers.py). ``Tensor`` arithmetic (``+``, ``-``, ``*`` and ``/`` by a
    number, ``add_n``, ``scale_regularization_loss``) combines nodes through ``plus`` and
    ``scaled``, so the custom-training page's ``compute_average_loss(per_example) +
    scale_regularization_loss(add_n(model.losses))`` is one node, and its gradient
    the sum of both parts' gradients.
    """

    def __init__(self, losses=(), penalties=()):
        self.losses, self.penalties = tuple(losses), tuple(penalties)

    def scaled(self, factor):
        return _Scaled(((l, s * factor) for l, s in self.losses),
                       (p[:4] + (p[4] * factor,) for p in self.penalties))

    def summed(self):
        return self

    def plus(self, other):
        if not isinstance(other, _Scaled):
            return None
        return _Scaled(self.losses + other.losses, self.penalties + other.penalties)


def penalty_node(regularizer, pack, k, r):
    """The tape's record of ``regularizer(variable k of pack, replica r's copy)``."""
    return _Scaled(penalties=((regularizer, pack, k, r, 1.0),))


def _labels_on(dev, y_true):
    """Class labels on ``dev`` as the loss kernels take them: (b,) ``LABEL_DTYPE`` (int64),
    converted once here whatever integer dtype the data set holds (as ``fit`` converts its
    batches, ``data_adapters.class_indices``): cast on the device where a cast kernel
    exists for the stored dtype, else converted on the host."""
    if isinstance(y_true, Tensor):
        if y_true.dev is not dev:
            raise ValueError(f"labels are on {y_true.device} but the predictions on {dev.name}: "
                             f"use the labels of the same replica (inside strategy.run).")
        labels = y_true.buf
        if np.dtype(labels.dtype) != LABEL_DTYPE and np.dtype(labels.dtype).name in CAST_DTYPES:
            with dev.activate():
                out = dev.empty(labels.shape, LABEL_DTYPE)
                dev.ops.cast(labels, out)
            labels = out
        if np.dtype(labels.dtype) == LABEL_DTYPE:
            return labels.reshape(labels.shape[0]) if len(labels.shape) == 2 else labels
        y_true = y_true.numpy()                  # int16, uint32...: no cast kernel, via the host
    arr = np.asarray(y_true).reshape(-1)
    arr = arr.astype(LABEL_DTYPE) if arr.dtype != LABEL_DTYPE else arr
    with dev.activate():
        return dev.from_numpy(np.ascontiguousarray(arr))


def _targets_on(dev, y_true, b, cols):
    """Float targets of the output's shape (b, cols) on ``dev`` (MSE, BCE). A tensor stays
    on its device (float32: its own buffer; other dtypes: cast there), so a traced
    ``@function`` can replay the loss on each new batch (a host read would freeze it)."""
    if isinstance(y_true, Tensor):
        if y_true.dev is not dev:
            raise ValueError(f"targets are on {y_true.device} but the predictions on {dev.name}: "
                             f"use the targets of the same replica (inside strategy.run).")
        if y_true.dtype == np.float32 or y_true.dtype.name in CAST_DTYPES:
            _check_targets(y_true.shape, b, cols)
            flat = y_true.buf.reshape(b * cols)
            if y_true.dtype != np.float32:
                with dev.activate():
                    flat = dev.ops.cast(flat, dev.empty((b * cols,), np.float32))
            return flat.reshape(b, cols)
        y_true = y_true.numpy()                  # no cast kernel for its dtype: via the host
    arr = np.asarray(y_true, np.float32)
    _check_targets(arr.shape, b, cols)
    with dev.activate():
        return dev.from_numpy(np.ascontiguousarray(arr.reshape(b, cols)))


def _check_targets(shape, b, cols):
    if int(np.prod(shape)) != b * cols or tuple(shape[:1]) != (b,):
        raise ValueError(f"targets of shape {tuple(shape)} for predictions of shape {(b, cols)}: "
                         f"give one target per output, shape ({b}, {cols}).")


def loss_from_model_output(loss_obj, y_true, y_pred, kernel_mode):
    """Forward of one of our losses on a model output; keeps a node for the tape.
    ``kernel_mode``: ``losses.kernel_mode``, which fused loss kernel the loss takes (the loss
    passes it in: ``losses.py`` calls this module, not the other way round)."""
    node = y_pred.node
    if not isinstance(node, ModelOutput):
        raise TypeError("the loss must be computed on a model's output: loss(labels, model(x)).")
    program = node.program
    dev = program.dev
    mode = kernel_mode(loss_obj, program.softmax_output)
    b = program.last_b
    if mode in ("logits", "probs"):
        labels = _labels_on(dev, y_true)
    else:
        labels = _targets_on(dev, y_true, b, program.classes)
    if labels.shape[0] != b:
        raise ValueError(f"{labels.shape[0]} labels for a batch of {b} predictions.")
    with dev.activate():
        per_example = dev.empty((b,), np.float32)          # the caller's: a new tensor each call
        correct = dev.scratch("xent correct", (b,), np.float32)   # nobody reads it here: reused
        if b and mode in ("logits", "probs"):
            op = dev.ops.prob_xent if mode == "probs" else dev.ops.softmax_xent
            op(program.logits, labels, per_example, None, correct, 1.0)
        elif b:                                  # float targets: one-hot, MSE, BCE
            dev.ops.target_loss(mode, program.logits, labels, per_example, None, correct, 1.0)
        loss_node = _Loss(node, labels, mode)
        vec = Tensor(per_example, dev, loss_node)
        if loss_obj.reduction == "none":
            return vec
        scale = 1.0 / b if (loss_obj.reduction == "sum_over_batch_size" and b) else 1.0
        return _scaled_sum(vec, scale)


def _scaled_sum(per_example, scale):
    """scale * sum(per_example) as a scalar Tensor that remembers how it was made."""
    dev = per_example.dev
    with dev.activate():
        total = dev.empty((1,), np.float32)
        dev.ops.sum_all(per_example.buf, total)
        dev.ops.binary_scalar("mul", total, scale, total)
    node = per_example.node
    node = node.summed().scaled(scale) if node is not None else None
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
        node = node.summed() if node is not None else None     # a vector's gradient is its sum's
        if not isinstance(node, _Scaled):
            raise TypeError(
                "GradientTape here differentiates losses computed from a mirrored.keras model: "
                "loss = loss_object(labels, model(x, training=True)) (optionally through "
                "mirrored.nn.compute_average_loss, sums, products with numbers, and "
                "model.losses). Got a target that was not made that way.")
        r, pack = self._backward(node)
        if pack is None:
            raise TypeError("this loss has no model output and no model.losses term: nothing to "
                            "differentiate here.")
        single = not isinstance(sources, (list, tuple))
        wanted = [sources] if single else list(sources)
        grads = custom_loop.grad_tensors(pack, r)
        result = []
        for var in wanted:
            k = custom_loop.index_of(pack, var)
            result.append(grads[k] if k is not None else None)
        return result[0] if single else result

    @staticmethod
    def _backward(node):
        """Run the backward kernels for ``node``; returns (replica index, ParameterPack)."""
        outputs = {id(l.output): l.output for l, _ in node.losses}
        if len(outputs) > 1:
            raise NotImplementedError("this loss combines several model calls; the tape here "
                                      "differentiates the loss of one model(x) call at a time.")
        terms = {}
        for l, s in node.losses:                    # the same loss twice: scales add up
            key = (id(l.labels), l.mode)
            prev = terms.get(key)
            terms[key] = (l, (prev[1] if prev else 0.0) + s * l.weight)
        if len(terms) > 1:
            raise NotImplementedError("two different losses of one model output in one target "
                                      "are not supported here; use one loss object.")
        r, pack = None, None
        if terms:
            (l, scale), = terms.values()
            out = l.output
            program = out.program
            if program.x is not out.x:
                raise RuntimeError("the model was called again after this loss's predictions were "
                                   "computed; compute the loss and its gradient right after the call.")
            with program.dev.activate():
                program.loss(l.labels, l.mode, scale, with_grad=True)
                program.backward()
            r, pack = program.r, program.pack
        for regularizer, p_pack, k, p_r, factor in node.penalties:
            if pack is not None and (p_pack is not pack or p_r != r):
                raise NotImplementedError(
                    f"this loss adds model.losses of {'another model' if p_pack is not pack else f'replica {p_r}'} "
                    f"to a loss computed on replica {r}: compute the penalties where the predictions "
                    f"are (model.losses inside the same strategy.run call).")
            r, pack = p_r, p_pack
            dev = pack.devices[r]
            if not node.losses:                     # penalties alone: start from zero
                with dev.activate():
                    dev.ops.fill(pack.grads[r], 0.0)
        for regularizer, p_pack, k, p_r, factor in node.penalties:
            with pack.devices[r].activate():
                regularizer.add_gradient(pack.devices[r], pack.param_views[r][k], pack.grad_views[r][k], factor)
        return r, pack


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


def scale_regularization_loss(regularization_loss):
    """``regularization_loss / num_replicas_in_sync`` (TensorFlow's ``tf.nn.scale_regularization_loss``).

    Every replica adds the model's penalty to its loss; the all-reduce SUM of the
    replicas' gradients then counts it once. Accepts a scalar or a list of them
    (``model.losses``), which it adds first, as TensorFlow does.
    """
    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = add_n(regularization_loss)
    return regularization_loss * (1.0 / _replicas())
