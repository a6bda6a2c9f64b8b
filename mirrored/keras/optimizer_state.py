"""What Keras shows and saves of an optimizer: ``iterations`` and ``learning_rate``, which
read like Keras 3's variables, and ``variables`` in Keras 3's order (iteration, learning
rate, the slots of each weight), as ``model.save``, ``save_weights`` and
``tf.train.Checkpoint`` write and read them (``OptimizerState``, the base class of
``optimizers.Optimizer``), and the arguments Keras takes (``check_keras_arguments``).
The update itself (``optimizers.py``) needs none of this: it reads the plain numbers
behind the two views, ``step_count`` and ``rate``. Also here: ``release_slots_with`` (the
slots go with their model).

Also here, because every optimizer takes them (Keras 3's base optimizer arguments): a
learning-rate schedule as ``learning_rate`` (``schedules.py``: the rate is computed from the
step count when each step's vector is made, ``hyper_vector``), and ``clipnorm``, ``clipvalue``,
``global_clipnorm`` and ``weight_decay``, applied before the update (``before_update``,
``kernels/gradient_transforms.py``) on the summed gradients, the same launches on every
replica. Their scalars travel as a tail of the optimizer's per-step vector
(``hyper_vector``); the update kernel reads its own scalars at its front.

Neighbours: ``optimizers.py`` (SGD, Adam: the update), ``optimizers_more.py`` (RMSprop,
Adagrad, AdamW), ``schedules.py``, ``saving.py`` and ``mirrored/checkpoint.py`` (the files).
"""
import warnings
import weakref

import numpy as np

from kernels.gradient_transforms import segment_starts, transform_scalars
from mirrored.program import recording
from mirrored.keras import schedules

#: Keras's optimizer arguments that are not implemented here, each with its default, the
#: value that means "not used" (a Keras config carries them all, so the default is accepted).
NOT_IMPLEMENTED = {"use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
                   "loss_scale_factor": None, "gradient_accumulation_steps": None}
#: The base optimizer's arguments implemented here (``before_update``), each with its default.
IMPLEMENTED = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None}
#: Every argument of Keras 3's base optimizer beyond ``learning_rate`` and ``name``.
BASE_ARGUMENTS = {**IMPLEMENTED, **NOT_IMPLEMENTED}


def _drop_slots(slots, owners, oid, sizes=None):
    """``release_slots_with``'s finalizer: forget the slots of the owner whose id was ``oid`` (their
    buffers are freed, and refunded to their device, when nothing else holds them). A module
    function holding the two dicts, not the optimizer: the finalizer must not keep it alive."""
    for key in [k for k in list(slots) if k[1] == oid]:
        slots.pop(key, None)
    owners.pop(oid, None)
    if sizes is not None:
        sizes.pop(oid, None)


