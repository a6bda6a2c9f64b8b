"""MaxPooling2D as Keras computes it: forward with the arg-max, backward to the first maximum.

    out[n, oh, ow, c] = max over the window's positions (a, b) inside the input of
                        x[n, oh*sh - pt + a, ow*sw - pl + b, c]
    arg[n, oh, ow, c] = a * PW + b of the FIRST maximum in row-major window order

NHWC in and out; ``pool_size`` (PH, PW), ``strides`` (default: the pool size) and
``padding`` "valid" or "same" follow Keras, with TensorFlow's padding rule
(``kernels.conv2d.window_geometry``: the odd extra after). Padding is not a value: a
window only looks at its positions inside the input ("same" never makes a window of
padding only).

Why the FIRST maximum: on MNIST's blank background most 2x2 windows hold four equal
zeros, and the gradient must go to exactly one of them, the one TensorFlow's CPU kernel
picks (core/kernels/maxpooling_op.cc: the first in row-major order). "valid" with an odd
size drops the last row/column: those inputs are in no window and get zero gradient.

NaN: a window holding a NaN outputs NaN, and its gradient goes to its first NaN (NumPy's
``max`` and ``argmax``; TensorFlow propagates NaN too). The reference ``max_pool_ref``
defines this; the kernel does the same comparisons in the same order.

Versions:
    forward v1   one thread per output (n, oh, ow, c), c fastest.
    backward v1  one thread per INPUT element, summing dy over the windows (usually one)
                 whose recorded arg-max is that element: no atomics even when windows
                 overlap (strides < pool), so the result is bitwise reproducible. Each
                 thread works out which windows cover it: 7 int64 divisions, 80 registers.
    backward v2  windows that do not overlap (strides == pool size, MaxPooling2D's
                 default): one thread per POOLED output (n, oh, ow, c), c fastest, writes
                 its whole window of dx (the recorded position gets dy, the others 0), so
                 no thread looks for its windows. Compiled per shape (the sizes are
                 constants, the indices 32-bit unsigned, as kernels/conv2d_v3.py), and
                 with ``relu_mask`` the ReLU of the conv before it is fused in: dy counts
                 only where the pooled output y > 0 (the max of ReLU outputs is > 0 exactly
                 where the conv output at the arg-max was), which removes relu_backward's
                 pass over the conv's output. Input rows/columns in no window (an odd size
                 with 'valid') get 0 from the thread of the last window before them.
The arg-max is stored as int32 (the position in the window, < PH * PW): the backward
reads 4 bytes per output instead of recomparing the window. The fused conv + ReLU + pool
(kernels/conv2d_v3.py) stores it as int8.

Neighbours: kernels/conv2d.py (``window_geometry``, the padding rule), kernels/launch.py;
the Keras layer MaxPooling2D (mirrored/keras/) calls these launchers, or on the CPU
kernels/cpu_loops.py (the reference's comparisons, in its order, compiled).  ``python -m pytest -q tests/test_kernels_pooling.py``
"""
import math

import numpy as np
from numba import cuda, float32, uint32

from kernels.conv2d import CheckMemo, check_size, pair, window_geometry
from kernels.launch import (SIMULATOR, check_array, check_no_alias, flat, grid_1d, launch,
                            nhwc_index, windows_over)
from kernels.registry import arr4, register, sig, vec

if SIMULATOR:
    def u32(v):
        """uint32(v) with C's wrap-around (NumPy's uint32 refuses negative numbers)."""
        return int(v) & 0xFFFFFFFF
else:
    u32 = uint32       # compiled: a truncation to 32 bits, which lets NVVM narrow the math

#: The arg-max dtype: a window position a * PW + b.
ARG_DTYPE = np.int32


# --- geometry --------------------------------------------------------------------------

