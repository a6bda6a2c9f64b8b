"""Dropout as Keras computes it (inverted dropout), with a counter-based random mask.

In training each unit is kept with probability 1 - rate and kept units are scaled by
1 / (1 - rate), so the layer's expected output equals its input and evaluate/predict
use the identity (the layer does not launch anything there):

    out[i] = x[i] * scale   if keep(key, i)   else 0,      scale = float32(1 / (1 - rate))

The mask: a counter-based generator. There is no random state to carry between steps,
replicas or devices: unit i's random bits are a hash of a key and of i,

    key  = dropout_key(seed, step, replica)        one uint64 per launch, on the host
    bits = mix64(key + (i + 1) * GOLDEN)           64 bits for unit i (splitmix64)
    keep = (bits >> 40) >= threshold               the top 24 bits against an integer

``mix64`` is splitmix64's finaliser (Steele, Lea, Flood 2014: the output function of
Java's SplittableRandom): xor-shifts and multiplications by odd constants, uint64
arithmetic that wraps. Every operation is an integer one that NumPy and Numba CUDA
define identically, so the mask is the same bits on the CPU (``dropout_ref``) and the
GPU for the same counters: the same Python function is the NumPy code and, compiled as
an inline device function, the kernel's code (tests/test_kernels_dropout.py checks the
bits). ``threshold = ceil(rate * 2^24)``: with u = (bits >> 40) / 2^24, uniform in
[0, 1) with 24-bit resolution, keep <=> u >= rate, TensorFlow's rule for ``nn.dropout``,
compared exactly in integers.

The key makes the mask reproducible (same seed, step, replica: same mask, so
``mirrored.random.set_seed`` repeats a run) and different on every replica and step
(each replica drops different units of its own slice of the batch, as in TensorFlow).
Two Dropout layers in one model pass different seeds (Keras gives each layer its own).

Backward recomputes the mask instead of storing it: dx = dy * scale where kept, else 0
is the very same kernel applied to dy with the same key. The hash is a handful of
integer instructions per element in a memory-bound kernel, so recomputing is free,
while a stored mask would cost a buffer per batch size and an extra write and read.

A dropped unit is 0 even when x is NaN or inf (a select, as ``np.where``, not a
multiplication by a 0/1 mask).

The counter on the device (for CUDA graphs). A graph replays its launches with the
arguments it captured, so a key passed from the host would freeze the first step's mask
into every replay. The Keras layer therefore keeps each replica's counter in device
memory, one (3,) uint64 array ``counter = [seed part, step, key]``, and two launches
per training forward read and advance it there:

    dropout_next_key(counter, replica)   one thread: counter[KEY] = dropout_key(seed,
                                         counter[STEP], replica); counter[STEP] += 1
    dropout_keyed(x, out, rate, counter) v2: v1 with the key read from counter[KEY]

``counter[SEED] = mix64(GOLDEN ^ seed)`` is dropout_key's first link, so the key is
dropout_key(seed, step, replica) bit for bit: the masks of a replayed graph are the
eager ones for the same counters (tests/test_dropout_layer.py, tests/test_graphs.py).

Versions. v1: one thread per element, grid-stride over the flattened array, the key a
launch argument. v2: the same, the key read from the device counter.

Neighbours: kernels/launch.py; the Keras layer Dropout (mirrored/keras/layers.py) calls
``dropout_next_key`` then ``dropout_keyed`` (GPU), or their references
``next_key_ref`` / ``dropout_ref`` (CPU), through mirrored/backends.py.
``python -m pytest -q tests/test_kernels_dropout.py tests/test_dropout_layer.py``
"""
import warnings

import numpy as np
from numba import cuda, float32, uint64

from kernels.launch import SIMULATOR, check_array, check_out, flat, grid_1d, launch
from kernels.registry import register, sig, vec

#: splitmix64's constants (Steele et al. 2014): the golden-ratio increment between
#: counters, the two odd multipliers and the three shifts of the finaliser. np.uint64
#: values, so that NumPy and Numba both do unsigned 64-bit arithmetic with them (a
#: Python int would make Numba mix signed and unsigned integers and fall back to float64).
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONE = np.uint64(1)
#: The mask compares the top KEEP_BITS of the 64: 24 bits, so that u = top / 2^24 is
#: exactly a float32 (TensorFlow draws float32 uniforms for its mask too).
KEEP_BITS = 24
_SHIFT = np.uint64(64 - KEEP_BITS)


# --- the generator: one definition for NumPy and the kernel -------------------------------

