"""Conv2D: 2-D cross-correlation as Keras computes it, forward and backward.

    out[n, oh, ow, co] = bias[co] + sum over kh, kw, ci of
                         x[n, oh*sh - pt + kh, ow*sw - pl + kw, ci] * w[kh, kw, ci, co]

(taps that fall in the padding count as zeros). Layouts are Keras's: the input is NHWC
(B, H, W, Cin), the kernel HWIO (KH, KW, Cin, Cout), the bias (Cout,), the output NHWC
(B, OH, OW, Cout). ``padding`` is "valid" (no padding: OH = (H - KH) // sh + 1) or
"same" (OH = ceil(H / sh)), with TensorFlow's rule for the padding: the total along an
axis is max((OH - 1) * sh + KH - H, 0), half of it (rounded down) on top/left and the
odd extra on the bottom/right (``window_geometry``, shared with kernels/pooling.py).

Versions (the launcher ``conv2d(..., version=...)`` picks one):

    v1  direct: one thread per output (n, oh, ow, co), co fastest, so the threads of a
        warp write consecutive addresses of the NHWC output (coalesced) and read the
        same input value (one broadcast load) with consecutive weights.
    v2  shared memory: a block computes an 8 x 8 tile of output pixels for every output
        channel; it first copies the input patch the tile needs and the whole kernel
        into shared memory, so each input value is read from global memory once per
        block instead of KH * KW * Cout times. Possible when both fit (``v2_fits``);
        the same sums in the same order as v1, so the two agree bit for bit. Measured
        on an H100 for the course lab's layer (3x3, 1 -> 32, 28x28, batch 512), v2 took
        3,690 µs against v1's 775 (both far from the ~16 µs that the 46 MB moved would
        take at copy speed). Its grid was then ``grid_1d(tiles, 256)``: tiles / 256
        blocks, 32 at batch 512, each looping over 256 tiles, which fills no GPU; it is
        now one block per tile (``v2_grid``), not yet timed.
    v3  compiled per layer shape, in kernels/conv2d_v3.py (with the fused conv + ReLU +
        2x2 max-pool): what the library runs on a GPU (``conv2d_v3.forward``), v1 past
        its register budget. v1 and v2 stay here as the lessons that lead to it;
        ``conv2d(..., version=None)`` runs v1.

Backward (``conv2d_backward``), given dy = dLoss/dout (already masked by the ReLU's
backward when the layer's activation is fused, kernels/activations.py):

    dx   one thread per input element (n, ih, iw, ci), summing over exactly the outputs
         whose window touched it (needed whenever the conv is not the first layer).
    dW, db  by per-block partial sums and a second pass in a fixed order: pass 1 gives
         every (chunk of output rows, weight) pair a partial sum, pass 2 adds each
         weight's partials in chunk order. No float atomics, so the result is bitwise
         the same every run and on every replica (the order of additions depends only on
         the shapes; see kernels/reduction.py for why that matters).

The lab's layer (3x3, 1 -> 32 channels, 28x28 input) does 9 multiply-adds per output:
its forward is memory-bound (it writes 32 floats for every input float it reads), so
the measure of the kernels is GB/s against the copy bandwidth (benchmarks/kernels.py).

The NumPy reference (the CPU backend computes the same math with compiled loops,
kernels/cpu_loops.py, tested against it) is im2col: the input's
KH x KW windows, laid out as the rows of one (B*OH*OW, KH*KW*Cin) "column" matrix with
``numpy.lib.stride_tricks.sliding_window_view``, times the kernel seen as a
(KH*KW*Cin, Cout) matrix: one matmul. The backward reuses that column matrix for dW.

Layout of this file (as every file in ``kernels/``): geometry (shared with pooling)
-> NumPy references -> kernels, simplest first -> registration -> launchers.

    python -m kernels.report --only conv2d        # registers, spills, stack on sm_90
    python -m pytest -q tests/test_kernels_conv2d.py

Neighbours: kernels/conv2d_v3.py and kernels/conv2d_grad.py (the same math compiled per
layer shape: what the library runs on a GPU), kernels/pooling.py (shares
``window_geometry``), kernels/activations.py
(``relu_backward`` before ``conv2d_backward`` when the ReLU is fused), kernels/launch.py;
the Keras layer Conv2D (mirrored/keras/) calls the launchers on a GPU and, on the CPU,
kernels/cpu_loops.py (this reference's math, faster).
"""
import weakref

import numpy as np
from numba import cuda, float32

from kernels.launch import (SIMULATOR, ceil_div, ceil_div_device, check_array, check_no_alias,
                            flat, grid_1d, grid_rows, launch, nhwc_index, windows_over)
from kernels.registry import arr4, mat, register, sig, vec

PADDINGS = ("valid", "same")
VERSIONS = ("v1", "v2")

