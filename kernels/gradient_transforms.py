"""What Keras 3's base optimizer does before every update: clip the gradients, decay the weights.

Keras (``keras/src/optimizers/base_optimizer.py``, ``_backend_apply_gradients``) first clips
the gradients (at most one of the three options may be set), then decays the weights, then
runs the optimizer's own update (``kernels/optimizers.py``, ``optimizers_more.py``)::

    clipnorm c          each variable's gradient:  g = g * c / max(||g||, c)     (||g|| of 0 is 0)
    global_clipnorm c   every gradient at once:    n = sqrt(sum over all variables of ||g||**2)
                                                   g = g * (c * min(1/n, 1/c) + (n - n))
                                                   (n - n: NaN when n is inf or NaN, as Keras's)
    clipvalue c         g = clip(g, -c, c)
    weight_decay wd     w = w - w * wd * lr        (lr: this step's learning rate)

Here they run on the packed buffers after the all-reduce, the same launches on every replica,
so the copies stay bitwise equal. A packed gradient buffer holds every variable one after
another: ``starts`` (nseg + 1,) int64 says where each begins (the last entry is the size), so
the norms of clipnorm and global_clipnorm are ONE reduction launch over the buffer.

Versions: v1 only.
  * ``decay_kernel``, ``clip_value_kernel``: one thread per element, grid-stride.
  * ``segment_sum_squares_kernel``: one block per segment (grid-stride over segments); each
    thread adds its strided share privately, then a shared-memory tree (log2 CLIP_THREADS
    halvings): sq[s] = sum of g[i]**2 over the segment.
  * ``clip_norm_kernel``: one block per segment again, scaling its elements by the factor
    read from ``sq`` (its own segment's, or, for global_clipnorm, the sum of all of them,
    added by every thread in the same order).

The scalars are a tail of the optimizer's per-step vector in DEVICE memory, at offset ``at``:
[lr, weight_decay, clip] (``transform_scalars``), so a schedule's learning rate reaches
the weight decay of a replayed CUDA graph as it reaches the update.
"""
import math

import numpy as np
from numba import cuda, float32

from kernels.launch import SIMULATOR, check_array, flat, grid_1d, launch
from kernels.registry import register, sig, vec

#: Offsets inside the tail of the per-step vector.
T_LR, T_WEIGHT_DECAY, T_CLIP = 0, 1, 2
TRANSFORM_SIZE = 3

#: Threads per block of the two per-segment kernels: a power of two (the tree halves it)
#: and a multiple of the warp. (Fewer in the simulator: one Python thread per CUDA thread.)
CLIP_THREADS = 32 if SIMULATOR else 256
#: At most this many blocks (segments are visited grid-stride beyond it).
MAX_SEGMENT_BLOCKS = 4096


def transform_scalars(lr, weight_decay=None, clip=None, dtype=np.float32):
    """[lr, weight_decay, clip]: (3,) ``dtype`` (0 where not set: the launcher skips them)."""
    return np.array([lr, weight_decay or 0.0, clip or 0.0], dtype)


def segment_starts(sizes):
    """(nseg + 1,) int64: where each of the variables of ``sizes`` begins, then the total."""
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]).astype(np.int64)


# --- NumPy references (in place) ---------------------------------------------------------------

def decay_ref(w, hyper, at):
    """w -= w * wd * lr, in float32 in Keras's order ((w * wd) * lr)."""
    w -= (w * hyper[at + T_WEIGHT_DECAY]) * hyper[at + T_LR]
    return w


def clip_value_ref(g, hyper, at):
    c = hyper[at + T_CLIP]
    np.clip(g, -c, c, out=g)
    return g


def segment_sum_squares_ref(g, starts, sq):
    """sq[s] = sum of g[i]**2 over segment s, added in float64 and rounded once (the same
    bits on every replica, whatever the buffer's alignment)."""
    for s in range(len(starts) - 1):
        seg = g[starts[s]:starts[s + 1]].astype(np.float64)
        sq[s] = np.float32(np.sum(seg * seg))
    return sq


def clip_norm_ref(g, starts, sq, hyper, at, global_norm):
    """Scale each segment of ``g`` by Keras's clipnorm factor (``global_norm``: by
    global_clipnorm's, one factor for all), from the sums of squares ``sq``."""
    c = hyper[at + T_CLIP]
    one = np.float32(1)
    if global_norm:
        n = np.sqrt(np.float32(np.sum(sq, dtype=np.float32)))
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = c * min(one / n, one / c) + (n - n)
        g *= np.float32(scale)
        return g
    for s in range(len(starts) - 1):
        l2sum = sq[s]
        l2norm = np.sqrt(l2sum) if l2sum > 0 else l2sum
        seg = g[starts[s]:starts[s + 1]]
        seg[...] = (seg * c) / max(l2norm, c)
    return g


# --- kernels ----------------------------------------------------------------------------------------

@cuda.jit
def decay_kernel(w, hyper, at):
    """One thread per element (grid-stride): w[i] -= (w[i] * wd) * lr."""
    lr = hyper[at + T_LR]
    wd = hyper[at + T_WEIGHT_DECAY]
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        wi = w[i]
        w[i] = wi - (wi * wd) * lr


@cuda.jit
def clip_value_kernel(g, hyper, at):
    """One thread per element (grid-stride): g[i] = min(max(g[i], -c), c)."""
    c = hyper[at + T_CLIP]
    for i in range(cuda.grid(1), g.size, cuda.gridsize(1)):
        g[i] = min(max(g[i], -c), c)


