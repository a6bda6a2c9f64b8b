"""The CPU backend's compiled loops: Conv2D, MaxPooling2D and the ReLU backward, fused.

Why this file exists. The CPU backend computes each op with its NumPy reference
(``kernels/*.py``, ``<op>_ref``): readable, and the oracle every test compares against.
For the image layers those references are slow where they are simple: im2col copies the
input nine times over, the bias and the ReLU are extra passes over the conv's output,
the pooling reference makes a dozen whole-array temporaries (one ``np.where`` per window
position), and the backward recomputes im2col. Profiled on the course lab's ConvNet
(batch 64, one BLAS thread; ``python -m benchmarks.breakdown --clock cpu``), those four
took 17 of the step's 21 ms. The loops here do the same arithmetic in one pass each,
compiled by Numba for the CPU (``numba.njit``: no GPU, no simulator involved):

    conv2d_forward     the reference's own method, im2col then ONE matmul (BLAS), but
                       the column matrix made by a compiled loop (``_im2col``) into a
                       buffer the device keeps, the product written straight into the
                       output, and bias + ReLU in one pass (``_bias_act``): bitwise the
                       reference's result
    conv2d_backward    dW = cols^T @ dy, the reference's matmul; db by ``_column_sums``
                       (float32 per image, float64 across images); dx (only when an
                       earlier layer needs it: never for the lab's first-layer conv,
                       as in every framework) as the reference: dcols = dy @ W^T
                       (BLAS, into the column buffer dW is done with), then
                       ``_col2im`` adds each window's row back onto its pixels
    max_pool_forward   max and arg-max in one pass over the input, the SAME comparisons
                       in the SAME order as ``max_pool_ref`` and the CUDA kernel: the
                       first maximum in row-major window order, NaN taken first
    max_pool_backward  each output's dy added at its recorded arg-max
    conv2d_relu_pool   Conv2D(relu) then MaxPooling2D as one op (the layers fuse them on
                       the CPU: keras/layers.py, ``Conv2D.fuse_next``): per block of
                       images (``image_blocks``), im2col + one matmul, then ONE pass
                       adding the bias, clipping at 0 and pooling (the activation is
                       never written out): bitwise the two references in the tests
    max_pool_relu_backward  the pool's backward with the ReLU's mask (from the pooled
                       output: the ReLU's value at the arg-max), one pass instead of two
    conv2d_relu_pool_backward  the pair's backward, general path (any pool): per block
                       of images, the pool's backward with the ReLU's mask, im2col, the
                       block's part of dW (BLAS), db's per-image sums, dx; the parts
                       added in float64 in block order. Where the pool's windows do not
                       overlap and the conv has enough input channels, kernels/
                       cpu_conv_pool.py's walk adds only the arg-max terms instead; with
                       one input channel and no dX, kernels/cpu_conv1.py does both ways.
    relu_backward      dz = dy where y > 0 else 0, one pass (NaN in y gives 0, as the
                       reference's ``y > 0``)

Measured with ``python -m benchmarks.breakdown --clock cpu`` (one thread, CPU time of
this process, so that other jobs on the machine do not count): the step went from 21.3
to 8.5 ms; the image layers (conv, pooling, their backward) from 17.9 to 5.0 ms. Then
(issue 25, ``python -m benchmarks.breakdown``, wall clock, this 2-core machine shared
with other work): im2col by flat runs (one copy per kernel row; 0.94 -> 0.40 ms for the
lab's 43,264 x 9 matrix), the blocks of images on threads, and the arg-max backward
(kernels/cpu_conv_pool.py): benchmarks/RESULTS.md, "CPU ConvNets, fused backward".

Equivalence with the references (tests/test_kernels_cpu_loops.py checks each on awkward
shapes: odd sizes, strides, "same", ties, NaN):

    * conv forward, pooling forward and the ReLU backward: bitwise equal (the same
      operations in the same order; the same BLAS call for the conv);
    * pooling backward: bitwise equal when windows do not overlap (strides >= pool,
      Keras's default), each input getting at most one term; with overlap an input's
      terms are added in output-pixel order instead of window-position order
      (equal to float32 rounding);
    * the conv's db and dx: the same sums in another order (float32 rounding); dW is
      the reference's own matmul (``conv2d_backward``), or its blocks' products added
      in float64 (``conv2d_relu_pool_backward``: float32 rounding).

Every loop's order of additions depends only on the shapes, never on the threads: the
blocks of images (``PARTS`` of them, fixed by the batch size) run on ``product_threads()``
threads where cores are free (``run_parts``), or the loops over images on Numba's threads
(``prange``, ``MIRRORED_CPU_PARALLEL=1``; see ``PARALLEL``), each image writing only its
own outputs, and partial sums are combined in a fixed order. So the result is the same on every run, with any thread
count, and on every replica (the replicas of a MirroredStrategy stay bitwise equal).

Numba compiles each loop on its first call (seconds; ``cache=True`` keeps the machine
code in ``__pycache__`` for the next process, where that folder is ours alone:
``disk_cache.trusted_for``, as numba's files are pickles).

Neighbours: kernels/conv2d.py and kernels/pooling.py (the references, the geometry and
the CUDA kernels these loops mirror), kernels/cpu_conv_pool.py (the pair's backward by
its arg-max terms), kernels/cpu_conv1.py (the pair for one input channel: the lab's first
conv), mirrored/backends.py (``CpuOps`` calls these).
"""
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit, prange