#: v2's output tile: V2_TILE x V2_TILE pixels (all Cout channels) per block. 8 x 8 x 32
#: channels is 2,048 outputs, 8 per thread of a 256-thread block: enough work to pay for
#: staging the patch and the kernel.
V2_TILE = 8
#: v2 threads per block (a multiple of the 32-thread warp; fewer in the simulator, where
#: every CUDA thread is a Python thread).
V2_THREADS = 32 if SIMULATOR else 256
#: v2's shared buffers, in floats (compile-time sizes): the input patch of one tile,
#: ((V2_TILE-1)*sh + KH) x ((V2_TILE-1)*sw + KW) x Cin, and the whole kernel,
#: KH*KW*Cin*Cout. 8 KiB + 16 KiB: a 3x3 stride-1 patch with up to 20 input channels and
#: a 3x3 kernel with Cin*Cout up to 455 (the lab's 1 -> 32 layer needs 100 and 288).
#: Larger layers run v1 (``v2_fits``).
V2_PATCH_FLOATS = 2048
V2_KERNEL_FLOATS = 4096

#: dW/db pass 1 threads per block, one weight (column) each.
DW_THREADS = 32 if SIMULATOR else 256
#: dW/db pass 1 splits the B*OH output rows into at most this many chunks (block-rows of
#: the grid), each at least DW_MIN_CHUNK_ROWS rows long. The chunk count depends only on
#: the shapes (the same in the simulator and on a GPU), so the order of additions, and the
#: result, is fixed. 128 chunks x 2 column blocks fill an H100's 132 SMs for the lab's
#: layer; pass 2 then adds 128 partials per weight.
DW_MAX_CHUNKS = 128
DW_MIN_CHUNK_ROWS = 4
#: Elements an array may have for kernels that index with 32-bit unsigned arithmetic
#: (v3 and the kernels compiled per shape): every index, and index + one row, stays
#: below 2**32. ``check_size`` refuses larger arrays.
MAX_ELEMENTS_32 = 2**31
#: v2's blocks at most: one block per output tile up to this (a grid-stride loop over
#: tiles covers the rest): 31 blocks of 256 threads per SM of an H100.
V2_MAX_BLOCKS = 4 if SIMULATOR else 4096


# --- geometry: shared with kernels/pooling.py ----------------------------------------

def pair(what, name, value):
    """``value`` as a pair of positive ints: 3 -> (3, 3), (2, 1) -> (2, 1). Raises a
    ValueError naming ``what`` (the layer or launcher) and the argument otherwise."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    ok = (len(items) == 2 and isinstance(items[0], (int, np.integer)) and not isinstance(items[0], bool)
          and isinstance(items[1], (int, np.integer)) and not isinstance(items[1], bool))
    if not ok or min(items) < 1:
        raise ValueError(f"{what}: {name} must be a positive integer or a pair of positive "
                         f"integers (height, width), got {value!r}.")
    return int(items[0]), int(items[1])


def _axis(what, size, window, stride, padding, axis, name):
    """(outputs, pad before, pad after) along one axis, TensorFlow's rule."""
    if padding == "valid":
        if window > size:
            raise ValueError(
                f"{what}: the {name} is {window} along {axis} but the input is only {size} "
                f"with padding='valid'; use a smaller {name}, padding='same', or a larger "
                f"input (each output needs a whole window inside the input).")
        return (size - window) // stride + 1, 0, 0
    out = ceil_div(size, stride)
    total = max((out - 1) * stride + window - size, 0)
    return out, total // 2, total - total // 2           # the odd extra goes after


#: The answers of ``window_geometry`` and ``conv2d_output_shape``, by the ``repr`` of the
#: arguments they depend on. A training step asks the same few questions every time (each
#: conv and pool layer, forward and backward, on every replica: 18 for the lab ConvNet on
#: 2 replicas), and working an answer out again took ~15 Python calls. Only answers are
#: kept (an argument an error refuses is refused again); the repr tells 1 from True and
#: from 1.0. At most GEOMETRY_ENTRIES (cleared past that): a program has a few shapes.
GEOMETRY_ENTRIES = 256
_geometry = {}


def _remember(key, answer):
    if len(_geometry) >= GEOMETRY_ENTRIES:
        _geometry.clear()
    _geometry[key] = answer
    return answer


def window_geometry(what, in_hw, window, strides, padding, name="window"):
    """(out_h, out_w, (pad_top, pad_bottom, pad_left, pad_right)) of a sliding window
    over an (H, W) input, or a ValueError naming ``what`` that says what to change.

    ``window`` and ``strides``: an int or an (h, w) pair of positive ints; ``padding``:
    "valid" or "same" (any case, as Keras); ``name``: what the window is called in errors
    ("kernel", "pool"). The shape rule of Conv2D and MaxPooling2D. Worked out once per
    arguments (``_geometry``).
    """
    key = repr(("window", in_hw, window, strides, padding))
    answer = _geometry.get(key)
    if answer is None:
        answer = _remember(key, _window_geometry(what, in_hw, window, strides, padding, name))
    return answer


