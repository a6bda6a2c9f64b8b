"""Keras optimizers: ``SGD`` and ``Adam``, with Keras's defaults and formulas.

The math is in ``kernels/optimizers.py`` (one kernel launch per parameter
buffer); this file holds the hyper-parameters, the step counter and the slot
buffers (velocity; Adam's m and v), one set per device.

A step has a host part and a device part. ``begin_step`` counts the step and
copies its hyper-parameter vector (Adam's alpha changes every step) into a small
buffer on every device; ``update`` only launches kernels, which read that
buffer. The device part can therefore be captured once as a CUDA graph and
replayed (``mirrored/graphs.py``): each replay updates with the alpha that the
host part of its step wrote.

An optimizer only updates: it never sums gradients itself. ``fit``'s step
(``keras/step.py``) calls ``begin_step``, the all-reduce and then ``update``;
``apply_gradients(zip(grads, variables))`` called inside ``strategy.run`` is a
*merge point* where the replicas meet and, when the gradients are a model's packed
gradient buffers (as ``GradientTape`` returns them), hands them to that same step
(``Step.apply_gradients``): one ring over one buffer, one launch per device. So every
copy of every variable gets the same update, the copies stay bitwise equal, and a
custom loop's weights are fit's, bit for bit.

Slots are created on first use on the devices of the variables they serve, so
an optimizer created outside ``strategy.scope()`` (as the course lab does,
``optimizer=tf.keras.optimizers.Adam()`` inside ``compile``) works.

Neighbours: ``optimizer_state.py`` (what Keras saves of an optimizer: its ``variables``),
``step.py``, ``kernels/optimizers.py``.
"""
import contextlib
import threading

import numpy as np

from kernels.optimizers import adam_scalars, sgd_scalars
from mirrored import context
from mirrored.keras.optimizer_state import OptimizerState
from mirrored.keras.step import step_of
from mirrored.strategy import to_tensor_on
from mirrored.tensor import Tensor
from mirrored.values import DistributedValues, Variable, components


class _Iterations:
    """``optimizer.iterations``: how many updates have been applied (reads like a tensor)."""

    def __init__(self, optimizer):
        self._opt = optimizer

    def numpy(self):
        return np.int64(self._opt._step)

    def assign(self, value):
        """Set the count (Keras's ``optimizer.iterations.assign(n)``; Adam's next step is n + 1)."""
        self._opt._step = int(value)

    def __int__(self):
        return self._opt._step

    __index__ = __int__

    def __repr__(self):
        return f"<iterations: {self._opt._step}>"


class LearningRate:
    """``optimizer.learning_rate``: a scalar variable, as Keras 3's (not a Python float).

    ``.numpy()`` (float32), ``.assign(x)``, ``float(lr)``, arithmetic and comparisons with
    numbers; ``optimizer.learning_rate = x`` assigns it too. The optimizer reads its value
    at each step's start (``begin_step``), so a callback that changes it between batches or
    epochs takes effect at the next step, on every replica alike."""

    def __init__(self, value):
        self._value = 0.0
        self.assign(value)

    def assign(self, value, read_value=True):
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"learning_rate must be a finite number, got {value!r}.")
        self._value = value
        return self if read_value else None

    def numpy(self):
        return np.float32(self._value)

    value = read_value = numpy
    shape = property(lambda self: ())
    dtype = property(lambda self: np.dtype(np.float32))

    def __float__(self):
        return self._value

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype)

    def __format__(self, spec):
        return format(self.numpy(), spec) if spec else str(self.numpy())

    def __repr__(self):
        return f"<tf.Variable 'learning_rate:0' shape=() dtype=float32, numpy={str(self.numpy())}>"

    def __add__(self, o): return self._value + o
    def __radd__(self, o): return o + self._value
    def __sub__(self, o): return self._value - o
    def __rsub__(self, o): return o - self._value
    def __mul__(self, o): return self._value * o
    def __rmul__(self, o): return o * self._value
    def __truediv__(self, o): return self._value / o
    def __rtruediv__(self, o): return o / self._value
    def __lt__(self, o): return self._value < float(o)
    def __le__(self, o): return self._value <= float(o)
    def __gt__(self, o): return self._value > float(o)
    def __ge__(self, o): return self._value >= float(o)
    def __eq__(self, o):
        try:
            return self._value == float(o)
        except (TypeError, ValueError):
            return NotImplemented
    __hash__ = None


