"""GEMM: ``out = alpha * op(A) @ op(B) + beta * out``, the matrix multiply behind Dense.

Three versions live side by side; the launcher ``gemm(..., version=...)`` picks one:

    v1  naive: one thread per output element, every operand read from global memory
        (K loads of A and K loads of B per output: limited by memory, not arithmetic).
    v2  shared-memory tiled: a 16x16 block stages a 16x16 tile of op(A) and of op(B)
        in shared memory, so each global value is read once per block, not 16 times.
    v3  register-tiled: a 16x16 block computes a 128x64 tile of ``out``; each thread
        keeps an 8x4 block of accumulators in registers and reuses every value it loads
        from shared memory 4 or 8 times. The fastest for large outputs, so it is the
        default (``DEFAULT_VERSION``); ``python -m benchmarks.kernels`` measures all three
        against cuBLAS on a GPU (target: v3 >= 50% of cuBLAS FP32 at 4096^3).

Which version for which shape (``choose_version``, what ``version=None`` does): a v3
block covers 128 x 64 outputs, so a small output (a Dense layer at batch 64 is 64 x 64)
is ONE block on ONE of the GPU's 132 SMs, looping over all of K alone: measured on an
H100, 318 µs for 64x64x784 where v2's sixteen 16x16 blocks take 49. The launcher takes
v3 only when its grid has at least one block per SM, else v2.

Tile shape, measured on an H100 at 4096^3 (cuBLAS FP32: 50 TFLOP/s): a 128x128 tile with
8x8 per thread (179 registers: one 256-thread block per SM) ran at 7.8 TFLOP/s; 128x64 with
8x4 per thread (about 120 registers: two blocks per SM, twice the warps to hide latency)
at 18.0; the same without the padding of the A tile (below) at 13.7.

``op(X)`` is ``X`` or ``X.T`` (flags ``trans_a``, ``trans_b``). Transposes are never
materialised: each kernel is compiled once per (trans_a, trans_b) pair with the flags
as compile-time constants (closure variables of a kernel factory), so the choice of
index expression costs nothing per element. Dense needs all four combinations:
forward ``x @ W``, backward ``dx = dy @ W.T`` and ``dW = x.T @ dy``.

Shapes: op(A) is (M, K), op(B) is (K, N), out is (M, N); float32, 2-D, C-contiguous.
``beta == 0`` never reads ``out`` (it may hold garbage or NaN), as BLAS specifies.

Layout of this file (as every file in ``kernels/``):
    NumPy reference   ``gemm_ref`` (the CPU backend calls it, any float dtype)
    kernel factories  ``_make_v1``, ``_make_v2``, ``_make_v3``, one kernel per trans pair
    registration      every kernel with the signature and block it is launched with
                      (``kernels/registry.py``: what the real compiler checks in CI)
    launcher          ``gemm``: check, pick grid and block, launch

What the compiler makes of each version, with no GPU (the v3 accumulators must live in
registers, not in a stack frame in slow local memory)::

    python -m kernels.report --only gemm          # NVVM + ptxas -v for sm_90, every variant

``tests/test_kernels_compile.py`` checks in every test run that every version has a
0-byte stack frame, no spills and no float64 instruction (``python -m kernels.report``
prints the registers, shared memory and occupancy; the README quotes them). The kernels
are registered below, with ``SIGNATURE`` and each launcher's block.
"""
import numpy as np
from numba import cuda, float32

from kernels.launch import ceil_div, check_array, check_no_alias, grid_rows, launch
from kernels.registry import mat, register, sig

VERSIONS = ("v1", "v2", "v3")

#: The launcher's choice when ``version=None``: the fastest correct version.
DEFAULT_VERSION = "v3"

#: v1 and v2 block edge: 16 x 16 = 256 threads, and a 16 x 16 shared tile (2 KiB
#: each for A and B) small enough for many resident blocks per SM.
TILE = 16
#: v2 shared tiles get one extra column, so a column of a tile (stride TILE_PADDED = 17
#: floats) falls in 16 different memory banks, not one. (A shared-array shape must be
#: a constant: Numba does not fold ``TILE + 1`` written inside the kernel.)
TILE_PADDED = TILE + 1

#: v3 block tile: each block computes a BM x BN tile of ``out``, stepping through K
#: BK columns at a time: 6 KiB of shared memory per block. (128 x 128 with 8 x 8 per
#: thread is the textbook shape, but its 179 registers allow one block per SM; measured
#: 2.3x slower at 4096^3, see the module docstring.)
BM = 128
BN = 64
BK = 8

