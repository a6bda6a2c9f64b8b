"""Sums: of a whole array (loss, metrics) and along one axis (bias gradients).

Versions:
    sum_all   v1: two passes of a block-level tree reduction in shared memory.
    sum_axis  v1: a 2-D block per strip of columns; threads down the reduced axis
              accumulate privately, then one shared-memory tree per column.

Why a second pass and not atomics? ``atomicAdd`` on floats makes the order of
additions depend on which block finishes first, so the same input can give
results that differ in the last bit from run to run and from device to device.
This project promises that replicas stay *bitwise* equal and that repeated runs
are identical, so every reduction here adds in a fixed order: pass 1 writes one
partial sum per block, pass 2 (one block) sums the partials. The number of
blocks depends only on the array's size, so the order is fixed too.

Reductions accumulate in the array's own dtype (float32 stays float32, as in
TensorFlow's reduce_sum on float32 tensors).

Neighbours: ``launch.py`` (grids), ``elementwise.py`` (the same file layout),
``mirrored/tensor.py`` (``reduce_sum``/``reduce_mean`` call these launchers).
"""
import numpy as np
from numba import cuda, from_dtype

from kernels.launch import SIMULATOR, ceil_div, check_array, flat, grid_rows, head, launch, view
from kernels.registry import TENSOR_DTYPES, arr3, mat, register, sig, vec

#: Threads per block in ``sum_all``: a power of two (the tree halves it each
#: step) and a multiple of the 32-thread warp. (Fewer in the simulator, where
#: every CUDA thread is a Python thread.)
SUM_THREADS = 32 if SIMULATOR else 256

#: Blocks in pass 1 of ``sum_all``: enough to fill a large GPU; every thread
#: first adds its grid-stride share privately, so more blocks buy little.
SUM_BLOCKS = 4 if SIMULATOR else 256

#: ``sum_axis`` block: COLS threads across (consecutive columns: coalesced
#: reads) by ROWS threads down the reduced axis. ROWS is a power of two.
#: (Smaller in the simulator, where every CUDA thread is a Python thread.)
AXIS_COLS = 8 if SIMULATOR else 32
AXIS_ROWS = 4 if SIMULATOR else 8


# --- NumPy references -------------------------------------------------------

def sum_all_ref(x):
    """Sum of every element, in x's dtype, as a shape-(1,) array."""
    return np.asarray(x.sum(dtype=x.dtype)).reshape(1)


def sum_axis_ref(x3):
    """x3 (O, N, I) -> (O, I): sum over the middle axis.

    Any ``reduce_sum(x, axis=k)`` is this after a free reshape:
    O = prod(shape[:k]), N = shape[k], I = prod(shape[k+1:]).
    """
    return x3.sum(axis=1, dtype=x3.dtype)


# --- kernels (one pair per dtype: the shared-memory dtype is compile-time) ----

def _make_kernels(nb_dtype):

    @cuda.jit
    def block_sums(x, out):
        """Block b writes out[b] = sum of the elements its threads visit.

        Thread t of block b adds x[i] for i = b*SUM_THREADS + t, then strides by
        the grid size (grid-stride loop), into a private register; then the
        block's SUM_THREADS partials are tree-reduced in shared memory:
        log2(SUM_THREADS) halving steps, one syncthreads each.
        Equals:  for b: out[b] = sum(x[i] for i with (i // SUM_THREADS) % grid == b)
        """
        partial = cuda.shared.array(SUM_THREADS, nb_dtype)
        t = cuda.threadIdx.x
        acc = nb_dtype(0)
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            acc += x[i]
        partial[t] = acc
        cuda.syncthreads()
        stride = SUM_THREADS // 2
        while stride > 0:
            if t < stride:
                partial[t] += partial[t + stride]
            cuda.syncthreads()
            stride //= 2
        if t == 0:
            out[cuda.blockIdx.x] = partial[0]

    @cuda.jit
    def axis_sums(x, out):
        """out[o, i] = sum over n of x[o, n, i].

        Block (AXIS_COLS, AXIS_ROWS) covers AXIS_COLS consecutive columns i of
        the outer indices o = blockIdx.y, blockIdx.y + gridDim.y, ... (a
        grid-stride loop in y: the hardware allows at most 65,535 blocks in y,
        and O may be larger). For each o, thread (tx, ty) adds rows n = ty,
        ty + AXIS_ROWS, ... privately; then the AXIS_ROWS partials of each
        column are tree-reduced in shared memory. The loop bound is the same for
        every thread of a block, so the syncthreads inside it are safe; thread
        (0, tx) reads partial[0, tx] before anyone writes it again.
        Equals:  for o, i: out[o, i] = sum(x[o, n, i] for n in range(N))
        """
        partial = cuda.shared.array((AXIS_ROWS, AXIS_COLS), nb_dtype)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        i = cuda.blockIdx.x * AXIS_COLS + tx
        for o in range(cuda.blockIdx.y, x.shape[0], cuda.gridDim.y):
            acc = nb_dtype(0)
            if i < x.shape[2]:
                for n in range(ty, x.shape[1], AXIS_ROWS):
                    acc += x[o, n, i]
            partial[ty, tx] = acc
            cuda.syncthreads()
            stride = AXIS_ROWS // 2
            while stride > 0:
                if ty < stride:
                    partial[ty, tx] += partial[ty + stride, tx]
                cuda.syncthreads()
                stride //= 2
            if ty == 0 and i < x.shape[2]:
                out[o, i] = partial[0, tx]

    return block_sums, axis_sums


