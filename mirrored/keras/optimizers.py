"""Keras optimizers: ``SGD`` and ``Adam``, with Keras's defaults and formulas.

The math is in ``kernels/optimizers.py`` (one kernel launch per parameter
buffer); this file holds the hyper-parameters, the step counter and the slot
buffers (velocity; Adam's m and v), one set per device.

A step has a host part and a device part. ``begin_step`` counts the step and
copies its hyper-parameter vector (Adam's alpha changes every step) into a small
buffer on every device; ``update_packed`` only launches kernels, which read that
buffer. The device part can therefore be captured once as a CUDA graph and
replayed (``mirrored/graphs.py``): each replay updates with the alpha that the
host part of its step wrote.

``apply_gradients(zip(grads, variables))`` called inside ``strategy.run`` is a
*merge point*: the replicas meet, their gradients are summed by the strategy's
cross-device ops (the ring all-reduce), and then every copy of every variable
gets the same update, so the copies stay bitwise equal. When the gradients are
a model's packed gradient buffers (``keras/engine.py``), the sum is one ring
over one buffer and the update is one launch per device.

Slots are created on first use on the devices of the variables they serve, so
an optimizer created outside ``strategy.scope()`` (as the course lab does,
``optimizer=tf.keras.optimizers.Adam()`` inside ``compile``) works.
"""
import threading

import numpy as np

from kernels.optimizers import adam_scalars, sgd_scalars
from mirrored import context
from mirrored.strategy import _to_tensor_on
from mirrored.tensor import Tensor
from mirrored.values import DistributedValues, MirroredVariable, Variable


class _Iterations:
    """``optimizer.iterations``: how many updates have been applied (reads like a tensor)."""

    def __init__(self, optimizer):
        self._opt = optimizer

    def numpy(self):
        return np.int64(self._opt._step)

    def __int__(self):
        return self._opt._step

    __index__ = __int__

    def __repr__(self):
        return f"<iterations: {self._opt._step}>"


class Optimizer:
    """Base: learning rate, step counter, slot buffers per (buffer, device)."""

    slot_names = ()

    def __init__(self, learning_rate, name, **kwargs):
        if callable(learning_rate):
            raise NotImplementedError("learning-rate schedules are not implemented; pass a float "
                                      "and change optimizer.learning_rate between epochs if needed.")
        self.learning_rate = float(learning_rate)
        self.name = name
        self._step = 0
        self._slots = {}
        self._hyper = {}                 # device name -> (k,) float32 hyper-parameter vector
        self._lock = threading.Lock()

    lr = property(lambda self: self.learning_rate,
                  lambda self, value: setattr(self, "learning_rate", float(value)))

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

    # -- the packed fast path (used by fit and by apply_gradients when it can)
    def update_packed(self, pack, reduce_fn=None):
        """The device part of a step: sum ``pack.grads`` across devices (``reduce_fn``),
        then one update launch per device. Launches only (after ``begin_step``)."""
        if reduce_fn is not None and len(pack.devices) > 1:
            reduce_fn(pack.grads, pack.devices)
        for r, dev in enumerate(pack.devices):
            with dev.activate():
                self._update(dev, pack.params[r], pack.grads[r], ("pack", id(pack), r))

    def apply_packed(self, pack, reduce_fn=None):
        """Sum ``pack.grads`` across devices (``reduce_fn``) and update every copy, once."""
        self.begin_step(pack.devices)
        self.update_packed(pack, reduce_fn)

    # -- Keras API
    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        pairs = [(g, v) for g, v in grads_and_vars]
        for g, v in pairs:
            if g is None:
                raise ValueError(f"no gradient for variable {v.name}: it did not take part in the loss.")
        strategy, replica_ctx = context.top()
        if replica_ctx is not None and strategy is not None and strategy.num_replicas_in_sync > 1:
            return replica_ctx.merge_call(self._distributed_apply, args=(pairs,))
        self.begin_step(_devices_of(v for _, v in pairs))
        for g, v in pairs:
            for c in _copies(v):
                dev = c._tensor._device
                gbuf = _on_device(g, dev)
                with dev.activate():
                    self._update(dev, c._tensor._buf, gbuf, ("var", id(c)))
        return self.iterations

    def _distributed_apply(self, strategy, pairs):
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        pack = _packed_group(variables, grads)
        cross_ops = strategy.extended._cross_device_ops
        if pack is not None:
            self.apply_packed(pack, lambda bufs, devs: cross_ops.all_reduce_flat("SUM", bufs, devs))
            return self.iterations
        comps = [list(g.values) if isinstance(g, DistributedValues) else [g] * strategy.num_replicas_in_sync
                 for g in grads]
        reduced = cross_ops.all_reduce_components("SUM", comps)
        self.begin_step(_devices_of(variables))
        for k, v in enumerate(variables):
            for r, c in enumerate(_copies(v)):
                dev = c._tensor._device
                with dev.activate():
                    self._update(dev, c._tensor._buf, _on_device(reduced[k][r], dev), ("var", id(c)))
        return self.iterations

    def get_config(self):
        return {"name": self.name, "learning_rate": self.learning_rate}


def _copies(variable):
    if isinstance(variable, MirroredVariable):
        return list(variable.values)
    if isinstance(variable, Variable):
        return [variable]
    raise TypeError(f"apply_gradients expects (gradient, variable) pairs, got {type(variable).__name__}.")


def _devices_of(variables):
    """The devices holding copies of ``variables``, each once, in first-seen order."""
    seen = {}
    for v in variables:
        for c in _copies(v):
            seen.setdefault(c._tensor._device.name, c._tensor._device)
    return list(seen.values())


def _on_device(g, dev):
    """The raw float32 buffer of gradient ``g`` on ``dev`` (copied there if need be)."""
    if not isinstance(g, (Tensor, Variable)):
        g = np.asarray(g, np.float32)
    return _to_tensor_on(g, dev)._buf


def _packed_group(variables, grads):
    """The model ParameterPack these (PerReplica) gradients are the packed views of, if any."""
    pack = getattr(variables[0], "_pack", None) if variables else None
    if pack is None or list(variables) != pack.variables:
        return None
    for k, g in enumerate(grads):
        comps = g.values if isinstance(g, DistributedValues) else (g,)
        if len(comps) != len(pack.devices):
            return None
        for r, t in enumerate(comps):
            if not isinstance(t, Tensor) or t._buf is not pack.grad_views[r][k]:
                return None
    return pack


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
        return sgd_scalars(self.learning_rate, self.momentum)

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
        return adam_scalars(self.learning_rate, self._step, self.beta_1, self.beta_2, self.epsilon)

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