#: v3 thread tile: each thread owns TM x TN outputs (32 accumulators in registers).
TM = 8
TN = 4

#: The A tile is stored k-major with this many floats of padding per k-row. A thread
#: loading op(A)[r, k] (non-transposed A: eight consecutive threads share r and walk k)
#: stores at as_[k, r]; with rows of exactly BM = 128 floats those eight stores would
#: hit one of the 32 shared-memory banks eight times over. 4 floats of padding move
#: each k-row 4 banks along: the eight land in eight banks (measured 13.7 -> 18.0 TFLOP/s).
A_PAD = 4
BM_PADDED = BM + A_PAD   # a constant: Numba does not fold ``BM + A_PAD`` inside a kernel

#: v3 block shape: (BN / TN) x (BM / TM) = 16 x 16 = 256 threads.
V3_THREADS_X = BN // TN  # 16, runs over columns of the tile
V3_THREADS_Y = BM // TM  # 16, runs over rows of the tile
V3_THREADS = V3_THREADS_X * V3_THREADS_Y  # 256

#: Elements of the A tile (BM x BK) and of the B tile (BK x BN) each thread loads.
A_LOADS = BM * BK // V3_THREADS  # 4
B_LOADS = BK * BN // V3_THREADS  # 2
assert A_LOADS * V3_THREADS == BM * BK and B_LOADS * V3_THREADS == BK * BN


# --- NumPy reference ---------------------------------------------------------------