#: dtype -> (block_sums, axis_sums)
KERNELS = {np.dtype(t): _make_kernels(from_dtype(np.dtype(t))) for t in TENSOR_DTYPES}

# What the real compiler checks (kernels/registry.py): one kernel pair per dtype, each
# compiled for its own dtype (the shared-memory dtype is baked in).
for _dtype, (_block_sums, _axis_sums) in KERNELS.items():
    register(_block_sums, "block_sums", sig(vec(_dtype.name), vec(_dtype.name)),
             block=SUM_THREADS, variant=_dtype.name)
    register(_axis_sums, "axis_sums", sig(arr3(_dtype.name), mat(_dtype.name)),
             block=(AXIS_COLS, AXIS_ROWS), variant=_dtype.name)


def _kernels_for(what, dtype):
    try:
        return KERNELS[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"{what}: no reduction kernel for dtype {dtype}; "
                        f"supported: {', '.join(str(d) for d in KERNELS)}.") from None


# --- launchers ----------------------------------------------------------------

def sum_all(x, out, partial=None, stream=None):
    """out[0] = sum(x) on the GPU in two fixed-order passes (see module docstring).

    ``out``: shape (1,) (or any 1-element array), x's dtype. ``partial``: a
    scratch array of SUM_BLOCKS elements of x's dtype. The library passes one that its
    device charged and keeps (``backends.CudaOps``); without it this launcher allocates
    one per call (fine for tests and benchmarks, but uncounted and a cudaMalloc each time).
    """
    block_sums, _ = _kernels_for("sum_all", x.dtype)
    check_array("sum_all: x", x, x.dtype)
    check_array("sum_all: out", out, x.dtype)
    if out.size != 1:
        raise ValueError(f"sum_all: out must hold 1 element, got shape {tuple(out.shape)}.")
    blocks = min(SUM_BLOCKS, max(1, ceil_div(x.size, SUM_THREADS)))
    if partial is None:
        partial = cuda.device_array(SUM_BLOCKS, dtype=x.dtype, stream=stream or 0)
    check_array("sum_all: partial", partial, x.dtype, ndim=1)
    if partial.shape[0] < blocks:
        raise ValueError(f"sum_all: partial holds {partial.shape[0]} elements, pass 1 writes "
                         f"{blocks}; pass a scratch array of SUM_BLOCKS = {SUM_BLOCKS}.")
    # flat, head and view: the same view objects every call, so the launches are replayed
    launch(block_sums, blocks, SUM_THREADS, stream, flat(x), partial)
    launch(block_sums, 1, SUM_THREADS, stream, head(partial, blocks), view(out, (1,)))
    return out


def sum_axis(x3, out, stream=None):
    """out (O, I) = x3 (O, N, I) summed over N, on the GPU."""
    _, axis_sums = _kernels_for("sum_axis", x3.dtype)
    check_array("sum_axis: x", x3, x3.dtype, ndim=3)
    o, _, i = x3.shape
    check_array("sum_axis: out", out, x3.dtype, shape=(o, i))
    if out.size:
        launch(axis_sums, (ceil_div(i, AXIS_COLS), grid_rows(o)), (AXIS_COLS, AXIS_ROWS), stream, x3, out)
    return out