def _window_geometry(what, in_hw, window, strides, padding, name):
    kh, kw = pair(what, f"the {name} size", window)
    sh, sw = pair(what, "strides", strides)
    if not isinstance(padding, str) or padding.lower() not in PADDINGS:
        raise ValueError(f"{what}: padding must be 'valid' or 'same', got {padding!r}.")
    padding = padding.lower()
    h, w = (int(v) for v in in_hw)
    if h < 1 or w < 1:
        raise ValueError(f"{what}: the input's height and width must be at least 1, got "
                         f"{h} x {w}.")
    out_h, pt, pb = _axis(what, h, kh, sh, padding, "height", name)
    out_w, pl, pr = _axis(what, w, kw, sw, padding, "width", name)
    return out_h, out_w, (pt, pb, pl, pr)


def conv2d_output_shape(x_shape, kernel_shape, strides=1, padding="valid", what="conv2d"):
    """The NHWC output shape (B, OH, OW, Cout) for an NHWC input and an HWIO kernel;
    raises a ValueError naming ``what`` for wrong ranks, channel counts or sizes. Worked out
    once per arguments (``_geometry``)."""
    key = repr(("conv", x_shape, kernel_shape, strides, padding))
    answer = _geometry.get(key)
    if answer is None:
        answer = _remember(key, _conv2d_output_shape(x_shape, kernel_shape, strides, padding, what))
    return answer


def _conv2d_output_shape(x_shape, kernel_shape, strides, padding, what):
    x_shape, kernel_shape = tuple(x_shape), tuple(kernel_shape)
    if len(x_shape) != 4:
        hint = (" (a batch of single-channel images: add the channel axis, e.g. "
                "x[..., None])" if len(x_shape) == 3 else "")
        raise ValueError(f"{what}: the input must be 4-D (batch, height, width, channels), "
                         f"got shape {x_shape}{hint}.")
    if len(kernel_shape) != 4 or min(kernel_shape) < 1:
        raise ValueError(f"{what}: the kernel must be 4-D (KH, KW, Cin, Cout) with every size "
                         f">= 1, got shape {kernel_shape}.")
    kh, kw, cin, cout = kernel_shape
    if x_shape[3] != cin:
        raise ValueError(f"{what}: the input has {x_shape[3]} channel(s) (shape {x_shape}) but "
                         f"the kernel {kernel_shape} expects Cin = {cin}: input shape "
                         f"(B, H, W, {cin}).")
    out_h, out_w, _ = window_geometry(what, x_shape[1:3], (kh, kw), strides, padding, "kernel")
    return x_shape[0], out_h, out_w, cout


# --- NumPy references -------------------------------------------------------------------

def im2col_ref(x, kernel_hw, strides=1, padding="valid"):
    """The column matrix of x (B, H, W, Cin): (B*OH*OW, KH*KW*Cin), one row per output
    pixel holding its window in (kh, kw, ci) order (zeros where it hangs over the padding).
    Output pixel r (= (n * OH + oh) * OW + ow), channel co, is row r of this matrix times
    column co of the kernel seen as a (KH*KW*Cin, Cout) matrix."""
    kh, kw = pair("im2col_ref", "kernel size", kernel_hw)
    b, h, w, cin = x.shape
    out_h, out_w, (pt, pb, pl, pr) = window_geometry("im2col_ref", (h, w), (kh, kw), strides,
                                                     padding)
    sh, sw = pair("im2col_ref", "strides", strides)
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))        # (B, H+pt+pb, W+pl+pr, Cin)
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(1, 2))
    win = win[:, ::sh, ::sw][:, :out_h, :out_w]                 # (B, OH, OW, Cin, KH, KW) view
    return win.transpose(0, 1, 2, 4, 5, 3).reshape(b * out_h * out_w, kh * kw * cin)  # copy


def conv2d_ref(x, kernel, bias=None, strides=1, padding="valid", relu=False, cols=None):
    """Keras's Conv2D forward for x (B, H, W, Cin), kernel (KH, KW, Cin, Cout), bias
    (Cout,) or None: (B, OH, OW, Cout) in x's dtype, then max(., 0) when ``relu``.
    ``cols``: x's column matrix (``im2col_ref``) when the caller made it already, to keep
    it for the backward's dW; made here otherwise."""
    b, out_h, out_w, cout = conv2d_output_shape(x.shape, kernel.shape, strides, padding,
                                                "conv2d_ref")
    if cols is None:
        cols = im2col_ref(x, kernel.shape[:2], strides, padding)  # (B*OH*OW, KH*KW*Cin)
    out = cols @ kernel.reshape(-1, cout)                      # (B*OH*OW, Cout)
    if bias is not None:
        out += bias
    if relu:
        np.maximum(out, 0, out=out)                            # NaN stays NaN
    return out.reshape(b, out_h, out_w, cout)