class Optimizer(OptimizerState):
    """Base: learning rate, step counter, slot buffers per (buffer, device); the state Keras
    saves is its base class's (``optimizer_state.py``)."""

    slot_names = ()

    def __init__(self, learning_rate, name, **kwargs):
        if callable(learning_rate):
            raise NotImplementedError("learning-rate schedules are not implemented; pass a float "
                                      "and change optimizer.learning_rate between epochs if needed.")
        self._learning_rate = LearningRate(learning_rate)
        self.name = name
        self._step = 0
        self._slots = {}
        self._hyper = {}                 # device name -> (k,) float32 hyper-parameter vector
        self._lock = threading.Lock()

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
        return _Iterations(self)

    def _slot_buffers(self, key, dev, like):
        """Zero-initialised slot buffers shaped like ``like`` on ``dev`` (created once)."""
        slots = self._slots.get(key)
        if slots is None:
            with self._lock:
                slots = self._slots.get(key)
                if slots is None:
                    slots = []
                    for _ in self.slot_names:
                        s = dev.empty(like.shape, like.dtype)
                        dev.ops.fill(s, 0.0)
                        slots.append(s)
                    self._slots[key] = slots
        return slots

    def _scalars(self):
        """This step's hyper-parameter vector, (k,) float32 (``kernels.optimizers``)."""
        raise NotImplementedError

    def _update(self, dev, w, g, key):
        """One kernel launch: update ``w`` with gradient ``g`` (both on ``dev``), reading
        the hyper-parameter vector ``self._hyper[dev.name]``."""
        raise NotImplementedError

    def begin_step(self, devices):
        """The host part of a step: count it, and copy its hyper-parameter vector into
        every device's buffer (queued on the device's stream, before the update)."""
        self._step += 1
        host = self._scalars()                       # (k,) float32
        for dev in devices:
            buf = self._hyper.get(dev.name)
            if buf is None:
                with dev.activate():
                    buf = self._hyper[dev.name] = dev.empty(host.shape, host.dtype)
            dev.upload_into(buf, host)

    def caches(self):
        """The dicts of buffers made on first use (slots, hyper-parameter vectors): a step
        that fails drops what it added (``Step.no_trace``)."""
        return [self._slots, self._hyper]

    def update(self, pack, around=None):
        """Step 4 of a training step: one update launch per device, each copy of the
        weights with its own (already summed) gradients. Launches only (after ``begin_step``).
        ``around(r, dev)``: a context manager entered around replica r's launch
        (``mirrored.lab.timing.TimedStep`` times each replica's update with it).

        The slots of every device are made (on the first step) before the first launch:
        running out of memory for device 1's slots after device 0 was updated would leave
        the copies of the weights different."""
        for r, dev in enumerate(pack.devices):
            with dev.activate():
                self._slot_buffers(("pack", id(pack), r), dev, pack.params[r])
        for r, dev in enumerate(pack.devices):
            with dev.activate(), (around(r, dev) if around else contextlib.nullcontext()):
                self._update(dev, pack.params[r], pack.grads[r], ("pack", id(pack), r))

    # -- Keras API
    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Update the variables with their gradients. Inside ``strategy.run`` with several
        replicas this is a merge point: every replica arrives with its own gradients, and
        the last to arrive sums them and updates every copy, once (``_apply``)."""
        pairs = [(g, v) for g, v in grads_and_vars]
        for g, v in pairs:
            if g is None:
                raise ValueError(f"no gradient for variable {v.name}: it did not take part in the loss.")
        strategy, replica_ctx = context.top()
        if replica_ctx is not None and strategy is not None and strategy.num_replicas_in_sync > 1:
            return replica_ctx.merge_call(self._apply, args=(pairs,))
        return self._apply(None, pairs)

    def _apply(self, strategy, pairs):
        """Sum the replicas' gradients and update every copy of every variable.

        A model's packed gradients (``tape.gradient(loss, model.trainable_variables)``) go
        through the model's training step, the code ``fit`` runs (``Step.apply_gradients``:
        one ring over one buffer, one update launch per device). Other variables are summed
        one by one (``strategy``: the replicas' gradients, PerReplica values) and updated
        one launch per copy."""
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        step = step_of(variables, grads)
        if step is not None:
            step.apply_gradients(self)
            return self.iterations
        if strategy is not None:
            comps = [list(g.values) if isinstance(g, DistributedValues) else [g] * len(strategy.extended.devices)
                     for g in grads]
            reduced = strategy.extended.cross_device_ops.all_reduce_components("SUM", comps)
        else:
            reduced = [[g] * len(_copies(v)) for g, v in pairs]
        self.begin_step(_devices_of(variables))
        for k, v in enumerate(variables):
            for r, c in enumerate(_copies(v)):
                dev = c.value().dev
                with dev.activate():
                    self._update(dev, c.value().buf, _on_device(reduced[k][r], dev), ("var", id(c)))
        return self.iterations

    def get_config(self):
        return {"name": self.name, "learning_rate": float(self.learning_rate)}


def _copies(variable):
    try:
        return components(variable)
    except TypeError as err:
        raise TypeError(f"apply_gradients expects (gradient, variable) pairs: {err}") from None


def _devices_of(variables):
    """The devices holding copies of ``variables``, each once, in first-seen order."""
    seen = {}
    for v in variables:
        for c in _copies(v):
            seen.setdefault(c.value().dev.name, c.value().dev)
    return list(seen.values())


def _on_device(g, dev):
    """The raw float32 buffer of gradient ``g`` on ``dev`` (copied there if need be)."""
    if not isinstance(g, (Tensor, Variable)):
        g = np.asarray(g, np.float32)
    return to_tensor_on(g, dev).buf


class SGD(Optimizer):
    """``w -= lr * g``; with momentum: ``v = momentum*v - lr*g; w += v`` (nesterov: ``w += momentum*v - lr*g``)."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD", **kwargs):
        super().__init__(learning_rate, name, **kwargs)
        if not 0 <= momentum <= 1:
            raise ValueError(f"SGD: momentum must be in [0, 1], got {momentum}.")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.slot_names = ("momentum",) if self.momentum else ()

    def _scalars(self):
        return sgd_scalars(float(self.learning_rate), self.momentum)

    def get_config(self):
        return dict(super().get_config(), momentum=self.momentum, nesterov=self.nesterov)

    def _update(self, dev, w, g, key):
        velocity = self._slot_buffers(key, dev, w)[0] if self.momentum else None
        dev.ops.sgd(w, g, velocity, self._hyper[dev.name], self.nesterov)


