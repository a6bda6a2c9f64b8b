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
variable.

Across models (keras.io's GAN: ``discriminator(generator(z))``): a model called on a tensor the
tape follows (``input_link``) runs a program whose backward also gives d loss / d its input
(``ReplicaProgram(input_grad=True)``); the walk runs the models it meets last call first and
walks each such input gradient back into whatever made the input, another model included. ``optimizer.apply_gradients`` recognises them (``ParameterPack.matches``)
and makes fit's two calls: ``all_reduce`` of the packed buffer, then ``update``. Anything else raises an error that says
what is supported.
"""
import contextlib
import enum
import itertools

import numpy as np

from kernels.elementwise import CAST_DTYPES      # the dtypes the device cast is compiled for
from kernels.softmax_xent import LABEL_DTYPE      # the one label type the loss kernels take
from mirrored import autodiff, backends, context, nest, ops
from mirrored.keras import custom_loop
from mirrored.tensor import Tensor, add_n, identity
from mirrored.values import Variable


class ModelOutput:
    """``model(x)`` on one replica: which program ran, on which input.

    ``x``: the input buffer the program read; ``inputs``: the Tensor the caller gave;
    ``link``: the tapes that followed ``inputs`` when the model was called (``input_link``:
    it was computed by a recorded op or by another model, a generator's output into a
    discriminator), for which the model's backward also gives d loss / d ``inputs`` and the
    walk goes on into ``inputs``'s graph; ``seq``: the calls' order (the walk runs the models
    backward last call first, so each gets all of its output's gradient before it runs)."""

    def __init__(self, model, program, x, inputs=None, link=frozenset()):
        self.model, self.program, self.x = model, program, x
        self.inputs, self.link, self.seq = inputs, link, next(_CALLS)


_CALLS = itertools.count()          # ModelOutput.seq


def input_link(inputs):
    """The tapes of this thread recording now that follow ``inputs`` (a Tensor): a model
    called on it must give them d loss / d ``inputs`` (its program with ``input_grad``)."""
    if not isinstance(inputs, Tensor):
        return frozenset()
    return frozenset(t for t in autodiff.recording_tapes() if t.recording and autodiff.tracked_by(t, inputs))


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
        scale = 1.0 / b * replica_scale() if (loss_obj.reduction == "sum_over_batch_size" and b) else 1.0
        return _scaled_sum(vec, scale)


def replica_scale():
    """Keras 3's ``scale_loss_for_distribution`` (``keras/src/losses/loss.py``): a loss object's
    default reduction (``sum_over_batch_size``, the mean over the batch it sees) is multiplied by
    1/N when ``tf.distribute.get_strategy()`` has N > 1 replicas in sync: inside ``strategy.run``
    (and in the strategy's scope). So ``loss = self.loss_fn(y, y_pred)`` in a replica is that
    replica's share of the mean, and the SUM the optimizer makes of the replicas' gradients is the
    mean's gradient (keras.io's lower-level custom ``train_step`` under N replicas). Not scaled:
    ``reduction='sum'`` or ``'none'`` (the course's loop: ``compute_average_loss`` divides by the
    GLOBAL batch itself), nor a ``call`` that returns a scalar. (Keras 2's tf.keras raised for the
    default reduction inside a strategy; TF 2.21's tf.keras is Keras 3, which scales.)"""
    strategy = context.top()[0]
    n = strategy.num_replicas_in_sync if strategy is not None else 1
    return 1.0 / n if n > 1 else 1.0


def _scaled_sum(per_example, scale):
    """scale * sum(per_example) as a scalar Tensor that remembers how it was made: a loss of the
    fused path keeps its node; one made by recorded ops (a weighted loss, ``per_example * w``)
    is summed by ops, so the tape differentiates them."""
    node = per_example.node
    if node is not None and not hasattr(node, "summed"):
        return ops.reduce_sum(per_example) * float(scale)
    dev = per_example.dev
    with dev.activate():
        total = dev.empty((1,), np.float32)
        dev.ops.sum_all(per_example.buf, total)
        dev.ops.binary_scalar("mul", total, scale, total)
    node = node.summed().scaled(scale) if node is not None else None
    return Tensor(total.reshape(()), dev, node)


class UnconnectedGradients(enum.Enum):
    """TensorFlow's ``tf.UnconnectedGradients``: what ``tape.gradient`` gives a source the target
    does not depend on: ``NONE`` (None, the default) or ``ZERO`` (zeros of its shape)."""
    NONE = "none"
    ZERO = "zero"


class GradientTape:
    """TensorFlow's ``tf.GradientTape``: records ops while open, differentiates any composition.

    Two ways to the gradient, the same answer:
    * the course's loop, ``loss_object(labels, model(x))`` (through ``compute_average_loss``,
      sums and products with numbers): the fused path above, one loss kernel and the
      model's backward kernels, as fast as ``fit``;
    * anything else made of ops (``mirrored/ops.py``): the tape's graph (``mirrored/autodiff.py``)
      is walked back, and a model's output met on the way is ONE node, whose backward is
      the model's own (the gradient of its output into its backward kernels).
    """

    def __init__(self, persistent=False, watch_accessed_variables=True):
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        self.recording = False
        self._watched = {}              # id -> the watched tensor or variable (kept alive)
        self._used = False

    def __enter__(self):
        self.recording = True
        autodiff.push(self)
        return self

    def __exit__(self, *exc):
        self.recording = False
        autodiff.pop(self)
        return False

    # -- what it follows
    def watch(self, tensor):
        """Follow ``tensor`` (a Tensor, a variable, or a list/tuple of them)."""
        for t in tensor if isinstance(tensor, (list, tuple)) else [tensor]:
            if isinstance(t, Variable):
                self.watch_variable(t)
            elif isinstance(t, Tensor):
                self._watched[id(t)] = t
            else:
                raise ValueError(f"tape.watch takes tensors or variables, got {type(t).__name__}.")

    def watch_variable(self, variable):
        self._watched[id(variable)] = variable

    def is_watched(self, obj):
        return self._watched.get(id(obj)) is obj

    def watched_variables(self):
        return tuple(v for v in self._watched.values() if isinstance(v, Variable))

    @contextlib.contextmanager
    def stop_recording(self):
        """Ops inside are not recorded by this tape (``tape.stop_recording()``)."""
        was, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = was

    def reset(self):
        self._watched.clear()

    # -- the gradient
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients="none"):
        if self._used and not self.persistent:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one set "
                               "of gradients; create it with persistent=True for more.")
        self._used = True
        unconnected = str(getattr(unconnected_gradients, "value", unconnected_gradients)).lower()
        if unconnected not in ("none", "zero"):
            raise ValueError(f"unconnected_gradients must be 'none' or 'zero', got {unconnected_gradients!r}.")
        structure = sources
        flat = list(sources) if isinstance(sources, (list, tuple)) else [sources]
        if isinstance(sources, dict):
            flat = list(sources.values())
        node = getattr(target, "node", None)
        legacy = node is not None and hasattr(node, "summed") and output_gradients is None
        # The backward's products at the CPU's BLAS-thread policy, as fit's (an eager loop
        # calls this outside strategy.run; inside one it is nothing: backends.call_block).
        with backends.call_block():
            if legacy and isinstance(node.summed(), _Scaled) and all(not isinstance(s, Tensor) for s in flat) \
                    and not any(self in l.output.link for l, _ in node.summed().losses):   # no model upstream
                result = self._fused_gradient(node.summed(), flat)
            else:
                result = self._graph_gradient(target, flat, output_gradients)
        if unconnected == "zero":
            result = [ops.zeros_like(s) if g is None else g for s, g in zip(flat, result)]
        if isinstance(structure, dict):
            return dict(zip(structure.keys(), result))
        if isinstance(structure, (list, tuple)):
            return type(structure)(result) if isinstance(structure, list) else tuple(result)
        return result[0]

    def jacobian(self, target, sources, unconnected_gradients="none", parallel_iterations=None,
                 experimental_use_pfor=True):
        """TensorFlow's ``tape.jacobian``: d target[i] / d source[j] for every pair, of shape
        ``target.shape + source.shape``, for a source or a list/dict of them. Computed as TF
        does without ``pfor``: one walk back per element of ``target``, seeded with a one-hot
        output gradient, so it costs ``target.size`` gradients (a small target only)."""
        if self._used and not self.persistent:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one set "
                               "of gradients; create it with persistent=True for more.")
        self._used = True
        flat = nest.flatten(sources)
        y = ops.as_tensor(target)
        rows = []
        for i in range(int(np.prod(y.shape, dtype=np.int64))):      # one row of d y / d sources
            seed = np.zeros(y.shape, y.dtype)
            seed.reshape(-1)[i] = 1
            seed = ops.as_tensor(seed, device=y.dev)
            grads = self._graph_gradient(target, flat, seed)      # a model's are views of its
            rows.append([None if g is None else identity(g, device=g.dev) for g in grads])  # buffer: copied
        zero = str(getattr(unconnected_gradients, "value", unconnected_gradients)).lower() == "zero"
        out = []
        for k, s in enumerate(flat):
            if not zero and all(row[k] is None for row in rows):
                out.append(None)                                    # not connected, as gradient
                continue
            parts = [ops.zeros_like(s) if row[k] is None else row[k] for row in rows]
            stacked = ops.stack(parts) if parts else ops.zeros((0,) + tuple(s.shape))
            out.append(ops.reshape(stacked, tuple(y.shape) + tuple(s.shape)))
        return nest.pack_sequence_as(sources, out) if isinstance(sources, (list, tuple, dict)) else out[0]

    def _fused_gradient(self, node, flat):
        """The course's loop: one loss kernel and the model's backward kernels."""
        r, pack = _fused_backward(node)
        if pack is None:
            raise TypeError("this loss has no model output and no model.losses term: nothing to "
                            "differentiate here.")
        grads = custom_loop.grad_tensors(pack, r)
        out = []
        for var in flat:
            k = custom_loop.index_of(pack, var)
            out.append(grads[k] if k is not None else None)
        return out

    def _graph_gradient(self, target, flat, output_gradients):
        """Any composition: the tape's graph walked back (``autodiff.gradient``)."""
        targets = nest.flatten(target)              # a list or dict of targets: their sum's gradient
        seeds = (nest.flatten(output_gradients) if isinstance(output_gradients, (list, tuple, dict))
                 else [output_gradients] * len(targets))
        was, self.recording = self.recording, False      # the walk is not recorded by this tape
        keep = {id(s) for s in flat if isinstance(s, Tensor)}
        variables = {id(s) for s in flat if isinstance(s, Variable)}
        kept, var_grads, models = {}, {}, {}

        def walk(t, g0):                              # one walk back from t; what it meets, added up
            k, v, leaves = autodiff.gradient(self, t, g0, ops.add, keep, variables)
            for key, g in k.items():
                kept[key] = g if key not in kept else kept[key] + g
            for key, (var, g) in v.items():
                var_grads[key] = (var, g if key not in var_grads else var_grads[key][1] + g)
            for leaf, g in leaves:
                _model_output_gradients(leaf, g, models)
        try:
            for t, seed in zip(targets, seeds):
                if isinstance(t, Variable) and id(t) in variables:   # gradient(v, v): ones, as TF
                    g = ops.ones_like(t) if seed is None else ops.as_tensor(seed, dtype=t.dtype)
                    var_grads[id(t)] = (t, g if id(t) not in var_grads else var_grads[id(t)][1] + g)
                    continue
                t = ops.as_tensor(t)
                walk(t, ops.ones_like(t) if seed is None else ops.as_tensor(seed, dtype=t.dtype, device=t.dev))
            # the models met, last call first: each runs backward once, with all of its output's
            # gradient (every later call and op has given its share by then); a model whose input
            # came from recorded ops or another model gives d loss / d input, walked back in turn
            model_grads, done = [], set()
            while len(done) < len(models):
                key = max((k for k in models if k not in done), key=lambda k: models[k][1].seq)
                done.add(key)
                program, node, dlogits = models[key]
                want_dx = self in node.link and _reaches(self, node.inputs, flat)
                pack, r, grads, dx = _run_model_backward(program, node, dlogits, want_dx)
                model_grads.append((pack, r, grads))
                if dx is not None:
                    walk(node.inputs, dx)
        finally:
            self.recording = was
        out = []
        for s in flat:
            if isinstance(s, Tensor):
                out.append(kept.get(id(s)))
                continue
            g = var_grads.get(id(s), (None, None))[1]
            for pack, r, grads in model_grads:
                k = custom_loop.index_of(pack, s)
                if k is not None:
                    g = grads[k] if g is None else g + grads[k]
            out.append(g)
        return out