from kernels import disk_cache
from kernels.conv2d import conv2d_output_shape, window_geometry
from kernels.pooling import pool_geometry

#: Serial by default. ``MIRRORED_CPU_PARALLEL=1`` (read at import) runs the loops over
#: images on Numba's threads instead (``prange``; NUMBA_NUM_THREADS of them), each
#: iteration writing only its own image's outputs, so the result does not depend on the
#: thread count. Not the default: Numba's threads and OpenBLAS's own (which keep
#: spinning after a GEMM) fight over the cores. Measured on 2 quiet cores, the lab
#: ConvNet's step: 7.1-7.6 ms serial, 47.5 ms parallel, 6.97 ms parallel with
#: OPENBLAS_NUM_THREADS=1 (README, "The course lab's ConvNet on the CPU"). Parallel
#: loops are not cached (a cache entry does not record how its code was compiled).
PARALLEL = os.environ.get("MIRRORED_CPU_PARALLEL", "0") == "1"
#: cache=: numba keeps each compiled loop on disk, where that folder is ours alone
#: (kernels/disk_cache.py, trusted_for: its files are pickles).
_CACHE = disk_cache.trusted_for(__file__)
_JIT = dict(cache=_CACHE, nogil=True)
_PAR = dict(nogil=True, parallel=True) if PARALLEL else _JIT
#: Calls are serialised by ``_LOCK``: Numba's fallback threading layer (workqueue, where
#: OpenMP is missing) must not be entered by two threads at once, and a custom loop's
#: ``strategy.run`` gives each replica a thread.
_LOCK = threading.Lock()


# --- the convs' products, split over threads ---------------------------------------------------

#: A product (the conv's forward, dW, dX) is split over threads only past this many
#: multiply-adds: below it, handing a part to another thread (~50 us) costs more than
#: it saves. The lab ConvNet's first conv (43264 x 9 x 32: 12.5 M) stays whole; the
#: two-conv model's second (7744 x 288 x 64: 143 M) is split.
SPLIT_MIN_MADDS = 20_000_000
#: ``MIRRORED_CPU_THREADS``: how many threads the convs' products are split over; unset
#: or "auto": the cores that fit, the cores this process may use less the other work
#: running at that moment (the kernel's count of runnable threads, /proc/loadavg's 4th
#: field, less this one: the pool's threads are idle between products; not the 1-minute
#: average, which lags and counts our own threads, so 2 threads would talk it down to 1
#: and back), at least 1. Each part
#: is one BLAS call on one BLAS thread (mirrored/backends.py's policy); the parts' threads
#: block, never spin, while they wait, so a core taken by something else slows its part
#: but stalls nothing (issue 25). On this 2-core machine under a load average of 11 from
#: other work, two parts made the two-conv model's second conv slower (forward 6.8 ->
#: 9.8 ms, best of 20), hence the load rule.
THREADS_VAR = "MIRRORED_CPU_THREADS"
_POOL = {}


def _other_runnable():
    """Threads of other work runnable right now (/proc/loadavg: "1.2 0.9 0.7 3/412 99" has
    3 runnable, this one among them); 0 where the kernel does not say."""
    try:
        with open("/proc/loadavg") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, IndexError, ValueError):
        return 0