@cuda.jit
def segment_sum_squares_kernel(g, starts, sq):
    """Block b handles segments b, b + gridDim, ... (the bound is the same for every thread
    of a block, so the syncthreads inside the loop are safe). Thread t adds g[i]**2 for
    i = start + t, start + t + CLIP_THREADS, ... privately, then the block's partials are
    tree-reduced in shared memory. Equals: sq[s] = sum(g[starts[s]:starts[s+1]] ** 2)."""
    partial = cuda.shared.array(CLIP_THREADS, float32)
    t = cuda.threadIdx.x
    for s in range(cuda.blockIdx.x, sq.size, cuda.gridDim.x):
        acc = float32(0)
        for i in range(starts[s] + t, starts[s + 1], CLIP_THREADS):
            gi = g[i]
            acc += gi * gi
        partial[t] = acc
        cuda.syncthreads()
        stride = CLIP_THREADS // 2
        while stride > 0:
            if t < stride:
                partial[t] += partial[t + stride]
            cuda.syncthreads()
            stride //= 2
        if t == 0:
            sq[s] = partial[0]
        cuda.syncthreads()                     # partial[0] read before the next segment writes


@cuda.jit
def clip_norm_kernel(g, starts, sq, hyper, at, global_norm):
    """Block b scales segments b, b + gridDim, ...: by c / max(||g_s||, c) (clipnorm), or by
    global_clipnorm's one factor, c * min(1/n, 1/c) + (n - n), n = sqrt(sum of sq) added by
    every thread in the same order. Loop nest: for s: for i in segment s: g[i] = g[i] * factor."""
    c = hyper[at + T_CLIP]
    t = cuda.threadIdx.x
    total = float32(0)
    if global_norm:
        for s in range(sq.size):
            total += sq[s]
    n = math.sqrt(total)
    global_scale = c * min(float32(1) / n, float32(1) / c) + (n - n) if global_norm else float32(1)
    for s in range(cuda.blockIdx.x, sq.size, cuda.gridDim.x):
        l2sum = sq[s]
        l2norm = math.sqrt(l2sum) if l2sum > 0 else l2sum
        denominator = max(l2norm, c)
        for i in range(starts[s] + t, starts[s + 1], CLIP_THREADS):
            if global_norm:
                g[i] = g[i] * global_scale
            else:
                g[i] = (g[i] * c) / denominator


_F32 = vec("float32")
register(decay_kernel, "decay_kernel", sig(_F32, _F32, "int64"), block=grid_1d(1)[1])
register(clip_value_kernel, "clip_value_kernel", sig(_F32, _F32, "int64"), block=grid_1d(1)[1])
register(segment_sum_squares_kernel, "segment_sum_squares_kernel", sig(_F32, vec("int64"), _F32),
         block=CLIP_THREADS)
register(clip_norm_kernel, "clip_norm_kernel", sig(_F32, vec("int64"), _F32, _F32, "int64", "int32"),
         block=CLIP_THREADS)


# --- launchers ------------------------------------------------------------------------------------

def _check_hyper(what, hyper, at):
    check_array(f"{what}: hyper (the optimizer's per-step vector, on the device)", hyper, np.float32, ndim=1)
    if not 0 <= at <= hyper.shape[0] - TRANSFORM_SIZE:
        raise ValueError(f"{what}: the transform scalars at offset {at} do not fit in a vector of "
                         f"{hyper.shape[0]}; expected 0 <= at <= {hyper.shape[0] - TRANSFORM_SIZE}.")


def decay(w, hyper, at, stream=None):
    """Keras's weight decay on the GPU, in place: w -= w * wd * lr (float32 contiguous ``w``)."""
    check_array("decay: w", w, np.float32)
    _check_hyper("decay", hyper, at)
    if w.size:
        launch(decay_kernel, *grid_1d(w.size), stream, flat(w), hyper, np.int64(at))
    return w


def clip_value(g, hyper, at, stream=None):
    """Keras's clipvalue on the GPU, in place."""
    check_array("clip_value: g", g, np.float32)
    _check_hyper("clip_value", hyper, at)
    if g.size:
        launch(clip_value_kernel, *grid_1d(g.size), stream, flat(g), hyper, np.int64(at))
    return g


def clip_norm(g, starts, sq, hyper, at, global_norm, stream=None):
    """Keras's clipnorm (``global_norm`` False: each segment by its own norm) or
    global_clipnorm (True) on the GPU, in place on ``g``: two launches, the sums of squares
    into ``sq`` (nseg,) float32, then the scaling. ``starts``: ``segment_starts(sizes)`` on
    the device, its last entry g's size."""
    check_array("clip_norm: g", g, np.float32)
    check_array("clip_norm: starts", starts, np.int64, shape=(sq.shape[0] + 1,))
    check_array("clip_norm: sq", sq, np.float32, ndim=1)
    _check_hyper("clip_norm", hyper, at)
    if not sq.size:
        return g
    grid = min(sq.size, MAX_SEGMENT_BLOCKS)
    launch(segment_sum_squares_kernel, grid, CLIP_THREADS, stream, flat(g), starts, sq)
    launch(clip_norm_kernel, grid, CLIP_THREADS, stream, flat(g), starts, sq, hyper, np.int64(at),
           np.int32(bool(global_norm)))
    return g