class Adam(Optimizer):
    """Keras's Adam: ``alpha = lr*sqrt(1-b2^t)/(1-b1^t)``; ``w -= alpha*m/(sqrt(v)+eps)``."""

    slot_names = ("m", "v")

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
                 name="Adam", **kwargs):
        super().__init__(learning_rate, name, **kwargs)
        if amsgrad:
            raise NotImplementedError("Adam(amsgrad=True) is not implemented.")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)

    def _scalars(self):
        return adam_scalars(float(self.learning_rate), self._step, self.beta_1, self.beta_2, self.epsilon)

    def get_config(self):
        return dict(super().get_config(), beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
                    amsgrad=False)

    def _update(self, dev, w, g, key):
        m, v = self._slot_buffers(key, dev, w)
        dev.ops.adam(w, g, m, v, self._hyper[dev.name])


def get(identifier):
    """An optimizer from Keras's string names ('adam', 'sgd') or the object itself."""
    if isinstance(identifier, Optimizer):
        return identifier
    names = {"adam": Adam, "sgd": SGD}
    if isinstance(identifier, str) and identifier.lower() in names:
        return names[identifier.lower()]()
    raise NotImplementedError(f"optimizer {identifier!r} is not implemented; use 'adam', 'sgd', "
                              f"optimizers.Adam(...) or optimizers.SGD(...).")
