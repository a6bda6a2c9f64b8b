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

Random *tensors* (``normal``, ``uniform``, below; ``keras.random``) are drawn on the device
by a counter-based generator (``kernels/random_fill.py``): each op's stream is seeded by the
same rule, and its counter lives on the device, so a replayed ``@tf.function`` draws new
numbers each call, as TensorFlow's stateful random ops do.
"""
import threading

import numpy as np

from kernels import random_fill
from mirrored import devices, ops, tensor
from mirrored.program import recording
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
        _streams.clear()                 # random tensors start their streams again


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


# --- random ---------------------------------------------------------------------------------

_streams = {}                     # (id of device, op seed or None) -> (device, its state buffer)


def _stream(dev, seed):
    """The random state (2,) uint64 on ``dev`` that an op with op seed ``seed`` draws from:
    one stream per op seed (and one for ops without one), keyed by TensorFlow's seed rule
    (``get_seed``) when first used after ``set_seed``, made once (never replayed), advanced
    on the device by every draw."""
    key = (id(dev), None if seed is None else int(seed))
    with _lock:
        entry = _streams.get(key)
    if entry is None or entry[0] is not dev:
        words = get_seed(seed)
        if words is None:
            words = [int(w) for w in np.random.SeedSequence().generate_state(2)]
        with recording.initialization(), dev.activate():
            state = dev.from_numpy(random_fill.state_init((words[0] * 1000003 + words[1]) % 2**64))
        entry = (dev, state)
        with _lock:
            _streams[key] = entry
    return entry[1]


def _draw(dist, shape, dtype, seed):
    dev = devices.current_device()
    return draw(dist, shape, dtype, dev, _stream(dev, seed))


def new_state(dev, seed):
    """A fresh random state on ``dev`` for an integer ``seed`` (``keras.random``'s seeds)."""
    with recording.initialization(), dev.activate():
        return dev.from_numpy(random_fill.state_init(int(seed) % 2**64))


def draw(dist, shape, dtype, dev, state):
    """``shape`` draws of ``dist`` ("uniform" in [0, 1), "normal") on ``dev`` from ``state``,
    which then advances (on the device: a replay draws the next numbers)."""
    shape = tuple(int(n) for n in shape)
    out = ops.empty(dev, shape, np.float32)
    if out.buf.size:
        with dev.activate():
            dev.ops.random_fill(dist, ops.flat(out), state)
            dev.ops.random_advance(state, out.buf.size)
    return out if tensor.as_dtype(dtype) == np.float32 else ops.cast(out, dtype)


def normal(shape, mean=0.0, stddev=1.0, dtype=np.float32, seed=None, name=None):
    """``tf.random.normal``: counter-based draws (``kernels/random_fill.py``), repeatable under
    ``tf.random.set_seed``; a replayed ``@tf.function`` draws new numbers each call."""
    z = _draw("normal", shape, dtype, seed)
    return z * stddev + mean if (stddev != 1.0 or mean != 0.0) else z


def uniform(shape, minval=0, maxval=None, dtype=np.float32, seed=None, name=None):
    dtype = tensor.as_dtype(dtype)
    if dtype.kind != "f":
        if maxval is None:
            raise ValueError("random.uniform with an integer dtype needs maxval.")
        u = _draw("uniform", shape, np.float32, seed)
        return ops.cast(ops.floor(u * float(maxval - minval)) + float(minval), dtype)
    hi = 1.0 if maxval is None else maxval
    u = _draw("uniform", shape, dtype, seed)
    return u * (hi - minval) + minval if (minval != 0 or hi != 1.0) else u
