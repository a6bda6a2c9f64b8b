"""Random tensors: ``tf.random.uniform``, ``tf.random.normal``, ``keras.random``.

Counter-based, like Dropout's masks (``kernels/dropout.py``, whose ``mix64`` is the one
generator of the library): element ``i`` of a draw is a pure function of
(key, offset + i), so a GPU thread computes its element alone, the CPU computes the same
bits, and a replayed graph draws new numbers because the offset lives in device memory:

    state = [key, offset]        (2,) uint64, one per random stream (a seed, a generator)
    random_fill(dist, out, state)     out[i] = draw(dist, key, offset + i)
    random_advance(state, n)          offset += n   (one thread; after the fill)

Draws: ``z = mix64(key ^ mix64((offset + i + 1) * GOLDEN))``.
    uniform  u = (z >> 40) * 2**-24: one of the 2**24 float32 values k / 2**24 in [0, 1)
    normal   Box-Muller on two uniforms from z and mix64(z): sqrt(-2 log u1) cos(2 pi u2),
             u1 in (0, 1] so the log is finite.
Scaling (``minval``/``maxval``, ``mean``/``stddev``) is done by the caller's elementwise
ops. These are not TensorFlow's numbers (its Philox streams are not ours): the same seed
gives the same numbers here on every backend and every run, as TF promises for its own.

Layout: NumPy references ``draw_ref``, ``random_fill_ref``, ``random_advance_ref``,
``state_init``; kernels and launchers follow.
"""
import numpy as np

from kernels.dropout import GOLDEN, mix64

DISTRIBUTIONS = ("uniform", "normal")
KEY, OFFSET = 0, 1
STATE_SIZE = 2
_ONE = np.uint64(1)
_SHIFT = np.uint64(40)
_INV24 = np.float32(2.0 ** -24)
_TWO_PI = np.float32(2 * np.pi)


def state_init(seed):
    """A stream's state (host, (2,) uint64) for an integer ``seed``: key = mix64 of it."""
    key = mix64(np.array([GOLDEN]) ^ np.array([int(seed) % 2**64], np.uint64))
    return np.array([key[0], 0], np.uint64)


def draw_ref(dist, key, counters):
    """float32 draws for uint64 ``counters`` under ``key`` (the kernel's per-thread math)."""
    with np.errstate(over="ignore"):
        z = mix64(np.uint64(key) ^ mix64((counters + _ONE) * GOLDEN))
        u1 = (z >> _SHIFT).astype(np.float32) * _INV24                  # [0, 1)
        if dist == "uniform":
            return u1
        u2 = (mix64(z) >> _SHIFT).astype(np.float32) * _INV24
        radius = np.sqrt(np.float32(-2.0) * np.log(np.float32(1.0) - u1))   # 1 - u1 in (0, 1]
        return (radius * np.cos(_TWO_PI * u2)).astype(np.float32)


def random_fill_ref(dist, out, state):
    """out (float32, any shape) <- draws at counters offset .. offset + size - 1."""
    counters = state[OFFSET] + np.arange(out.size, dtype=np.uint64)
    out.reshape(-1)[...] = draw_ref(dist, state[KEY], counters)
    return out


def random_advance_ref(state, n):
    """state's offset += n (in place)."""
    state[OFFSET:OFFSET + 1] = state[OFFSET:OFFSET + 1] + np.uint64(n)
    return state
