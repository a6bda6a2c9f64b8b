"""Keras optimizers: ``SGD`` and ``Adam``, with Keras's defaults and formulas (RMSprop, Adagrad,
AdamW: ``optimizers_more.py``). The math is in ``kernels/optimizers.py`` (one launch per parameter
buffer); here: the hyper-parameters, the step counter and the slot buffers (velocity; Adam's m
and v), one set per device, made on first use where the variables live (an optimizer made
outside ``strategy.scope()``, as the course lab's, works), dropped with their model.

A step has a host part and a device part. ``begin_step`` counts the step and puts its
hyper-parameter vector (Adam's alpha changes every step) in a small buffer on every device
(``fit``'s step sends it with the inputs, in their one copy: ``step_scalars``); ``update``
only launches kernels, which read that buffer, so a CUDA graph of the device part
(``mirrored/program/capture.py``) or a ``@function``'s replay updates with the alpha just written.
The launches update every copy or none: a Ctrl-C waits for the last one.

An optimizer only updates: it never sums gradients itself. ``fit``'s step
(``keras/step.py``) calls ``begin_step``, the all-reduce and then ``update``;
``apply_gradients(zip(grads, variables))`` inside ``strategy.run`` is a *merge point*
where the replicas meet and, when the gradients are a model's packed gradient buffers (as
``GradientTape`` returns them), hands them to that same step (``Step.apply_gradients``):
one ring over one buffer, one launch per device. So every copy gets the same update, the
copies stay bitwise equal, and a custom loop's weights are fit's, bit for bit.

Neighbours: ``optimizer_state.py`` (``iterations``, ``learning_rate``, schedules, clipping, weight
decay, what Keras saves), ``step.py``, ``kernels/optimizers.py``."""
import contextlib
import threading
import warnings
import weakref

from kernels.optimizers import adam_scalars, sgd_scalars
from mirrored import context
from mirrored.program import recording
from mirrored.devices import every_device_or_none
from mirrored.keras.optimizer_state import OptimizerState
from mirrored.keras.custom_loop import step_of
from mirrored.keras.variable_updates import apply_to_variables


