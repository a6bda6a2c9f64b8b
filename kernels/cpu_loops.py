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

    conv2d_forward     out = relu(conv(x, W) + bias): one pass over the output, the
                       KH*KW*Cin taps summed in (kh, kw, ci) order for all Cout channels
                       at once (the inner loop over co is contiguous: SIMD)
    conv2d_grads       dW, db: per image, a float32 partial sum over its output pixels,
                       added to a float64 total in image order (so a sum over 43,264
                       pixels loses no more than the reference's BLAS sum does)
    conv2d_input_grad  dx: each output pixel's dy @ W^T scattered back onto its window,
                       in output-pixel order (only when an earlier layer needs dx)
    max_pool_forward   max and arg-max in one pass over the input, the SAME comparisons
                       in the SAME order as ``max_pool_ref`` and the CUDA kernel: the
                       first maximum in row-major window order, NaN taken first
    max_pool_backward  zero dx, then each output's dy added at its recorded arg-max
    relu_backward      dz = dy where y > 0 else 0, one pass (NaN in y gives 0, as the
                       reference's ``y > 0``)

Equivalence with the references (tests/test_kernels_cpu_loops.py checks each on awkward
shapes: odd sizes, strides, "same", ties, NaN):

    * pooling forward and the ReLU backward: bitwise equal (the same comparisons);
    * pooling backward: bitwise equal when windows do not overlap (strides >= pool,
      Keras's default), each input getting at most one term; with overlap an input's
      terms are added in output-pixel order instead of window-position order
      (equal to float32 rounding);
    * conv forward and gradients: the same sums in another order (the reference's
      order is OpenBLAS's, which depends on the machine), so equal to float32 rounding.

Every loop's order of additions depends only on the shapes, never on threads or timing:
the result is the same on every run and every replica (the replicas of a
MirroredStrategy stay bitwise equal). The loops are serial: OpenBLAS already uses the
cores for the Dense layers' GEMMs, and the image layers of the lab are memory-bound.

Numba compiles each loop on its first call (about a second each; ``cache=True`` keeps
the machine code in ``__pycache__`` for the next process).

Neighbours: kernels/conv2d.py and kernels/pooling.py (the references, the geometry and
the CUDA kernels these loops mirror), mirrored/backends.py (``CpuOps`` calls these).
"""
import math

import numpy as np
from numba import njit

from kernels.conv2d import conv2d_output_shape, window_geometry
from kernels.pooling import pool_geometry

_JIT = dict(cache=True, nogil=True)


# --- Conv2D ----------------------------------------------------------------------------------

@njit(**_JIT)
def _conv2d_forward(x, w, bias, out, sh, sw, pt, pl, relu):
    """Loop nest: for each output pixel (n, oh, ow): acc[:] = 0
                      for t = (kh, kw, ci) in order (taps inside the input):
                          acc[:] += x[n, ih, iw, ci] * W[t, :]      (W: the kernel as (KH*KW*Cin, Cout))
                      out[n, oh, ow, :] = relu(acc + bias)"""
    b, h, wd, cin = x.shape
    kh_n, kw_n, _, cout = w.shape
    out_h, out_w = out.shape[1], out.shape[2]
    wf = w.reshape(kh_n * kw_n * cin, cout).copy()     # contiguous rows, one per tap
    acc = np.empty(cout, np.float32)
    for n in range(b):
        for oh in range(out_h):
            for ow in range(out_w):
                acc[:] = 0.0
                t = 0
                for kh in range(kh_n):
                    ih = oh * sh - pt + kh
                    for kw in range(kw_n):
                        iw = ow * sw - pl + kw
                        inside = ih >= 0 and ih < h and iw >= 0 and iw < wd
                        for ci in range(cin):
                            if inside:                 # a tap in the padding adds nothing
                                xv = x[n, ih, iw, ci]
                                for co in range(cout):
                                    acc[co] += xv * wf[t, co]
                            t += 1
                o = out[n, oh, ow]
                for co in range(cout):
                    v = acc[co] + bias[co]
                    o[co] = np.float32(0.0) if relu and v < 0.0 else v   # NaN stays NaN
    return out


@njit(**_JIT)
def _conv2d_grads(x, dy, dw, db, sh, sw, pt, pl, with_bias):
    """Loop nest: for each image n: part[:] = 0, pb[:] = 0
                      for each output pixel (oh, ow), tap (kh, kw) inside, ci:
                          part[kh, kw, ci, :] += x[n, ih, iw, ci] * dy[n, oh, ow, :]
                      (pb[:] += dy[n, oh, ow, :])
                      total += part (float64)            -> dw, db = total (float32)"""
    b, h, wd, cin = x.shape
    kh_n, kw_n, _, cout = dw.shape
    out_h, out_w = dy.shape[1], dy.shape[2]
    total = np.zeros((kh_n, kw_n, cin, cout), np.float64)
    total_b = np.zeros(cout, np.float64)
    part = np.empty((kh_n, kw_n, cin, cout), np.float32)
    part_b = np.empty(cout, np.float32)
    for n in range(b):
        part[:] = 0.0
        part_b[:] = 0.0
        for oh in range(out_h):
            for ow in range(out_w):
                if with_bias:
                    for co in range(cout):
                        part_b[co] += dy[n, oh, ow, co]
                for kh in range(kh_n):
                    ih = oh * sh - pt + kh
                    if ih < 0 or ih >= h:
                        continue
                    for kw in range(kw_n):
                        iw = ow * sw - pl + kw
                        if iw < 0 or iw >= wd:
                            continue
                        for ci in range(cin):
                            xv = x[n, ih, iw, ci]
                            for co in range(cout):
                                part[kh, kw, ci, co] += xv * dy[n, oh, ow, co]
        total += part
        total_b += part_b
    for kh in range(kh_n):
        for kw in range(kw_n):
            for ci in range(cin):
                for co in range(cout):
                    dw[kh, kw, ci, co] = total[kh, kw, ci, co]
    if with_bias:
        for co in range(cout):
            db[co] = total_b[co]


@njit(**_JIT)
def _conv2d_input_grad(dy, w, dx, sh, sw, pt, pl):
    """Loop nest: dx[:] = 0; for each output pixel (n, oh, ow), tap (kh, kw) inside, ci:
                      dx[n, ih, iw, ci] += sum over co of dy[n, oh, ow, co] * w[kh, kw, ci, co]"""
    b, h, wd, cin = dx.shape
    kh_n, kw_n, _, cout = w.shape
    out_h, out_w = dy.shape[1], dy.shape[2]
    dx[:] = 0.0
    for n in range(b):
        for oh in range(out_h):
            for ow in range(out_w):
                for kh in range(kh_n):
                    ih = oh * sh - pt + kh
                    if ih < 0 or ih >= h:
                        continue
                    for kw in range(kw_n):
                        iw = ow * sw - pl + kw
                        if iw < 0 or iw >= wd:
                            continue
                        for ci in range(cin):
                            s = np.float32(0.0)
                            for co in range(cout):
                                s += dy[n, oh, ow, co] * w[kh, kw, ci, co]
                            dx[n, ih, iw, ci] += s


def conv2d_forward(x, kernel, bias, out, strides=1, padding="valid", relu=False):
    """``conv2d_ref(x, kernel, bias, strides, padding, relu)`` written into ``out``
    (B, OH, OW, Cout) float32; x (B, H, W, Cin), kernel (KH, KW, Cin, Cout), bias (Cout,)
    or None, all float32 (C-contiguous or not)."""
    shape = conv2d_output_shape(x.shape, kernel.shape, strides, padding, "conv2d_forward")
    _check_out("conv2d_forward", out, shape)
    (sh, sw), (pt, pl) = _strides_pads(x.shape, kernel.shape[:2], strides, padding)
    if bias is None:
        bias = np.zeros(kernel.shape[3], np.float32)
    return _conv2d_forward(x, kernel, bias, out, sh, sw, pt, pl, bool(relu))


def conv2d_backward(x, kernel, dy, dx, dw, db, strides=1, padding="valid"):
    """``conv2d_backward_ref`` written into dw (KH, KW, Cin, Cout), db (Cout,) or None, and
    dx (B, H, W, Cin) unless it is None (the first layer: no earlier layer needs it)."""
    shape = conv2d_output_shape(x.shape, kernel.shape, strides, padding, "conv2d_backward")
    _check_out("conv2d_backward: dy", dy, shape)
    (sh, sw), (pt, pl) = _strides_pads(x.shape, kernel.shape[:2], strides, padding)
    _conv2d_grads(x, dy, dw, dw[0, 0, 0] if db is None else db, sh, sw, pt, pl, db is not None)
    if dx is not None:
        _check_out("conv2d_backward: dx", dx, tuple(x.shape))
        _conv2d_input_grad(dy, kernel, dx, sh, sw, pt, pl)
    return dx, dw, db


def _strides_pads(x_shape, kernel_hw, strides, padding):
    _, _, (pt, _, pl, _) = window_geometry("conv2d", x_shape[1:3], kernel_hw, strides, padding)
    sh, sw = (strides, strides) if isinstance(strides, (int, np.integer)) else tuple(strides)
    return (int(sh), int(sw)), (pt, pl)


def _check_out(what, out, shape):
    if tuple(out.shape) != tuple(shape) or out.dtype != np.float32:
        raise ValueError(f"{what}: expected a float32 array of shape {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}.")


# --- MaxPooling2D ------------------------------------------------------------------------------

@njit(**_JIT)
def _max_pool_forward(x, out, arg, ph_n, pw_n, sh, sw, pt, pl):
    """Loop nest (max_pool_v1's, with the window positions outside the channel loop so
    that the loop over c, contiguous in NHWC, runs in SIMD lanes):
        for each output pixel (n, oh, ow):
            the window's first position inside x: out[n, oh, ow, :] = x[...], arg = its position
            each later position (a, b) inside x, in row-major order, for every c:
                v = x[n, oh*sh - pt + a, ow*sw - pl + b, c]
                take = v > best or (isnan(v) and not isnan(best));  if take: best, k = v, a*PW + b
    which is max_pool_ref's rule: the first maximum, or the first NaN."""
    b, h, wd, ch = x.shape
    out_h, out_w = out.shape[1], out.shape[2]
    for n in range(b):
        for oh in range(out_h):
            for ow in range(out_w):
                o = out[n, oh, ow]
                g = arg[n, oh, ow]
                first = True
                for a in range(ph_n):
                    ih = oh * sh - pt + a
                    if ih < 0 or ih >= h:
                        continue
                    for bb in range(pw_n):
                        iw = ow * sw - pl + bb
                        if iw < 0 or iw >= wd:
                            continue
                        xr = x[n, ih, iw]
                        pos = a * pw_n + bb
                        if first:
                            for c in range(ch):
                                o[c] = xr[c]
                                g[c] = pos
                            first = False
                        else:
                            for c in range(ch):
                                v = xr[c]
                                best = o[c]
                                take = v > best or (v != v and best == best)   # v != v: isnan(v)
                                o[c] = v if take else best
                                g[c] = pos if take else g[c]


@njit(**_JIT)
def _max_pool_backward(dy, arg, dx, ph_n, pw_n, sh, sw, pt, pl):
    """Loop nest: dx[:] = 0; for each output pixel (n, oh, ow), window position (a, b)
           inside dx, for every c: dx[n, ih, iw, c] += dy[n, oh, ow, c] if arg[n, oh, ow, c] == a*PW + b else 0"""
    h, wd = dx.shape[1], dx.shape[2]
    out_h, out_w, ch = dy.shape[1], dy.shape[2], dy.shape[3]
    dx[:] = 0.0
    for n in range(dy.shape[0]):
        for oh in range(out_h):
            for ow in range(out_w):
                d = dy[n, oh, ow]
                g = arg[n, oh, ow]
                for a in range(ph_n):
                    ih = oh * sh - pt + a
                    if ih < 0 or ih >= h:
                        continue
                    for bb in range(pw_n):
                        iw = ow * sw - pl + bb
                        if iw < 0 or iw >= wd:
                            continue
                        pos = a * pw_n + bb
                        r = dx[n, ih, iw]
                        for c in range(ch):
                            r[c] += d[c] if g[c] == pos else np.float32(0.0)


def max_pool_forward(x, out, arg, pool_size=2, strides=None, padding="valid"):
    """``max_pool_ref`` written into out (B, OH, OW, C) float32 and arg (B, OH, OW, C) int32."""
    shape, (ph, pw), (sh, sw), (pt, _, pl, _) = pool_geometry(x.shape, pool_size, strides,
                                                              padding, "max_pool_forward")
    _check_out("max_pool_forward: out", out, shape)
    if tuple(arg.shape) != shape or arg.dtype != np.int32:
        raise ValueError(f"max_pool_forward: arg must be int32 of shape {shape}, got "
                         f"{arg.dtype} {tuple(arg.shape)}.")
    _max_pool_forward(x, out, arg, ph, pw, sh, sw, pt, pl)
    return out, arg


def max_pool_backward(dy, arg, dx, pool_size=2, strides=None, padding="valid"):
    """``max_pool_backward_ref`` written into dx (B, H, W, C) float32."""
    shape, (ph, pw), (sh, sw), (pt, _, pl, _) = pool_geometry(dx.shape, pool_size, strides,
                                                              padding, "max_pool_backward")
    _check_out("max_pool_backward: dy", dy, shape)
    _max_pool_backward(dy, arg, dx, ph, pw, sh, sw, pt, pl)
    return dx


# --- ReLU backward -------------------------------------------------------------------------------

@njit(**_JIT)
def _relu_backward(dy, y, out):
    for i in range(out.size):
        out[i] = dy[i] if y[i] > 0.0 else np.float32(0.0)


@njit(**_JIT)
def _relu_backward_in_place(d, y):
    # out is dy: a loop of its own (with ``out`` and ``dy`` the same array passed twice,
    # the compiled loop ran 30x slower, measured here: it cannot know they alias).
    for i in range(d.size):
        d[i] = d[i] if y[i] > 0.0 else np.float32(0.0)


def relu_backward(dy, y, out):
    """``relu_backward_ref(dy, y, out)`` in one pass, C-contiguous float32 arrays of one
    size, ``out`` either separate or ``dy`` itself (the layers' in-place use); else the
    reference."""
    flat = [a.reshape(-1) if a.flags.c_contiguous else None for a in (dy, y, out)]
    ok = (all(f is not None for f in flat) and dy.dtype == y.dtype == out.dtype == np.float32
          and dy.size == y.size == out.size)
    if ok and out.ctypes.data == dy.ctypes.data and not np.shares_memory(dy, y):
        _relu_backward_in_place(flat[0], flat[1])
    elif ok and not np.shares_memory(out, dy) and not np.shares_memory(out, y):
        _relu_backward(flat[0], flat[1], flat[2])
    else:
        from kernels.activations import relu_backward_ref
        relu_backward_ref(dy, y, out)
    return out