def _fused_backward(node):
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
            empty_replica_backward(program)
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


def empty_replica_backward(program):
    """The backward of ``program`` (an ``engine.ReplicaProgram``) on a replica with no rows of
    the batch. The program skips its layers then (``ReplicaProgram.backward``: its gradients are
    zeros), but a layer that all-reduces across replicas (``cross_replica``:
    BatchNormalization(synchronized=True), which ran its ``call`` on 0 rows in the forward,
    ``call_layers.meets_others``) must meet the other replicas' backward all-reduces, in the
    order theirs reach them: the nodes in reverse, where the engine runs a node's backward."""
    if program.last_b:
        return
    for i in reversed(range(len(program.nodes))):
        layer = program.states[i].layer
        if program.upstream[i + 1] and getattr(layer, "cross_replica", False):
            dy = program.dev.empty((0,) + tuple(layer.output_shape), np.float32)     # (0,) + its output
            layer.backward(program.states[i], dy)


def _unit_loss_gradient(loss_node):
    """d (per-example loss) / d the model's output, one row per example, for a loss of the
    fused path met inside a composition (its kernel run again, with gradient, scale 1)."""
    program = loss_node.output.program
    dev, b = program.dev, program.last_b
    with dev.activate():
        grad = dev.empty((b, program.classes), np.float32)
        loss, correct = dev.empty((b,), np.float32), dev.empty((b,), np.float32)
        if b and loss_node.mode in ("logits", "probs"):
            op = dev.ops.prob_xent if loss_node.mode == "probs" else dev.ops.softmax_xent
            op(program.logits, loss_node.labels, loss, grad, correct, 1.0)
        elif b:
            dev.ops.target_loss(loss_node.mode, program.logits, loss_node.labels, loss, grad, correct, 1.0)
    return Tensor(grad, dev)          # d loss_i / d logits_i (pre-softmax for the xent modes)


