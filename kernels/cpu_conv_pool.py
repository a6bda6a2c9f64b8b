"""Conv2D(relu) + MaxPooling2D's backward on the CPU, touching only the pooled pixels.

Why. A max-pool whose windows do not overlap (strides >= pool size; Keras's default
2x2) keeps ONE conv pixel per window and channel, its arg-max; its backward sends the
pooled gradient there and zero everywhere else, and the ReLU before it zeroes more
(where the pooled value is 0). The general path (kernels/cpu_loops.py
``conv2d_relu_pool_backward``) writes that mostly-zero gradient dz out in full and
multiplies over every pixel: dW = cols^T @ dz, dX = col2im(dz @ W^T). The loops here read the pooled gradient dy, the arg-max and the
pooled output y (for the ReLU's mask: the ReLU's value at the arg-max IS the pooled
value) and add each surviving term straight into dW, db and dX, never writing dz:

    the two-conv model's second conv (13x13x32 -> 11x11x64 -> pool 5x5x64), batch 64:
        dW  64*5*5*64*288 = 29.5 M multiply-adds instead of 7744 x 288 x 64 = 143 M,
        dX  the same. Timed alone on this 2-core machine (batch 64, random inputs, 71 %
        of the pooled values > 0, load ~1.2 from other work), one thread: 11.3 ms for
        the general path (pool backward, im2col, two BLAS products, col2im), 5.4 ms
        here; 2.6 ms here on two threads.

The walk ("gather"): for each window and output channel co whose pooled value is > 0,
the arg-max pixel p; a kernel row kh of p's window reads x[n, ih, iw0:iw0 + KW, :], ONE
contiguous run of KW*Cin values in channels-last memory whatever the stride, so

    _gather(into_x=False)   dW^T[co, kh, :] += g * (row kh of p's window in x)
    _gather(into_x=True)    (row kh of p's window in dX) += g * W^T[co, kh, :]

each a SIMD loop over KW*Cin values (96 for Cin = 32), the window's four pixels' runs
found once per window (``_window_runs``), the channels in blocks (``CHANNEL_BLOCK``) so
that the block's rows of dW^T stay in the L1 cache. It pays only where that run is long
(``pays``: KW*Cin >= ``SMALL_RUN``): for the lab ConvNet's first conv (Cin = 1, runs of
3 values) the general path, whose dW is a BLAS product, is faster (timed alone, one
thread: 3.7 vs 1.8 ms), and kernels/cpu_conv1.py (SIMD across output channels) faster
still; mirrored/backends.py's ``CpuOps.conv2d_relu_pool_backward`` chooses.

Order of sums and equivalence (tests/test_cpu_fused_backward.py): the reference's terms
without its zeros, added in a fixed order of (image block, channel block, window,
channel, kernel row): equal to ``conv2d_backward_ref`` to float32 rounding. Images are
cut in fixed blocks (``cpu_loops.image_blocks``); each block sums its own dW (float32), the
blocks are added in float64 in block order, db likewise per image: the same bits with
any thread count (``cpu_loops.run_parts`` runs the blocks on ``product_threads()``
threads) and on every replica. No FMA: Numba does not contract a*b + c without fastmath.

Neighbours: kernels/cpu_loops.py (the forward ``conv2d_relu_pool``, the general
backward, the thread split), kernels/conv2d.py and kernels/pooling.py (the references
and the geometry), mirrored/backends.py (``CpuOps`` calls ``backward`` where ``pays``).
"""
import numpy as np
from numba import njit

from kernels import cpu_loops, disk_cache
from kernels.conv2d import conv2d_output_shape
from kernels.cpu_loops import add_in_order, check_out, image_blocks, run_parts, strides_pads, taps_inside
from kernels.pooling import pool_geometry

