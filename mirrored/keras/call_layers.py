"""Layers written as Keras writes them: ``build`` with ``add_weight``, and a ``call`` made of ops.

    class SimpleDense(keras.layers.Layer):
        def __init__(self, units=32):
            super().__init__()
            self.units = units
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal")
            self.b = self.add_weight(shape=(self.units,), initializer="zeros")
        def call(self, inputs):
            return tf.matmul(inputs, self.w) + self.b

Such a layer follows the engine's protocol (``layers.py``) with no forward or backward of
its own; the base ``Layer`` hands those to this module:

    forward(state, x)    x wrapped as a Tensor on the replica's device; ``call`` run under a
                         private GradientTape that watches x and the layer's variables;
                         new tensors (``tf.ones``, ``keras.random.normal``) made on that device;
                         every variable read there is replica r's copy (``values.replica_copies``:
                         the views into r's packed buffer, ``engine.ParameterPack``); the tape
                         and the output kept for the backward; y's buffer returned
    backward(state, dy)  tape.gradient([y] + the values ``call`` gave ``add_loss``, [x] + weights,
                         output_gradients=[dy] + [1/N each]: fit's loss includes them): the weights'
                         gradients copied into ``state.grads`` (r's packed gradient buffer, so
                         still one ring and one optimizer launch a step), dx's buffer returned

The tapes of the caller (a custom loop's ``GradientTape``) are paused meanwhile: the model
call is one node to them, whose backward is the engine's. Called on a Tensor outside a model
(``layer(x)``), the layer builds on first use and runs ``call`` as it is, recorded by any
tape that is open. The output shape for a model: Keras's ``compute_output_shape`` if the
layer defines it, else ``call`` run once on a batch of one example of zeros.

Inside a ``call`` (any layer's, while ``run_call`` runs it): a layer written with ``call`` runs
its own, and may return a tuple (keras.io's VAE ``Encoder``: ``z_mean, z_log_var, z``); a
library layer with an entry in ``inline_ops`` (Dense) runs as its ops. A layer that is one node
of a model returns one tensor (a model whose ``call`` needs more runs it as one node:
``model_call.py``). What ``call`` gives ``add_loss`` trains (the backward above) and is reported
in fit's loss (``AddedLosses``, in the engine's penalty form).

Neighbours: ``base_layer.py`` (``Layer.add_weight``, the protocol's defaults that call
here), ``composed_layers.py`` (Activation, ReLU, Reshape, ... written this way),
``mirrored/ops.py`` (the ops), ``keras/tape.py`` (the tape).
"""
import contextlib
import functools
import inspect
import threading
from types import SimpleNamespace

import numpy as np

from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored import autodiff, context, devices, ops, values
from mirrored.keras import initializers, non_trainable
from mirrored.keras.tape import GradientTape
from mirrored.tensor import Tensor

FLOAT = np.dtype(np.float32)


def is_call_layer(layer):
    """A layer whose computation is its ``call`` (no forward/backward of its own)."""
    return callable(getattr(layer, "call", None))


@contextlib.contextmanager
def private_tapes():
    """Inside, only the tapes opened inside record in this thread: the caller's are paused."""
    tapes = autodiff.recording_tapes()
    saved = list(tapes)
    tapes.clear()
    try:
        yield
    finally:
        tapes[:] = saved


# --- weights -------------------------------------------------------------------------------

def make_weight(layer, shape, initializer, dtype, trainable, regularizer, constraint, name,
                aggregation="none"):
    """A new variable for ``layer.add_weight`` (a MirroredVariable under a strategy's scope)."""
    what = f"{type(layer).__name__} {layer.name!r}: add_weight"
    if shape is None:
        raise ValueError(f"{what} needs a shape, e.g. add_weight(shape=(input_shape[-1], units)).")
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if dtype is not None and np.dtype(getattr(dtype, "as_numpy_dtype", dtype)) != FLOAT:
        raise NotImplementedError(f"{what}(dtype={dtype!r}): weights are float32 here (every layer "
                                  f"computes in float32); leave dtype out.")
    aggregation = non_trainable.aggregation(aggregation, what)
    if constraint is not None:
        raise NotImplementedError(f"{what}(constraint=...) is not implemented; leave it out.")
    if initializer is None:
        initializer = "glorot_uniform" if len(shape) > 1 else "zeros"     # Keras's default
    init = initializers.get(initializer, f"{what} initializer")
    value = np.asarray(init(shape), FLOAT)
    if value.shape != shape:
        raise ValueError(f"{what}: the initializer gave an array of shape {value.shape} for a weight "
                         f"of shape {shape}.")
    return values.Variable(value, trainable=bool(trainable), name=f"{layer.name}/{name or 'variable'}",
                           aggregation=aggregation)