def mix64(z):
    """splitmix64's finaliser: a bijection of uint64 that scrambles every input bit into
    every output bit. ``z``: a np.uint64 or a uint64 array (NumPy) or uint64 (kernel)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _make_keep_unit(mix):
    """``keep_unit`` built on ``mix``: the NumPy function on ``mix64``, the kernel's on
    the device-compiled ``mix64`` (a device function can only call device functions)."""
    def keep_unit(key, index, threshold):
        """True where unit ``index`` (uint64) is kept under ``key`` and ``threshold``."""
        return (mix(key + (index + _ONE) * GOLDEN) >> _SHIFT) >= threshold
    return keep_unit


keep_unit = _make_keep_unit(mix64)
#: The same two functions compiled for the kernel (inline: see kernels/registry.py).
_mix64_device = cuda.jit(device=True, inline="always")(mix64)
_keep_unit_device = cuda.jit(device=True, inline="always")(_make_keep_unit(_mix64_device))
#: The device-compiled ``mix64`` for other kernels built on the same generator
#: (kernels/random_fill.py): one compiled copy of the hash in the library.
mix64_device = _mix64_device


def dropout_key(seed, step, replica):
    """The uint64 key of one launch: ``mix64`` chained over (seed, step, replica), so any
    change of one of them gives an unrelated mask. Integers >= 0 (taken mod 2^64)."""
    key = np.array([GOLDEN])               # 1-element arrays: uint64 wraps without warnings
    for part in (seed, step, replica):     # (mix64(0) == 0: hence the GOLDEN start)
        part = int(part)
        if part < 0:
            raise ValueError(f"dropout_key: seed, step and replica must be >= 0, got "
                             f"{(seed, step, replica)}.")
        key = mix64(key ^ np.array([part % 2**64], np.uint64))
    return key[0]


def check_rate(rate, what="dropout"):
    """``rate`` as a float in [0, 1), or a ValueError naming ``what``."""
    try:
        rate = float(rate)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: rate must be a number in [0, 1), got {rate!r}.") from None
    if not 0.0 <= rate < 1.0:                # also refuses NaN
        raise ValueError(f"{what}: rate must be in [0, 1) (the fraction of units to drop), "
                         f"got {rate}; rate=1 would drop everything and divide by zero.")
    return rate


def threshold_and_scale(rate, dtype=np.float32):
    """(threshold as np.uint64, scale in ``dtype``) for a checked ``rate``."""
    rate = check_rate(rate)
    threshold = np.uint64(int(np.ceil(rate * 2**KEEP_BITS)))
    return threshold, np.dtype(dtype).type(1.0 / (1.0 - rate))


#: The device counter's layout: one (COUNTER_SIZE,) uint64 array per replica.
SEED, STEP, KEY = 0, 1, 2
COUNTER_SIZE = 3


def counter_init(seed, step=0):
    """A counter (host NumPy, (3,) uint64) that draws dropout_key(seed, step, r) next."""
    for what, value in (("seed", seed), ("step", step)):
        if int(value) < 0:
            raise ValueError(f"dropout counter: {what} must be >= 0, got {value}.")
    counter = np.zeros(COUNTER_SIZE, np.uint64)
    counter[SEED:SEED + 1] = mix64(np.array([GOLDEN]) ^ np.array([int(seed) % 2**64], np.uint64))
    counter[STEP] = int(step) % 2**64
    return counter


# --- NumPy reference -----------------------------------------------------------------------

def next_key_ref(counter, replica):
    """``dropout_next_key`` on a host counter, in place: the key of this step, then step + 1.
    (1-element slices, not scalars: NumPy arrays wrap modulo 2^64 without warnings.)"""
    step = counter[STEP:STEP + 1].copy()
    counter[KEY:KEY + 1] = mix64(mix64(counter[SEED:SEED + 1] ^ step) ^ np.uint64(int(replica) % 2**64))
    counter[STEP:STEP + 1] = step + _ONE
    return counter


def dropout_mask_ref(key, size, rate):
    """The keep mask (size,) bool of units 0 .. size-1 under ``key``."""
    threshold, _ = threshold_and_scale(rate)
    return keep_unit(np.uint64(key), np.arange(size, dtype=np.uint64), threshold)


def dropout_ref(x, key, rate):
    """Training-mode dropout of x (any shape, any float dtype): x * scale where kept, else 0.
    The backward is the same call on dy with the same key."""
    _, scale = threshold_and_scale(rate, x.dtype)
    keep = dropout_mask_ref(key, x.size, rate).reshape(x.shape)
    return np.where(keep, x * scale, x.dtype.type(0))


# --- kernel --------------------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def _apply_mask(x, out, key, threshold, scale):
    """The loop both kernels run: this thread's elements, grid-stride."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        if _keep_unit_device(key, uint64(i), threshold):
            out[i] = x[i] * scale
        else:
            out[i] = float32(0.0)


