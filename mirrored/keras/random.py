"""``keras.random``: Keras 3's random tensors, on the device (``kernels/random_fill.py``).

Keras 3's seeding rules (keras.io, "keras.random"):
    seed=None            the global generator: new numbers every call, repeatable after
                         ``keras.utils.set_random_seed`` / ``tf.random.set_seed``
    seed=<int>           stateless: the same numbers every call with the same seed
    seed=SeedGenerator   the generator's state advances: new numbers every call, the
                         sequence repeatable from the generator's own seed

The draws are mirrored.random's (counter-based, the same bits on the CPU and a GPU);
they are not TensorFlow's or JAX's numbers.
"""
import numpy as np

from mirrored import devices, ops
from mirrored import random as tf_random
from mirrored.tensor import as_dtype


class SeedGenerator:
    """A random stream of its own (``keras.random.SeedGenerator(seed=None)``): its state lives
    on the device where it first draws, one state per device."""

    def __init__(self, seed=None, name=None, **kwargs):
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0])
        self.seed = int(seed)
        self.name = name or "seed_generator"
        self._states = {}                 # id(device) -> (device, state buffer)

    def state_on(self, dev):
        entry = self._states.get(id(dev))
        if entry is None or entry[0] is not dev:
            entry = self._states[id(dev)] = (dev, tf_random.new_state(dev, self.seed))
        return entry[1]

    def get_config(self):
        return {"seed": self.seed, "name": self.name}


def _tensor(dist, shape, dtype, seed):
    dev = devices.current_device()
    if isinstance(seed, SeedGenerator):
        state = seed.state_on(dev)
    elif seed is None:
        return tf_random.normal(shape, dtype=dtype) if dist == "normal" else tf_random.uniform(shape, dtype=dtype)
    else:
        state = tf_random.new_state(dev, int(seed))        # stateless: the same numbers each call
    return tf_random.draw(dist, shape, dtype, dev, state)


def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    """Normal draws (``keras.random.normal``)."""
    z = _tensor("normal", shape, as_dtype(dtype or np.float32), seed)
    return z * stddev + mean if (stddev != 1.0 or mean != 0.0) else z


def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    """Uniform draws in [minval, maxval) (``keras.random.uniform``; float dtypes)."""
    dtype = as_dtype(dtype or np.float32)
    if dtype.kind != "f":
        raise ValueError(f"keras.random.uniform takes a float dtype, got {dtype}; use "
                         f"keras.random.randint for integers (not implemented here).")
    u = _tensor("uniform", shape, dtype, seed)
    return u * (maxval - minval) + minval if (minval != 0.0 or maxval != 1.0) else u


def dropout(inputs, rate, noise_shape=None, seed=None):
    """Inverted dropout of a tensor (``keras.random.dropout``): kept / (1 - rate), else 0."""
    if noise_shape is not None:
        raise NotImplementedError("keras.random.dropout: noise_shape is not implemented.")
    x = ops.as_tensor(inputs)
    keep = ops.greater_equal(uniform(x.shape, seed=seed, dtype=x.dtype), rate)
    return ops.where(keep, x / (1.0 - rate), ops.zeros_like(x))