# --- build and shapes ----------------------------------------------------------------------

def _without_batch(input_shape):
    """The engine's shape of one example (or a list of them) from Keras's or the engine's."""
    if isinstance(input_shape, list) or (input_shape and isinstance(input_shape[0], (tuple, list))):
        return [_without_batch(tuple(s)) for s in input_shape]
    shape = tuple(input_shape)
    return shape[1:] if shape and shape[0] is None else shape


def _with_batch(shape):
    if isinstance(shape, list):
        return [_with_batch(s) for s in shape]
    return (None,) + tuple(shape)


def build(layer, input_shape, user_build=None):
    """Build ``layer`` for examples of ``input_shape`` (once): the user's ``build`` with
    Keras's shape (batch axis ``None`` first), then the output shape."""
    shape = _without_batch(input_shape)
    if layer.built and layer.input_shape is not None:
        if _key(shape) != _key(layer.input_shape):
            raise ValueError(f"{type(layer).__name__} {layer.name!r} was built for examples of shape "
                             f"{layer.input_shape} and is now given {shape}: use a new layer for the new shape.")
        return
    if user_build is not None:
        user_build(layer, _with_batch(shape))
    layer.input_shape = shape
    layer.output_shape = output_shape(layer, shape)
    layer.built = True


def _key(shape):
    return [tuple(s) for s in shape] if isinstance(shape, list) else tuple(shape)


def wrap_build(user_build):
    """``cls.build`` of a layer written with ``call``: the user's build, then what the
    engine needs (``build`` above); a subclass's ``super().build(...)`` runs the user's only."""
    @functools.wraps(user_build)
    def wrapper(self, input_shape):
        if getattr(self, "user_building", False):
            return user_build(self, input_shape)
        self.user_building = True
        try:
            return build(self, input_shape, user_build)
        finally:
            self.user_building = False
    return wrapper


def output_shape_for(layer, input_shape):
    """The engine's output shape of one example: built here on first use (Keras builds on
    the first call), then ``compute_output_shape`` or one call on zeros."""
    shape = _without_batch(input_shape)
    if not layer.built:
        layer.build(shape)
    if _key(shape) == _key(layer.input_shape):
        return layer.output_shape
    return output_shape(layer, shape)


def output_shape(layer, shape):
    compute = getattr(layer, "compute_output_shape", None)
    if compute is not None:
        return tuple(compute(_with_batch(shape)))[1:]
    dev = _device_for(layer)
    shapes = shape if isinstance(shape, list) else [shape]
    with private_tapes(), values.replica_copies(0), devices.device_scope(dev):
        xs = [ops.zeros((1,) + tuple(s), device=dev) for s in shapes]
        y = run_call(layer, xs if isinstance(shape, list) else xs[0], False)
    clear_added_losses(layer)                    # the trial's add_loss values are no call's
    if isinstance(y, tuple):                     # several outputs: a list of shapes (functional.py refuses it)
        return [tuple(t.shape[1:]) for t in y]
    return tuple(y.shape[1:])


def _device_for(layer):
    """Where to try ``call`` on zeros: the weights' (first) device, else the first device of
    the strategy whose scope the model is built in, else the current device."""
    weights = layer.weights
    if weights:
        return values.components(weights[0])[0].value().dev
    strategy, _ = context.top()
    if strategy is not None:
        return strategy.extended.devices[0]
    return devices.current_device()


def run_call(layer, inputs, training):
    """``layer.call(inputs)``, with ``training=`` where ``call`` takes it; the output as a Tensor,
    or a tuple of them where ``call`` returns several (keras.io's VAE ``Encoder``: a tuple)."""
    kwargs = {"training": bool(training)} if takes_training(type(layer).call) else {}
    running = _calls.__dict__.setdefault("running", [])        # the calls under way: ``inside_call``
    running.append(layer)
    try:
        y = layer.call(inputs, **kwargs)
    finally:
        running.pop()
    if isinstance(y, dict):
        raise NotImplementedError(f"{type(layer).__name__} {layer.name!r}: call returned a dict; a "
                                  f"layer returns a tensor or a tuple of tensors here.")
    ys = tuple(ops.as_tensor(t) for t in y) if isinstance(y, (list, tuple)) else (ops.as_tensor(y),)
    for t in ys:
        if t.dtype != FLOAT:
            raise TypeError(f"{type(layer).__name__} {layer.name!r}: call returned a {t.dtype} tensor; "
                            f"layers compute in float32 here: cast it, tf.cast(y, tf.float32).")
    return ys if isinstance(y, (list, tuple)) else ys[0]