def _model_output_gradients(t, g, models):
    """Add what ``g`` (d target / d ``t``) gives each model output's logits into ``models``
    ({id(program): [program, ModelOutput, d logits]}). ``t``: a model's output, or a loss of
    the fused path (per-example ``_Loss`` or scalar ``_Scaled``) met inside a composition."""
    node = t.node
    if isinstance(node, ModelOutput):
        program = node.program
        dlogits = g
        if program.softmax_output:                  # the output is softmax(logits)
            p = t
            dlogits = p * (g - ops.reduce_sum(g * p, axis=-1, keepdims=True))
        parts = [(node, dlogits)]
    elif isinstance(node, (_Loss, _Scaled)):
        terms = [(node, 1.0)] if isinstance(node, _Loss) else list(node.losses)
        if isinstance(node, _Scaled) and node.penalties:
            raise NotImplementedError("model.losses (weight penalties) inside a composition of ops are "
                                      "not differentiated here: add tf.reduce_sum(model.losses) to the "
                                      "loss outside the composition, or write the penalty with ops.")
        parts = []
        for loss, scale in terms:
            unit = _unit_loss_gradient(loss)
            weight = g if isinstance(node, _Loss) else g * (scale * loss.weight)
            if isinstance(node, _Loss):
                weight = ops.reshape(weight * loss.weight, (-1, 1))
            parts.append((loss.output, unit * weight))
    else:
        raise TypeError(f"the tape met a tensor made by {type(node).__name__}, which it cannot differentiate.")
    for out, d in parts:
        key = (id(out.program.pack), out.program.r)          # one model on one replica
        entry = models.get(key)
        if entry is None:
            models[key] = [out.program, out, d]
        else:
            if entry[1] is not out:
                raise NotImplementedError("the target uses two calls of one model; the tape here "
                                          "differentiates one call of each model per gradient (join "
                                          "the inputs with tf.concat and call the model once).")
            entry[2] = entry[2] + d


