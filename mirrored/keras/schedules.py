"""``keras.optimizers.schedules``: a learning rate that is a function of the step count.

Passed as an optimizer's ``learning_rate``, a schedule is called with the number of updates
already applied (Keras's ``optimizer.iterations``) when the next update's host part is made
(``OptimizerState.rate_at``), on the host in float64, and the result rounded once to float32
in the per-step vector every device reads: under ``fit``, a CUDA graph's replay or a
``@function``'s (whose host part, ``begin_step``, is called again each time) the rate
advances with the step. ``optimizer.learning_rate`` reads the value at ``iterations``.

Keras 3's formulas (``keras/src/optimizers/schedules/learning_rate_schedule.py``)::

    ExponentialDecay        lr0 * decay_rate ** (step / decay_steps)   (staircase: floor of it)
    PiecewiseConstantDecay  values[0] while step <= boundaries[0], values[i] while
                            boundaries[i-1] < step <= boundaries[i], values[-1] after the last
    CosineDecay             no warm-up: s = min(step, decay_steps);
                              lr0 * ((1 - alpha) * 0.5 * (1 + cos(pi * s / decay_steps)) + alpha)
                            warm-up (warmup_target set): s = min(step, decay_steps + warmup_steps);
                              s < warmup_steps: lr0 + (target - lr0) * s / warmup_steps
                              else: the decay above from ``target``, at s - warmup_steps

``serialize`` / ``deserialize`` write and read Keras 3's config of one (a .keras file's
``compile_config``). Neighbours: ``optimizer_state.py`` (which calls them), ``saving.py``.
"""
import math

__all__ = ["LearningRateSchedule", "ExponentialDecay", "PiecewiseConstantDecay", "CosineDecay",
           "serialize", "deserialize"]


class LearningRateSchedule:
    """The base class: a subclass defines ``__call__(step)`` (a number) and ``get_config``."""

    def __call__(self, step):
        raise NotImplementedError(f"Learning rate schedule '{type(self).__name__}' must override "
                                  f"`__call__(self, step)`.")

    def get_config(self):
        raise NotImplementedError(f"Learning rate schedule '{type(self).__name__}' must override "
                                  f"`get_config()` in order to be serializable.")

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _positive_steps(what, decay_steps):
    if not decay_steps > 0:
        raise ValueError(f"{what}: Argument `decay_steps` must be > 0. Received: decay_steps={decay_steps}")


class ExponentialDecay(LearningRateSchedule):
    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False,
                 name="ExponentialDecay"):
        _positive_steps("ExponentialDecay", decay_steps)
        self.initial_learning_rate, self.decay_steps = initial_learning_rate, decay_steps
        self.decay_rate, self.staircase, self.name = decay_rate, staircase, name

    def __call__(self, step):
        p = float(step) / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate * self.decay_rate ** p

    def get_config(self):
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase, "name": self.name}


class PiecewiseConstantDecay(LearningRateSchedule):
    def __init__(self, boundaries, values, name="PiecewiseConstant"):
        if len(boundaries) != len(values) - 1:
            raise ValueError(f"The length of boundaries should be 1 less than the length of values. "
                             f"Received: boundaries={boundaries} of length {len(boundaries)}, and "
                             f"values={values} of length {len(values)}.")
        self.boundaries, self.values, self.name = list(boundaries), list(values), name

    def __call__(self, step):
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return value
        return self.values[-1]

    def get_config(self):
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class CosineDecay(LearningRateSchedule):
    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0, name="CosineDecay",
                 warmup_target=None, warmup_steps=0):
        _positive_steps("CosineDecay", decay_steps)
        self.initial_learning_rate, self.decay_steps, self.alpha = initial_learning_rate, decay_steps, alpha
        self.name, self.warmup_target, self.warmup_steps = name, warmup_target, warmup_steps

    def _decay(self, step, decay_from):
        cosine = 0.5 * (1.0 + math.cos(math.pi * step / self.decay_steps))
        return decay_from * ((1 - self.alpha) * cosine + self.alpha)

    def __call__(self, step):
        step = float(step)
        if self.warmup_target is None:
            return self._decay(min(step, self.decay_steps), self.initial_learning_rate)
        step = min(step, self.decay_steps + self.warmup_steps)
        if step < self.warmup_steps:
            delta = self.warmup_target - self.initial_learning_rate
            return delta * (step / self.warmup_steps) + self.initial_learning_rate
        return self._decay(step - self.warmup_steps, self.warmup_target)

    def get_config(self):
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "alpha": self.alpha, "name": self.name, "warmup_target": self.warmup_target,
                "warmup_steps": self.warmup_steps}


_CLASSES = {c.__name__: c for c in (ExponentialDecay, PiecewiseConstantDecay, CosineDecay)}


def serialize(schedule):
    """Keras 3's serialized form of a schedule (``keras.optimizers.schedules.serialize``)."""
    return {"module": "keras.optimizers.schedules", "class_name": type(schedule).__name__,
            "config": schedule.get_config(), "registered_name": None}


def deserialize(config, custom_objects=None):
    """A schedule from ``serialize``'s form; ``custom_objects`` {name: class} for your own."""
    classes = dict(_CLASSES, **(custom_objects or {}))
    name = config.get("class_name") if isinstance(config, dict) else None
    if name not in classes:
        raise ValueError(f"Unknown learning rate schedule {name!r} in {config!r}; known: {sorted(classes)} "
                         f"(pass your own class in custom_objects).")
    return classes[name].from_config(config["config"])