@contextlib.contextmanager
def model_owned():
    """Inside: the calls run for a model (a node's forward, ``model_call.ModelCall``), whose
    weights are the model's packed ones."""
    _calls.owned = getattr(_calls, "owned", 0) + 1
    try:
        yield
    finally:
        _calls.owned -= 1


def in_model():
    return getattr(_calls, "owned", 0) > 0


def inside_call():
    """True while some layer's ``call`` runs in this thread: a library layer called on data
    there runs as its ops (``inline_ops``), the caller's tape recording them."""
    return bool(getattr(_calls, "running", None))


#: {library layer class: fn(layer, x) -> y}: the layer's computation as ops, for a call on data
#: inside another layer's ``call`` (``Dense``: ``composed_layers.dense_as_ops``, registered by
#: ``keras/__init__.py``); the layer's weights are then read like ``add_weight``'s
inline_ops = {}


def call_inline(layer, inputs):
    """A library layer called on data inside another layer's ``call``: its ops (``inline_ops``).
    Without them: None outside any model (the caller runs it alone: ``models.run_alone``), a
    clear refusal inside one (its kernels run only as a node of a model's program)."""
    run = inline_ops.get(type(layer))
    if run is None:
        if not in_model():
            return None
        raise NotImplementedError(
            f"{type(layer).__name__} {layer.name!r} was called on a tensor inside a layer's or model's call "
            f"that runs op by op (a call that mixes layers and ops, or a layer written with call); here "
            f"only {sorted(c.__name__ for c in inline_ops)} and layers written with call run there. Call it "
            f"on the model's input in a call made of layers only, or in a functional model.")
    return run(layer, inputs)


@functools.lru_cache(maxsize=None)
def takes_training(call):
    """Whether ``call`` takes Keras's ``training=`` argument (by name, or through **kwargs)."""
    try:
        params = inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False
    return "training" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


# --- the engine's protocol ----------------------------------------------------------------

def make_buffers(layer, state, b):
    """What the forward keeps for the backward, per batch size: its tape, inputs and output."""
    return SimpleNamespace(tape=None, xs=None, y=None, added=[])


# Keras runs fit's step as a tf.function: the Python of a layer's ``call`` runs when the step is
# traced, its ops are replayed afterwards. Here the same, one level up: ``forward`` and
# ``backward`` run the Python, and ``fit`` (``mirrored/program/passes.py``) or a ``@function``
# records the whole step once per key and replays its launches, these layers' among them. Run
# eagerly (``run_eagerly=True``, an eager custom loop) the Python runs every step, as in Keras.

def forward(layer, state, x, training=False):
    """x: (b,) + input shape (a list for a layer called on several) -> y's buffer: the layer's
    ``call`` run under a private tape (``_forward_eager``)."""
    return _forward_eager(layer, state, x, training)


def backward(layer, state, dy):
    """The gradient of the last forward (``_backward_eager``)."""
    if dy.shape[0] == 0:                         # a cross-replica layer on a replica with no rows
        return _backward_eager(layer, state, dy) if state.buffers(0).tape is not None else None
    return _backward_eager(layer, state, dy)


def meets_others(layer):
    """A layer that all-reduces across replicas in training (``cross_replica``:
    BatchNormalization(synchronized=True)). On a replica with no rows of the batch it still runs
    its ``call`` on 0 rows, and its backward (``tape.empty_replica_backward``), so that this
    replica meets the others at each of its all-reduces, adding zeros."""
    return bool(getattr(layer, "cross_replica", False))


