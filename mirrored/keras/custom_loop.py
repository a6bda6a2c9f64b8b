"""A custom training loop's way back to the packed step: which model's packed gradient
buffers the gradients a ``GradientTape`` returned are.

``tape.gradient(loss, model.trainable_variables)`` returns views of the model's packed
gradient buffers (``engine.ParameterPack``); ``optimizer.apply_gradients`` then finds the
``step.Step`` they belong to (``step_of``) and makes fit's two calls, the ring and the update,
over the one packed buffer. Gradients made any other way take the per-variable path
(``variable_updates.py``). ``fit`` never comes here.

Neighbours: ``engine.py`` (``ParameterPack`` registers its variables here), ``step.py``
(``Step`` registers itself), ``tape.py``, ``optimizers.py`` (``apply_gradients``),
``regularizers.py`` (``model.losses`` of a packed variable).

One set of weights, however many models share them. Two models that share a layer (Keras's
feature extractor: ``feat = keras.Model(inp, hidden)`` beside ``model = keras.Model(inp,
out)``; a model nested in another) each pack its weights, and a variable lives in ONE of
those packs at a time (``Variable.use_storage``): the last one that took it. Before a model
runs (``fit``, ``evaluate``, ``predict``, ``model(x)``, ``apply_gradients``), ``claim`` brings
home what lives elsewhere: the variable's current value is copied into this pack's view,
which becomes its storage. So ``fit`` of one model moves what the others see, and reading
a variable (``get_weights``, saving) always reads the value last written. The check costs
one comparison per step: ``MOVES`` counts every move (a new pack, a claim), and a model
looks again only when it changed since its last look.
"""
import threading
import weakref

from mirrored.tensor import Tensor
from mirrored.values import DistributedValues, components

_PACK_OF = weakref.WeakKeyDictionary()      # variable -> weakref to its pack (a pack holds its variables)
_STEPS = weakref.WeakKeyDictionary()        # ParameterPack -> weak reference to the Step that made it
#: [n]: how many times a variable may have moved between packs (each new pack, each claim that moved one)
MOVES = [0]
_CLAIM = threading.Lock()                   # the replicas of strategy.run may claim at once


def register(pack, step=None):
    """Remember ``pack``'s variables (and the ``step`` that owns it, when given)."""
    for var in pack.variables:
        _PACK_OF[var] = weakref.ref(pack)
    MOVES[0] += 1                               # a new pack takes its variables' storage
    if step is not None:
        _STEPS[pack] = weakref.ref(step)


def claim(pack):
    """Make ``pack``'s views the storage of every variable of it that lives in another pack
    (another model sharing the layer), its current value copied in first (module docstring).
    Returns ``MOVES[0]`` after the claim: the caller compares it before its next run."""
    with _CLAIM:
        moved = False
        for k, var in enumerate(pack.variables):
            for r, (comp, dev) in enumerate(zip(components(var), pack.devices)):
                view, here = pack.param_views[r][k], comp.value()
                if here.buf is view:
                    continue
                with dev.activate():
                    dev.copy_into(view, here.buf)            # the value last written, wherever it lives
                comp.use_storage(Tensor(view, dev))
                moved = True
        if moved:
            register(pack)                       # pack_of: this pack now (regularizers, step_of)
        return MOVES[0]


def pack_of(variable):
    """The ``ParameterPack`` holding ``variable``, or None (a variable outside any model)."""
    try:
        return _PACK_OF[variable]()
    except (KeyError, TypeError):               # in no pack; not a variable at all (no weak reference to it)
        return None


def index_of(pack, variable):
    """k such that ``variable`` (or one of its per-device copies) is ``pack.variables[k]``, else None."""
    for k, v in enumerate(pack.variables):
        if variable is v or any(variable is c for c in components(v)):
            return k
    return None


def grad_tensors(pack, r):
    """Replica ``r``'s gradient views of every variable of ``pack``, as Tensors."""
    dev = pack.devices[r]
    return [Tensor(g, dev) for g in pack.grad_views[r]]


def matches(pack, variables, grads):
    """True when ``grads`` (PerReplica or Tensors, one per variable) are exactly ``pack``'s
    gradient views of ``variables``: then one ring over ``grads`` sums them all."""
    if list(variables) != pack.variables:
        return False
    for k, g in enumerate(grads):
        comps = g.values if isinstance(g, DistributedValues) else (g,)
        if len(comps) != len(pack.devices):
            return False
        for r, t in enumerate(comps):
            if not isinstance(t, Tensor) or t.buf is not pack.grad_views[r][k]:
                return False
    return True


def step_of(variables, grads):
    """The ``Step`` whose packed gradient buffers ``grads`` are, for exactly its trainable
    ``variables`` (what ``tape.gradient(loss, model.trainable_variables)`` returns), or None
    (other variables, or gradients computed some other way)."""
    pack = pack_of(variables[0]) if variables else None
    ref = _STEPS.get(pack) if pack is not None else None
    step = ref() if ref is not None else None
    if step is None or not matches(pack, variables, grads):
        return None
    step.model.use_own_weights()                 # another model may have taken a shared weight since
    return step
