"""Conv2D forward v3, compiled per layer shape, and the fused conv + bias + ReLU + 2x2 max-pool.

Same math as kernels/conv2d.py (read its docstring and v1 first: v1 is the readable
baseline, this file is what the lab's layer runs on a GPU). Why v1 is slow: measured
with the real compiler and no GPU (``python -m kernels.report --only conv2d``), v1's
code is about 880 static SASS instructions for one output that needs 9 multiply-adds:
its shapes are run-time int64 values, so every output pays for 64-bit divisions,
64-bit stride arithmetic and NumPy's negative-index wrap-around.

v3 makes the shape part of the program. ``forward_kernel(geometry, relu, pool)`` is a
closure factory: KH, KW, Cin, Cout, H, W, OH, OW, the strides and the padding are Python
constants captured by the kernel, so NVVM sees fixed trip counts (loops unroll, divisions
by OH become a multiply), and ``cuda.local.array``s of compile-time size live in
registers (DESIGN.md, "Register tiling"). One kernel per (shape, relu, pool), cached.

Thread -> data mapping (both kernels)::

    block (LANES=32, ROWS_PER_BLOCK) threads; grid (row blocks, ceil(Cout / 32))
    lane  = threadIdx.x  -> out channel co = blockIdx.y * 32 + lane   (across the warp)
    row   = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y, + grid stride  -> one output row (n, oh)

so a warp's 32 stores are consecutive channels of one pixel (coalesced, NHWC), and its
32 loads of an input value are the same address (one broadcast). The thread walks along
its output row, STEP outputs at a time: it copies the input patch those outputs read
(KH rows x ((STEP-1)*sw + KW) columns x a chunk of channels, zeros in the padding) into
registers once, so neighbouring outputs share their overlapping taps, then does the
multiply-adds from registers. Its filter's taps (KH*KW*CHUNK weights) are in registers too.

Any Cin: the taps of all Cin channels do not fit in registers for large layers (32 -> 64,
3x3 is 288 weights, plus the patch), so the channels go in chunks of CHUNK (the largest
divisor of Cin with KH*KW*CHUNK <= MAX_TAPS and the patch <= MAX_PATCH): the STEP
accumulators stay in registers across chunks, and each chunk reloads its weights (from
L1: a warp reads 32 consecutive co) and its patch. A divisor, so no chunk is partial and
no tap needs a guard. When Cin fits in one chunk (the lab's 1 -> 32: 9 taps) the weights
are loaded once, before the walk. Kernels with KH*KW > MAX_TAPS have no v3 (``fits``).

Index arithmetic is 32-bit unsigned (``u32``): one compare ``ih < H`` also rejects a
negative row of the padding (it wraps to a huge number). The launcher refuses arrays of
2**31 elements or more (``check_size``), so no index overflows.

Fused conv + bias + ReLU + 2x2 max-pool (``pool=2``; Conv2D(activation='relu') followed
by MaxPooling2D(2), stride 2, 'valid'): a thread's row is a POOLED row (conv rows 2ph and
2ph+1), each step computes 2 x 2*STEP conv outputs from one patch, ReLUs them and writes
only the STEP window maxima and an int8 arg-max (a*2 + b of the FIRST maximum, NaN rule
as kernels/pooling.py). The conv output is never written: 4x less traffic, and the pool
forward's launch is gone. Conv rows/columns that no 2x2 window covers (an odd OH or OW)
are not computed; their gradient is zero (kernels/pooling.py, ``max_pool_backward_v2``).

The sums: bias, then (chunk, kh, kw, ci) in that order; with one chunk this is v1's
order, so v3 and v1 agree bit for bit except where a padding tap adds 0 * w.

    python -m kernels.report --only conv2d_v3     # registers, spills, SASS per output
    python -m pytest -q tests/test_kernels_conv_v3.py

Neighbours: kernels/conv2d.py (geometry, references, v1, backward v1),
kernels/conv2d_grad.py (dW/db and dX compiled the same way), kernels/pooling.py (pool
backward with the ReLU mask), mirrored/backends.py (CudaOps calls ``conv2d_v3`` and
``conv2d_relu_pool``).
"""
import math

