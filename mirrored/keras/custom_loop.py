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
"""
import weakref

from mirrored.tensor import Tensor
from mirrored.values import DistributedValues, components

_PACK_OF = weakref.WeakKeyDictionary()      # variable -> weakref to its pack (a pack holds its variables)
_STEPS = weakref.WeakKeyDictionary()        # ParameterPack -> weak reference to the Step that made it


def register(pack, step=None):
    """Remember ``pack``'s variables (and the ``step`` that owns it, when given)."""
    for var in pack.variables:
        _PACK_OF[var] = weakref.ref(pack)
    if step is not None:
        _STEPS[pack] = weakref.ref(step)


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
    return step if step is not None and matches(pack, variables, grads) else None
