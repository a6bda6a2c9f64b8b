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
``state_init``; kernels (``random_uniform_kernel``, ``random_normal_kernel``: one thread
per element, grid-stride; ``random_advance_kernel``: one thread) and launchers
(``random_fill``, ``random_advance``) follow.

Bits. The hash and the uniform draws are integer work and one exact conversion: the
kernel's bits equal the reference's. The normal draws go through float32 log, sqrt and cos:
libdevice's (GPU) and NumPy's may differ in the last bit or two, so the backends agree to
a few ulps there. (The simulator runs Python's math in float64, rounded when stored: the
tests compare normals within NORMAL_ULPS.)
"""
import math

import numpy as np
from numba import cuda, float32, uint64

from kernels.dropout import GOLDEN, launch_hash, mix64, mix64_device
from kernels.launch import check_array, flat, grid_1d
from kernels.registry import register, sig, vec

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


#: Most ulps a float32 normal draw of the kernel may differ from the reference's
#: (log, sqrt, cos rounded by two libraries; checked in the simulator).
NORMAL_ULPS = 2


# --- kernels ------------------------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def _bits(key, counter):
    """The 64 random bits of one counter: ``draw_ref``'s z."""
    return mix64_device(key ^ mix64_device((counter + _ONE) * GOLDEN))


@cuda.jit
def random_uniform_kernel(out, state):
    """One thread per element i (grid-stride): out[i] = uniform draw at counter
    state[OFFSET] + i under state[KEY] (every thread reads the same two words)."""
    key, offset = state[KEY], state[OFFSET]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = float32(_bits(key, offset + uint64(i)) >> _SHIFT) * _INV24


@cuda.jit
def random_normal_kernel(out, state):
    """One thread per element i (grid-stride): Box-Muller on the two uniforms of counter
    state[OFFSET] + i: sqrt(-2 log(1 - u1)) cos(2 pi u2), in float32."""
    key, offset = state[KEY], state[OFFSET]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        z = _bits(key, offset + uint64(i))
        u1 = float32(z >> _SHIFT) * _INV24
        u2 = float32(mix64_device(z) >> _SHIFT) * _INV24
        radius = math.sqrt(float32(-2.0) * math.log(float32(1.0) - u1))
        out[i] = radius * math.cos(_TWO_PI * u2)


@cuda.jit
def random_advance_kernel(state, n):
    """One thread (a grid of one block of one): state[OFFSET] += n, on the device, so a
    replayed CUDA graph draws new numbers each time."""
    if cuda.grid(1) == 0:
        state[OFFSET] += n


#: random_advance_kernel runs on one thread: one word is read and written.
ADVANCE_BLOCK = 1
_BLOCK = grid_1d(1)[1]
register(random_uniform_kernel, "random_uniform_kernel", sig(vec("float32"), vec("uint64")), block=_BLOCK)
register(random_normal_kernel, "random_normal_kernel", sig(vec("float32"), vec("uint64")), block=_BLOCK)
register(random_advance_kernel, "random_advance_kernel", sig(vec("uint64"), "uint64"), block=ADVANCE_BLOCK)
_KERNELS = {"uniform": random_uniform_kernel, "normal": random_normal_kernel}


# --- launchers ------------------------------------------------------------------------------------

def _check_state(what, state):
    check_array(f"{what}: state", state, np.uint64, shape=(STATE_SIZE,))


def random_fill(dist, out, state, stream=None):
    """out (float32, any shape, C-contiguous) <- draws of ``dist`` ("uniform" in [0, 1),
    "normal") at counters state[OFFSET] .. + out.size - 1 (``random_fill_ref``). Does not
    advance the state: ``random_advance(state, out.size)`` next, on the same stream."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTRIBUTIONS}.")
    check_array(f"random_fill({dist}): out", out, np.float32)
    _check_state(f"random_fill({dist})", state)
    if out.size:
        launch_hash(_KERNELS[dist], *grid_1d(out.size), stream, flat(out), state)
    return out


def random_advance(state, n, stream=None):
    """state[OFFSET] += n on the device (one thread); n >= 0 (``random_advance_ref``)."""
    _check_state("random_advance", state)
    if int(n) < 0:
        raise ValueError(f"random_advance: n must be >= 0 (counters only move forward), got {n}.")
    launch_hash(random_advance_kernel, ADVANCE_BLOCK, ADVANCE_BLOCK, stream, state, np.uint64(n))
    return state