def _forward_eager(layer, state, x, training=False):
    """x: (b,) + input shape (a list for a layer called on several) -> y's buffer."""
    multi = isinstance(x, (list, tuple))
    parts = list(x) if multi else [x]
    shapes = layer.input_shape if multi else [layer.input_shape]
    b = parts[0].shape[0]
    dev = state.dev
    if b == 0 and not (training and meets_others(layer)):    # a replica with no rows this step
        if layer.__dict__.get("adds_losses"):
            state.ops.fill(AddedLosses.of(layer).sum_on(dev), 0.0)
            layer.__dict__.setdefault("added_by_replica", {})[state.replica_id] = []
        return dev.empty((0,) + tuple(layer.output_shape), FLOAT)
    buf = state.buffers(b)
    xs = [Tensor(view(p, (b,) + tuple(s)), dev) for p, s in zip(parts, shapes)]
    tape = GradientTape(persistent=True)         # a replayed step may walk it again (backward)
    with private_tapes(), values.replica_copies(state.replica_id), devices.device_scope(dev):
        with tape:
            tape.watch(xs)
            tape.watch(list(layer.trainable_weights))
            added, _calls.in_model = [], []      # add_loss collects into this list (see add_loss)
            try:
                with model_owned():
                    y = run_call(layer, xs if multi else xs[0], training)
                added = _calls.in_model
            finally:
                _calls.in_model = None
    if isinstance(y, tuple):
        raise NotImplementedError(f"{type(layer).__name__} {layer.name!r}: call returned {len(y)} tensors; a "
                                  f"layer that is one node of a model returns one tensor here (a model "
                                  f"whose call uses it runs its call as one node: model_call.py).")
    want = (b,) + tuple(layer.output_shape)
    if y.shape != want:
        raise ValueError(f"{type(layer).__name__} {layer.name!r}: call returned shape {y.shape} for a "
                         f"batch of {b}, expected {want} (the output shape it gave when built).")
    buf.tape, buf.xs, buf.y, buf.added = tape, xs, y, added
    if layer.__dict__.get("adds_losses"):        # fit's reported loss includes them (``AddedLosses``)
        total = ops.reshape(functools.reduce(ops.add, added), (1,)) if added else ops.zeros((1,), device=dev)
        dev.copy_into(AddedLosses.of(layer).sum_on(dev), total.buf)
        layer.__dict__.setdefault("added_by_replica", {})[state.replica_id] = list(added)   # layer.losses
    return y.buf


def _backward_eager(layer, state, dy):
    """dy: d loss / d y -> the weights' gradients into ``state.grads``; dx's buffer (or a
    tuple of them), None when no earlier layer needs it (``state.need_dx``)."""
    b = dy.shape[0]
    buf = state.buffers(b)
    dev = state.dev
    weights = list(layer.trainable_weights)
    slots = {id(w): i for i, w in enumerate(layer.weights)}        # state.grads: every weight's
    need = state.need_dx if isinstance(state.need_dx, tuple) else (state.need_dx,)
    asked = [x for x, wanted in zip(buf.xs, need) if wanted]     # dx only where a layer before needs it
    with private_tapes(), values.replica_copies(state.replica_id), devices.device_scope(dev):
        seed = Tensor(view(dy, buf.y.shape), dev)
        # the layer's added losses join fit's loss, each scaled 1/N per replica (Keras scales
        # model.losses so under MirroredStrategy): d/d value = 1/N (``state.penalty_factor``)
        shares = [ops.ones_like(v) * state.penalty_factor for v in buf.added]
        grads = buf.tape.gradient([buf.y] + buf.added, asked + weights, output_gradients=[seed] + shares)
        n = len(asked)
        for dst, g in zip([state.grads[slots[id(w)]] for w in weights], grads[n:]):
            if g is None:                        # the output does not depend on this weight
                state.ops.fill(dst, 0.0)
            else:
                dev.copy_into(dst, ops.cast(g, FLOAT).buf)
        if not any(need):
            buf.tape = None
            return None
        given = iter(grads[:n])
        dxs = [None if not wanted else (lambda g: (g if g is not None else ops.zeros_like(x)).buf)(next(given))
               for x, wanted in zip(buf.xs, need)]
    buf.tape = None                              # one backward per forward
    return tuple(dxs) if isinstance(state.need_dx, tuple) else dxs[0]


# --- outside a model -------------------------------------------------------------------------

_calls = threading.local()        # .depth: eager calls in progress; .in_model: a model's forward


def add_loss(layer, loss):
    """``self.add_loss(value)`` inside ``call``. Called on its own (``layer(x)``): kept in the
    layer's ``losses`` until its next outermost call (Keras clears them then), for the tape of a
    custom loop (``loss += sum(layer.losses)``). In a model's forward: kept for the layer's
    backward, which adds the term's gradient x 1/N to the model's (``_backward_eager``), as
    fit's loss is the compiled loss plus the added ones; fit reports that sum (``AddedLosses``)."""
    for running in getattr(_calls, "running", ()):              # these calls add losses: fit reports them
        running.__dict__["adds_losses"] = True
    collecting = getattr(_calls, "in_model", None)
    if collecting is not None:
        collecting.append(ops.as_tensor(loss))
        return
    kept = layer.__dict__.setdefault("added_eagerly", {})      # replica id -> [term]: see added_eagerly
    kept.setdefault(_replica(), []).append(ops.as_tensor(loss))


