"""``tf.image.resize`` of NHWC float32 images: "bilinear" and "nearest", TensorFlow 2's way.

TensorFlow 2 resizes with half-pixel centres (``half_pixel_centers=True``,
``align_corners=False``, ``antialias=False``): output pixel o of a row of ``out`` pixels
covering ``inp`` input pixels has its centre at o + 0.5, which lies at input coordinate
(o + 0.5) * scale with scale = inp / out (a float32 division, as TF's
``CalculateResizeScale``). Every coordinate below is float32 arithmetic, as in TF's kernels
(``tensorflow/core/kernels/image/resize_bilinear_op.cc``, ``resize_nearest_neighbor_op.cc``):

    bilinear  in = (o + 0.5) * scale - 0.5           (the input pixels' centres are at k + 0.5)
              lower = max(floor(in), 0),  upper = min(ceil(in), inp - 1),  lerp = in - floor(in)
              (at the borders lower == upper: the edge pixel, whatever lerp is)
              top    = x[lo_y, lo_x] + (x[lo_y, up_x] - x[lo_y, lo_x]) * lerp_x
              bottom = x[up_y, lo_x] + (x[up_y, up_x] - x[up_y, lo_x]) * lerp_x
              out    = top + (bottom - top) * lerp_y
    nearest   in = min(floor((o + 0.5) * scale), inp - 1)

(TF's CPU kernel returns the input itself when the size does not change; the formula gives
the same values but for infinite inputs, whose lerp by 0 is NaN. Here, as on TF's GPU, the
formula always runs.)

Layout: NumPy reference ``resize_ref`` (the coordinates by ``source_coords``); kernels
``resize_bilinear_kernel`` and ``resize_nearest_kernel``; launcher ``resize``.

Thread -> data: one thread per output element (n, oy, ox, ch) of the flat NHWC output
(grid-stride), channels fastest: consecutive threads write consecutive addresses and read
the same pixels' consecutive channels.
"""
import math

import numpy as np
from numba import cuda, float32

from kernels.launch import check_array, grid_1d, launch
from kernels.registry import arr4, register, sig

METHODS = ("bilinear", "nearest")
_HALF = np.float32(0.5)


def resize_scale(inp, out):
    """TF's scale for ``align_corners=False``: float32(in) / float32(out)."""
    return np.float32(inp) / np.float32(out)


def source_coords(method, inp, out):
    """For each output position o of a dimension resized from ``inp`` to ``out``:
    bilinear -> (lower, upper, lerp) arrays; nearest -> the index array."""
    scale = resize_scale(inp, out)
    o = np.arange(out, dtype=np.float32)
    if method == "nearest":
        return np.minimum(np.floor((o + _HALF) * scale).astype(np.int64), inp - 1)
    pos = (o + _HALF) * scale - _HALF                                        # float32
    below = np.floor(pos)
    lower = np.maximum(below.astype(np.int64), 0)
    upper = np.minimum(np.ceil(pos).astype(np.int64), inp - 1)
    return lower, upper, (pos - below).astype(np.float32)


# --- NumPy reference -----------------------------------------------------------------------------

def resize_ref(x, out_h, out_w, method):
    """x (b, h, w, c) float32 -> (b, out_h, out_w, c) float32, ``tf.image.resize``'s way."""
    if method not in METHODS:
        raise ValueError(f"unknown resize method {method!r}; expected one of {METHODS}.")
    x = np.asarray(x, np.float32)
    b, h, w, c = x.shape
    if method == "nearest":
        return x[:, source_coords("nearest", h, out_h)][:, :, source_coords("nearest", w, out_w)]
    y_lo, y_up, y_lerp = source_coords("bilinear", h, out_h)
    x_lo, x_up, x_lerp = source_coords("bilinear", w, out_w)
    xl = x_lerp[None, None, :, None]                                         # (1, 1, out_w, 1)
    yl = y_lerp[None, :, None, None]                                         # (1, out_h, 1, 1)
    rows_lo, rows_up = x[:, y_lo], x[:, y_up]                                # (b, out_h, w, c)
    top = rows_lo[:, :, x_lo] + (rows_lo[:, :, x_up] - rows_lo[:, :, x_lo]) * xl
    bottom = rows_up[:, :, x_lo] + (rows_up[:, :, x_up] - rows_up[:, :, x_lo]) * xl
    return (top + (bottom - top) * yl).astype(np.float32)                   # (b, out_h, out_w, c)


