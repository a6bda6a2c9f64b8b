"""``mirrored.random.set_seed``: one seed for weight initialisers and shuffles.

Keras draws initial weights from a global random state that
``tf.random.set_seed`` / ``tf.keras.utils.set_random_seed`` fix; here that state
is one NumPy ``Generator``. Weights are drawn once, on the host, and copied to
every replica, so the copies start bitwise equal whatever the seed.
"""
import numpy as np

_generator = np.random.default_rng()


def set_seed(seed):
    """Make initial weights (and unseeded shuffles) repeatable."""
    global _generator
    _generator = np.random.default_rng(seed)


def generator():
    return _generator