def gemm_ref(a, b, out=None, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """``alpha * op(a) @ op(b) + beta * out``, written into ``out`` when given.

    Any float dtype (the result has ``a``'s dtype). ``beta`` is ignored when ``out``
    is None, and ``out`` is never read when ``beta == 0`` (it may hold NaN).
    Equals the loop nest::

        for i in range(M):
            for j in range(N):
                acc = sum(op(a)[i, k] * op(b)[k, j] for k in range(K))
                out[i, j] = alpha * acc + beta * out[i, j]   # beta * out only if beta != 0
    """
    op_a = a.T if trans_a else a  # (M, K)
    op_b = b.T if trans_b else b  # (K, N)
    if out is None:
        out = np.matmul(op_a, op_b)  # (M, N)
        if alpha != 1.0:
            out *= out.dtype.type(alpha)
        return out
    if beta == 0.0:
        np.matmul(op_a, op_b, out=out)  # (M, N), old out never read
        if alpha != 1.0:
            out *= out.dtype.type(alpha)
        return out
    prod = np.matmul(op_a, op_b)  # (M, N)
    if alpha != 1.0:
        prod *= prod.dtype.type(alpha)
    out *= out.dtype.type(beta)
    out += prod
    return out


# --- device helpers: where op(A)[i, k] and op(B)[k, j] live in memory -----------------

def _element_at(transposed):
    """A device function ``at(x, r, c) = op(X)[r, c]``: ``x[r, c]``, or ``x[c, r]`` when
    X is stored transposed. ``transposed`` is a Python bool fixed at compile time, so
    each kernel gets straight-line indexing code with no run-time branch."""
    if transposed:
        @cuda.jit(device=True, inline="always")
        def at(x, r, c):
            return x[c, r]  # x stored (cols, rows)
    else:
        @cuda.jit(device=True, inline="always")
        def at(x, r, c):
            return x[r, c]  # x stored (rows, cols)
    return at


def _make_loaders(trans_a, trans_b):
    """Return device functions ``a_at(a, i, k) = op(A)[i, k]`` (a stored (K, M) when
    ``trans_a``, else (M, K)) and ``b_at(b, k, j) = op(B)[k, j]`` (b stored (N, K) when
    ``trans_b``, else (K, N))."""
    return _element_at(trans_a), _element_at(trans_b)


@cuda.jit(device=True, inline="always")
def _epilogue(out, i, j, acc, alpha, beta):
    """out[i, j] = alpha * acc + beta * out[i, j], reading out only when beta != 0."""
    if beta == 0:
        out[i, j] = alpha * acc
    else:
        out[i, j] = alpha * acc + beta * out[i, j]


# --- v1: naive ---------------------------------------------------------------------

def _make_v1(trans_a, trans_b):
    a_at, b_at = _make_loaders(trans_a, trans_b)

    @cuda.jit
    def gemm_v1(a, b, out, alpha, beta):
        """v1, naive. One thread per out[i, j]: i = global y index, j = global x index
        (consecutive threads take consecutive columns, so the reads of op(B) and the
        write of out coalesce). Grid: ceil(N/16) x min(ceil(M/16), 65535) blocks of
        16 x 16; past 65,535 block-rows (the hardware's limit in y) a thread also takes
        rows i + 16 * gridDim.y, ... (a grid-stride loop in y).
        Preconditions: shapes agree (the launcher checks); K may be 0.
        Loop nest: for k in range(K): acc += op(A)[i, k] * op(B)[k, j].
        """
        j, i0 = cuda.grid(2)  # x runs over columns j, y over rows i
        M, N = out.shape
        K = a.shape[0] if trans_a else a.shape[1]
        if j < N:
            for i in range(i0, M, cuda.gridDim.y * TILE):
                acc = float32(0.0)
                for k in range(K):
                    acc += a_at(a, i, k) * b_at(b, k, j)
                _epilogue(out, i, j, acc, alpha, beta)

    return gemm_v1


# --- v2: shared-memory tiles ---------------------------------------------------------

def _make_v2(trans_a, trans_b):
    @cuda.jit
    def gemm_v2(a, b, out, alpha, beta):
        """v2, shared-memory tiled. One thread per out[i, j] as in v1; a 16 x 16 block
        walks K in steps of 16. Each step, every thread loads one element of the A tile
        and one of the B tile into shared memory (zero outside the matrices), the block
        syncs, each thread does 16 multiply-adds from shared memory, the block syncs
        again before the tiles are overwritten: two syncthreads per tile.

        Loads coalesce in the *stored* layout: consecutive threads (tx) read consecutive
        addresses of ``a``/``b`` whether or not the operand is transposed; a transposed
        operand is written to shared memory transposed. Tiles are padded to 17 columns
        so those transposed writes hit 16 different memory banks.
        Grid: ceil(N/16) x min(ceil(M/16), 65535); a block takes tile rows blockIdx.y,
        blockIdx.y + gridDim.y, ... (a grid-stride loop in y, the hardware's y limit).
        Preconditions: shapes agree (the launcher checks).
        Loop nest: for k0 in range(0, K, 16): for kk in range(16):
                       acc += op(A)[i, k0 + kk] * op(B)[k0 + kk, j]   (zero-padded)
        """
        sa = cuda.shared.array((TILE, TILE_PADDED), float32)  # sa[r, c] = op(A)[row0 + r, k0 + c]
        sb = cuda.shared.array((TILE, TILE_PADDED), float32)  # sb[r, c] = op(B)[k0 + r, col0 + c]
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        col0 = cuda.blockIdx.x * TILE
        M, N = out.shape
        K = a.shape[0] if trans_a else a.shape[1]
        # Grid-stride over tile rows (at most 65,535 blocks in y): the same bound for
        # every thread of the block, so the syncthreads inside stay uniform.
        for row0 in range(cuda.blockIdx.y * TILE, M, cuda.gridDim.y * TILE):
            acc = float32(0.0)
            for k0 in range(0, K, TILE):
                if trans_a:  # a is (K, M): tx runs along M, the contiguous axis
                    k, r = k0 + ty, row0 + tx
                    sa[tx, ty] = a[k, r] if (k < K and r < M) else float32(0.0)
                else:        # a is (M, K): tx runs along K
                    r, k = row0 + ty, k0 + tx
                    sa[ty, tx] = a[r, k] if (r < M and k < K) else float32(0.0)
                if trans_b:  # b is (N, K): tx runs along K
                    c, k = col0 + ty, k0 + tx
                    sb[tx, ty] = b[c, k] if (c < N and k < K) else float32(0.0)
                else:        # b is (K, N): tx runs along N
                    k, c = k0 + ty, col0 + tx
                    sb[ty, tx] = b[k, c] if (k < K and c < N) else float32(0.0)
                cuda.syncthreads()  # tiles complete before anyone reads them
                for kk in range(TILE):
                    acc += sa[ty, kk] * sb[kk, tx]
                cuda.syncthreads()  # everyone done reading before the next tile overwrites
            i, j = row0 + ty, col0 + tx
            if i < M and j < N:
                _epilogue(out, i, j, acc, alpha, beta)

    return gemm_v2


# --- v3: register tiles ----------------------------------------------------------------

def _make_v3(trans_a, trans_b):
    @cuda.jit
    def gemm_v3(a, b, out, alpha, beta):
        """v3, register-tiled. A 16 x 16 block computes the 128 x 64 tile of ``out``
        starting at (row0, col0); thread (ty, tx) owns the 8 x 4 outputs
        out[row0 + ty + 16*p, col0 + tx + 16*q] for p in range(8), q in range(4). Strided ownership
        keeps consecutive threads on consecutive columns, so shared-memory reads are
        conflict-free and the final stores coalesce.

        Per step of BK = 8 along K: the 256 threads load the 128 x 8 A tile (stored
        k-major: as_[k, r], rows padded by A_PAD) and the 8 x 64 B tile, 4 and 2
        elements each, zero outside the matrices; sync; then for each of the 8 k's a
        thread copies 8 values of A and 4 of B into registers and does 32 multiply-adds;
        sync.

        Registers, not local memory: ``acc``, ``frag_a``, ``frag_b`` are
        ``cuda.local.array`` with compile-time sizes, indexed only by loop counters of
        constant trip count, so the compiler unrolls the loops and keeps all 44 values
        in registers (ptxas: 0-byte stack frame). Edges are handled by zero-padding the
        shared tiles, never by run-time loop bounds, and by one bounds check per store.
        Grid: ceil(N/64) x min(ceil(M/128), 65535); a block takes tile rows blockIdx.y,
        blockIdx.y + gridDim.y, ... (a grid-stride loop in y, the hardware's y limit).
        Preconditions: shapes agree (the launcher checks).
        Loop nest: for k0 in range(0, K, 8): for k in range(8): for p in range(8):
                       for q in range(4): acc[p, q] += As[k, ty + 16p] * Bs[k, tx + 16q]
        """
        as_ = cuda.shared.array((BK, BM_PADDED), float32)  # as_[k, r] = op(A)[row0 + r, k0 + k]
        bs = cuda.shared.array((BK, BN), float32)   # bs[k, c]  = op(B)[k0 + k, col0 + c]
        acc = cuda.local.array((TM, TN), float32)   # this thread's 8 x 4 outputs
        frag_a = cuda.local.array(TM, float32)      # one column of A for its 8 rows
        frag_b = cuda.local.array(TN, float32)      # one row of B for its 4 columns
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * V3_THREADS_X + tx
        col0 = cuda.blockIdx.x * BN
        M, N = out.shape
        K = a.shape[0] if trans_a else a.shape[1]
        # Grid-stride over 128-row tiles (at most 65,535 blocks in y): the same bound
        # for every thread of the block, so the syncthreads inside stay uniform.
        for row0 in range(cuda.blockIdx.y * BM, M, cuda.gridDim.y * BM):
            for p in range(TM):
                for q in range(TN):
                    acc[p, q] = float32(0.0)

            for k0 in range(0, K, BK):
                # Load the tiles. Element e of a tile goes to thread e % 256; within a load
                # consecutive threads read consecutive addresses of the *stored* matrix.
                for l in range(A_LOADS):
                    e = tid + l * V3_THREADS
                    if trans_a:  # a is (K, M): the tile is 8 rows of 128 contiguous floats
                        k, r = e // BM, e % BM
                        gk, gr = k0 + k, row0 + r
                        as_[k, r] = a[gk, gr] if (gk < K and gr < M) else float32(0.0)
                    else:        # a is (M, K): the tile is 128 rows of 8 contiguous floats
                        r, k = e // BK, e % BK
                        gr, gk = row0 + r, k0 + k
                        as_[k, r] = a[gr, gk] if (gr < M and gk < K) else float32(0.0)
                for l in range(B_LOADS):
                    e = tid + l * V3_THREADS
                    if trans_b:  # b is (N, K): 64 rows of 8 contiguous floats
                        c, k = e // BK, e % BK
                        gc, gk = col0 + c, k0 + k
                        bs[k, c] = b[gc, gk] if (gc < N and gk < K) else float32(0.0)
                    else:        # b is (K, N): 8 rows of 64 contiguous floats
                        k, c = e // BN, e % BN
                        gk, gc = k0 + k, col0 + c
                        bs[k, c] = b[gk, gc] if (gk < K and gc < N) else float32(0.0)
                cuda.syncthreads()

                for k in range(BK):
                    for p in range(TM):
                        frag_a[p] = as_[k, ty + p * V3_THREADS_Y]
                    for q in range(TN):
                        frag_b[q] = bs[k, tx + q * V3_THREADS_X]
                    for p in range(TM):
                        for q in range(TN):
                            acc[p, q] += frag_a[p] * frag_b[q]
                cuda.syncthreads()

            for p in range(TM):
                i = row0 + ty + p * V3_THREADS_Y
                for q in range(TN):
                    j = col0 + tx + q * V3_THREADS_X
                    if i < M and j < N:
                        _epilogue(out, i, j, acc[p, q], alpha, beta)

    return gemm_v3


_FACTORIES = {"v1": _make_v1, "v2": _make_v2, "v3": _make_v3}

#: KERNELS[version][(trans_a, trans_b)] -> the compiled-on-first-use kernel.
KERNELS = {v: {(ta, tb): make(ta, tb) for ta in (False, True) for tb in (False, True)}
           for v, make in _FACTORIES.items()}

#: The argument types every GEMM kernel is launched with: a, b, out, alpha, beta.
SIGNATURE = sig(mat("float32"), mat("float32"), mat("float32"), "float32", "float32")


def _grid(version, m, n):
    """(grid, block) for ``version`` on an (m, n) output; x runs over columns."""
    if version == "v3":
        return (ceil_div(n, BN), grid_rows(ceil_div(m, BM))), (V3_THREADS_X, V3_THREADS_Y)
    return (ceil_div(n, TILE), grid_rows(ceil_div(m, TILE))), (TILE, TILE)


# What the real compiler checks (kernels/registry.py, python -m kernels.report): all
# twelve kernels, each with the block its launcher uses.
for _version, _by_trans in KERNELS.items():
    for (_ta, _tb), _kernel in _by_trans.items():
        register(_kernel, f"gemm_{_version}", SIGNATURE, block=_grid(_version, 1, 1)[1],
                 variant=f"trans_a={_ta}, trans_b={_tb}")


# --- which version -------------------------------------------------------------------

_SM_COUNTS = {}


def _sm_count():
    """Multiprocessors of the current GPU (1 in the simulator, which has no such number)."""
    dev = cuda.get_current_device()
    key = getattr(dev, "id", 0)
    if key not in _SM_COUNTS:
        _SM_COUNTS[key] = int(getattr(dev, "MULTIPROCESSOR_COUNT", 1))
    return _SM_COUNTS[key]


def choose_version(m, n, sm_count=None):
    """The version ``gemm(..., version=None)`` runs for an (m, n) output: v3 when its
    grid gives every SM at least one block, else v2, whose 16 x 16 tiles make 32 times
    as many blocks (a 64 x 64 output: one v3 block on one SM, sixteen v2 blocks).
    ``sm_count`` defaults to the current GPU's."""
    sm_count = _sm_count() if sm_count is None else sm_count
    v3_blocks = ceil_div(n, BN) * ceil_div(m, BM)
    return DEFAULT_VERSION if v3_blocks >= sm_count else "v2"


# --- launcher -------------------------------------------------------------------------

def gemm(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, stream=None,
         version=None, sm_count=None):
    """out = alpha * op(a) @ op(b) + beta * out on the GPU; returns ``out``.

    a, b, out: float32, 2-D, C-contiguous device arrays; op(a) is (M, K), op(b) is
    (K, N), out is (M, N) and must not overlap a or b. ``version``: "v1", "v2", "v3"
    or None for ``choose_version`` by the output's shape (``sm_count``: the GPU's
    multiprocessors, if the caller knows them; else asked of the driver). Every check
    runs before the launch.
    """
    if version is not None and version not in KERNELS:
        raise ValueError(f"gemm: unknown version {version!r}; expected one of {VERSIONS} "
                         f"or None to choose by shape (choose_version).")
    check_array("gemm: a", a, np.float32, ndim=2)
    check_array("gemm: b", b, np.float32, ndim=2)
    check_array("gemm: out", out, np.float32, ndim=2)
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb:
        raise ValueError(
            f"gemm: inner dimensions differ: op(a) is ({m}, {k}) but op(b) is ({kb}, {n}) "
            f"(a {tuple(a.shape)}, trans_a={trans_a}; b {tuple(b.shape)}, trans_b={trans_b}).")
    if tuple(out.shape) != (m, n):
        raise ValueError(f"gemm: out has shape {tuple(out.shape)}, expected ({m}, {n}) "
                         f"= (rows of op(a), columns of op(b)).")
    check_no_alias("gemm", out, a, b)
    if m == 0 or n == 0:
        return out
    version = choose_version(m, n, sm_count) if version is None else version
    kernel = KERNELS[version][(bool(trans_a), bool(trans_b))]
    launch(kernel, *_grid(version, m, n), stream, a, b, out,
           np.float32(alpha), np.float32(beta))
    return out