class Optimizer(OptimizerState):
    """Base: slot buffers per (buffer, device), the per-step hyper-parameter vectors, the update.
    The step count and rate (``step_count``, ``rate``), their Keras views (``iterations``,
    ``learning_rate``) and what Keras saves are its base class's (``optimizer_state.py``)."""

    slot_names = ()

    def __init__(self, learning_rate, name, **kwargs):
        super().__init__(learning_rate, **kwargs)    # step_count, rate, their Keras views; kwargs checked
        self.name = name
        self._slots = {}                 # ("pack", id(pack), r) or ("var", id(copy)) -> [buffer per slot]
        self.hyper = weakref.WeakValueDictionary()   # device name -> this step's vector (its own
        self._own = {}                   # buffer in ``_own``, or the one sent with the inputs)
        self._lock = threading.Lock()

    def _slot_buffers(self, key, dev, like):
        """Zero-initialised slot buffers shaped like ``like`` on ``dev`` (created once)."""
        slots = self._slots.get(key)
        if slots is None:
            with self._lock:
                slots = self._slots.get(key)
                if slots is None:
                    slots = []
                    for name in self.slot_names:
                        slots.append(dev.empty(like.shape, like.dtype))
                        with recording.initialization():      # a @function's replay never re-zeroes
                            dev.ops.fill(slots[-1], self.initial_slot_value(name))
                    self._slots[key] = slots
        return slots

    def _scalars(self, t):
        """Step t's hyper-parameter vector, (k,) float32 (``kernels.optimizers``)."""
        raise NotImplementedError

    def step_scalars(self):
        return self.step_vector(self.step_count + 1)   # the next step's (fit sends it with its inputs)

    def update_buffer(self, dev, w, g, key):
        """One launch: update ``w`` with ``g`` (on ``dev``), reading ``self.hyper[dev.name]``."""
        raise NotImplementedError

    def begin_step(self, devices, sent=None):
        """The host part of a step: count it, and copy its hyper-parameter vector into a buffer
        on every device (queued on its stream, before the update), except where ``sent``
        {device name: buffer} holds it: it went up with the step's inputs (``Step.host_part``)."""
        self.step_count += 1
        for dev in devices:
            buf = (sent or {}).get(dev.name)
            if buf is None:                                        # not sent: its own buffer
                host = self.step_vector(self.step_count)           # (k,) float32
                with dev.activate():
                    buf = self._own.get(dev.name)
                    buf = self._own[dev.name] = dev.empty(host.shape, host.dtype) if buf is None else buf
                    dev.upload_into(buf, host)
            self.hyper[dev.name] = buf

    def caches(self):  # the buffers made on first use: a failed step drops what it added (rolled_back_on_error)
        return [self._slots, self._own]

    def update(self, pack, around=None):
        """Step 4 of a training step: one update launch per device, each copy of the
        weights with its own (already summed) gradients. Launches only (after ``begin_step``).
        ``around(r, dev)``: a context manager entered around replica r's launch
        (``mirrored.lab.timing.TimedStep`` times each replica's update with it)."""
        if ("pack", id(pack), 0) not in self._slots:            # the first step: slots made, and
            self.release_slots_with(pack)                       # freed with the model
        self.update_buffers([(dev, pack.params[r], pack.grads[r], ("pack", id(pack), r))
                             for r, dev in enumerate(pack.devices)], around)

    def update_buffers(self, launches, around=None):
        """One ``update_buffer`` per ``(dev, w, g, key)``, all or none (copies must not differ):
        slots made before the first launch, a Ctrl-C waits for the last (``every_device_or_none``)."""
        for dev, w, _, key in launches:
            with dev.activate():
                self._slot_buffers(key, dev, w)
        with every_device_or_none():
            for i, (dev, w, g, key) in enumerate(launches):
                with dev.activate(), (around(i, dev) if around else contextlib.nullcontext()):
                    if self.transforming:                              # clipping, weight decay
                        self.before_update(dev, w, g, key)
                    self.update_buffer(dev, w, g, key)
            self.count_update()             # on every copy: a Ctrl-C now leaves it counted (rolled_back_on_error)

    def count_update(self):    # a host entry of the step's program: a replay counts, a dry run not
        self.updates_done += 1

    # -- Keras API
    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Update the variables with their gradients. Inside ``strategy.run`` with several
        replicas this is a merge point: every replica arrives with its own gradients, and
        the last to arrive sums them and updates every copy, once (``_apply``).

        As Keras: a variable whose gradient is None is left out with a warning; None for
        every variable is an error; no pairs at all: nothing done, the step not counted."""
        given = [(g, v) for g, v in grads_and_vars]
        pairs = [(g, v) for g, v in given if g is not None]
        if len(pairs) < len(given):
            names = [getattr(v, "name", repr(v)) for g, v in given if g is None]
            if not pairs:
                raise ValueError(f"No gradients provided for any variable: {names}.")
            warnings.warn(f"Gradients do not exist for variables {names} when minimizing the loss: "
                          f"they are not updated.", stacklevel=2)
        if not pairs:
            return self.iterations
        strategy, replica_ctx = context.top()
        if replica_ctx is not None and strategy is not None and strategy.num_replicas_in_sync > 1:
            return replica_ctx.merge_call(self._apply, args=(pairs,))
        return self._apply(None, pairs)

    def _apply(self, strategy, pairs):
        """Sum the replicas' gradients and update every copy of every variable.

        A model's packed gradients (``tape.gradient(loss, model.trainable_variables)``) go
        through the model's training step, the code ``fit`` runs (``Step.apply_gradients``:
        one ring over one buffer, one update launch per device). Other variables are summed
        one by one and updated one launch per copy (``variable_updates.py``)."""
        step = step_of([v for _, v in pairs], [g for g, _ in pairs])
        if step is not None:
            step.apply_gradients(self)
        else:
            apply_to_variables(self, strategy, pairs)
        return self.iterations

    def get_config(self):
        return self.base_config()      # Keras 3's base keys (optimizer_state.py)


recording.host_method(Optimizer, "begin_step", restores="step_count")   # a @function's replay calls it
recording.host_method(Optimizer, "count_update", restores="updates_done")


class SGD(Optimizer):
    """``w -= lr * g``; with momentum: ``v = momentum*v - lr*g; w += v`` (nesterov: ``w += momentum*v - lr*g``)."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD", **kwargs):
        super().__init__(learning_rate, name, **kwargs)
        if not 0 <= momentum <= 1:
            raise ValueError(f"SGD: momentum must be in [0, 1], got {momentum}.")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.slot_names = ("momentum",) if self.momentum else ()

    def _scalars(self, t):
        return sgd_scalars(self.rate, self.momentum)

    def get_config(self):
        return dict(super().get_config(), momentum=self.momentum, nesterov=self.nesterov)

    def update_buffer(self, dev, w, g, key):
        velocity = self._slot_buffers(key, dev, w)[0] if self.momentum else None
        dev.ops.sgd(w, g, velocity, self.hyper[dev.name], self.nesterov)


class Adam(Optimizer):
    """Keras's Adam: ``alpha = lr*sqrt(1-b2^t)/(1-b1^t)``; ``w -= alpha*m/(sqrt(v)+eps)``."""

    slot_names = ("m", "v")

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
                 name="Adam", **kwargs):
        super().__init__(learning_rate, name, **kwargs)
        if amsgrad:
            raise NotImplementedError("Adam(amsgrad=True) is not implemented.")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)

    def _scalars(self, t):
        return adam_scalars(self.rate, t, self.beta_1, self.beta_2, self.epsilon)

    def get_config(self):
        return dict(super().get_config(), beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
                    amsgrad=False)

    def update_buffer(self, dev, w, g, key):
        m, v = self._slot_buffers(key, dev, w)
        dev.ops.adam(w, g, m, v, self.hyper[dev.name])


NAMES = {"adam": Adam, "sgd": SGD}     # Keras's string names (optimizers_more.py adds its own)


def get(identifier):
    """An optimizer from Keras's string names ('adam', 'sgd', 'rmsprop'...) or the object itself."""
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in NAMES:
        return NAMES[identifier.lower()]()
    raise NotImplementedError(f"optimizer {identifier!r} is not implemented; use one of {sorted(NAMES)} "
                              f"or an optimizer object, e.g. optimizers.Adam(...).")