import numpy as np
from numba import cuda, float32, int8, uint32

from kernels.conv2d import (CheckMemo, check_size, conv2d, conv2d_output_shape, conv2d_ref, pair,
                            window_geometry)
from kernels.pooling import max_pool_ref
from kernels.launch import (SIMULATOR, check_array, check_no_alias, flat, grid_rows, launch)
from kernels.registry import register, sig, vec

if SIMULATOR:
    def u32(v):
        """uint32(v) with C's wrap-around (NumPy's uint32 refuses negative numbers)."""
        return int(v) & 0xFFFFFFFF
else:
    u32 = uint32       # compiled: a truncation to 32 bits, which lets NVVM narrow the math

#: Out-channel lanes per block: one warp across 32 consecutive channels.
LANES = 32
#: Output rows per block (warps per block). 4 x 32 = 128 threads: with ~100 registers a
#: thread, 4 blocks fit an SM. The simulator gets 2: every CUDA thread is a Python thread.
ROWS_PER_BLOCK = 2 if SIMULATOR else 4
#: Blocks along x at most (grid-stride over rows): ~16 blocks per SM of an H100 in one wave.
MAX_ROW_BLOCKS = 4 if SIMULATOR else 2048
#: Conv outputs (plain) or pooled outputs (fused) per step along the row: the patch of
#: STEP outputs is loaded once, so neighbours share taps, and the code of one step is
#: amortised over STEP outputs.
STEP = 4
POOL_STEP = 2
#: Register budgets, in floats: the filter taps one chunk holds, and the input patch.
MAX_TAPS = 36
MAX_PATCH = 96
#: The pool the fused kernel does: 2x2, stride 2, 'valid'.
POOL = 2
#: The arg-max dtype of the fused kernel: a position a * 2 + b < 4.
FUSED_ARG_DTYPE = np.int8


# --- geometry and register budgets ---------------------------------------------------------

def chunk_channels(kh, kw, cin, rows_in, cols_in):
    """The input channels one pass holds in registers: the largest divisor of ``cin``
    whose taps (kh*kw*chunk) and patch (rows_in*cols_in*chunk) fit the budgets; 0 when
    even one channel does not fit (no v3 for that kernel size)."""
    for chunk in range(cin, 0, -1):
        if (cin % chunk == 0 and kh * kw * chunk <= MAX_TAPS
                and rows_in * cols_in * chunk <= MAX_PATCH):
            return chunk
    return 0


def _patch_size(kh, kw, sh, sw, pool):
    step = POOL_STEP if pool == POOL else STEP
    return (pool - 1) * sh + kh, (pool * step - 1) * sw + kw


def fits(kernel_shape, strides, pool=1):
    """True when v3 (``pool=1``) or the fused kernel (``pool=2``) exists for this kernel."""
    kh, kw, cin, _ = kernel_shape
    rows_in, cols_in = _patch_size(kh, kw, *strides, pool)
    return chunk_channels(kh, kw, cin, rows_in, cols_in) > 0


def geometry(x_shape, kernel_shape, strides, padding):
    """The compile-time constants of one layer shape, as a hashable tuple:
    (H, W, Cin, KH, KW, Cout, sh, sw, pt, pl, OH, OW). The batch is not part of it."""
    _, h, w, cin = (int(v) for v in x_shape)
    kh, kw, _, cout = (int(v) for v in kernel_shape)
    sh, sw = pair("conv2d", "strides", strides)
    oh, ow, (pt, _, pl, _) = window_geometry("conv2d", (h, w), (kh, kw), (sh, sw), padding,
                                             "kernel")
    return h, w, cin, kh, kw, cout, sh, sw, pt, pl, oh, ow