def usable_cores():
    """The CPU cores this process may run on (its affinity where the OS says, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def product_threads():
    """The threads a large conv product is split over (``THREADS_VAR``). A bad value
    raises ValueError saying what is accepted."""
    raw = os.environ.get(THREADS_VAR, "").strip().lower()
    if raw in ("", "auto"):
        cores = usable_cores()
        return max(1, min(cores, cores - _other_runnable()))
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ValueError(f"{THREADS_VAR}={raw!r}: expected 'auto' or a whole number of threads >= 1 "
                     f"(unset: auto, the cores free of other work).")


#: A large product is always cut in this many row blocks, whatever the thread count, so
#: that its result depends on the shapes only: BLAS may round a block's rows differently
#: from the whole (other edge kernels), and the replicas of a MirroredStrategy, run one
#: after another while the load and so the thread count changes, must stay bitwise equal.
PARTS = 4


def matmul_rows(a, b, out):
    """``np.matmul(a, b, out=out)`` for 2-D float32 ``a`` (M, K), ``b`` (K, N), ``out``
    (M, N) C-contiguous. A large product (``SPLIT_MIN_MADDS``) is cut in ``PARTS`` blocks
    of rows, one BLAS call each, run on ``product_threads()`` threads (this one and a
    pool's): the same bits with any thread count, equal to the single call to float32
    rounding (tests/test_cpu_conv_fused.py); a small one is the single call."""
    m = a.shape[0]
    if m < PARTS or m * a.shape[1] * b.shape[1] < SPLIT_MIN_MADDS:
        return np.matmul(a, b, out=out)
    bounds = [m * i // PARTS for i in range(PARTS + 1)]
    run_parts([(np.matmul, (a[lo:hi], b, out[lo:hi])) for lo, hi in zip(bounds[:-1], bounds[1:])])
    return out


#: A product whose inner dimension K is at least this many times its output's longer
#: side is cut along K (``matmul_split``): the dense layer's forward (64 x 5408 x 64) cut
#: in rows read all of W (1.4 MB) once per block; cut along K each block reads its own
#: quarter of x and W, and the 64 x 64 partial products are added afterwards.
K_SPLIT_RATIO = 8


def matmul_split(a, b, out):
    """``np.matmul(a, b, out=out)`` for 2-D float32 arrays (``a`` and ``b`` may be
    transposed views, as the dense layer's x^T and W^T), a large product
    (``SPLIT_MIN_MADDS``) cut in ``PARTS`` blocks: along K when K is ``K_SPLIT_RATIO``
    times the output's longer side or more (the dense layer's forward, 64 x 64 from
    K = 5408: each block's partial product, the blocks then added in float64 in order),
    else along the longer side of ``out``: rows when M >= N (``matmul_rows``; the dense
    layer's dW, 5408 x 64), else columns (its dx, 64 x 5408), each a BLAS call writing its
    own block, run on ``product_threads()`` threads. The blocks are fixed by the shapes:
    the same bits with any thread count, equal to the single call to float32 rounding.
    Measured on the lab ConvNet's dense layer (this 2-core machine, its other core free):
    forward 0.50 -> 0.39 ms, dW 0.51 -> 0.34, dx 0.61 -> 0.39; on one thread the blocks
    cost up to 0.13 ms more than the single calls. The forward cut along K instead of in
    rows (median of 300, load 0.4-0.7): 0.44 -> 0.35 ms on two threads, 0.63 -> 0.51 on
    one (the single call: 0.48)."""
    m, n = out.shape
    k = a.shape[1]
    if m * k * n >= SPLIT_MIN_MADDS and k >= K_SPLIT_RATIO * max(m, n):
        bounds = [k * i // PARTS for i in range(PARTS + 1)]
        parts = np.empty((PARTS, m, n), np.float32)        # each block of K's product
        run_parts([(np.matmul, (a[:, lo:hi], b[lo:hi], parts[i]))
                   for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])
        out[...] = add_in_order(parts)                     # in block order, float64
        return out
    if m >= n or m * k * n < SPLIT_MIN_MADDS or n < PARTS:
        return matmul_rows(a, b, out)
    bounds = [n * i // PARTS for i in range(PARTS + 1)]
    run_parts([(np.matmul, (a, b[:, lo:hi], out[:, lo:hi])) for lo, hi in zip(bounds[:-1], bounds[1:])])
    return out


def run_parts(parts, threads=None):
    """Run ``parts``, a list of ``(function, args)`` each writing only its own outputs, on
    ``threads`` threads (default ``product_threads()``): this one and a pool's, which
    block (never spin) while they wait. Part i goes to thread i % threads, so which
    thread runs a part never changes what it computes; the caller combines the parts'
    results in a fixed order. Compiled loops called here must release the GIL
    (``nogil=True``); with ``MIRRORED_CPU_PARALLEL=1`` (Numba's own threads inside the
    loops, ``_LOCK``) the parts run one after another on this thread."""
    n = 1 if PARALLEL else max(1, min(product_threads() if threads is None else threads, len(parts)))
    pool = _POOL.get(n - 1) if n > 1 else None
    if n > 1 and pool is None:
        pool = _POOL[n - 1] = ThreadPoolExecutor(n - 1, thread_name_prefix="mirrored-cpu")
    theirs = [pool.submit(fn, *args) for i, (fn, args) in enumerate(parts) if i % n] if pool else []
    for fn, args in parts[::n]:                         # this thread's parts; the pool's the rest
        fn(*args)
    for part in theirs:
        part.result()


def threads_note():
    """One line for ``python -m mirrored info``: how the loops over images run."""
    try:
        split = (f"large conv and dense products and conv+pool image blocks split over "
                 f"{product_threads()} thread(s) now "
                 f"({THREADS_VAR}: {os.environ.get(THREADS_VAR) or 'auto, the cores free of other work'})")
    except ValueError as err:
        split = f"invalid: {err}"
    if not PARALLEL:
        return f"{split}; loops serial (MIRRORED_CPU_PARALLEL=1 spreads images over Numba's threads)"
    import numba
    return (f"{split}; loops parallel over images, {numba.get_num_threads()} Numba threads "
            f"(MIRRORED_CPU_PARALLEL=1; NUMBA_NUM_THREADS sets the count)")


def _run(loop, *args):
    if not PARALLEL:                    # serial loops: any number of threads may call them
        return loop(*args)
    with _LOCK:
        return loop(*args)


# --- Windows --------------------------------------------------------------------------------------

@njit(cache=_CACHE, inline="always")
def taps_inside(o, stride, pad, taps, size):
    """The taps ``[lo, hi)`` of output position ``o``'s window that land inside the input:
    0 <= o*stride - pad + t < size (the rest is padding). The loops below walk
    ``range(lo, hi)``, the same taps in the same ascending order as skipping the outside ones."""
    start = o * stride - pad
    return max(0, -start), min(taps, size - start)


# --- Conv2D ----------------------------------------------------------------------------------

@njit(**_PAR)
def _im2col(x, cols, out_h, out_w, kh_n, kw_n, sh, sw, pt, pl):
    """cols[r, t] = x[n, oh*sh - pt + kh, ow*sw - pl + kw, ci], 0 in the padding, for
    r = (n*OH + oh)*OW + ow and t = (kh*KW + kw)*Cin + ci: ``im2col_ref`` in one loop.
    A kernel row's taps (kw, ci) read x[n, ih, iw0:iw0 + KW, :], ONE contiguous run of
    KW*Cin values in channels-last memory whatever the stride, landing in cols[r, kh*KW*Cin:]
    contiguous too: one copy per kernel row (3 values for the lab's Cin = 1, 96 for
    Cin = 32), through flat offsets (``_copy_run``). Zeros first where the window
    leaves the image (padding), then the rows' runs inside it."""
    b, h, wd, cin = x.shape
    run = kw_n * cin
    k = kh_n * run
    xf = x.reshape(-1)
    cf = cols.reshape(-1)
    for n in prange(b):
        for oh in range(out_h):
            kh_lo, kh_hi = taps_inside(oh, sh, pt, kh_n, h)
            for ow in range(out_w):
                r = ((n * out_h + oh) * out_w + ow) * k
                kw_lo, kw_hi = taps_inside(ow, sw, pl, kw_n, wd)
                if kh_hi - kh_lo < kh_n or kw_hi - kw_lo < kw_n:
                    cf[r:r + k] = np.float32(0.0)
                for kh in range(kh_lo, kh_hi):
                    src = ((n * h + oh * sh - pt + kh) * wd + ow * sw - pl + kw_lo) * cin
                    _copy_run(cf, r + kh * run + kw_lo * cin, xf, src, (kw_hi - kw_lo) * cin)


#: Runs (of a kernel row's taps) shorter than this are copied without SIMD lanes.
SHORT_RUN = 8


@njit(cache=_CACHE, inline="always")
def _copy_run(dst, d0, src, s0, count):
    """dst[d0:d0 + count] = src[s0:s0 + count] by unsigned offsets: a signed index makes
    Numba test each for a negative one (Python's wrap-around), which keeps LLVM from
    copying in SIMD lanes. Runs shorter than ``SHORT_RUN`` are copied one value at a time
    (the vector loop's checks cost more than they save there)."""
    if count < SHORT_RUN:
        for j in range(count):
            dst[d0 + j] = src[s0 + j]
    else:
        for j in range(count):
            dst[np.uint64(d0 + j)] = src[np.uint64(s0 + j)]


@njit(**_PAR)
def _col2im(dcols, dx, out_h, out_w, kh_n, kw_n, sh, sw, pt, pl):
    """col2im, the reference's order: dx[n] = 0; for each tap (kh, kw) in order, for each
    output pixel (oh, ow) whose tap lands inside dx, for every ci:
        dx[n, oh*sh - pt + kh, ow*sw - pl + kw, ci] += dcols[r, (kh*KW + kw)*Cin + ci]
    (r = (n*OH + oh)*OW + ow). Each input pixel gets its taps' terms in tap order, as
    ``conv2d_backward_ref``'s loop over (i, j) adds whole slices: bitwise the same sums."""
    b, h, wd, cin = dx.shape
    for n in prange(b):                     # image n's rows of dcols write only dx[n]
        dx[n] = 0.0
        for kh in range(kh_n):
            for kw in range(kw_n):
                t = (kh * kw_n + kw) * cin
                oh_lo, oh_hi = outputs_touching(kh, sh, pt, out_h, h)
                ow_lo, ow_hi = outputs_touching(kw, sw, pl, out_w, wd)
                for oh in range(oh_lo, oh_hi):
                    ih = oh * sh - pt + kh
                    for ow in range(ow_lo, ow_hi):
                        src = dcols[(n * out_h + oh) * out_w + ow]
                        dst = dx[n, ih, ow * sw - pl + kw]
                        for ci in range(cin):
                            dst[ci] += src[t + ci]


@njit(cache=_CACHE, inline="always")
def outputs_touching(tap, stride, pad, n_out, size):
    """The outputs ``[lo, hi)`` whose tap ``tap`` lands inside the input:
    0 <= o*stride - pad + tap < size."""
    lo = max(0, -(-(pad - tap) // stride))         # ceil((pad - tap) / stride), at least 0
    hi = min(n_out, (size - 1 + pad - tap) // stride + 1)
    return lo, max(lo, hi)


@njit(**_PAR)
def _bias_act(out, bias, relu):
    """out[r, :] = relu(out[r, :] + bias), in place (NaN stays NaN, as np.maximum)."""
    for r in prange(out.shape[0]):
        o = out[r]
        for co in range(out.shape[1]):
            v = o[co] + bias[co]
            o[co] = np.float32(0.0) if relu and v < 0.0 else v


@njit(**_PAR)
def _column_sums(d, out, rows_per_part):
    """out[c] = sum over rows of d[:, c]: float32 partial sums over ``rows_per_part``
    consecutive rows (one image's pixels; in parallel), added to a float64 total in
    part order (the same order whatever the threads)."""
    n_parts = (d.shape[0] + rows_per_part - 1) // rows_per_part
    parts = np.zeros((n_parts, d.shape[1]), np.float32)
    for p in prange(n_parts):
        _image_sums(d, parts, rows_per_part, p, p + 1)
    for c in range(d.shape[1]):
        total = 0.0
        for p in range(n_parts):
            total += np.float64(parts[p, c])
        out[c] = total


def conv2d_forward(x, kernel, bias, out, strides=1, padding="valid", relu=False, cols=None):
    """``conv2d_ref(x, kernel, bias, strides, padding, relu)`` written into ``out``
    (B, OH, OW, Cout) float32: x (B, H, W, Cin), kernel (KH, KW, Cin, Cout), bias (Cout,)
    or None, all float32. The reference's own method (im2col, then one matmul, here
    straight into ``out``), with the column matrix made by one compiled loop instead of
    a strided copy and the bias and ReLU in one pass. ``cols``: a (B*OH*OW, KH*KW*Cin)
    float32 buffer to reuse (the CPU device keeps one), else one is made."""
    b, out_h, out_w, cout = shape = conv2d_output_shape(x.shape, kernel.shape, strides, padding,
                                                        "conv2d_forward")
    check_out("conv2d_forward", out, shape)
    cols = _columns(x, kernel.shape, out_h, out_w, strides, padding, cols)
    out2 = out.reshape(b * out_h * out_w, cout)          # a view: out is C-contiguous
    matmul_rows(cols, kernel.reshape(-1, cout), out2)    # (B*OH*OW, Cout)
    if bias is not None or relu:
        _run(_bias_act, out2, np.zeros(cout, np.float32) if bias is None else bias, bool(relu))
    return out


def conv2d_backward(x, kernel, dy, dx, dw, db, strides=1, padding="valid", cols=None):
    """``conv2d_backward_ref`` written into dw (KH, KW, Cin, Cout), db (Cout,) or None, and
    dx (B, H, W, Cin) unless it is None (a first layer: no earlier layer needs it, and
    it is not computed). dW = cols^T @ dy as the reference (one matmul); db by
    ``_column_sums``; dx = col2im(dy @ W^T) as the reference: the product by BLAS into
    ``cols`` (dW has used it), the col2im by ``_col2im`` (no temporaries)."""
    b, out_h, out_w, cout = shape = conv2d_output_shape(x.shape, kernel.shape, strides, padding,
                                                        "conv2d_backward")
    check_out("conv2d_backward: dy", dy, shape)
    check_out("conv2d_backward: dw", dw, tuple(kernel.shape))
    dy2 = dy.reshape(b * out_h * out_w, cout)
    cols = _columns(x, kernel.shape, out_h, out_w, strides, padding, cols)
    matmul_rows(cols.T, dy2, dw.reshape(-1, cout))       # (KH*KW*Cin, Cout)
    if db is not None:
        _run(_column_sums, dy2, db, max(out_h * out_w, 1))
    if dx is not None:
        check_out("conv2d_backward: dx", dx, tuple(x.shape))
        (sh, sw), (pt, pl) = strides_pads(x.shape, kernel.shape[:2], strides, padding)
        # dcols = dy @ W^T (BLAS) into the column buffer, free now that dW is made
        matmul_rows(dy2, kernel.reshape(-1, cout).T, cols)     # (B*OH*OW, KH*KW*Cin)
        _run(_col2im, cols, dx, out_h, out_w, kernel.shape[0], kernel.shape[1], sh, sw, pt, pl)
    return dx, dw, db


def cols_shape(x_shape, kernel_shape, strides=1, padding="valid"):
    """The column matrix's shape (B*OH*OW, KH*KW*Cin), for a caller keeping the buffer."""
    b, out_h, out_w, _ = conv2d_output_shape(x_shape, kernel_shape, strides, padding, "cols_shape")
    return b * out_h * out_w, int(np.prod(kernel_shape[:3]))


def _columns(x, kernel_shape, out_h, out_w, strides, padding, cols):
    (sh, sw), (pt, pl) = strides_pads(x.shape, kernel_shape[:2], strides, padding)
    shape = (x.shape[0] * out_h * out_w, int(np.prod(kernel_shape[:3])))
    if cols is None:
        cols = np.empty(shape, np.float32)
    check_out("conv2d: cols", cols, shape)
    _run(_im2col, x, cols, out_h, out_w, kernel_shape[0], kernel_shape[1], sh, sw, pt, pl)
    return cols


def strides_pads(x_shape, kernel_hw, strides, padding):
    """``((sh, sw), (pad_top, pad_left))`` of a conv over an NHWC input, as the loops take them."""
    _, _, (pt, _, pl, _) = window_geometry("conv2d", x_shape[1:3], kernel_hw, strides, padding)
    sh, sw = (strides, strides) if isinstance(strides, (int, np.integer)) else tuple(strides)
    return (int(sh), int(sw)), (pt, pl)


def check_out(what, out, shape):
    """A ValueError naming ``what`` unless ``out`` is float32 of ``shape`` (before anything is written)."""
    if tuple(out.shape) != tuple(shape) or out.dtype != np.float32:
        raise ValueError(f"{what}: expected a float32 array of shape {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}.")


# --- MaxPooling2D ------------------------------------------------------------------------------

@njit(**_PAR)
def _max_pool_forward(x, out, arg, ph_n, pw_n, sh, sw, pt, pl, bias, relu):
    """Loop nest (max_pool_v1's, with the window positions outside the channel loop so
    that the loop over c, contiguous in NHWC, runs in SIMD lanes):
        for each output pixel (n, oh, ow):
            the window's first position inside x: out[n, oh, ow, :] = x[...], arg = its position
            each later position (a, b) inside x, in row-major order, for every c:
                v = x[n, oh*sh - pt + a, ow*sw - pl + b, c]
                take = v > best or (isnan(v) and not isnan(best));  if take: best, k = v, a*PW + b
    which is max_pool_ref's rule: the first maximum, or the first NaN.

    With ``bias`` (not None) each value read is first ``v + bias[c]``, then, with ``relu``,
    ``0 if v < 0`` (``_bias_act``'s arithmetic): the pooling of a conv's output whose bias
    and ReLU were never written out (``conv2d_relu_pool``). ``bias=None`` compiles a
    version without that step (Numba prunes the branch for a None argument)."""
    b, h, wd, ch = x.shape
    out_h, out_w = out.shape[1], out.shape[2]
    xf, of, af = x.reshape(-1), out.reshape(-1), arg.reshape(-1)   # flat: see _copy_run
    for n in prange(b):
        for oh in range(out_h):
            a_lo, a_hi = taps_inside(oh, sh, pt, ph_n, h)
            for ow in range(out_w):
                o = ((n * out_h + oh) * out_w + ow) * ch
                b_lo, b_hi = taps_inside(ow, sw, pl, pw_n, wd)
                first = True
                for a in range(a_lo, a_hi):
                    for bb in range(b_lo, b_hi):
                        xo = ((n * h + oh * sh - pt + a) * wd + ow * sw - pl + bb) * ch
                        pos = np.int32(a * pw_n + bb)
                        if first:
                            for c in range(ch):
                                v = xf[np.uint64(xo + c)]
                                if bias is not None:
                                    v = v + bias[c]
                                    v = np.float32(0.0) if relu and v < 0.0 else v
                                of[np.uint64(o + c)] = v
                                af[np.uint64(o + c)] = pos
                            first = False
                        else:
                            for c in range(ch):
                                v = xf[np.uint64(xo + c)]
                                if bias is not None:
                                    v = v + bias[c]
                                    v = np.float32(0.0) if relu and v < 0.0 else v
                                best = of[np.uint64(o + c)]
                                take = (v > best) | ((v != v) & (best == best))   # v != v: isnan(v)
                                of[np.uint64(o + c)] = v if take else best
                                af[np.uint64(o + c)] = pos if take else af[np.uint64(o + c)]


@njit(**_PAR)
def _max_pool_backward(dy, arg, dx, ph_n, pw_n, sh, sw, pt, pl, y):
    """Loop nest: dx[:] = 0; for each output pixel (n, oh, ow), window position (a, b)
           inside dx, for every c: dx[n, ih, iw, c] += dy[n, oh, ow, c] if arg[n, oh, ow, c] == a*PW + b else 0
    With ``y`` (the pooled output, not None), dy[n, oh, ow, c] counts only where
    y[n, oh, ow, c] > 0: the ReLU before the pool, whose output at the arg-max IS the
    pooled value, so its mask is known here (``max_pool_relu_backward``)."""
    h, wd = dx.shape[1], dx.shape[2]
    out_h, out_w, ch = dy.shape[1], dy.shape[2], dy.shape[3]
    df, gf, xf = dy.reshape(-1), arg.reshape(-1), dx.reshape(-1)     # flat: see _copy_run
    yf = y.reshape(-1) if y is not None else None
    for n in prange(dy.shape[0]):           # image n's windows write only dx[n]
        xf[n * h * wd * ch:(n + 1) * h * wd * ch] = 0.0
        for oh in range(out_h):
            a_lo, a_hi = taps_inside(oh, sh, pt, ph_n, h)
            for ow in range(out_w):
                o = ((n * out_h + oh) * out_w + ow) * ch
                b_lo, b_hi = taps_inside(ow, sw, pl, pw_n, wd)
                for a in range(a_lo, a_hi):
                    for bb in range(b_lo, b_hi):
                        r = ((n * h + oh * sh - pt + a) * wd + ow * sw - pl + bb) * ch
                        pos = a * pw_n + bb
                        if yf is None:
                            for c in range(ch):
                                take = gf[np.uint64(o + c)] == pos
                                xf[np.uint64(r + c)] += df[np.uint64(o + c)] if take else np.float32(0.0)
                        else:
                            for c in range(ch):
                                take = (gf[np.uint64(o + c)] == pos) & (yf[np.uint64(o + c)] > 0.0)
                                xf[np.uint64(r + c)] += df[np.uint64(o + c)] if take else np.float32(0.0)


def max_pool_forward(x, out, arg, pool_size=2, strides=None, padding="valid"):
    """``max_pool_ref`` written into out (B, OH, OW, C) float32 and arg (B, OH, OW, C) int32."""
    shape, (ph, pw), (sh, sw), (pt, _, pl, _) = pool_geometry(x.shape, pool_size, strides,
                                                              padding, "max_pool_forward")
    check_out("max_pool_forward: out", out, shape)
    if tuple(arg.shape) != shape or arg.dtype != np.int32:
        raise ValueError(f"max_pool_forward: arg must be int32 of shape {shape}, got "
                         f"{arg.dtype} {tuple(arg.shape)}.")
    _run(_max_pool_forward, x, out, arg, ph, pw, sh, sw, pt, pl, None, False)
    return out, arg


def max_pool_backward(dy, arg, dx, pool_size=2, strides=None, padding="valid"):
    """``max_pool_backward_ref`` written into dx (B, H, W, C) float32."""
    shape, (ph, pw), (sh, sw), (pt, _, pl, _) = pool_geometry(dx.shape, pool_size, strides,
                                                              padding, "max_pool_backward")
    check_out("max_pool_backward: dy", dy, shape)
    _run(_max_pool_backward, dy, arg, dx, ph, pw, sh, sw, pt, pl, None)
    return dx


def max_pool_relu_backward(dy, arg, y, dx, pool_size=2, strides=None, padding="valid"):
    """The gradient through ReLU then max-pool in one pass, into dx (B, H, W, C) float32:
    ``relu_backward_ref(max_pool_backward_ref(dy, arg, ...), relu_out)``, where the ReLU's
    output at each arg-max is the pooled output ``y`` (B, OH, OW, C): dy counts where
    y > 0 (NaN: not counted, as ``y > 0``). Bitwise the two passes' result where windows
    do not overlap."""
    shape, (ph, pw), (sh, sw), (pt, _, pl, _) = pool_geometry(dx.shape, pool_size, strides,
                                                              padding, "max_pool_relu_backward")
    check_out("max_pool_relu_backward: dy", dy, shape)
    check_out("max_pool_relu_backward: y", y, shape)
    _run(_max_pool_backward, dy, arg, dx, ph, pw, sh, sw, pt, pl, y)
    return dx


#: A Conv2D(relu) + MaxPooling2D pair is run in ``PARTS`` blocks of images on
#: ``product_threads()`` threads past this many multiply-adds in its product (each block:
#: im2col, its BLAS product, the pooling pass; a few hundred microseconds for the lab
#: ConvNet's conv at 12.5 M, far above the ~50 us of handing a block to a thread).
PIPELINE_MIN_MADDS = 2_000_000


def add_in_order(parts):
    """The float64 sum of ``parts`` (each block's float32 result, e.g. its share of dW),
    added in block order: the same bits whatever thread computed which block."""
    total = parts[0].astype(np.float64)
    for part in parts[1:]:
        total += part
    return total


def image_blocks(b):
    """The ``PARTS`` fixed blocks of a batch's images ``[(n0, n1), ...]`` (fewer for a
    batch under PARTS, none empty): the shapes alone decide them, never the threads."""
    parts = min(PARTS, b)
    bounds = [b * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _pair_threads(madds):
    return None if madds >= PIPELINE_MIN_MADDS else 1


def conv2d_relu_pool(x, kernel, bias, out, arg, strides=1, padding="valid", pool_size=2,
                     pool_strides=None, pool_padding="valid", cols=None, z=None):
    """``max_pool_ref(conv2d_ref(x, kernel, bias, strides, padding, relu=True), pool_size,
    pool_strides, pool_padding)`` written into out (B, PH, PW, Cout) float32 and arg
    (B, PH, PW, Cout) int32: for each block of images (``image_blocks``), im2col and ONE
    matmul into ``z`` (B, OH, OW, Cout), the conv before its bias, then one pass adding
    the bias, clipping at 0 and pooling (``_max_pool_forward`` with a bias), so the
    activation is never written out and read back. The blocks run on threads where cores
    are free (``run_parts``). Which equality holds: z is the reference's product to
    float32 rounding, not bitwise (BLAS does not promise a block of rows the whole
    product's bits; OpenBLAS on an AMD EPYC differed by an ulp where SkylakeX did not);
    the bias, ReLU and pool of that z are the references' bitwise (our loop's order); and
    the blocks are fixed by the batch size, so the bits never depend on the threads
    (tests/test_cpu_conv_fused.py checks all three).
    ``cols``, ``z``: buffers to reuse (the CPU device keeps them), else made. The
    backward: ``conv2d_relu_pool_backward``."""
    b, out_h, out_w, cout = conv_shape = conv2d_output_shape(x.shape, kernel.shape, strides,
                                                             padding, "conv2d_relu_pool")
    shape, (ph, pw), (psh, psw), (ppt, _, ppl, _) = pool_geometry(
        conv_shape, pool_size, pool_strides, pool_padding, "conv2d_relu_pool")
    check_out("conv2d_relu_pool: out", out, shape)
    if tuple(arg.shape) != shape or arg.dtype != np.int32:
        raise ValueError(f"conv2d_relu_pool: arg must be int32 of shape {shape}, got "
                         f"{arg.dtype} {tuple(arg.shape)}.")
    if z is None:
        z = np.empty(conv_shape, np.float32)
    check_out("conv2d_relu_pool: z", z, conv_shape)
    (sh, sw), (pt, pl) = strides_pads(x.shape, kernel.shape[:2], strides, padding)
    k_rows = int(np.prod(kernel.shape[:3]))
    if cols is None:
        cols = np.empty((b * out_h * out_w, k_rows), np.float32)
    check_out("conv2d: cols", cols, (b * out_h * out_w, k_rows))
    w2 = kernel.reshape(-1, cout)
    z2 = z.reshape(-1, cout)
    bias = np.zeros(cout, np.float32) if bias is None else bias
    per_image = out_h * out_w

    def block(n0, n1):
        r0, r1 = n0 * per_image, n1 * per_image
        _run(_im2col, x[n0:n1], cols[r0:r1], out_h, out_w, kernel.shape[0], kernel.shape[1], sh, sw, pt, pl)
        np.matmul(cols[r0:r1], w2, out=z2[r0:r1])
        _run(_max_pool_forward, z[n0:n1], out[n0:n1], arg[n0:n1], ph, pw, psh, psw, ppt, ppl, bias, True)

    run_parts([(block, blk) for blk in image_blocks(b)], _pair_threads(cols.size * cout))
    return out, arg


@njit(**_JIT)
def _image_sums(d, parts, rows_per_image, n0, n1):
    """parts[n, c] = the float32 sum of image n's rows of d (B*rows, C), for n0..n1-1
    (the last image's rows may stop short at d's end)."""
    for n in range(n0, n1):
        p = parts[n]
        p[:] = 0.0
        for r in range(n * rows_per_image, min((n + 1) * rows_per_image, d.shape[0])):
            row = d[r]
            for c in range(d.shape[1]):
                p[c] += row[c]


def conv2d_relu_pool_backward(x, kernel, dy, arg, y, dz, dx, dw, db, strides=1, padding="valid",
                              pool_size=2, pool_strides=None, pool_padding="valid", cols=None,
                              cols_ready=False):
    """``conv2d_relu_pool``'s backward, the general path (any pool): into dw (KH, KW, Cin,
    Cout), db (Cout,) or None and dx (B, H, W, Cin) or None (a first layer), from the
    pooled gradient dy, the arg-max and the pooled output y (B, PH, PW, Cout); ``dz``
    (B, OH, OW, Cout) receives the conv's gradient. For each block of images
    (``image_blocks``), on threads where cores are free: the pool's backward with the
    ReLU's mask into its rows of dz (``max_pool_relu_backward``'s loop), im2col, its part
    of dW = cols^T @ dz (BLAS), each image's float32 sums of dz for db, and dx as
    ``conv2d_backward`` (dcols = dz @ W^T by BLAS into the column buffer, then col2im).
    dW's parts and db's per-image sums are added in float64 in order. So db is bitwise
    ``conv2d_backward``'s (the same sums in the same order), dW and dx the reference's
    products cut in blocks (float32 rounding: BLAS may round a block's rows otherwise
    than the whole's; the blocks are fixed by the batch size). The arg-max walk of
    kernels/cpu_conv_pool.py is the faster path where kernel rows are long.
    ``cols_ready``: ``cols`` still holds the forward's im2col of this very ``x`` (the
    caller knows: mirrored/backends.py's CpuOps), so it is not made again."""
    b, out_h, out_w, cout = conv_shape = conv2d_output_shape(x.shape, kernel.shape, strides, padding,
                                                             "conv2d_relu_pool_backward")
    shape, (ph, pw), (psh, psw), (ppt, _, ppl, _) = pool_geometry(
        conv_shape, pool_size, pool_strides, pool_padding, "conv2d_relu_pool_backward")
    for what, a in (("dy", dy), ("y", y)):
        check_out(f"conv2d_relu_pool_backward: {what}", a, shape)
    check_out("conv2d_relu_pool_backward: dz", dz, conv_shape)
    check_out("conv2d_relu_pool_backward: dw", dw, tuple(kernel.shape))
    if db is not None:
        check_out("conv2d_relu_pool_backward: db", db, (cout,))
    if dx is not None:
        check_out("conv2d_relu_pool_backward: dx", dx, tuple(x.shape))
    (sh, sw), (pt, pl) = strides_pads(x.shape, kernel.shape[:2], strides, padding)
    k_rows = int(np.prod(kernel.shape[:3]))
    if cols is None:
        cols = np.empty((b * out_h * out_w, k_rows), np.float32)
    check_out("conv2d: cols", cols, (b * out_h * out_w, k_rows))
    blocks = image_blocks(b)
    parts = np.empty((len(blocks), k_rows, cout), np.float32)
    sums = np.empty((b, cout), np.float32)
    dz2, w2 = dz.reshape(-1, cout), kernel.reshape(-1, cout)
    per_image = out_h * out_w
    kh_n, kw_n = kernel.shape[:2]

    def block(i, n0, n1):
        r0, r1 = n0 * per_image, n1 * per_image
        _run(_max_pool_backward, dy[n0:n1], arg[n0:n1], dz[n0:n1], ph, pw, psh, psw, ppt, ppl, y[n0:n1])
        if not cols_ready:
            _run(_im2col, x[n0:n1], cols[r0:r1], out_h, out_w, kh_n, kw_n, sh, sw, pt, pl)
        np.matmul(cols[r0:r1].T, dz2[r0:r1], out=parts[i])
        if db is not None:
            _image_sums(dz2, sums, max(per_image, 1), n0, n1)
        if dx is not None:
            np.matmul(dz2[r0:r1], w2.T, out=cols[r0:r1])
            _run(_col2im, cols[r0:r1], dx[n0:n1], out_h, out_w, kh_n, kw_n, sh, sw, pt, pl)

    madds = cols.size * cout * (1 if dx is None else 2)
    run_parts([(block, (i, n0, n1)) for i, (n0, n1) in enumerate(blocks)], _pair_threads(madds))
    dw[...] = add_in_order(parts).reshape(kernel.shape)
    if db is not None:
        db[...] = sums.astype(np.float64).sum(axis=0)
    return dx, dw, db


# --- ReLU backward -------------------------------------------------------------------------------

@njit(**_PAR)
def _relu_backward(dy, y, out):
    for i in prange(out.size):
        out[i] = dy[i] if y[i] > 0.0 else np.float32(0.0)


@njit(**_PAR)
def _relu_backward_in_place(d, y):
    # out is dy: a loop of its own (with ``out`` and ``dy`` the same array passed twice,
    # the compiled loop ran 30x slower, measured here: it cannot know they alias).
    for i in prange(d.size):
        d[i] = d[i] if y[i] > 0.0 else np.float32(0.0)


def relu_backward(dy, y, out):
    """``relu_backward_ref(dy, y, out)`` in one pass, C-contiguous float32 arrays of one
    size, ``out`` either separate or ``dy`` itself (the layers' in-place use); else the
    reference."""
    flat = [a.reshape(-1) if a.flags.c_contiguous else None for a in (dy, y, out)]
    ok = (all(f is not None for f in flat) and dy.dtype == y.dtype == out.dtype == np.float32
          and dy.size == y.size == out.size)
    if ok and out.ctypes.data == dy.ctypes.data and not np.shares_memory(dy, y):
        _run(_relu_backward_in_place, flat[0], flat[1])
    elif ok and not np.shares_memory(out, dy) and not np.shares_memory(out, y):
        _run(_relu_backward, flat[0], flat[1], flat[2])
    else:
        from kernels.activations import relu_backward_ref
        relu_backward_ref(dy, y, out)
    return out