def pool_geometry(x_shape, pool_size=2, strides=None, padding="valid", what="max_pool"):
    """((B, OH, OW, C), pool (PH, PW), strides (sh, sw), pads (pt, pb, pl, pr)) for an
    NHWC input; a ValueError naming ``what`` for a wrong rank or size. ``strides=None``
    means the pool size, as in Keras."""
    x_shape = tuple(x_shape)
    if len(x_shape) != 4:
        hint = (" (a batch of single-channel images: add the channel axis, e.g. "
                "x[..., None])" if len(x_shape) == 3 else "")
        raise ValueError(f"{what}: the input must be 4-D (batch, height, width, channels), "
                         f"got shape {x_shape}{hint}.")
    pool = pair(what, "pool_size", pool_size)
    strides = pool if strides is None else pair(what, "strides", strides)
    out_h, out_w, pads = window_geometry(what, x_shape[1:3], pool, strides, padding, "pool")
    return (x_shape[0], out_h, out_w, x_shape[3]), pool, strides, pads


# --- NumPy references ----------------------------------------------------------------------

def max_pool_ref(x, pool_size=2, strides=None, padding="valid"):
    """(out, arg) for x (B, H, W, C): the window maxima (B, OH, OW, C) in x's dtype and
    the position a * PW + b of each window's first maximum (first NaN, if any), int32.

    One vectorised step per window position, in row-major order: a position replaces the
    best so far when it is inside the input and larger, or NaN where the best is not."""
    shape, (ph, pw), (sh, sw), (pt, pb, pl, pr) = pool_geometry(x.shape, pool_size, strides,
                                                                padding, "max_pool_ref")
    b, out_h, out_w, c = shape
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))     # the pad values are never used
    inside = np.zeros(xp.shape[1:3], bool)                    # (Hp, Wp): True on the input
    inside[pt:pt + x.shape[1], pl:pl + x.shape[2]] = True
    best = np.zeros(shape, x.dtype)                            # (B, OH, OW, C)
    arg = np.full(shape, -1, ARG_DTYPE)                        # -1: nothing seen yet
    for a in range(ph):
        for bb in range(pw):
            v = xp[:, a:a + sh * out_h:sh, bb:bb + sw * out_w:sw, :]        # (B, OH, OW, C)
            ok = inside[a:a + sh * out_h:sh, bb:bb + sw * out_w:sw][None, :, :, None]
            take = ok & ((arg < 0) | (v > best) | (np.isnan(v) & ~np.isnan(best)))
            best = np.where(take, v, best)
            arg = np.where(take, ARG_DTYPE(a * pw + bb), arg)
    return best, arg


def max_pool_backward_ref(dy, arg, x_shape, pool_size=2, strides=None, padding="valid"):
    """dx (x_shape) from dy and the forward's ``arg`` (B, OH, OW, C): each window's
    gradient added to its recorded first maximum; inputs in no window get zero."""
    shape, (ph, pw), (sh, sw), (pt, pb, pl, pr) = pool_geometry(
        x_shape, pool_size, strides, padding, "max_pool_backward_ref")
    b, out_h, out_w, c = shape
    h, w = x_shape[1], x_shape[2]
    dxp = np.zeros((b, h + pt + pb, w + pl + pr, c), dy.dtype)     # (B, Hp, Wp, C)
    for a in range(ph):
        for bb in range(pw):       # one window position at a time: its slices never collide
            dxp[:, a:a + sh * out_h:sh, bb:bb + sw * out_w:sw, :] += np.where(
                arg == a * pw + bb, dy, 0)
    return dxp[:, pt:pt + h, pl:pl + w, :]


# --- kernels --------------------------------------------------------------------------------

