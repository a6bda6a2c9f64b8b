"""What Keras shows and saves of an optimizer: ``iterations`` and ``learning_rate``, which
read like Keras 3's variables, and ``variables`` in Keras 3's order (iteration, learning
rate, the slots of each weight), as ``model.save``, ``save_weights`` and
``tf.train.Checkpoint`` write and read them (``OptimizerState``, the base class of
``optimizers.Optimizer``), and the arguments Keras takes (``check_keras_arguments``).
The update itself (``optimizers.py``) needs none of this: it reads the plain numbers
behind the two views, ``step_count`` and ``rate``. Also here: ``release_slots_with`` (the
slots go with their model).

Neighbours: ``optimizers.py`` (SGD, Adam: the update), ``saving.py`` and
``mirrored/checkpoint.py`` (the files).
"""
import warnings
import weakref

import numpy as np

#: Keras's optimizer arguments that are not implemented here, each with its default, the
#: value that means "not used" (a Keras config carries them all, so the default is accepted).
NOT_IMPLEMENTED = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None,
                   "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
                   "loss_scale_factor": None, "gradient_accumulation_steps": None}


def _drop_slots(slots, owners, oid):
    """``release_slots_with``'s finalizer: forget the slots of the owner whose id was ``oid`` (their
    buffers are freed, and refunded to their device, when nothing else holds them). A module
    function holding the two dicts, not the optimizer: the finalizer must not keep it alive."""
    for key in [k for k in list(slots) if k[1] == oid]:
        slots.pop(key, None)
    owners.pop(oid, None)


def check_keras_arguments(what, kwargs):
    """Keras's rule for the arguments an optimizer does not name: ``decay`` is ignored with a
    warning, an unknown one is a ValueError; and here, one of ``NOT_IMPLEMENTED`` set to
    anything but its default is refused (ignoring ``clipnorm=1.0`` would train unclipped)."""
    if kwargs.pop("decay", None) is not None:
        warnings.warn("Argument `decay` is no longer supported and will be ignored.", stacklevel=5)
    unknown = {k: v for k, v in kwargs.items() if k not in NOT_IMPLEMENTED}
    if unknown:
        raise ValueError(f"Argument(s) not recognized: {unknown}")
    for key, value in kwargs.items():
        if value != NOT_IMPLEMENTED[key]:
            raise NotImplementedError(f"{what}({key}={value!r}) is not implemented here; leave {key} at "
                                      f"its default ({NOT_IMPLEMENTED[key]!r}).")


class Iterations:
    """``optimizer.iterations``: how many updates have been applied (reads like a tensor);
    a view of the optimizer's ``step_count``."""

    def __init__(self, optimizer):
        self._opt = optimizer

    def numpy(self):
        return np.int64(self._opt.step_count)

    def assign(self, value):
        """Set the count (Keras's ``optimizer.iterations.assign(n)``; Adam's next step is n + 1)."""
        self._opt.step_count = int(value)

    def __int__(self):
        return self._opt.step_count

    __index__ = __int__

    def __repr__(self):
        return f"<iterations: {self._opt.step_count}>"


class LearningRate:
    """``optimizer.learning_rate``: a scalar variable, as Keras 3's (not a Python float);
    a view of the optimizer's ``rate``.

    ``.numpy()`` (float32), ``.assign(x)``, ``float(lr)``, arithmetic and comparisons with
    numbers; ``optimizer.learning_rate = x`` assigns it too. The optimizer reads the rate
    at each step's start (``begin_step``), so a callback that changes it between batches or
    epochs takes effect at the next step, on every replica alike."""

    def __init__(self, optimizer):
        self._opt = optimizer

    def assign(self, value, read_value=True):
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"learning_rate must be a finite number, got {value!r}.")
        self._opt.rate = value
        return self if read_value else None

    def numpy(self):
        return np.float32(self._opt.rate)

    value = read_value = numpy
    shape = property(lambda self: ())
    dtype = property(lambda self: np.dtype(np.float32))

    def __float__(self):
        return self._opt.rate

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype)

    def __format__(self, spec):
        return format(self.numpy(), spec) if spec else str(self.numpy())

    def __repr__(self):
        return f"<tf.Variable 'learning_rate:0' shape=() dtype=float32, numpy={str(self.numpy())}>"

    def __add__(self, o): return float(self) + o
    def __radd__(self, o): return o + float(self)
    def __sub__(self, o): return float(self) - o
    def __rsub__(self, o): return o - float(self)
    def __mul__(self, o): return float(self) * o
    def __rmul__(self, o): return o * float(self)
    def __truediv__(self, o): return float(self) / o
    def __rtruediv__(self, o): return o / float(self)
    def __lt__(self, o): return float(self) < float(o)
    def __le__(self, o): return float(self) <= float(o)
    def __gt__(self, o): return float(self) > float(o)
    def __ge__(self, o): return float(self) >= float(o)
    def __eq__(self, o):
        try:
            return float(self) == float(o)
        except (TypeError, ValueError):
            return NotImplemented
    __hash__ = None