#: The shortest contiguous run of input values per kernel row (KW * Cin) for which the
#: gather walk beats the general path: one AVX-512 vector of float32 (Cin = 1 reads
#: runs of 3; Cin = 32 runs of 96).
SMALL_RUN = 16
#: The gather walks the channels in blocks of this many, each block over all of an
#: image's windows: the block's rows of dW^T (16 x 288 floats for Cin = 32: 18 KB)
#: and the image stay in the L1 cache while it runs.
CHANNEL_BLOCK = 16
#: cache=: numba keeps each compiled loop on disk, where that folder is ours alone
#: (kernels/disk_cache.py, trusted_for: its files are pickles).
_CACHE = disk_cache.trusted_for(__file__)
_JIT = dict(cache=_CACHE, nogil=True)


# --- geometry ------------------------------------------------------------------------------------

def conv_pool_geometry(x_shape, kernel_shape, strides, padding, pool_size, pool_strides,
                       pool_padding, what):
    """``(pooled_shape, geometry)``: the pool's output shape (B, QH, QW, Cout) and the
    loops' ``shape`` vector (H, W, Cin, KH, KW, Cout, OH, OW, QH, QW, sh, sw, pt, pl, PH,
    PW, psh, psw, ppt, ppl), int64; ValueErrors naming ``what`` for wrong shapes."""
    conv_shape = conv2d_output_shape(x_shape, kernel_shape, strides, padding, what)
    pooled, (ph, pw), (psh, psw), (ppt, _, ppl, _) = pool_geometry(conv_shape, pool_size,
                                                                   pool_strides, pool_padding, what)
    (sh, sw), (pt, pl) = strides_pads(x_shape, kernel_shape[:2], strides, padding)
    geometry = np.array([x_shape[1], x_shape[2], x_shape[3], kernel_shape[0], kernel_shape[1],
                         kernel_shape[3], conv_shape[1], conv_shape[2], pooled[1], pooled[2],
                         sh, sw, pt, pl, ph, pw, psh, psw, ppt, ppl], np.int64)
    return pooled, geometry


def windows_overlap(pool_size, pool_strides):
    """True when a pool's windows overlap (a stride smaller than the window): a conv pixel
    may then be the arg-max of two windows, and ``backward`` is not used for it."""
    ph, pw = (pool_size, pool_size) if np.isscalar(pool_size) else pool_size
    if pool_strides is None:
        return False
    sh, sw = (pool_strides, pool_strides) if np.isscalar(pool_strides) else pool_strides
    return sh < ph or sw < pw


def pays(kernel_shape, pool_size, pool_strides):
    """True where ``backward`` is the one to use: non-overlapping pool windows and a
    kernel row reading at least ``SMALL_RUN`` contiguous input values (KW * Cin)."""
    return (not windows_overlap(pool_size, pool_strides)
            and kernel_shape[1] * kernel_shape[2] >= SMALL_RUN)


@njit(cache=_CACHE, inline="always")
def _axpy(dst, d0, src, s0, count, g):
    """dst[d0:d0 + count] += src[s0:s0 + count] * g in SIMD lanes (no FMA: two roundings).
    The loops index flat 1-D arrays by computed offsets: a view made inside a loop
    (x[n, ih]) costs a reference count each time, and a signed index makes Numba test
    for a negative one (Python's wrap-around), which keeps LLVM from using SIMD lanes;
    unsigned offsets do not (measured here: adding a 96-float run took 70 ns with
    signed offsets, 12 ns unsigned)."""
    for j in range(count):
        dst[np.uint64(d0 + j)] += src[np.uint64(s0 + j)] * g


# --- the backward: only the surviving terms ------------------------------------------------------