def shape_label(geo):
    """``geo`` in words, the registered variant: "28x28x1 k3x3->32 s1x1 p0,0 out26x26"."""
    h, w, cin, kh, kw, cout, sh, sw, pt, pl, oh, ow = geo
    return f"{h}x{w}x{cin} k{kh}x{kw}->{cout} s{sh}x{sw} p{pt},{pl} out{oh}x{ow}"


def is_padded(geo):
    """True when some window of ``geo`` hangs over x's edge (taps there count 0): without
    padding every output's window is inside x, and a clamped tap (``step``) feeds only
    outputs past OW, which are not stored."""
    h, w, _, kh, kw, _, sh, sw, pt, pl, oh, ow = geo
    return pt > 0 or pl > 0 or (oh - 1) * sh + kh > h or (ow - 1) * sw + kw > w


# --- NumPy reference (the v3 forward's is kernels/conv2d.py's conv2d_ref) -------------

def conv2d_relu_pool_ref(x, kernel, bias, strides=1, padding="valid"):
    """NumPy reference of the fused kernel: (pooled, arg int8) from conv2d_ref (ReLU)
    and max_pool_ref (2x2, stride 2, 'valid')."""
    y = conv2d_ref(x, kernel, bias, strides, padding, relu=True)
    pooled, arg = max_pool_ref(y, POOL, POOL, "valid")
    return pooled, arg.astype(FUSED_ARG_DTYPE)


# --- kernels -------------------------------------------------------------------------------

_kernels = {}


def forward_kernel(geo, relu, pool):
    """The v3 (``pool=1``) or fused (``pool=2``, relu must be True) kernel for ``geo``
    (``geometry``), made and registered on first use, then cached."""
    key = (geo, bool(relu), pool)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = _make_forward(geo, bool(relu), pool)
        variant = shape_label(geo) + (" relu" if relu else "")
        if pool == 1:
            register(kernel, "conv2d_v3", sig(_F32, _F32, _F32, _F32, "uint32"),
                     block=(LANES, ROWS_PER_BLOCK), variant=variant, outputs_per_pass=STEP,
                     made_by=(forward_kernel, key))
        else:
            register(kernel, "conv2d_relu_pool", sig(_F32, _F32, _F32, _F32, vec("int8"),
                                                     "uint32"),
                     block=(LANES, ROWS_PER_BLOCK), variant=variant,
                     outputs_per_pass=POOL * POOL * POOL_STEP, made_by=(forward_kernel, key))
    return kernel