@cuda.jit
def max_pool_v1(x, out, arg, ph_n, pw_n, sh, sw, pt, pl):
    """Forward. One thread per output element i of the flattened (B, OH, OW, C) output
    (grid-stride), c = i % C fastest: a warp reads and writes consecutive channels.
    Loop nest: for each (n, oh, ow, c): best, k = -, -1
                   for a in range(PH): for b in range(PW): (if inside the input)
                       v = x[n, oh*sh - pt + a, ow*sw - pl + b, c]
                       if k < 0 or v > best or (isnan(v) and not isnan(best)): best, k = v, a*PW + b
                   out[n, oh, ow, c] = best; arg[n, oh, ow, c] = k
    (``v > best`` is False for NaN on either side: a NaN is taken only by the isnan test,
    and once taken nothing replaces it.)
    """
    in_h, in_w, ch = x.shape[1], x.shape[2], x.shape[3]
    out_h, out_w = out.shape[1], out.shape[2]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        n, oh, ow, c = nhwc_index(i, out_h, out_w, ch)
        best = float32(0.0)     # replaced by the window's first position inside x (k < 0)
        k = -1
        for a in range(ph_n):
            ih = oh * sh - pt + a
            if ih >= 0 and ih < in_h:
                for b in range(pw_n):
                    iw = ow * sw - pl + b
                    if iw >= 0 and iw < in_w:
                        v = x[n, ih, iw, c]
                        if k < 0 or v > best or (math.isnan(v) and not math.isnan(best)):
                            best = v
                            k = a * pw_n + b
        out[n, oh, ow, c] = best
        arg[n, oh, ow, c] = k


@cuda.jit
def max_pool_backward_v1(dy, arg, dx, ph_n, pw_n, sh, sw, pt, pl):
    """Backward. One thread per input element i of the flattened (B, H, W, C) dx
    (grid-stride), c fastest. The windows covering input row ih are
    oh = ceil((ih + pt - PH + 1) / sh) .. floor((ih + pt) / sh) (clipped to [0, OH)), at
    window row a = ih + pt - oh * sh; the same along the width. The thread adds dy of
    each such window whose arg-max is its position (a, b): it alone writes its dx.
    Loop nest: for each (n, ih, iw, c): acc = 0
                   for oh, ow in those ranges:
                       if arg[n, oh, ow, c] == a * PW + b: acc += dy[n, oh, ow, c]
                   dx[n, ih, iw, c] = acc
    """
    in_h, in_w, ch = dx.shape[1], dx.shape[2], dx.shape[3]
    out_h, out_w = dy.shape[1], dy.shape[2]
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        n, ih, iw, c = nhwc_index(i, in_h, in_w, ch)
        acc = float32(0.0)
        oh_lo, oh_hi, ow_lo, ow_hi = windows_over(ih, iw, pt, pl, ph_n, pw_n, sh, sw,
                                                  out_h, out_w)
        for oh in range(oh_lo, oh_hi + 1):
            a = ih + pt - oh * sh
            for ow in range(ow_lo, ow_hi + 1):
                if arg[n, oh, ow, c] == a * pw_n + (iw + pl - ow * sw):
                    acc += dy[n, oh, ow, c]
        dx[n, ih, iw, c] = acc