@njit(cache=_CACHE, inline="always")
def _window_runs(n, qh, qw, shape, kh_lo, kh_hi, x_run, w_run, count):
    """For each position pos = a*PW + b of pooled pixel (n, qh, qw)'s window, the conv
    pixel's taps inside x: kernel rows [kh_lo[pos], kh_hi[pos]), and for row kh_lo the
    offsets of its run in x (``x_run``, flat (B, H, W, Cin)) and in a (KH, KW*Cin) kernel
    row block (``w_run``), ``count`` values long; the next rows are W*Cin further in x,
    KW*Cin further in the kernel. Computed once per window, not per channel."""
    h, wd, cin, kh_n, kw_n = shape[0], shape[1], shape[2], shape[3], shape[4]
    out_h, out_w = shape[6], shape[7]
    sh, sw, pt, pl, ph_n, pw_n, psh, psw, ppt, ppl = shape[10:]
    for a in range(ph_n):
        oh = qh * psh - ppt + a
        for bb in range(pw_n):
            pos = a * pw_n + bb
            ow = qw * psw - ppl + bb
            if oh < 0 or oh >= out_h or ow < 0 or ow >= out_w:     # padding: never an arg-max
                kh_lo[pos] = kh_hi[pos] = 0
                continue
            lo, hi = taps_inside(oh, sh, pt, kh_n, h)
            kw_lo, kw_hi = taps_inside(ow, sw, pl, kw_n, wd)
            kh_lo[pos], kh_hi[pos] = lo, hi
            x_run[pos] = ((n * h + oh * sh - pt + lo) * wd + ow * sw - pl + kw_lo) * cin
            w_run[pos] = lo * kw_n * cin + kw_lo * cin
            count[pos] = (kw_hi - kw_lo) * cin


@njit(**_JIT)
def _gather(x_or_dx, wt_or_dwt, dy, arg, y, shape, n0, n1, into_x):
    """The gather walk, both ways (flat arrays; ``shape``: ``conv_pool_geometry``'s vector).
    Loop nest: for each pooled pixel (n, qh, qw) of images n0..n1-1, each channel co
    with y > 0 (the ReLU's mask; NaN: masked), g = dy there, (oh, ow) its arg-max pixel;
    for each kernel row kh inside x, the run of taps kw_lo..kw_hi-1 and all Cin:
        into_x=False (dW^T, (Cout, KH, KW*Cin)):  dwt[co, kh, run] += g * x[n, ih, iw_lo.., :]
        into_x=True  (dX, zeroed first):          dx[n, ih, iw_lo.., :] += g * wt[co, kh, run]
    (wt: the kernel transposed to (Cout, KH, KW*Cin)). The window's pixels' runs are
    found once per window (``_window_runs``), then each channel only picks one."""
    h, wd, cin, kh_n, kw_n, cout = shape[:6]
    q_h, q_w, ph_n, pw_n = shape[8], shape[9], shape[14], shape[15]
    run, x_row = kw_n * cin, wd * cin
    kh_lo = np.zeros(ph_n * pw_n, np.int64)
    kh_hi = np.zeros(ph_n * pw_n, np.int64)
    x_run = np.zeros(ph_n * pw_n, np.int64)
    w_run = np.zeros(ph_n * pw_n, np.int64)
    count = np.zeros(ph_n * pw_n, np.int64)
    for n in range(n0, n1):
        if into_x:
            x_or_dx[n * h * x_row:(n + 1) * h * x_row] = 0.0
        for c0 in range(0, cout, CHANNEL_BLOCK):
            for qh in range(q_h):
                for qw in range(q_w):
                    _window_runs(n, qh, qw, shape, kh_lo, kh_hi, x_run, w_run, count)
                    o = ((n * q_h + qh) * q_w + qw) * cout
                    for co in range(c0, min(c0 + CHANNEL_BLOCK, cout)):
                        if not y[o + co] > 0.0:
                            continue
                        g = dy[o + co]
                        pos = arg[o + co]
                        xo = x_run[pos]
                        wo = co * kh_n * run + w_run[pos]
                        for kh in range(kh_lo[pos], kh_hi[pos]):
                            if into_x:
                                _axpy(x_or_dx, xo, wt_or_dwt, wo, count[pos], g)
                            else:
                                _axpy(wt_or_dwt, wo, x_or_dx, xo, count[pos], g)
                            xo += x_row
                            wo += run


