"""Keras's weight initialisers, by name: a layer's ``kernel_initializer=`` / ``bias_initializer=``.

    layers.Dense(64, kernel_initializer="glorot_uniform", bias_initializer="zeros")   # Keras's defaults

Each initialiser is ``fn(shape, rng=None) -> float32 array``, drawn from ``mirrored.random``'s
generator (``mirrored.random.set_seed`` repeats a run). A layer also takes any such callable.

Neighbours: ``layers.py`` (Dense and Conv2D build their weights with these),
``saving.py`` (a .keras archive names them in Keras's config format: ``config``).
"""
import math

import numpy as np

from mirrored import random as _random


def fans(shape):
    """(fan_in, fan_out) of a kernel, Keras's rule: a Dense kernel (in, out) has fans
    (in, out); a conv kernel (KH, KW, Cin, Cout) has (KH*KW*Cin, KH*KW*Cout), the
    receptive field times the channels (each output sums KH*KW*Cin inputs)."""
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[:-2], dtype=np.int64))    # KH * KW
    return receptive * shape[-2], receptive * shape[-1]


def glorot_uniform(shape, rng=None):
    """Keras's default kernel initialiser: U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    rng = rng or _random.generator()
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)    # (in, out) or (KH, KW, Cin, Cout)


def he_uniform(shape, rng=None):
    """U(-limit, limit), limit = sqrt(6 / fan_in) (Keras's he_uniform)."""
    limit = math.sqrt(6.0 / fans(shape)[0])
    return (rng or _random.generator()).uniform(-limit, limit, size=shape).astype(np.float32)


def random_normal(shape, rng=None):
    """N(0, 0.05**2), Keras's ``RandomNormal()`` defaults (``add_weight(initializer="random_normal")``)."""
    return (rng or _random.generator()).normal(0.0, 0.05, size=shape).astype(np.float32)


def random_uniform(shape, rng=None):
    """U(-0.05, 0.05), Keras's ``RandomUniform()`` defaults."""
    return (rng or _random.generator()).uniform(-0.05, 0.05, size=shape).astype(np.float32)


INITIALIZERS = {
    "glorot_uniform": glorot_uniform,
    "zeros": lambda shape, rng=None: np.zeros(shape, np.float32),
    "ones": lambda shape, rng=None: np.ones(shape, np.float32),
    "he_uniform": he_uniform,
    "random_normal": random_normal,
    "random_uniform": random_uniform,
}


def get(spec, what):
    """The initialiser named ``spec`` (a key of ``INITIALIZERS``), or ``spec`` itself if it
    is a callable; ``what`` names the argument in the error."""
    if callable(spec) and not isinstance(spec, str):
        return spec
    if spec not in INITIALIZERS:
        raise ValueError(f"{what}: unknown initializer {spec!r}; available: {sorted(INITIALIZERS)}.")
    return INITIALIZERS[spec]


def config(fn):
    """Keras's config of initialiser ``fn`` (``{"class_name": "GlorotUniform", ...}``), or
    None for a custom callable (the weights in the file are what count)."""
    for name, f in INITIALIZERS.items():
        if f is fn:
            return {"module": "keras.initializers", "class_name": "".join(p.title() for p in name.split("_")),
                    "config": {} if name in ("zeros", "ones") else {"seed": None}, "registered_name": None}
    return None