@cuda.jit
def dropout_v1(x, out, key, threshold, scale):
    """One thread per element i of the flattened arrays (grid-stride).
    Loop nest: for i in range(size):
                   out[i] = x[i] * scale if keep_unit(key, i, threshold) else 0
    """
    _apply_mask(x, out, key, threshold, scale)


@cuda.jit
def dropout_v2(x, out, counter, threshold, scale):
    """v1 with the key read from the device counter (``counter[KEY]``, written by
    ``next_key_v1`` earlier on the same stream): every thread reads the same word."""
    _apply_mask(x, out, counter[KEY], threshold, scale)


@cuda.jit
def next_key_v1(counter, replica):
    """One thread (the grid is one block of one): counter[KEY] = dropout_key(seed,
    counter[STEP], replica), then counter[STEP] += 1 (see ``next_key_ref``)."""
    if cuda.grid(1) == 0:
        step = counter[STEP]
        counter[KEY] = _mix64_device(_mix64_device(counter[SEED] ^ step) ^ replica)
        counter[STEP] = step + _ONE


#: next_key_v1 runs on one thread: the counter is one word, read and written once.
NEXT_KEY_BLOCK = 1

# What the real compiler checks (kernels/registry.py): float32 vectors, uint64 key and
# threshold, float32 scale.
register(dropout_v1, "dropout_v1", sig(vec("float32"), vec("float32"), "uint64", "uint64",
                                       "float32"), block=grid_1d(1)[1])
register(dropout_v2, "dropout_v2", sig(vec("float32"), vec("float32"), vec("uint64"), "uint64",
                                       "float32"), block=grid_1d(1)[1])
register(next_key_v1, "dropout_next_key_v1", sig(vec("uint64"), "uint64"), block=NEXT_KEY_BLOCK)


# --- launcher --------------------------------------------------------------------------------

def dropout(x, out, rate, key, stream=None):
    """Training-mode dropout on the GPU: out = x * 1/(1-rate) where kept, else 0.

    x, out: float32, the same shape, C-contiguous; ``out`` may be ``x`` (each element is
    read, then written, by one thread) but must not partly overlap it. ``key``:
    ``dropout_key(seed, step, replica)``. The backward: ``dropout(dy, dx, rate, key)``
    with the forward's key. ``rate`` in [0, 1), checked before the launch.
    """
    threshold, scale = _checked("dropout", x, out, rate)
    if out.size:
        launch_hash(dropout_v1, *grid_1d(out.size), stream, flat(x), flat(out), np.uint64(key),
                threshold, scale)
    return out


def dropout_keyed(x, out, rate, counter, stream=None):
    """``dropout`` with the key in device memory: ``counter[KEY]``, as ``dropout_next_key``
    last wrote it (a CUDA graph replays this launch unchanged, and still draws each step's
    mask). The backward: the same call on (dy, dx) with the same counter."""
    threshold, scale = _checked("dropout_keyed", x, out, rate)
    _check_counter("dropout_keyed", counter)
    if out.size:
        launch_hash(dropout_v2, *grid_1d(out.size), stream, flat(x), flat(out), counter, threshold, scale)
    return out


def dropout_next_key(counter, replica, stream=None):
    """On the device: the key of this step into ``counter[KEY]``, then ``counter[STEP] += 1``
    (one thread). ``replica``: the replica's id among all replicas, >= 0."""
    _check_counter("dropout_next_key", counter)
    if int(replica) < 0:
        raise ValueError(f"dropout_next_key: replica must be >= 0, got {replica}.")
    launch_hash(next_key_v1, NEXT_KEY_BLOCK, NEXT_KEY_BLOCK, stream, counter, np.uint64(replica))
    return counter


def _checked(what, x, out, rate):
    threshold, scale = threshold_and_scale(rate)
    check_array(f"{what}: x", x, np.float32)
    check_array(f"{what}: out", out, np.float32, shape=x.shape)
    check_out(what, out, same_ok=(x,), others=())
    return threshold, scale


def _check_counter(what, counter):
    check_array(f"{what}: counter", counter, np.uint64, shape=(COUNTER_SIZE,))


def launch_hash(*args):
    """``launch`` for a kernel built on ``mix64`` (Dropout's masks, random tensors:
    kernels/random_fill.py)."""
    if not SIMULATOR:
        launch(*args)
        return
    # The simulator runs the kernel's uint64 arithmetic on NumPy scalars, which warn about
    # the wrap-around modulo 2^64 that the hash is built on (and a GPU does silently).
    # Its launches are synchronous, so the filter covers exactly this kernel's run.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="overflow encountered in scalar",
                                category=RuntimeWarning)
        launch(*args)