def conv2d_backward_ref(x, kernel, dy, strides=1, padding="valid", cols=None, need_dx=True):
    """(dx, dW, db) for dy = dLoss/dout (B, OH, OW, Cout); dx is None unless ``need_dx``.

    dW = cols.T @ dy (the forward's column matrix, recomputed unless given), db = dy
    summed over (B, OH, OW), dx = col2im(dy @ W.T): each window's gradient added back
    onto the input pixels it came from.
    """
    b, out_h, out_w, cout = conv2d_output_shape(x.shape, kernel.shape, strides, padding,
                                                "conv2d_backward_ref")
    kh, kw, cin, _ = kernel.shape
    if tuple(dy.shape) != (b, out_h, out_w, cout):
        raise ValueError(f"conv2d_backward_ref: dy has shape {tuple(dy.shape)}, expected "
                         f"{(b, out_h, out_w, cout)} (the forward's output).")
    if cols is None:
        cols = im2col_ref(x, (kh, kw), strides, padding)     # (B*OH*OW, KH*KW*Cin)
    dy2 = dy.reshape(-1, cout)                                 # (B*OH*OW, Cout)
    dw = (cols.T @ dy2).reshape(kernel.shape)                  # (KH, KW, Cin, Cout)
    db = dy2.sum(axis=0)                                       # (Cout,)
    if not need_dx:
        return None, dw, db
    sh, sw = pair("conv2d_backward_ref", "strides", strides)
    _, _, (pt, pb, pl, pr) = window_geometry("conv2d_backward_ref", x.shape[1:3], (kh, kw),
                                             strides, padding)
    dcols = (dy2 @ kernel.reshape(-1, cout).T).reshape(b, out_h, out_w, kh, kw, cin)
    dxp = np.zeros((b, x.shape[1] + pt + pb, x.shape[2] + pl + pr, cin), dcols.dtype)
    for i in range(kh):                    # col2im: tap (i, j) of every window at once
        for j in range(kw):
            dxp[:, i:i + sh * out_h:sh, j:j + sw * out_w:sw, :] += dcols[:, :, :, i, j, :]
    return dxp[:, pt:pt + x.shape[1], pl:pl + x.shape[2], :], dw, db


# --- kernels -----------------------------------------------------------------------------

def _make_v1(relu):
    @cuda.jit
    def conv2d_v1(x, w, bias, out, sh, sw, pt, pl):
        """v1, direct. One thread per output element i of the flattened (B, OH, OW, Cout)
        output (grid-stride), co = i % Cout fastest: a warp writes consecutive addresses
        and reads one input value (broadcast) against consecutive weights w[kh, kw, ci, :].
        Taps in the padding are skipped. ``relu`` is a compile-time constant.
        Preconditions: shapes agree (the launcher checks).
        Loop nest: for each (n, oh, ow, co): acc = bias[co]
                       for kh: for kw: (if the tap is inside x) for ci:
                           acc += x[n, oh*sh - pt + kh, ow*sw - pl + kw, ci] * w[kh, kw, ci, co]
                       out[n, oh, ow, co] = max(acc, 0) if relu else acc
        """
        in_h, in_w, cin = x.shape[1], x.shape[2], x.shape[3]
        kh_n, kw_n, cout = w.shape[0], w.shape[1], w.shape[3]
        out_h, out_w = out.shape[1], out.shape[2]
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            n, oh, ow, co = nhwc_index(i, out_h, out_w, cout)
            acc = bias[co]
            for kh in range(kh_n):
                ih = oh * sh - pt + kh
                if ih >= 0 and ih < in_h:
                    for kw in range(kw_n):
                        iw = ow * sw - pl + kw
                        if iw >= 0 and iw < in_w:
                            for ci in range(cin):
                                acc += x[n, ih, iw, ci] * w[kh, kw, ci, co]
            if relu and acc < float32(0.0):      # NaN is not < 0: it passes, as np.maximum
                acc = float32(0.0)
            out[n, oh, ow, co] = acc

    return conv2d_v1