class AddedLosses:
    """The sum of what a layer's ``call`` gave ``add_loss`` in its last forward on each device, in
    the engine's penalty form (``engine.ReplicaProgram.penalties``: ``value_into``, ``add_gradient``),
    so that fit and evaluate report loss = compiled loss + added losses, as Keras does. The
    gradient is not here: the layer's backward adds it (``_backward_eager``)."""

    @staticmethod
    def of(layer):
        found = layer.__dict__.get("added_losses_term")
        if found is None:
            found = layer.__dict__["added_losses_term"] = AddedLosses()
        return found

    def __init__(self):
        self.sums = {}                           # id(device) -> (device, (1,) float32 buffer)

    def sum_on(self, dev):
        """The buffer the forward on ``dev`` writes its sum into (the same one every step)."""
        entry = self.sums.get(id(dev))
        if entry is None or entry[0] is not dev:
            entry = self.sums[id(dev)] = (dev, dev.empty((1,), FLOAT))
            dev.ops.fill(entry[1], 0.0)
        return entry[1]

    def value_into(self, dev, weights, out):
        dev.copy_into(out, self.sum_on(dev))

    def add_gradient(self, dev, weights, grads, factor):
        """Nothing: the layer's backward adds the added losses' gradient."""


def reported_losses(layer):
    """[(AddedLosses, every weight)] for a layer whose ``call`` adds losses, else []: the
    engine's penalties besides the regularizers (``base_layer.Layer.reported_losses``)."""
    return [(AddedLosses.of(layer), slice(None))] if layer.__dict__.get("adds_losses") else []


def added_in_model(layer):
    """The values ``call`` gave ``add_loss`` in the layer's last forward as a node of a model, on
    this replica (``model(x)``, inside ``strategy.run`` each replica's own): for ``layer.losses``.
    They are the forward's own values; their gradient is the model node's backward's (1/N each,
    as fit's), so ``loss += sum(model.losses)`` after ``model(x)`` adds the right value."""
    return list(layer.__dict__.get("added_by_replica", {}).get(_replica(), ()))


def added_eagerly(layer):
    """The values ``call`` gave ``add_loss`` in the layer's last eager call (``layer(x)``, or
    ``model(x)`` run op by op: ``model_call.call_eagerly``) on this replica: for ``layer.losses``.

    Kept per replica, as ``added_by_replica`` is: inside ``strategy.run`` the replicas are
    threads that call the same layer object at the same time. One list for all of them let
    replica 1's call clear or append to it between replica 0's call and its read of
    ``vae.losses``, which then held replica 1's term (on the other device), none, or both."""
    return list(layer.__dict__.get("added_eagerly", {}).get(_replica(), ()))


def _replica():
    """This thread's replica id inside ``strategy.run``, else 0: whose added losses to keep or read."""
    _, replica_ctx = context.top()
    return replica_ctx.local_replica_id if replica_ctx is not None else 0


def clear_added_losses(layer):
    """Forget what ``add_loss`` kept for ``layer`` and its sublayers (Keras: at each outermost
    call), on this replica only: the other replicas' threads may be between their own call and
    their read of ``losses`` (``added_eagerly``)."""
    replica = _replica()
    layer.__dict__.get("added_eagerly", {}).pop(replica, None)
    layer.__dict__.get("added_by_replica", {}).pop(replica, None)
    for sub in layer.__dict__.get("_sublayers", ()):
        clear_added_losses(sub)


def eager_call(layer, inputs, kwargs):
    """``layer(x)`` on tensors or arrays: build on first use (Keras does), then ``call``,
    recorded by any open tape. The outermost call clears the losses its layers added before."""
    depth = getattr(_calls, "depth", 0)
    _calls.depth = depth + 1
    try:
        return _eager_call(layer, inputs, kwargs, outermost=depth == 0)
    finally:
        _calls.depth = depth


def _eager_call(layer, inputs, kwargs, outermost):
    unknown = sorted(k for k in kwargs if k != "training")
    if unknown:
        raise NotImplementedError(f"{type(layer).__name__} {layer.name!r} called with {unknown}: only "
                                  f"the inputs and training= are taken here.")
    multi = isinstance(inputs, (list, tuple))
    xs = [_as_float_tensor(x) for x in (inputs if multi else [inputs])]
    if not layer.built:
        layer.build([x.shape[1:] for x in xs] if multi else xs[0].shape[1:])
    if outermost:                                # after build: its trial call may add some too
        clear_added_losses(layer)
    return run_call(layer, xs if multi else xs[0], kwargs.get("training") or False)


def _as_float_tensor(x):
    if isinstance(x, (Tensor, values.Variable)):
        return ops.as_tensor(x)
    return ops.as_tensor(np.asarray(x, FLOAT))