class OptimizerState:
    """An optimizer's state in Keras's terms (the module docstring): the step count and the
    rate, and the views Keras users see of them. Uses the optimizer's slots and
    ``_slot_buffers`` (``optimizers.Optimizer``)."""

    def __init__(self, learning_rate, **kwargs):
        check_keras_arguments(type(self).__name__, kwargs)
        if callable(learning_rate):
            raise NotImplementedError("learning-rate schedules are not implemented; pass a float "
                                      "and change optimizer.learning_rate between epochs if needed.")
        self.step_count = 0                         # updates applied (``iterations``)
        self.updates_done = 0                       # updates of every copy done (``update_buffers``)
        self._owners = {}                           # id(owner) -> the finalizer that drops its slots
        self.rate = 0.0                             # the learning rate, a Python float
        self._learning_rate = LearningRate(self)
        self._learning_rate.assign(learning_rate)   # checked: a finite number

    @property
    def learning_rate(self):
        """The rate as a variable (``LearningRate``); assigning a number sets it."""
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self._learning_rate.assign(value)

    lr = learning_rate

    @property
    def iterations(self):
        return Iterations(self)

    def apply(self, grads, trainable_variables=None):
        """Keras 3's ``optimizer.apply(grads, trainable_variables)``: the same update as
        ``apply_gradients(zip(grads, trainable_variables))`` (in a replica it is the same merge
        point, where the replicas' gradients are summed). Keras 3 lets a built optimizer leave
        the variables out; here they are needed: pass ``model.trainable_variables``."""
        if trainable_variables is None:
            raise ValueError("optimizer.apply(grads) without trainable_variables: pass the variables the "
                             "gradients belong to, optimizer.apply(grads, model.trainable_variables).")
        grads, trainable_variables = list(grads), list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"optimizer.apply: {len(grads)} gradients for {len(trainable_variables)} "
                             f"variables; pass one gradient per variable, in the variables' order.")
        return self.apply_gradients(zip(grads, trainable_variables))

    def release_slots_with(self, owner):
        """Drop the slots keyed by ``id(owner)`` (``("pack", id(pack), r)``: a model's
        ``ParameterPack``; ``("var", id(copy))``: a copy of a variable) when ``owner`` is
        collected (``del model``): an optimizer reused across models then keeps none of an
        earlier model's slots (nor their device memory), and a later owner that gets the same
        ``id`` cannot find a dead one's slots. Called when its slots are first made."""
        oid = id(owner)
        if oid not in self._owners:
            self._owners[oid] = weakref.finalize(owner, _drop_slots, self._slots, self._owners, oid)

    def _pack_slots(self, pack, r):
        return self._slots.get(("pack", id(pack), r))

    def keras_variable_count(self, pack, built=None):
        """``len(optimizer.variables)`` in Keras for a model whose parameters are ``pack``:
        iteration and learning_rate, plus the slots once built (``built``: count them as if
        built; None: as they are now)."""
        if built is None:
            built = self._pack_slots(pack, 0) is not None
        return 2 + (len(self.slot_names) * len(pack.variables) if built else 0)

    def keras_variables(self, pack):
        """Keras 3's ``optimizer.variables`` as NumPy, in its order: iteration (int64),
        learning_rate (float32), then for each trainable variable its slots (Adam: m, v;
        SGD with momentum: the velocity), read from the first replica (all replicas agree)."""
        out = [np.int64(self.step_count), self.learning_rate.numpy()]
        slots = self._pack_slots(pack, 0)
        if slots is None:
            return out
        dev = pack.devices[0]
        flats = [dev.to_numpy(s) for s in slots]                  # (total,) each
        for off, size, shape in zip(pack.offsets, pack.sizes, pack.shapes):
            out.extend(flat[off:off + size].reshape(shape) for flat in flats)
        return out

    def keras_variables_setter(self, pack, values):
        """The inverse of ``keras_variables``, in two halves: check ``values`` (of a count the
        caller checked) against this optimizer and ``pack``, changing nothing, and return
        the function that sets them: the step counter, the learning rate, and every
        replica's slots (created if need be). ``keras/saving.py`` checks the whole file
        before it calls it.

        ``values`` holds only the iteration and the learning rate when the optimizer that
        wrote them had not taken a step yet (Keras saves no slots then): those two are set
        and the slots left as they are. (Reading slots that were not there raised an
        IndexError after the weights had been loaded: ``load_weights`` between two
        compiled, never-trained models with Adam.)"""
        step = int(np.asarray(values[0]))
        lr = np.float32(np.asarray(values[1]))
        k = len(self.slot_names)
        flats = None
        if k and len(values) > 2:
            if len(values) != 2 + k * len(pack.variables):
                raise ValueError(f"optimizer {self.name}: {len(values)} variables, expected 2 or "
                                 f"{2 + k * len(pack.variables)} (iteration, learning rate, {k} slot(s) for "
                                 f"each of {len(pack.variables)} variables).")
            flats = [np.empty(pack.total, np.float32) for _ in range(k)]
            for i, (off, size, shape) in enumerate(zip(pack.offsets, pack.sizes, pack.shapes)):
                for j in range(k):
                    value = np.asarray(values[2 + i * k + j], np.float32)
                    if value.shape != tuple(shape):
                        raise ValueError(f"optimizer slot {self.slot_names[j]} of {pack.variables[i].name}: "
                                         f"shape {value.shape} in the file, {tuple(shape)} in the model.")
                    flats[j][off:off + size] = value.reshape(-1)

        def apply():
            if flats is not None:                  # the slots first: the one part that may fail
                for r, dev in enumerate(pack.devices):
                    with dev.activate():
                        self.release_slots_with(pack)
                        for buf, flat in zip(self._slot_buffers(("pack", id(pack), r), dev, pack.params[r]),
                                             flats):
                            dev.upload_into(buf, flat)
            self.step_count = step
            if lr != self.learning_rate.numpy():     # Keras keeps it as float32: the same float32
                self.learning_rate = float(lr)          # keeps this exact float (the same updates)
        return apply
