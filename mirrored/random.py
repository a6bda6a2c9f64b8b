"""``mirrored.random.set_seed``: one seed for weight initialisers and shuffles.

Keras draws initial weights from a global random state that
``tf.random.set_seed`` / ``tf.keras.utils.set_random_seed`` fix; here that state
is one NumPy ``Generator``. Weights are drawn once, on the host, and copied to
every replica, so the copies start bitwise equal whatever the seed.

Random *ops* (a dataset's ``shuffle``) get their seeds as TensorFlow's
``tf.random.get_seed`` gives them: with a global seed and no op seed, the op seed
is the number of such ops made since ``set_seed`` — so a program that builds the
same pipeline shuffles the same way in every run, while two shuffles in one run
still differ.
"""
import threading

import numpy as np

#: TensorFlow's global seed when only an op seed is given (``random_seed.DEFAULT_GRAPH_SEED``).
DEFAULT_GRAPH_SEED = 87654321

_generator = np.random.default_rng()
_global_seed = None
_ops_seeded = 0                  # random ops given a seed since set_seed
_lock = threading.Lock()         # pipelines may be built on several threads


def set_seed(seed):
    """Make initial weights and unseeded shuffles repeatable (``None``: unrepeatable again)."""
    global _generator, _global_seed, _ops_seeded
    with _lock:
        _generator = np.random.default_rng(seed)
        _global_seed = None if seed is None else int(seed)
        _ops_seeded = 0


def generator():
    return _generator


def get_seed(op_seed):
    """The seed words for a random op, as ``tf.random.get_seed``: a list of ints for
    ``np.random.default_rng``, or ``None`` (fresh entropy) when neither the global seed
    nor ``op_seed`` is set."""
    global _ops_seeded
    with _lock:
        if _global_seed is None and op_seed is None:
            return None
        global_seed = DEFAULT_GRAPH_SEED if _global_seed is None else _global_seed
        if op_seed is None:
            op_seed = _ops_seeded
            _ops_seeded += 1
        return [global_seed % 2**64, int(op_seed) % 2**64]