def _make_backward_v2(geo, relu_mask):
    H, W, C, PH, PW, PT, PL, OH, OW = geo
    # The last window's thread also zeroes the rows/columns after it that no window covers.
    REST_H = max(0, H + PT - OH * PH)
    REST_W = max(0, W + PL - OW * PW)

    @cuda.jit
    def max_pool_backward_v2(dy, arg, y, dx, total):
        """Backward v2 (module docstring). dy, arg, y (B*OH*OW*C,) and dx (B*H*W*C,) flat;
        total = B*OH*OW*C; y is read only with ``relu_mask``. One thread per pooled output i
        (grid-stride), c fastest.
        Loop nest: for each (n, oh, ow, c): g = dy (0 if relu_mask and not y > 0)
                       for (a, b) in the window (+ the uncovered rest after the last one),
                       inside x: dx[n, oh*PH - pt + a, ow*PW - pl + b, c] =
                           g if (a, b) is the recorded position else 0
        """
        i = u32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
        while i < total:
            p = u32(i // C)
            c = u32(i - p * C)
            q = u32(p // OW)
            ow = u32(p - q * OW)
            n = u32(q // OH)
            oh = u32(q - n * OH)
            k = arg[i]
            g = dy[i]
            if relu_mask and not y[i] > float32(0.0):
                g = float32(0.0)
            for a in range(PH + REST_H):
                ih = u32(oh * PH + u32(a - PT))               # a negative row wraps: >= H
                if ih < H and (a < PH or oh == OH - 1):
                    for b in range(PW + REST_W):
                        iw = u32(ow * PW + u32(b - PL))
                        if iw < W and (b < PW or ow == OW - 1):
                            v = float32(0.0)
                            if a < PH and b < PW and a * PW + b == k:
                                v = g
                            dx[u32(u32(u32(n * H + ih) * W + iw) * C + c)] = v
            i = u32(i + cuda.gridDim.x * cuda.blockDim.x)

    return max_pool_backward_v2


_v2_kernels = {}


def backward_v2_kernel(geo, relu_mask, arg_dtype):
    """``max_pool_backward_v2`` for ``geo`` = (H, W, C, PH, PW, pt, pl, OH, OW), made and
    registered (with the arg dtype's signature) on first use."""
    key = (geo, bool(relu_mask), np.dtype(arg_dtype).name)
    if key not in _v2_kernels:
        _v2_kernels[key] = _make_backward_v2(geo, bool(relu_mask))
        h, w, c, ph, pw, pt, pl, oh, ow = geo
        f32 = vec("float32")
        register(_v2_kernels[key], "max_pool_backward_v2",
                 sig(f32, vec(key[2]), f32, f32, "uint32"), block=grid_1d(1)[1],
                 variant=f"{h}x{w}x{c} pool{ph}x{pw} p{pt},{pl} out{oh}x{ow} {key[2]}"
                         + (" relu" if relu_mask else ""),
                 made_by=(backward_v2_kernel, key))
    return _v2_kernels[key]


# What the real compiler checks (kernels/registry.py): float32 NHWC arrays, int32 arg-max.
_A4, _ARG, _I = arr4("float32"), arr4("int32"), "int64"
register(max_pool_v1, "max_pool_v1", sig(_A4, _A4, _ARG, _I, _I, _I, _I, _I, _I),
         block=grid_1d(1)[1])
register(max_pool_backward_v1, "max_pool_backward_v1",
         sig(_A4, _ARG, _A4, _I, _I, _I, _I, _I, _I), block=grid_1d(1)[1])
# v2 for the lab's pools: after a 26x26x32 conv (int32 arg: MaxPooling2D alone; int8 arg
# with the ReLU mask: after the fused conv + ReLU + pool), and the tutorials' 11x11x64.
for _geo in ((26, 26, 32, 2, 2, 0, 0, 13, 13), (11, 11, 64, 2, 2, 0, 0, 5, 5)):
    backward_v2_kernel(_geo, False, ARG_DTYPE)
    backward_v2_kernel(_geo, True, np.int8)


# --- launchers --------------------------------------------------------------------------------

_forward_checked = CheckMemo()


def max_pool(x, out, arg, pool_size=2, strides=None, padding="valid", stream=None):
    """MaxPooling2D forward on the GPU: out (B, OH, OW, C) float32 and arg (B, OH, OW, C)
    int32 (``pool_geometry`` gives the shape) from x (B, H, W, C) float32; C-contiguous,
    outputs disjoint from x and each other. Every check runs before the launch, once per
    (buffers, settings): they are remembered."""
    arrays, settings = (x, out, arg), (pool_size, strides, padding)
    done = _forward_checked.get(arrays, settings)
    if done is None:
        shape, (ph, pw), (sh, sw), (pt, _, pl, _) = pool_geometry(x.shape, pool_size, strides,
                                                                  padding)
        check_array("max_pool: x", x, np.float32, ndim=4)
        check_array("max_pool: out", out, np.float32, shape=shape)
        check_array("max_pool: arg", arg, ARG_DTYPE, shape=shape)
        check_no_alias("max_pool", out, x, arg)
        check_no_alias("max_pool", arg, x)
        done = _forward_checked.put(arrays, settings, (ph, pw, sh, sw, pt, pl))
    ph, pw, sh, sw, pt, pl = done
    if out.size:
        launch(max_pool_v1, *grid_1d(out.size), stream, x, out, arg, ph, pw, sh, sw, pt, pl)
    return out, arg


_checked = CheckMemo()


def max_pool_backward(dy, arg, dx, pool_size=2, strides=None, padding="valid", stream=None,
                      relu_y=None, version=None):
    """MaxPooling2D backward on the GPU: dx (B, H, W, C) float32 from dy and the forward's
    arg (B, OH, OW, C); the same pool_size, strides and padding as the forward.

    ``relu_y``: the pooled output y, to fuse the ReLU before the pool (dx = 0 where
    y <= 0; ``arg`` may then be int8, the fused forward's). ``version``: "v1", "v2" or None:
    v2 when the windows do not overlap (strides == pool size), else v1 (which cannot take
    ``relu_y``). Checks run once per (shapes, buffers) and are remembered."""
    arrays, settings = (dy, arg, dx, relu_y), (pool_size, strides, padding, version)
    done = _checked.get(arrays, settings)
    if done is None:
        shape, (ph, pw), (sh, sw), (pt, _, pl, _) = pool_geometry(
            dx.shape, pool_size, strides, padding, "max_pool_backward")
        non_overlapping = (sh, sw) == (ph, pw)
        if version not in (None, "v1", "v2"):
            raise ValueError(f"max_pool_backward: unknown version {version!r}; expected 'v1', "
                             f"'v2' or None.")
        if version == "v2" and not non_overlapping or version == "v1" and relu_y is not None:
            raise ValueError(f"max_pool_backward: v2 needs strides equal to the pool size "
                             f"(windows that do not overlap) and v1 cannot fuse the ReLU; got "
                             f"pool {(ph, pw)}, strides {(sh, sw)}, version {version!r}: use "
                             f"version=None.")
        if relu_y is not None and not non_overlapping:
            raise ValueError("max_pool_backward: relu_y (the fused ReLU) needs windows that do "
                             "not overlap (strides == pool size).")
        version = version or ("v2" if non_overlapping else "v1")
        check_array("max_pool_backward: dx", dx, np.float32, ndim=4)
        check_array("max_pool_backward: dy", dy, np.float32, shape=shape)
        arg_types = (ARG_DTYPE, np.int8) if version == "v2" else (ARG_DTYPE,)
        if np.dtype(arg.dtype) not in [np.dtype(t) for t in arg_types]:
            names = " or ".join(np.dtype(t).name for t in arg_types)
            raise TypeError(f"max_pool_backward: arg must be {names}, got {arg.dtype}.")
        check_array("max_pool_backward: arg", arg, arg.dtype, shape=shape)
        if relu_y is not None:
            check_array("max_pool_backward: relu_y", relu_y, np.float32, shape=shape)
        check_no_alias("max_pool_backward", dx, dy, arg, relu_y)
        check_size("max_pool_backward", dx)
        geo = (dx.shape[1], dx.shape[2], dx.shape[3], ph, pw, pt, pl, shape[1], shape[2])
        done = _checked.put(arrays, settings, (version, geo, (ph, pw, sh, sw, pt, pl)))
    version, geo, (ph, pw, sh, sw, pt, pl) = done
    if not dx.size:
        return dx
    if version == "v1":
        launch(max_pool_backward_v1, *grid_1d(dx.size), stream, dy, arg, dx, ph, pw, sh, sw,
               pt, pl)
    else:
        kernel = backward_v2_kernel(geo, relu_y is not None, arg.dtype)
        launch(kernel, *grid_1d(dy.size), stream, flat(dy), flat(arg),
               flat(relu_y if relu_y is not None else dy), flat(dx), np.uint32(dy.size))
    return dx