def _make_forward(geo, relu, pool):
    H, W, CIN, KH, KW, COUT, SH, SW, PT, PL, OH, OW = geo
    STEPS = POOL_STEP if pool == POOL else STEP            # outputs of the thread's row per step
    CONV_COLS = pool * STEPS                               # conv columns per step
    ROWS_IN, COLS_IN = _patch_size(KH, KW, SH, SW, pool)
    CHUNK = chunk_channels(KH, KW, CIN, ROWS_IN, COLS_IN)
    NCHUNK = CIN // CHUNK
    TAPS = KH * KW * CHUNK
    PATCH = ROWS_IN * COLS_IN * CHUNK
    ACCS = pool * CONV_COLS                                # conv outputs per step
    OUT_H, OUT_W = (OH // pool, OW // pool) if pool == POOL else (OH, OW)
    PADDED = is_padded(geo)

    @cuda.jit(device=True, inline="always")
    def load_weights(w, wreg, co, c):
        """wreg[(kh*KW + kw)*CHUNK + i] = w[kh, kw, c*CHUNK + i, co] (HWIO, flat)."""
        for t in range(KH * KW):
            for i in range(CHUNK):
                wreg[t * CHUNK + i] = w[(u32(t * CIN + c * CHUNK + i)) * COUT + co]

    @cuda.jit(device=True, inline="always")
    def step(x, w, wreg, patch, acc, n, oh0, ow0, co):
        """acc[r * CONV_COLS + j] += conv output (oh0 + r, ow0 + j) for r < pool,
        j < CONV_COLS, over every chunk of input channels.

        The patch loads are branch-free: a row or column outside x (the padding, or past
        the row's end in the last step) reads the clamped, valid address and is then
        replaced by 0 where the layer has padding. With no padding (PADDED False) such
        a tap only feeds an output past OW, which is not stored: no select at all."""
        for c in range(NCHUNK):
            if NCHUNK > 1:
                load_weights(w, wreg, co, c)
            for r in range(ROWS_IN):                         # the patch
                ih = u32(oh0 * SH + u32(r - PT))             # a negative row wraps: >= H
                row_base = u32(u32(n * H + min(ih, u32(H - 1))) * W)
                for j in range(COLS_IN):
                    iw = u32(ow0 * SW + u32(j - PL))
                    base = u32(u32(row_base + min(iw, u32(W - 1))) * CIN + c * CHUNK)
                    for i in range(CHUNK):
                        v = x[u32(base + i)]
                        if PADDED and not (ih < H and iw < W):
                            v = float32(0.0)
                        patch[(r * COLS_IN + j) * CHUNK + i] = v
            for r in range(pool):
                for j in range(CONV_COLS):
                    a = acc[r * CONV_COLS + j]
                    for kh in range(KH):
                        for kw in range(KW):
                            for i in range(CHUNK):
                                a += (patch[((r * SH + kh) * COLS_IN + j * SW + kw) * CHUNK + i]
                                      * wreg[(kh * KW + kw) * CHUNK + i])
                    acc[r * CONV_COLS + j] = a

    @cuda.jit(device=True, inline="always")
    def relu_of(a):
        if relu and a < float32(0.0):                      # NaN is not < 0: it passes
            return float32(0.0)
        return a

    if pool == 1:
        @cuda.jit
        def conv2d_v3(x, w, bias, out, rows):
            """v3: see the module docstring. x (B*H*W*Cin,), w (KH*KW*Cin*Cout,) HWIO,
            bias (Cout,), out (B*OH*OW*Cout,), all flat; rows = B * OH.
            Loop nest: for each row (n, oh) of this thread, co = its lane's channel:
                           for ow0 in 0, STEP, ...: acc[j] = bias[co]
                               for each chunk: patch <- x; acc[j] += patch . wreg
                               out[n, oh, ow0 + j, co] = relu(acc[j]) (j with ow0 + j < OW)
            """
            co = u32(cuda.blockIdx.y * LANES + cuda.threadIdx.x)
            if co < COUT:
                wreg = cuda.local.array(TAPS, float32)
                patch = cuda.local.array(PATCH, float32)
                acc = cuda.local.array(ACCS, float32)
                b = bias[co]
                if NCHUNK == 1:
                    load_weights(w, wreg, co, 0)
                row = u32(cuda.blockIdx.x * ROWS_PER_BLOCK + cuda.threadIdx.y)
                while row < rows:                          # 32-bit loops: no trip-count division
                    n = u32(row // OH)
                    oh = u32(row - n * OH)
                    ow0 = u32(0)
                    while ow0 < OW:
                        for j in range(ACCS):
                            acc[j] = b
                        step(x, w, wreg, patch, acc, n, oh, ow0, co)
                        for j in range(STEPS):
                            if ow0 + j < OW:
                                out[u32(u32(row * OW + ow0 + j) * COUT + co)] = relu_of(acc[j])
                        ow0 = u32(ow0 + STEPS)
                    row = u32(row + cuda.gridDim.x * ROWS_PER_BLOCK)

        return conv2d_v3

    @cuda.jit
    def conv2d_relu_pool(x, w, bias, out, arg, rows):
        """Fused conv + bias + ReLU + 2x2/2 max-pool: see the module docstring. out and
        arg (B*PH*PW*Cout,) flat, PH = OH // 2, PW = OW // 2; rows = B * PH.
        Loop nest: for each pooled row (n, ph), co: for pw0 in 0, POOL_STEP, ...:
                       acc = bias; conv rows 2ph, 2ph+1, columns 2pw0 .. 2pw0 + 2*STEP - 1
                       for each pooled column pw: best, k over (a, b) in row-major order of
                           relu(acc[a, 2(pw - pw0) + b]) (first maximum, NaN rule of pooling)
                       out[n, ph, pw, co] = best; arg[n, ph, pw, co] = k
        """
        co = u32(cuda.blockIdx.y * LANES + cuda.threadIdx.x)
        if co < COUT:
            wreg = cuda.local.array(TAPS, float32)
            patch = cuda.local.array(PATCH, float32)
            acc = cuda.local.array(ACCS, float32)
            b = bias[co]
            if NCHUNK == 1:
                load_weights(w, wreg, co, 0)
            row = u32(cuda.blockIdx.x * ROWS_PER_BLOCK + cuda.threadIdx.y)
            while row < rows:
                n = u32(row // OUT_H)
                ph = u32(row - n * OUT_H)
                pw0 = u32(0)
                while pw0 < OUT_W:
                    for j in range(ACCS):
                        acc[j] = b
                    step(x, w, wreg, patch, acc, n, u32(ph * POOL), u32(pw0 * POOL), co)
                    for j in range(STEPS):
                        if pw0 + j < OUT_W:
                            best = float32(0.0)
                            k = -1
                            for a in range(POOL):
                                for bb in range(POOL):
                                    v = relu_of(acc[a * CONV_COLS + j * POOL + bb])
                                    nan_first = math.isnan(v) and not math.isnan(best)
                                    if k < 0 or v > best or nan_first:
                                        best = v
                                        k = a * POOL + bb
                            o = u32(u32(row * OUT_W + pw0 + j) * COUT + co)
                            out[o] = best
                            arg[o] = int8(k)
                    pw0 = u32(pw0 + STEPS)
                row = u32(row + cuda.gridDim.x * ROWS_PER_BLOCK)

    return conv2d_relu_pool


# --- registration: the shapes the course runs (more are registered as layers make them) ---

_F32 = vec("float32")
#: The lab's first conv (28x28x1, 3x3 -> 32, valid) and the official tutorials' second
#: (13x13x32, 3x3 -> 64), plus stride 2 with 'same' padding: the report and the compile
#: test see these with no layer built.
REGISTERED_SHAPES = (((1, 28, 28, 1), (3, 3, 1, 32), 1, "valid"),
                     ((1, 13, 13, 32), (3, 3, 32, 64), 1, "valid"),
                     ((1, 28, 28, 1), (3, 3, 1, 32), 2, "same"))
for _x, _k, _s, _p in REGISTERED_SHAPES:
    forward_kernel(geometry(_x, _k, _s, _p), True, 1)
    forward_kernel(geometry(_x, _k, _s, _p), True, POOL)


# --- launchers ---------------------------------------------------------------------------

def _grid(rows, cout):
    """(blocks over rows, blocks over channels), block (LANES, ROWS_PER_BLOCK)."""
    row_blocks = max(1, min(-(-rows // ROWS_PER_BLOCK), MAX_ROW_BLOCKS))
    return (row_blocks, grid_rows(-(-cout // LANES))), (LANES, ROWS_PER_BLOCK)


_checked = CheckMemo()


def _check_once(what, x, kernel, bias, outs, strides, padding, pool):
    """The launcher's checks, run once per (argument shapes, dtypes, buffers) and
    remembered: a training step calls the launcher with the same buffers every time.
    Returns (geometry, output shape)."""
    arrays, settings = (x, kernel, bias, *outs), (what, pool, strides, padding)
    done = _checked.get(arrays, settings)
    if done is not None:
        return done
    b, oh, ow, cout = conv2d_output_shape(x.shape, kernel.shape, strides, padding, what)
    check_array(f"{what}: x", x, np.float32, ndim=4)
    check_array(f"{what}: kernel", kernel, np.float32, ndim=4)
    check_array(f"{what}: bias", bias, np.float32, shape=(cout,))
    geo = geometry(x.shape, kernel.shape, strides, padding)
    if not fits(kernel.shape, geo[6:8], pool):
        raise ValueError(f"{what}: a {kernel.shape[0]}x{kernel.shape[1]} kernel has more taps "
                         f"than v3 holds in registers ({MAX_TAPS}); use conv2d(..., "
                         f"version='v1').")
    if pool == 1:
        shape = (b, oh, ow, cout)
        check_array(f"{what}: out", outs[0], np.float32, shape=shape)
    else:
        shape = (b, oh // POOL, ow // POOL, cout)
        if shape[1] < 1 or shape[2] < 1:
            raise ValueError(f"{what}: the conv output {oh}x{ow} is smaller than the 2x2 pool.")
        check_array(f"{what}: out", outs[0], np.float32, shape=shape)
        check_array(f"{what}: arg", outs[1], FUSED_ARG_DTYPE, shape=shape)
        check_no_alias(what, outs[1], x, kernel, bias, outs[0])
    check_no_alias(what, outs[0], x, kernel, bias)
    check_size(what, x, *outs)
    return _checked.put(arrays, settings, (geo, shape))


def conv2d_v3(x, kernel, bias, out, strides=1, padding="valid", relu=False, stream=None):
    """Conv2D forward v3 on the GPU: arguments and result as ``kernels.conv2d.conv2d``
    (``forward`` picks v3 or v1 for the library). Raises before any launch on bad input, for
    a kernel size v3 cannot hold (``fits``), or for arrays of 2**31 elements or more."""
    geo, shape = _check_once("conv2d", x, kernel, bias, (out,), strides, padding, 1)
    if out.size:
        rows = shape[0] * shape[1]
        grid, block = _grid(rows, shape[3])
        launch(forward_kernel(geo, relu, 1), grid, block, stream, flat(x), flat(kernel), bias,
               flat(out), np.uint32(rows))
    return out


def forward(x, kernel, bias, out, strides=1, padding="valid", relu=False, stream=None):
    """The library's Conv2D forward on a GPU: v3 where it exists for the kernel size
    (``fits``: KH*KW <= MAX_TAPS), else v1 (kernels/conv2d.py)."""
    if fits(kernel.shape, pair("conv2d", "strides", strides)):
        return conv2d_v3(x, kernel, bias, out, strides, padding, relu, stream)
    return conv2d(x, kernel, bias, out, strides, padding, relu, stream, version="v1")


def fuses_with_pool(kernel_shape, strides, activation, pool_size, pool_strides, pool_padding):
    """True when Conv2D(activation) followed by MaxPooling2D(pool_size, pool_strides,
    pool_padding) runs as one ``conv2d_relu_pool``: a ReLU, a 2x2 pool of stride 2,
    'valid', and a kernel the fused kernel holds."""
    return (activation == "relu" and tuple(pool_size) == (POOL, POOL)
            and tuple(pool_strides) == (POOL, POOL) and pool_padding == "valid"
            and fits(kernel_shape, pair("conv2d", "strides", strides), POOL))


def conv2d_relu_pool(x, kernel, bias, out, arg, strides=1, padding="valid", stream=None):
    """Conv2D(activation='relu') followed by MaxPooling2D(2) in one launch:
    out[n, ph, pw, co] = the max of relu(conv(x, kernel) + bias) over the conv outputs
    (2ph + a, 2pw + b), a, b in {0, 1}; arg = a * 2 + b of the first maximum (int8).
    out and arg (B, OH // 2, OW // 2, Cout), OH x OW the conv's output (``conv2d_output_shape``).
    The conv output is not written. Checks as ``conv2d_v3``, run once per shape."""
    geo, shape = _check_once("conv2d_relu_pool", x, kernel, bias, (out, arg), strides, padding,
                             POOL)
    if out.size:
        rows = shape[0] * shape[1]
        grid, block = _grid(rows, shape[3])
        launch(forward_kernel(geo, True, POOL), grid, block, stream, flat(x), flat(kernel),
               bias, flat(out), flat(arg), np.uint32(rows))
    return out, arg