def _make_v2(relu):
    @cuda.jit
    def conv2d_v2(x, w_flat, bias, out, sh, sw, pt, pl, kh_n, kw_n):
        """v2, shared memory. A block of V2_THREADS threads takes output tiles of
        V2_TILE x V2_TILE pixels (all Cout channels): tile = blockIdx.x, + gridDim.x, ...
        over B * ceil(OH/8) * ceil(OW/8) tiles. Once per block it copies the kernel
        (w_flat, KH*KW*Cin*Cout floats in HWIO order) into ``ws``; per tile it copies the
        input patch the tile reads, PH x PW x Cin with PH = 7*sh + KH, PW = 7*sw + KW,
        zeros outside the image, into ``xs`` (consecutive threads, consecutive (col, ci):
        coalesced), syncs, computes, syncs before the next patch overwrites ``xs``.
        Thread t computes the tile's outputs e = t, t + V2_THREADS, ... with co = e % Cout
        fastest (coalesced stores, conflict-free reads of ws, broadcast reads of xs).
        Preconditions: KH*KW*Cin*Cout <= V2_KERNEL_FLOATS, PH*PW*Cin <= V2_PATCH_FLOATS
        (``v2_fits``, checked by the launcher).
        Loop nest: as v1, with the padding taps added as x = 0 (the same sums in the same
        order: acc + 0 * w == acc for finite w, so v2 equals v1 bit for bit).
        """
        xs = cuda.shared.array(V2_PATCH_FLOATS, float32)   # xs[(r * PW + c) * Cin + ci]
        ws = cuda.shared.array(V2_KERNEL_FLOATS, float32)  # ws[((kh*KW + kw)*Cin + ci)*Cout + co]
        t = cuda.threadIdx.x
        batch, in_h, in_w, cin = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
        out_h, out_w, cout = out.shape[1], out.shape[2], out.shape[3]
        for e in range(t, w_flat.size, V2_THREADS):
            ws[e] = w_flat[e]
        patch_h = (V2_TILE - 1) * sh + kh_n
        patch_w = (V2_TILE - 1) * sw + kw_n
        tiles_h = ceil_div_device(out_h, V2_TILE)
        tiles_w = ceil_div_device(out_w, V2_TILE)
        # The same trip count for every thread of the block: the syncthreads stay uniform.
        for tile in range(cuda.blockIdx.x, batch * tiles_h * tiles_w, cuda.gridDim.x):
            oh0 = (tile // tiles_w) % tiles_h * V2_TILE
            ow0 = tile % tiles_w * V2_TILE
            n = tile // (tiles_w * tiles_h)
            for e in range(t, patch_h * patch_w * cin, V2_THREADS):
                ci = e % cin
                rc = e // cin
                ih = oh0 * sh - pt + rc // patch_w
                iw = ow0 * sw - pl + rc % patch_w
                inside = ih >= 0 and ih < in_h and iw >= 0 and iw < in_w
                xs[e] = x[n, ih, iw, ci] if inside else float32(0.0)
            cuda.syncthreads()                             # patch (and kernel) complete
            for e in range(t, V2_TILE * V2_TILE * cout, V2_THREADS):
                co = e % cout
                pix = e // cout
                ph = pix // V2_TILE
                pw = pix % V2_TILE
                oh = oh0 + ph
                ow = ow0 + pw
                if oh < out_h and ow < out_w:
                    acc = bias[co]
                    for kh in range(kh_n):
                        for kw in range(kw_n):
                            xb = ((ph * sh + kh) * patch_w + pw * sw + kw) * cin
                            wb = (kh * kw_n + kw) * cin * cout + co
                            for ci in range(cin):
                                acc += xs[xb + ci] * ws[wb + ci * cout]
                    if relu and acc < float32(0.0):
                        acc = float32(0.0)
                    out[n, oh, ow, co] = acc
            cuda.syncthreads()                             # done reading xs

    return conv2d_v2


@cuda.jit
def conv2d_dx_v1(dy, w, dx, sh, sw, pt, pl):
    """dx, v1. One thread per input element i of the flattened (B, H, W, Cin) dx
    (grid-stride), ci fastest. The outputs whose window covers input row ih are
    oh = ceil((ih + pt - KH + 1) / sh) .. floor((ih + pt) / sh) (clipped to [0, OH)),
    each through tap kh = ih + pt - oh * sh; the same along the width. The thread sums
    over exactly those (no atomics: it alone writes dx[n, ih, iw, ci]).
    Loop nest: for each (n, ih, iw, ci): acc = 0
                   for oh in that range: for ow in that range: for co in range(Cout):
                       acc += dy[n, oh, ow, co] * w[ih + pt - oh*sh, iw + pl - ow*sw, ci, co]
                   dx[n, ih, iw, ci] = acc
    """
    in_h, in_w, cin = dx.shape[1], dx.shape[2], dx.shape[3]
    kh_n, kw_n, cout = w.shape[0], w.shape[1], w.shape[3]
    out_h, out_w = dy.shape[1], dy.shape[2]
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        n, ih, iw, ci = nhwc_index(i, in_h, in_w, cin)
        acc = float32(0.0)
        oh_lo, oh_hi, ow_lo, ow_hi = windows_over(ih, iw, pt, pl, kh_n, kw_n, sh, sw,
                                                  out_h, out_w)
        for oh in range(oh_lo, oh_hi + 1):
            kh = ih + pt - oh * sh
            for ow in range(ow_lo, ow_hi + 1):
                kw = iw + pl - ow * sw
                for co in range(cout):
                    acc += dy[n, oh, ow, co] * w[kh, kw, ci, co]
        dx[n, ih, iw, ci] = acc


@cuda.jit
def conv2d_dw_partial(x, dy, partial, kh_n, kw_n, sh, sw, pt, pl):
    """dW and db, pass 1. Columns e of ``partial`` (chunks, KH*KW*Cin*Cout [+ Cout]) are
    the weights in HWIO order (e -> kh, kw, ci, co with co = e % Cout fastest), then, when
    the bias has a gradient, Cout bias columns. One thread per column (x over columns);
    block-row c = blockIdx.y, + gridDim.y, ... takes chunk c: output rows r = (n, oh) in
    [c * R, (c + 1) * R), R = ceil(B*OH / chunks), and writes their sum:
        partial[c, e] = sum over r in chunk c, ow of x[n, oh*sh - pt + kh, ow*sw - pl + kw, ci]
                                                  * dy[n, oh, ow, co]   (taps in the padding: 0)
        partial[c, bias column co] = sum over the same (r, ow) of dy[n, oh, ow, co]
    Consecutive threads take consecutive co: their dy reads coalesce, their x reads are
    one broadcast. Every partial is written (zero for an empty chunk).
    """
    in_h, in_w, cin = x.shape[1], x.shape[2], x.shape[3]
    out_h, out_w, cout = dy.shape[1], dy.shape[2], dy.shape[3]
    n_w = kh_n * kw_n * cin * cout
    chunks = partial.shape[0]
    rows = x.shape[0] * out_h
    per_chunk = (rows + chunks - 1) // chunks
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e < partial.shape[1]:
        co = e % cout                       # also for the bias columns: n_w % Cout == 0
        is_bias = e >= n_w
        r = e // cout
        ci = r % cin
        r //= cin
        kw = r % kw_n
        kh = r // kw_n
        for c in range(cuda.blockIdx.y, chunks, cuda.gridDim.y):
            acc = float32(0.0)
            for row in range(c * per_chunk, min((c + 1) * per_chunk, rows)):
                n = row // out_h
                oh = row % out_h
                ih = oh * sh - pt + kh
                if is_bias:
                    for ow in range(out_w):
                        acc += dy[n, oh, ow, co]
                elif ih >= 0 and ih < in_h:
                    for ow in range(out_w):
                        iw = ow * sw - pl + kw
                        if iw >= 0 and iw < in_w:
                            acc += x[n, ih, iw, ci] * dy[n, oh, ow, co]
            partial[c, e] = acc


@cuda.jit
def conv2d_dw_finish(partial, dw_flat, db):
    """dW and db, pass 2. One thread per column e of ``partial`` (grid-stride): the sum
    of its chunks in order c = 0, 1, ... (fixed, so bitwise reproducible), written to
    dw_flat[e] (the HWIO kernel's gradient, flattened) or, for a bias column, to
    db[e - dw_flat.size].
    Loop nest: for e: acc = 0; for c in range(chunks): acc += partial[c, e]
    """
    n_w = dw_flat.size
    for e in range(cuda.grid(1), partial.shape[1], cuda.gridsize(1)):
        acc = float32(0.0)
        for c in range(partial.shape[0]):
            acc += partial[c, e]
        if e < n_w:
            dw_flat[e] = acc
        else:
            db[e - n_w] = acc


#: KERNELS[version][relu] -> the forward kernel.
KERNELS = {"v1": {r: _make_v1(r) for r in (False, True)},
           "v2": {r: _make_v2(r) for r in (False, True)}}

# What the real compiler checks (kernels/registry.py): float32 NHWC/HWIO arrays, and the
# int64 sizes a launcher's Python ints become.
_F32, _A4 = vec("float32"), arr4("float32")
_I = "int64"
for _relu in (False, True):
    register(KERNELS["v1"][_relu], "conv2d_v1", sig(_A4, _A4, _F32, _A4, _I, _I, _I, _I),
             block=grid_1d(1)[1], variant=f"relu={_relu}")
    register(KERNELS["v2"][_relu], "conv2d_v2",
             sig(_A4, _F32, _F32, _A4, _I, _I, _I, _I, _I, _I), block=V2_THREADS,
             variant=f"relu={_relu}")
register(conv2d_dx_v1, "conv2d_dx_v1", sig(_A4, _A4, _A4, _I, _I, _I, _I), block=grid_1d(1)[1])
register(conv2d_dw_partial, "conv2d_dw_partial",
         sig(_A4, _A4, mat("float32"), _I, _I, _I, _I, _I, _I), block=DW_THREADS)
register(conv2d_dw_finish, "conv2d_dw_finish", sig(mat("float32"), _F32, _F32),
         block=grid_1d(1)[1])


# --- launchers -----------------------------------------------------------------------------

#: What ``conv2d(..., version=None)`` runs: v1, measured 4.8x faster than v2 on an H100
#: (before v2's grid was fixed). The library runs v3 (kernels/conv2d_v3.py).
DEFAULT_VERSION = "v1"


def check_size(what, *arrays):
    """Raise a ValueError unless every array has fewer than 2**31 elements (the kernels
    compiled per shape index with 32-bit unsigned arithmetic)."""
    for a in arrays:
        if a.size >= MAX_ELEMENTS_32:
            raise ValueError(f"{what}: an array of shape {tuple(a.shape)} has {a.size:,} "
                             f"elements; these kernels index with 32-bit arithmetic and take "
                             f"fewer than 2**31 = {MAX_ELEMENTS_32:,}: split the batch.")


class CheckMemo:
    """What a launcher's checks concluded, remembered per (argument arrays, settings).

    A training step calls each launcher with the same buffers every time, so shapes,
    dtypes, aliasing and the window geometry are checked on the first call only. An
    entry holds weak references to its arrays and is used only for the very same live
    objects (a freed array's id may be reused by a new one: its dead reference then
    misses); it keeps no array alive (a device's memory accounting refunds freed
    buffers). At most MAX_ENTRIES are kept (cleared past that).
    """
    MAX_ENTRIES = 256

    def __init__(self):
        self._entries = {}

    def get(self, arrays, settings):
        hit = self._entries.get((settings, tuple(id(a) for a in arrays)))
        if hit is None:
            return None
        refs, value = hit
        same = all(a is None if r is None else r() is a for r, a in zip(refs, arrays))
        return value if same else None

    def put(self, arrays, settings, value):
        try:
            refs = tuple(None if a is None else weakref.ref(a) for a in arrays)
        except TypeError:                   # an array type without weak references
            return value
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries.clear()
        self._entries[(settings, tuple(id(a) for a in arrays))] = (refs, value)
        return value


def v2_grid(out_shape):
    """v2's (blocks, threads): one block per 8 x 8 output tile (all channels), up to
    V2_MAX_BLOCKS. (It was ``grid_1d(tiles, 256)``: tiles / 256 blocks, 32 at batch 512,
    each looping over 256 tiles: no GPU was filled.)"""
    tiles = out_shape[0] * ceil_div(out_shape[1], V2_TILE) * ceil_div(out_shape[2], V2_TILE)
    return max(1, min(tiles, V2_MAX_BLOCKS)), V2_THREADS


def v2_fits(kernel_shape, strides):
    """True when v2's shared buffers hold this layer's kernel and one tile's input patch."""
    kh, kw, cin, cout = kernel_shape
    sh, sw = strides
    patch = ((V2_TILE - 1) * sh + kh) * ((V2_TILE - 1) * sw + kw) * cin
    return kh * kw * cin * cout <= V2_KERNEL_FLOATS and patch <= V2_PATCH_FLOATS


def _check_forward(x, kernel, strides, padding):
    """Shapes and dtypes of the inputs; returns (output shape, strides, pads)."""
    shape = conv2d_output_shape(x.shape, kernel.shape, strides, padding)
    check_array("conv2d: x", x, np.float32, ndim=4)
    check_array("conv2d: kernel", kernel, np.float32, ndim=4)
    _, _, pads = window_geometry("conv2d", x.shape[1:3], kernel.shape[:2], strides, padding)
    return shape, pair("conv2d", "strides", strides), pads


_forward_checked = CheckMemo()
_backward_checked = CheckMemo()


def conv2d(x, kernel, bias, out, strides=1, padding="valid", relu=False, stream=None,
           version=None):
    """Conv2D forward on the GPU: out = conv(x, kernel) + bias, then max(., 0) if ``relu``.

    x (B, H, W, Cin), kernel (KH, KW, Cin, Cout), bias (Cout,) (zeros for a layer with
    use_bias=False), out (B, OH, OW, Cout) (``conv2d_output_shape``): float32,
    C-contiguous, out disjoint from the inputs. ``version``: "v1", "v2" (when ``v2_fits``)
    or None for v1, the faster one measured (see the module docstring). Every check runs
    before the launch.
    """
    if version is not None and version not in VERSIONS:
        raise ValueError(f"conv2d: unknown version {version!r}; expected one of {VERSIONS} "
                         f"or None.")
    arrays, settings = (x, kernel, bias, out), (strides, padding, version)
    done = _forward_checked.get(arrays, settings)
    if done is None:
        shape, (sh, sw), (pt, _, pl, _) = _check_forward(x, kernel, strides, padding)
        check_array("conv2d: bias", bias, np.float32, shape=(shape[3],))
        check_array("conv2d: out", out, np.float32, shape=shape)
        check_no_alias("conv2d", out, x, kernel, bias)
        if version == "v2" and not v2_fits(kernel.shape, (sh, sw)):
            raise ValueError(f"conv2d: v2 holds at most {V2_KERNEL_FLOATS} kernel floats and "
                             f"a {V2_PATCH_FLOATS}-float input patch in shared memory; kernel "
                             f"{tuple(kernel.shape)} with strides {(sh, sw)} needs more: use "
                             f"v1 (or version=None).")
        done = _forward_checked.put(arrays, settings, (shape, sh, sw, pt, pl))
    shape, sh, sw, pt, pl = done
    version = version or DEFAULT_VERSION
    if out.size == 0:
        return out
    if version == "v1":
        launch(KERNELS["v1"][bool(relu)], *grid_1d(out.size), stream, x, kernel, bias, out,
               sh, sw, pt, pl)
    else:
        launch(KERNELS["v2"][bool(relu)], *v2_grid(shape), stream, x, flat(kernel), bias,
               out, sh, sw, pt, pl, kernel.shape[0], kernel.shape[1])
    return out


def dw_partial_shape(x_shape, kernel_shape, strides=1, padding="valid", with_bias=True):
    """The (chunks, columns) float32 scratch ``conv2d_backward`` uses for dW/db's pass 1:
    a layer allocates it once per batch size and passes it as ``partial``."""
    _, out_h, _, cout = conv2d_output_shape(x_shape, kernel_shape, strides, padding)
    chunks = max(1, min(ceil_div(x_shape[0] * out_h, DW_MIN_CHUNK_ROWS), DW_MAX_CHUNKS))
    return chunks, int(np.prod(kernel_shape)) + (cout if with_bias else 0)


def check_backward_arrays(x, kernel, dy, dx, dw, db, partial, shape, part_shape):
    """The array checks of both backward launchers (v1 here, v2 in conv2d_grad.py): dy of the
    forward's output ``shape``, dx like x, dw like kernel, db (Cout,), ``partial`` (if given)
    of ``part_shape``, all float32; every output clear of the inputs and of each other."""
    check_array("conv2d_backward: dy", dy, np.float32, shape=shape)
    if dx is not None:
        check_array("conv2d_backward: dx", dx, np.float32, shape=x.shape)
    check_array("conv2d_backward: dw", dw, np.float32, shape=kernel.shape)
    if db is not None:
        check_array("conv2d_backward: db", db, np.float32, shape=(shape[3],))
    if partial is not None:
        check_array("conv2d_backward: partial", partial, np.float32, shape=part_shape)
    outs = [o for o in (dx, dw, db, partial) if o is not None]
    for i, o in enumerate(outs):         # each output clear of the inputs and the others
        check_no_alias("conv2d_backward", o, x, kernel, dy, *outs[i + 1:])


def conv2d_backward(x, kernel, dy, dx, dw, db, strides=1, padding="valid", partial=None,
                    stream=None):
    """Conv2D backward on the GPU: dx (or None to skip it: a first layer), dw, db (or
    None: use_bias=False) from the forward's x and kernel and dy = dLoss/dout.

    Shapes as ``conv2d``: dy (B, OH, OW, Cout), dx like x, dw like kernel, db (Cout,);
    float32, C-contiguous, outputs disjoint from the inputs and each other. ``partial``:
    a float32 scratch of ``dw_partial_shape(...)`` (allocated per call when None). With
    a fused ReLU, pass dy already masked (kernels.activations.relu_backward). dW and db
    are bitwise reproducible (module docstring). Every check runs before any launch.
    """
    arrays, settings = (x, kernel, dy, dx, dw, db, partial), (strides, padding)
    done = _backward_checked.get(arrays, settings) if partial is not None else None
    if done is None:
        shape, (sh, sw), (pt, _, pl, _) = _check_forward(x, kernel, strides, padding)
        part_shape = dw_partial_shape(x.shape, kernel.shape, (sh, sw), padding, db is not None)
        if partial is None:                  # a scratch made per call: not remembered
            partial = cuda.device_array(part_shape, np.float32, stream=stream or 0)
            arrays = None
        check_backward_arrays(x, kernel, dy, dx, dw, db, partial, shape, part_shape)
        done = (part_shape, sh, sw, pt, pl)
        if arrays is not None:
            _backward_checked.put(arrays, settings, done)
    part_shape, sh, sw, pt, pl = done
    if dx is not None and dx.size:
        launch(conv2d_dx_v1, *grid_1d(dx.size), stream, dy, kernel, dx, sh, sw, pt, pl)
    chunks, cols = part_shape
    launch(conv2d_dw_partial, (ceil_div(cols, DW_THREADS), grid_rows(chunks)), DW_THREADS,
           stream, x, dy, partial, kernel.shape[0], kernel.shape[1], sh, sw, pt, pl)
    dw_flat = flat(dw)
    # Without a bias gradient pass 2 never writes db (every column is a weight): dw_flat
    # fills the argument slot.
    launch(conv2d_dw_finish, *grid_1d(cols), stream, partial, dw_flat,
           db if db is not None else dw_flat)
    return dx, dw, db