def _run_model_backward(program, node, dlogits, want_dx):
    """The model's backward kernels from its output's gradient: (pack, replica, weight
    gradients, d loss / d the call's input or None). ``want_dx``: the program was made with
    ``input_grad`` (``input_link``), so its backward leaves dx in ``program.grads[0]``."""
    if program.x is not node.x:
        raise RuntimeError("the model was called again after this output was computed; take the "
                           "gradient right after the call it belongs to.")
    b, dev = program.last_b, program.dev
    dx = None
    with dev.activate():
        if b:
            dst = program.loss_buffers(b).dlogits
            src = ops.cast(ops.reshape(dlogits, tuple(dst.shape)), np.float32)
            dev.copy_into(dst, src.buf)
        program.backward()
        empty_replica_backward(program)
        if want_dx:
            inputs = node.inputs
            if b:
                flat = dev.copy_from(program.grads[0], dev).reshape(inputs.shape)   # the program reuses its own
            else:
                flat = dev.from_numpy(np.zeros(inputs.shape, np.float32))
            dx = Tensor(flat if inputs.dev is dev else inputs.dev.copy_from(flat, dev), inputs.dev)
    return program.pack, program.r, custom_loop.grad_tensors(program.pack, program.r), dx


def _reaches(tape, start, sources):
    """Whether ``tape``'s graph leads from tensor ``start`` to one of ``sources`` (watched
    tensors, variables, or the variables of a model met on the way): only then is a model's
    d loss / d input worth walking (a discriminator's input made by a generator called before
    the tape, or for a loss of the discriminator's weights alone, is not)."""
    tensors = {id(s) for s in sources if isinstance(s, Tensor)}
    variables = [s for s in sources if not isinstance(s, Tensor)]
    stack, seen = [start], set()
    while stack:
        t = stack.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        node = getattr(t, "node", None)
        if id(t) in tensors or (isinstance(node, autodiff.ReadNode) and
                                any(node.variable is v for v in variables)):
            return True
        if isinstance(node, autodiff.Node) and tape in node.tapes:
            stack += list(node.inputs)
        elif isinstance(node, ModelOutput):
            if any(custom_loop.index_of(node.program.pack, v) is not None for v in variables):
                return True
            if tape in node.link:
                stack.append(node.inputs)
    return False


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None,
                         regularization_losses=None):
    """``sum(per_example_loss) / global_batch_size`` (TensorFlow's ``tf.nn.compute_average_loss``).

    Under a strategy every replica divides by the GLOBAL batch, so the all-reduce
    SUM of the replicas' losses (and gradients) is the mean over the whole batch.
    Default ``global_batch_size``: this replica's batch × ``num_replicas_in_sync``.
    ``sample_weight``: a number or one weight per example, multiplied in first (TF's
    ``scale_losses_by_sample_weight``); the sum is still divided by the batch, not the weights.
    """
    if regularization_losses:
        raise NotImplementedError("compute_average_loss(regularization_losses=) is not implemented: add "
                                  "tf.nn.scale_regularization_loss(model.losses) to the loss.")
    if sample_weight is not None:
        per_example_loss = _weighted(per_example_loss, sample_weight)
    if not isinstance(per_example_loss, Tensor):
        per_example_loss = np.asarray(per_example_loss, np.float32)
        n = global_batch_size or per_example_loss.shape[0] * _replicas()
        return np.float32(per_example_loss.sum() / n) if n else np.float32(0)
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * _replicas()
    scale = 1.0 / global_batch_size if global_batch_size else 0.0
    return _scaled_sum(per_example_loss, scale)


def _weighted(per_example_loss, sample_weight):
    """``per_example_loss * sample_weight``, the weights broadcast to the losses' shape."""
    if not isinstance(per_example_loss, Tensor):
        w = sample_weight.numpy() if hasattr(sample_weight, "numpy") else sample_weight
        return np.asarray(per_example_loss, np.float32) * np.asarray(w, np.float32)
    if isinstance(sample_weight, (int, float, np.number)) or np.ndim(sample_weight) == 0 and not isinstance(
            sample_weight, Tensor):
        return per_example_loss * float(sample_weight)             # a number: the fused path stays
    w = ops.cast(ops.as_tensor(sample_weight, device=per_example_loss.dev), np.float32)
    if w.ndim > per_example_loss.ndim:                             # (b, 1) weights for (b,) losses
        w = ops.reshape(w, tuple(per_example_loss.shape))
    return per_example_loss * w


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
