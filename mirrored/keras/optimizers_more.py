"""Keras optimizers beyond SGD and Adam: ``RMSprop``, ``Adagrad`` and ``AdamW``.

Each is an ``optimizers.Optimizer``: the same step (``begin_step`` puts this step's vector on
every device, ``update`` makes one launch per device over the packed buffer, after the ring),
only its slots, its per-step scalars and its kernel differ (``kernels/optimizers_more.py``;
AdamW is Adam's kernel after Keras's weight decay, ``kernels/gradient_transforms.py``). The
base optimizer's arguments (``clipnorm``, ``clipvalue``, ``global_clipnorm``,
``weight_decay``, a schedule as ``learning_rate``) work on every optimizer alike
(``optimizer_state.py``). ``mirrored.keras`` sets these classes on ``keras.optimizers``, and
their string names ('rmsprop', 'adagrad', 'adamw') are added to ``optimizers.NAMES`` here.

Neighbours: ``optimizers.py`` (the base class, SGD, Adam), ``optimizer_state.py``, ``schedules.py``.
"""
from kernels.optimizers_more import adagrad_scalars, rmsprop_scalars
from mirrored.keras import optimizers, schedules
from mirrored.keras.optimizers import Adam, Optimizer

__all__ = ["RMSprop", "Adagrad", "AdamW", "schedules", "LearningRateSchedule"]

LearningRateSchedule = schedules.LearningRateSchedule


class RMSprop(Optimizer):
    """Keras's RMSprop (``kernels/optimizers_more.py`` has the formulas). Slots, in Keras's order of
    ``optimizer.variables``: every weight's velocity, then (momentum > 0) every momentum, then
    (centered) every average gradient."""

    slots_grouped = True      # Keras makes them one name at a time (add_optimizer_variables)

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False,
                 name="rmsprop", **kwargs):
        super().__init__(learning_rate, name, **kwargs)
        if not 0 <= momentum <= 1:
            raise ValueError(f"RMSprop: momentum must be in [0, 1], got {momentum}.")
        self.rho, self.momentum, self.epsilon = float(rho), float(momentum), float(epsilon)
        self.centered = bool(centered)
        self.slot_names = ("velocity",) + (("momentum",) if self.momentum > 0 else ()) + (
            ("average_gradient",) if self.centered else ())

    def _scalars(self, t):
        return rmsprop_scalars(self.rate, self.rho, self.momentum, self.epsilon)

    def update_buffer(self, dev, w, g, key):
        slots = dict(zip(self.slot_names, self._slot_buffers(key, dev, w)))
        dev.ops.rmsprop(w, g, slots["velocity"], slots.get("momentum"), slots.get("average_gradient"),
                        self.hyper[dev.name])

    def get_config(self):
        return dict(super().get_config(), rho=self.rho, momentum=self.momentum, epsilon=self.epsilon,
                    centered=self.centered)


class Adagrad(Optimizer):
    """Keras's Adagrad: ``acc += g**2; w -= lr * g / sqrt(acc + epsilon)``, the accumulator
    starting at ``initial_accumulator_value``."""

    slot_names = ("accumulator",)

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7, name="adagrad",
                 **kwargs):
        super().__init__(learning_rate, name, **kwargs)
        self.initial_accumulator_value, self.epsilon = float(initial_accumulator_value), float(epsilon)

    def initial_slot_value(self, name):
        return self.initial_accumulator_value

    def _scalars(self, t):
        return adagrad_scalars(self.rate, self.epsilon)

    def update_buffer(self, dev, w, g, key):
        (accumulator,) = self._slot_buffers(key, dev, w)
        dev.ops.adagrad(w, g, accumulator, self.hyper[dev.name])

    def get_config(self):
        return dict(super().get_config(), initial_accumulator_value=self.initial_accumulator_value,
                    epsilon=self.epsilon)


class AdamW(Adam):
    """Keras's AdamW: Adam with ``weight_decay`` (0.004 by default), applied as Keras 3's base
    optimizer applies it to any optimizer: ``w -= w * weight_decay * lr`` before Adam's update."""

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False, name="adamw", **kwargs):
        if weight_decay is None:
            raise ValueError("Argument `weight_decay` must be a float. Received: weight_decay=None")
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, name, weight_decay=weight_decay,
                         **kwargs)


optimizers.NAMES.update(rmsprop=RMSprop, adagrad=Adagrad, adamw=AdamW)