# --- kernels ---------------------------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def _out_index(i, out_h, out_w, c):
    """(n, oy, ox, ch) of element i of a C-contiguous (b, out_h, out_w, c) array."""
    ch = i % c
    p = i // c
    ox = p % out_w
    p //= out_w
    return p // out_h, p % out_h, ox, ch


@cuda.jit(device=True, inline="always")
def _bilinear_coords(o, scale, inp):
    """(lower, upper, lerp) of output position o: ``source_coords``'s bilinear arithmetic."""
    pos = (float32(o) + float32(0.5)) * scale - float32(0.5)
    below = math.floor(pos)
    return max(int(below), 0), min(int(math.ceil(pos)), inp - 1), pos - below


@cuda.jit
def resize_bilinear_kernel(x, out, scale_h, scale_w):
    """One thread per output element (n, oy, ox, ch) (grid-stride, channels fastest):
    the four input pixels around (oy, ox)'s source point, blended as TF's compute_lerp."""
    b, h, w, c = x.shape
    out_h, out_w = out.shape[1], out.shape[2]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        n, oy, ox, ch = _out_index(i, out_h, out_w, c)
        y_lo, y_up, y_lerp = _bilinear_coords(oy, scale_h, h)
        x_lo, x_up, x_lerp = _bilinear_coords(ox, scale_w, w)
        top_left, top_right = x[n, y_lo, x_lo, ch], x[n, y_lo, x_up, ch]
        bottom_left, bottom_right = x[n, y_up, x_lo, ch], x[n, y_up, x_up, ch]
        top = top_left + (top_right - top_left) * x_lerp
        bottom = bottom_left + (bottom_right - bottom_left) * x_lerp
        out[n, oy, ox, ch] = top + (bottom - top) * y_lerp


@cuda.jit
def resize_nearest_kernel(x, out, scale_h, scale_w):
    """One thread per output element (n, oy, ox, ch) (grid-stride, channels fastest):
    out = x[n, min(floor((oy + 0.5) scale_h), h - 1), min(floor((ox + 0.5) scale_w), w - 1), ch]."""
    b, h, w, c = x.shape
    out_h, out_w = out.shape[1], out.shape[2]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        n, oy, ox, ch = _out_index(i, out_h, out_w, c)
        iy = min(int(math.floor((float32(oy) + float32(0.5)) * scale_h)), h - 1)
        ix = min(int(math.floor((float32(ox) + float32(0.5)) * scale_w)), w - 1)
        out[n, oy, ox, ch] = x[n, iy, ix, ch]


_BLOCK = grid_1d(1)[1]
_KERNELS = {"bilinear": resize_bilinear_kernel, "nearest": resize_nearest_kernel}
for _method, _kernel in _KERNELS.items():
    register(_kernel, f"resize_{_method}_kernel",
             sig(arr4("float32"), arr4("float32"), "float32", "float32"), block=_BLOCK)


# --- launcher ----------------------------------------------------------------------------------------

def resize(x, out, method, stream=None):
    """out (b, out_h, out_w, c) = ``resize_ref(x, out_h, out_w, method)`` on the GPU; x and out
    float32 NHWC, C-contiguous, the same batch and channels; every size >= 1 where out has
    elements (an empty image has no pixel to sample)."""
    if method not in METHODS:
        raise ValueError(f"unknown resize method {method!r}; expected one of {METHODS}.")
    check_array("resize: x", x, np.float32, ndim=4)
    check_array("resize: out", out, np.float32, ndim=4)
    (b, h, w, c), (ob, out_h, out_w, oc) = x.shape, out.shape
    if (ob, oc) != (b, c):
        raise ValueError(f"resize: out {tuple(out.shape)} must keep x's batch and channels "
                         f"{(b, c)}; only height and width change.")
    if out.size == 0:
        return out
    if h == 0 or w == 0:
        raise ValueError(f"resize: x {tuple(x.shape)} has no pixels to resize to ({out_h}, {out_w}).")
    launch(_KERNELS[method], *grid_1d(out.size), stream, x, out,
           resize_scale(h, out_h), resize_scale(w, out_w))
    return out