def _number_or_none(what, key, value):
    """``value`` as a float (None stays None); a bool, a string or a non-finite number is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value):
        raise ValueError(f"{what}: {key} must be a finite number or None, got {value!r}.")
    return float(value)


def check_base_arguments(what, kwargs):
    """Take Keras's implemented base arguments (``IMPLEMENTED``) out of ``kwargs``, checked as
    Keras checks them: at most one of clipnorm, clipvalue and global_clipnorm."""
    got = {k: _number_or_none(what, k, kwargs.pop(k, None)) for k in IMPLEMENTED}
    clips = [k for k in ("clipnorm", "clipvalue", "global_clipnorm") if got[k] is not None]
    if len(clips) > 1:
        raise ValueError(f"Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. "
                         f"Received: clipnorm={got['clipnorm']}, clipvalue={got['clipvalue']}, "
                         f"global_clipnorm={got['global_clipnorm']}")
    return got


def check_keras_arguments(what, kwargs):
    """Keras's rule for the arguments an optimizer does not name: ``decay`` is ignored with a
    warning, an unknown one is a ValueError; and here, one of ``NOT_IMPLEMENTED`` set to
    anything but its default is refused (ignoring ``use_ema=True`` would train without it)."""
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
        if self._opt.schedule is not None:
            raise TypeError("This optimizer was created with a `LearningRateSchedule` object as its "
                            "`learning_rate` constructor argument, hence its learning rate is not "
                            "settable. If you need the learning rate to be settable, you should "
                            "instantiate the optimizer with a float `learning_rate` argument.")
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"learning_rate must be a finite number, got {value!r}.")
        self._opt.rate = value
        return self if read_value else None

    def numpy(self):
        return np.float32(float(self))

    value = read_value = numpy
    shape = property(lambda self: ())
    dtype = property(lambda self: np.dtype(np.float32))

    def __float__(self):
        opt = self._opt                        # a schedule's: its value at ``iterations``
        return float(opt.schedule(opt.step_count)) if opt.schedule is not None else opt.rate

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

    #: Keras orders ``optimizer.variables`` slot by slot for each weight (Adam: m, v of the
    #: first weight, then of the second...); True: every weight's first slot, then every
    #: weight's second (RMSprop's ``add_optimizer_variables`` one name at a time).
    slots_grouped = False

    def __init__(self, learning_rate, **kwargs):
        base = check_base_arguments(type(self).__name__, kwargs)
        check_keras_arguments(type(self).__name__, kwargs)
        self.step_count = 0                         # updates applied (``iterations``)
        self.updates_done = 0                       # updates of every copy done (``update_buffers``)
        self._owners = {}                           # id(owner) -> the finalizer that drops its slots
        self._sizes = {}                            # id(owner) -> its variables' sizes (clipnorm)
        self.own_size = None                        # the update's part of the per-step vector
        self.schedule = None                        # a LearningRateSchedule, or None
        self.rate = 0.0                             # the learning rate, a Python float (a schedule's:
        self._learning_rate = LearningRate(self)    # set by ``hyper_vector`` for the step it makes)
        self._base = base                           # weight_decay, clipnorm, clipvalue, global_clipnorm
        if isinstance(learning_rate, schedules.LearningRateSchedule):
            self.schedule = learning_rate
        elif callable(learning_rate):
            raise NotImplementedError(f"learning_rate={learning_rate!r}: a callable that is not a "
                                      f"keras.optimizers.schedules.LearningRateSchedule is not "
                                      f"implemented; subclass LearningRateSchedule (its __call__(step)).")
        else:
            self._learning_rate.assign(learning_rate)   # checked: a finite number
        self._choose_path()

    def _choose_path(self):
        """Plain SGD or Adam (no schedule, no clipping, no weight decay) keep their old step: the
        per-step vector is ``_scalars`` alone and nothing runs before the update, so their step
        never enters this file (tests/test_step_path.py counts the files a step crosses)."""
        self.transforming = self.weight_decay is not None or self.clip() is not None
        self.step_vector = self.hyper_vector if self.transforming or self.schedule is not None else self._scalars

    weight_decay = property(lambda self: self._base["weight_decay"],
                            lambda self, v: self._set_base("weight_decay", v))
    clipnorm = property(lambda self: self._base["clipnorm"], lambda self, v: self._set_base("clipnorm", v))
    clipvalue = property(lambda self: self._base["clipvalue"], lambda self, v: self._set_base("clipvalue", v))
    global_clipnorm = property(lambda self: self._base["global_clipnorm"],
                               lambda self, v: self._set_base("global_clipnorm", v))

    def _set_base(self, key, value):
        """``optimizer.clipnorm = 1.0`` between steps: checked as in the constructor, then used."""
        self._base = check_base_arguments(type(self).__name__, dict(self._base, **{key: value}))
        self._choose_path()

    def rate_at(self, t):
        """The learning rate of update t (t >= 1): a schedule's value at t - 1, the
        ``iterations`` Keras passes it when it applies update t."""
        return float(self.schedule(t - 1)) if self.schedule is not None else self.rate

    # -- the base optimizer's clipping and weight decay (module docstring) -------------------
    def clip(self):
        """("norm" | "global" | "value", threshold) as Keras applies it (a threshold must be
        > 0 to act, as Keras's ``if self.clipnorm and self.clipnorm > 0``), or None."""
        for mode, value in (("norm", self.clipnorm), ("global", self.global_clipnorm),
                            ("value", self.clipvalue)):
            if value and value > 0:
                return mode, value
        return None

    def hyper_vector(self, t):
        """Update t's per-step vector: the optimizer's own scalars (``_scalars``, from ``rate``:
        a schedule's value for update t is put there first), then, when something runs before
        the update, [lr, weight_decay, clip] (``transform_scalars``). The update kernels read
        their own scalars at the front and ignore the tail."""
        self.rate = self.rate_at(t)
        own = self._scalars(t)                                         # (k,) float32
        self.own_size = own.shape[0]
        if not self.transforming:
            return own
        clip = self.clip()
        return np.concatenate([own, transform_scalars(self.rate, self.weight_decay,
                                                      clip[1] if clip else None)])

    def before_update(self, dev, w, g, key):
        """Keras's ``_clip_gradients`` on ``g`` then ``_apply_weight_decay`` on ``w`` (one copy's
        packed buffers, already summed over the replicas), launches reading this step's vector
        (``optimizers.Optimizer.update_buffers`` calls it when ``transforming``)."""
        hyper, at = self.hyper[dev.name], self.own_size
        clip = self.clip()
        if clip is not None and clip[0] == "value":
            dev.ops.clip_value(g, hyper, at)
        elif clip is not None:
            starts, sq = self._clip_buffers(dev, g, key)
            dev.ops.clip_norm(g, starts, sq, hyper, at, clip[0] == "global")
        if self.weight_decay is not None:
            dev.ops.decay_weights(w, hyper, at)

    def _clip_buffers(self, dev, g, key):
        """Where each variable begins in ``g`` ((nseg + 1,) int64) and its sum of squares
        ((nseg,) float32), on ``dev``, made once per key (and dropped with its owner)."""
        ckey = ("clip",) + key[1:]
        bufs = self._slots.get(ckey)
        if bufs is None:
            sizes = self._sizes.get(key[1], [g.size]) if key[0] == "pack" else [g.size]
            starts = segment_starts(sizes)                             # (nseg + 1,) int64
            with recording.initialization():
                bufs = [dev.from_numpy(starts), dev.empty((len(sizes),), np.float32)]
            self._slots[ckey] = bufs
        return bufs

    def initial_slot_value(self, name):
        """What slot ``name`` starts as (Adagrad's accumulator: its initial_accumulator_value)."""
        return 0.0

    def base_config(self):
        """Keras 3's base optimizer config (``get_config``); a schedule serialized as Keras does."""
        lr = schedules.serialize(self.schedule) if self.schedule is not None else self.rate
        return {"name": self.name, "learning_rate": lr, **{k: getattr(self, k) for k in IMPLEMENTED},
                **NOT_IMPLEMENTED}

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
        ``id`` cannot find a dead one's slots. Called when its slots are first made. A pack's
        variables' sizes are remembered with it: clipnorm clips each variable (``_clip_buffers``)."""
        oid = id(owner)
        if oid not in self._owners:
            if hasattr(owner, "sizes"):
                self._sizes[oid] = list(owner.sizes)
            self._owners[oid] = weakref.finalize(owner, _drop_slots, self._slots, self._owners, oid,
                                                 self._sizes)

    def _pack_slots(self, pack, r):
        return self._slots.get(("pack", id(pack), r))

    @property
    def keras_head(self):
        """How many variables come before the slots: iteration and learning_rate, or only the
        iteration when the rate is a schedule (Keras 3 makes no learning_rate variable then)."""
        return 1 if self.schedule is not None else 2

    def keras_slot_order(self, pack):
        """[(variable index i, slot index j)] in Keras's order of ``optimizer.variables``:
        each variable's slots in turn, or (``slots_grouped``) each slot over every variable."""
        n, k = len(pack.variables), len(self.slot_names)
        if self.slots_grouped:
            return [(i, j) for j in range(k) for i in range(n)]
        return [(i, j) for i in range(n) for j in range(k)]

    def keras_variable_count(self, pack, built=None):
        """``len(optimizer.variables)`` in Keras for a model whose parameters are ``pack``:
        iteration and learning_rate (``keras_head``), plus the slots once built (``built``:
        count them as if built; None: as they are now)."""
        if built is None:
            built = self._pack_slots(pack, 0) is not None
        return self.keras_head + (len(self.slot_names) * len(pack.variables) if built else 0)

    def keras_variables(self, pack):
        """Keras 3's ``optimizer.variables`` as NumPy, in its order: iteration (int64),
        learning_rate (float32; not with a schedule), then the slots (``keras_slot_order``:
        Adam: m, v of each variable; SGD with momentum: the velocity), read from the first
        replica (all replicas agree)."""
        out = [np.int64(self.step_count), self.learning_rate.numpy()][:self.keras_head]
        slots = self._pack_slots(pack, 0)
        if slots is None:
            return out
        dev = pack.devices[0]
        flats = [dev.to_numpy(s) for s in slots]                  # (total,) each
        for i, j in self.keras_slot_order(pack):
            off, size = pack.offsets[i], pack.sizes[i]
            out.append(flats[j][off:off + size].reshape(pack.shapes[i]))
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
        h = self.keras_head
        lr = np.float32(np.asarray(values[1])) if h == 2 else None
        k = len(self.slot_names)
        flats = None
        if k and len(values) > h:
            if len(values) != h + k * len(pack.variables):
                raise ValueError(f"optimizer {self.name}: {len(values)} variables, expected {h} or "
                                 f"{h + k * len(pack.variables)} (iteration{', learning rate' if h == 2 else ''}, "
                                 f"{k} slot(s) for each of {len(pack.variables)} variables).")
            flats = [np.empty(pack.total, np.float32) for _ in range(k)]
            for n, (i, j) in enumerate(self.keras_slot_order(pack)):
                off, size, shape = pack.offsets[i], pack.sizes[i], pack.shapes[i]
                value = np.asarray(values[h + n], np.float32)
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
            if lr is not None and lr != self.learning_rate.numpy():     # Keras keeps it as float32: the same float32
                self.learning_rate = float(lr)          # keeps this exact float (the same updates)
        return apply