@njit(**_JIT)
def _db_parts(dy, y, parts, cout, n0, n1):
    """parts[n, co] = image n's float32 sum of dy[n, :, :, co] where y > 0, for n0..n1-1
    (dy, y flat; each image's pixels in order)."""
    per_image = dy.size // parts.shape[0]
    for n in range(n0, n1):
        p = parts[n]
        p[:] = 0.0
        for o in range(n * per_image, (n + 1) * per_image, cout):
            for co in range(cout):
                if y[o + co] > 0.0:
                    p[co] += dy[o + co]


def _run_block(calls):
    """One block of images on one thread: its dW part, its db parts, its dX rows."""
    for fn, args in calls:
        fn(*args)


def backward(x, kernel, dy, arg, y, dx, dw, db, strides=1, padding="valid", pool_size=2,
             pool_strides=None, pool_padding="valid"):
    """The gradients of ``cpu_loops.conv2d_relu_pool``'s pooled output (B, QH, QW, Cout)
    with respect to its input, kernel and bias, from dy (B, QH, QW, Cout), the forward's
    arg (int32) and pooled output y: into dw (KH, KW, Cin, Cout), db (Cout,) or None, dx
    (B, H, W, Cin) or None (a first layer: not computed). ``conv2d_backward_ref(x, kernel,
    relu_backward_ref(max_pool_backward_ref(dy, arg, ...), z))`` to float32 rounding (z:
    the conv's ReLU output), without writing that gradient out (the module's docstring).
    Non-overlapping pool windows only: a ValueError otherwise, before anything is written."""
    what = "conv2d_relu_pool_backward"
    shape, geo = conv_pool_geometry(x.shape, kernel.shape, strides, padding, pool_size,
                                    pool_strides, pool_padding, what)
    if windows_overlap(pool_size, pool_strides):
        raise ValueError(f"{what}: pool windows {pool_size} with strides {pool_strides} overlap; "
                         f"use cpu_loops.max_pool_relu_backward then conv2d_backward for them.")
    for name, a in (("dy", dy), ("y", y)):
        check_out(f"{what}: {name}", a, shape)
    if tuple(arg.shape) != shape or arg.dtype != np.int32:
        raise ValueError(f"{what}: arg must be int32 of shape {shape}, got {arg.dtype} "
                         f"{tuple(arg.shape)}.")
    check_out(f"{what}: dw", dw, tuple(kernel.shape))
    b, cout = x.shape[0], kernel.shape[3]
    if db is not None:
        check_out(f"{what}: db", db, (cout,))
    if dx is not None:
        check_out(f"{what}: dx", dx, tuple(x.shape))
    x1, dy1, arg1, y1 = (np.ascontiguousarray(a).reshape(-1) for a in (x, dy, arg, y))
    blocks = image_blocks(b)
    parts = np.zeros((len(blocks), kernel.size), np.float32)   # each block's dW^T: (Cout, KH*KW*Cin)
    db_parts = np.empty((b, cout), np.float32) if db is not None else None
    if dx is not None:
        wt = np.ascontiguousarray(kernel.reshape(-1, cout).T).reshape(-1)   # W^T: (Cout, KH*KW*Cin)
    tasks = []
    for i, (n0, n1) in enumerate(blocks):
        calls = [(_gather, (x1, parts[i], dy1, arg1, y1, geo, n0, n1, False))]
        if db is not None:
            calls.append((_db_parts, (dy1, y1, db_parts, cout, n0, n1)))
        if dx is not None:
            calls.append((_gather, (dx.reshape(-1), wt, dy1, arg1, y1, geo, n0, n1, True)))
        tasks.append((_run_block, (calls,)))
    madds = b * shape[1] * shape[2] * kernel.size * (1 if dx is None else 2)
    run_parts(tasks, None if madds >= cpu_loops.SPLIT_MIN_MADDS else 1)
    dw[...] = add_in_order(parts).reshape(cout, -1).T.reshape(kernel.shape)   # blocks in order, float64
    if db is not None:
        db[...] = db_parts.astype(np.float64).sum(axis=0)
    return dx, dw, db
