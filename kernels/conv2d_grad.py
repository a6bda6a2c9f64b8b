"""Conv2D backward v2, compiled per layer shape: dW + db, and dX.

The math and the v1 kernels are in kernels/conv2d.py (``conv2d_backward``, read them
first); these are the same sums, compiled per layer shape as kernels/conv2d_v3.py does
(its docstring explains the closure factory, the 32-bit unsigned indices and the clamped,
branch-free patch loads).

dW + db (``dw_partial_v2`` then ``dw_finish_v2``). v1 gives each weight one
thread that walks a whole chunk of rows: 40,960 threads doing 2,704 dependent steps each
for the lab's layer, latency-bound. v2::

    block (LANES=32, DW_WARPS) threads; grid (chunks, ceil(Cout / 32))
    lane -> out channel co (dy loads coalesce; x loads are one broadcast per warp)
    warp -> output rows r0 + warp, r0 + warp + DW_WARPS, ... of block-row chunk blockIdx.x

Each thread keeps the KH*KW*CHUNK taps of its co in registers (CHUNK input channels at a
time, as v3) and accumulates x * dy over its rows and every ow, plus dy for db. Then the
warps' sums meet in shared memory and are added in warp order 0, 1, ... (fixed), giving
``partial[chunk, column]`` in v1's column layout; v1's pass 2 adds the chunks in order.
No atomics: the order of every addition depends only on the shapes, so dW and db are
bitwise the same every run and on every replica.

Pass 2 (``dw_finish_v2``) adds each column's chunks. v1's ``conv2d_dw_finish`` gives a
column one thread that adds all its chunks in a row: 320 threads (two blocks) for the
lab's layer, which took 68 of the 110 µs of dW at batch 512 on an H100 (Nsight Compute,
7.8 % of the SMs' warps busy). v2 spreads a column's chunks over FINISH_WARPS warps::

    block (LANES=32, FINISH_WARPS) threads; grid ceil(columns / 32)
    lane -> column e = 32 * blockIdx.x + lane (a warp reads 32 neighbouring floats)
    warp w -> chunks w, w + FINISH_WARPS, ...; then warp 0 adds the warps' sums in order

dX (``dx_v2``, when the conv is not the first layer): one warp per input pixel
(n, ih, iw), lanes across the out channels co. Lane l sums, for every tap whose window
covers the pixel and every co = l, l + 32, ..., dy[n, oh, ow, co] * w[kh, kw, ci, co] for
CHUNK input channels ci at once (registers); the 32 lanes' partial sums are then reduced
per ci. That reduction would be a warp shuffle (``cuda.shfl_down_sync``) on a GPU, but
Numba's CUDA simulator has no warp intrinsics, and one copy of each kernel runs in both:
so the lanes write their partials to shared memory and lane ci adds lanes 0..31 in order
(fixed, like the rest), a transpose-and-sum that costs no more than the shuffles would.

    python -m kernels.report --only conv2d_dw_partial_v2
    python -m pytest -q tests/test_kernels_conv_v3.py

Neighbours: kernels/conv2d.py (references, v1 and its pass 2 ``conv2d_dw_finish``),
kernels/conv2d_v3.py (forward, ``geometry``), kernels/pooling.py (pool backward with the
ReLU mask, whose dz this consumes), mirrored/backends.py (CudaOps).
"""
import numpy as np
from numba import cuda, float32

from kernels.conv2d import (CheckMemo, check_backward_arrays, check_size, conv2d_backward,
                            conv2d_output_shape, dw_partial_shape)
from kernels.conv2d_v3 import LANES, MAX_TAPS, geometry, is_padded, shape_label, u32
from kernels.launch import SIMULATOR, check_array, flat, grid_rows, launch
from kernels.registry import mat, register, sig, vec

#: Warps per dW block, each over its own rows (8 x 32 = 256 threads; 2 in the simulator).
DW_WARPS = 2 if SIMULATOR else 8
#: Warps per dX block, one input pixel each.
DX_WARPS = 2 if SIMULATOR else 4
#: dX blocks at most (grid-stride over pixels).
DX_MAX_BLOCKS = 4 if SIMULATOR else 4096
#: dX input channels summed at once (registers per lane); a divisor of Cin.
DX_MAX_CHUNK = 32
#: Warps per dW pass-2 block, each adding every FINISH_WARPS-th chunk of 32 columns
#: (32 x 32 = 1,024 threads: 528 chunks become 17 loads per thread; 2 in the simulator).
FINISH_WARPS = 2 if SIMULATOR else 32


def _divisor_at_most(n, limit):
    """The largest divisor of n that is <= limit (>= 1)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def dw_chunk(kh, kw, cin):
    """Input channels whose dW taps one dW pass keeps in registers (a divisor of Cin)."""
    return _divisor_at_most(cin, max(1, MAX_TAPS // (kh * kw)))


def fits(kernel_shape):
    """True when v2 (dW and dX) exists for this kernel size: KH*KW <= MAX_TAPS."""
    return kernel_shape[0] * kernel_shape[1] <= MAX_TAPS


_kernels = {}


@cuda.jit
def dw_finish_v2(partial, dw_flat, db):
    """dW and db, pass 2: column e of ``partial`` summed over its chunks, written to
    dw_flat[e] (the HWIO kernel's gradient, flattened) or, for a bias column, to
    db[e - dw_flat.size]. Thread (lane, warp) of block b: column e = 32 b + lane, chunks
    warp, warp + FINISH_WARPS, ... in order; warp 0 then adds the FINISH_WARPS sums in
    warp order (fixed: bitwise reproducible; a different order from v1's pass 2).
    Loop nest: for e: s[w] = sum(partial[c, e] for c = w, w + W, ...); out[e] = sum(s)"""
    sums = cuda.shared.array((FINISH_WARPS, LANES), float32)
    lane, warp = cuda.threadIdx.x, cuda.threadIdx.y
    e = cuda.blockIdx.x * LANES + lane
    cols = partial.shape[1]
    acc = float32(0.0)
    if e < cols:
        for c in range(warp, partial.shape[0], FINISH_WARPS):
            acc += partial[c, e]
    sums[warp, lane] = acc
    cuda.syncthreads()
    if warp == 0 and e < cols:
        total = float32(0.0)
        for w in range(FINISH_WARPS):
            total += sums[w, lane]
        n_w = dw_flat.size
        if e < n_w:
            dw_flat[e] = total
        else:
            db[e - n_w] = total


register(dw_finish_v2, "conv2d_dw_finish_v2", sig(mat("float32"), vec("float32"), vec("float32")),
         block=(LANES, FINISH_WARPS))


def dw_kernel(geo, with_bias):
    """``dw_partial_v2`` for ``geo`` (kernels.conv2d_v3.geometry), made once and registered."""
    key = ("dw", geo, bool(with_bias))
    if key not in _kernels:
        _kernels[key] = _make_dw(geo, bool(with_bias))
        register(_kernels[key], "conv2d_dw_partial_v2",
                 sig(vec("float32"), vec("float32"), mat("float32"), "uint32", "uint32"),
                 block=(LANES, DW_WARPS), variant=shape_label(geo) + (" bias" if with_bias else ""),
                 made_by=(dw_kernel, key[1:]))
    return _kernels[key]


def dx_kernel(geo):
    """``dx_v2`` for ``geo``, made once and registered."""
    key = ("dx", geo)
    if key not in _kernels:
        _kernels[key] = _make_dx(geo)
        register(_kernels[key], "conv2d_dx_v2",
                 sig(vec("float32"), vec("float32"), vec("float32"), "uint32"),
                 block=(LANES, DX_WARPS), variant=shape_label(geo), made_by=(dx_kernel, key[1:]))
    return _kernels[key]


def _make_dw(geo, with_bias):
    H, W, CIN, KH, KW, COUT, SH, SW, PT, PL, OH, OW = geo
    CHUNK = dw_chunk(KH, KW, CIN)
    NCHUNK = CIN // CHUNK
    TAPS = KH * KW * CHUNK
    PADDED = is_padded(geo)
    N_W = KH * KW * CIN * COUT                       # the bias columns start here

    @cuda.jit
    def dw_partial_v2(x, dy, partial, rows, per_chunk):
        """dW/db pass 1 (module docstring). x (B*H*W*Cin,), dy (B*OH*OW*Cout,) flat;
        partial (chunks, KH*KW*Cin*Cout [+ Cout]) as v1's; rows = B*OH; chunk
        c = blockIdx.x covers rows [c * per_chunk, min((c + 1) * per_chunk, rows)).
        Loop nest: for each input-channel chunk: acc[t] = 0
                       for row in this warp's rows: for ow: d = dy[n, oh, ow, co]
                           acc[kh, kw, ci] += x[n, oh*sh - pt + kh, ow*sw - pl + kw, ci] * d
                       smem[warp, t, lane] = acc[t]; sync
                       partial[c, (kh, kw, ci, co)] = sum over warps in order; sync
        """
        lane = cuda.threadIdx.x
        warp = cuda.threadIdx.y
        co = u32(cuda.blockIdx.y * LANES + lane)
        chunk = cuda.blockIdx.x
        r0 = u32(chunk * per_chunk)
        r1 = min(u32(r0 + per_chunk), rows)
        sums = cuda.shared.array((DW_WARPS, TAPS, LANES), float32)
        bias_sums = cuda.shared.array((DW_WARPS, LANES), float32)
        acc = cuda.local.array(TAPS, float32)
        for c in range(NCHUNK):
            for t in range(TAPS):
                acc[t] = float32(0.0)
            acc_b = float32(0.0)
            if co < COUT:
                row = u32(r0 + warp)
                while row < r1:
                    n = u32(row // OH)
                    oh = u32(row - n * OH)
                    ow = u32(0)
                    while ow < OW:
                        d = dy[u32(u32(row * OW + ow) * COUT + co)]
                        acc_b += d
                        for kh in range(KH):
                            ih = u32(oh * SH + u32(kh - PT))
                            row_base = u32(u32(n * H + min(ih, u32(H - 1))) * W)
                            for kw in range(KW):
                                iw = u32(ow * SW + u32(kw - PL))
                                base = u32(u32(row_base + min(iw, u32(W - 1))) * CIN + c * CHUNK)
                                for i in range(CHUNK):
                                    v = x[u32(base + i)]
                                    if PADDED and not (ih < H and iw < W):
                                        v = float32(0.0)
                                    acc[(kh * KW + kw) * CHUNK + i] += v * d
                        ow = u32(ow + 1)
                    row = u32(row + DW_WARPS)
            for t in range(TAPS):
                sums[warp, t, lane] = acc[t]
            bias_sums[warp, lane] = acc_b
            cuda.syncthreads()
            if co < COUT:
                for t in range(warp, TAPS, DW_WARPS):          # the warps' sums, in warp order
                    s = float32(0.0)
                    for v in range(DW_WARPS):
                        s += sums[v, t, lane]
                    tap = t // CHUNK
                    ci = c * CHUNK + t - tap * CHUNK
                    partial[chunk, u32(u32(tap * CIN + ci) * COUT + co)] = s
                if with_bias and c == 0 and warp == 0:
                    s = float32(0.0)
                    for v in range(DW_WARPS):
                        s += bias_sums[v, lane]
                    partial[chunk, u32(N_W + co)] = s
            cuda.syncthreads()                              # before the next chunk's sums

    return dw_partial_v2


def _make_dx(geo):
    H, W, CIN, KH, KW, COUT, SH, SW, PT, PL, OH, OW = geo
    CHUNK = _divisor_at_most(CIN, DX_MAX_CHUNK)
    NCHUNK = CIN // CHUNK
    CO_TRIPS = -(-COUT // LANES)                      # out channels per lane, rounded up

    @cuda.jit
    def dx_v2(dy, w, dx, pixels):
        """dX (module docstring). dy (B*OH*OW*Cout,), w (KH*KW*Cin*Cout,) HWIO, dx
        (B*H*W*Cin,), flat; pixels = B*H*W. Warp v of block b takes pixels
        b*DX_WARPS + v, + gridDim.x*DX_WARPS, ... (the same trip count for the whole block:
        its syncthreads stay uniform).
        Loop nest: for each pixel (n, ih, iw), chunk of ci: acc[i] = 0 (per lane)
                       for (kh, kw) with oh = (ih + pt - kh) / sh, ow = (iw + pl - kw) / sw
                       whole and inside: for co = lane, lane + 32, ...:
                           acc[i] += dy[n, oh, ow, co] * w[kh, kw, ci, co]
                       smem[warp, i, lane] = acc[i]; sync
                       dx[n, ih, iw, ci = lane] = sum over lanes 0..31 in order; sync
        """
        lane = cuda.threadIdx.x
        warp = cuda.threadIdx.y
        sums = cuda.shared.array((DX_WARPS, CHUNK, LANES), float32)
        acc = cuda.local.array(CHUNK, float32)
        p0 = u32(cuda.blockIdx.x * DX_WARPS)
        while p0 < pixels:
            pix = u32(p0 + warp)
            n = u32(pix // (H * W))
            rem = u32(pix - n * (H * W))
            ih = u32(rem // W)
            iw = u32(rem - ih * W)
            for c in range(NCHUNK):
                for i in range(CHUNK):
                    acc[i] = float32(0.0)
                if pix < pixels:
                    for kh in range(KH):
                        th = u32(ih + u32(PT - kh))           # oh * sh when whole; negative wraps
                        oh = u32(th // SH)
                        for kw in range(KW):
                            tw = u32(iw + u32(PL - kw))
                            ow = u32(tw // SW)
                            if th == oh * SH and oh < OH and tw == ow * SW and ow < OW:
                                for k in range(CO_TRIPS):
                                    co = u32(k * LANES + lane)
                                    if co < COUT:
                                        d = dy[u32(u32(u32(n * OH + oh) * OW + ow) * COUT + co)]
                                        wb = u32(u32((kh * KW + kw) * CIN + c * CHUNK) * COUT + co)
                                        for i in range(CHUNK):
                                            acc[i] += d * w[u32(wb + i * COUT)]
                for i in range(CHUNK):
                    sums[warp, i, lane] = acc[i]
                cuda.syncthreads()
                if pix < pixels and lane < CHUNK:
                    s = float32(0.0)
                    for j in range(LANES):
                        s += sums[warp, lane, j]
                    dx[u32(pix * CIN + c * CHUNK + lane)] = s
                cuda.syncthreads()
            p0 = u32(p0 + cuda.gridDim.x * DX_WARPS)

    return dx_v2


# --- registration: the course's shapes (kernels/conv2d_v3.py registers their forwards) ---

for _x, _k, _s, _p in (((1, 28, 28, 1), (3, 3, 1, 32), 1, "valid"),
                       ((1, 13, 13, 32), (3, 3, 32, 64), 1, "valid"),
                       ((1, 14, 14, 8), (3, 3, 8, 16), 2, "same")):
    dw_kernel(geometry(_x, _k, _s, _p), True)
    dx_kernel(geometry(_x, _k, _s, _p))


# --- launcher ----------------------------------------------------------------------------

#: dW pass-1 chunks: at most DW_MAX_CHUNKS (4 blocks per SM of an H100's 132) of at least
#: DW_MIN_CHUNK_ROWS rows; pass 2 then adds that many partials per weight.
DW_MAX_CHUNKS = 4 if SIMULATOR else 528
DW_MIN_CHUNK_ROWS = 8


def partial_shape(x_shape, kernel_shape, strides=1, padding="valid", with_bias=True):
    """The (chunks, columns) float32 scratch of ``conv2d_backward_v2`` (a layer makes it
    once per batch size): v1's columns, v2's chunk count."""
    _, cols = dw_partial_shape(x_shape, kernel_shape, strides, padding, with_bias)
    _, out_h, _, _ = conv2d_output_shape(x_shape, kernel_shape, strides, padding)
    rows = x_shape[0] * out_h
    return max(1, min(-(-rows // DW_MIN_CHUNK_ROWS), DW_MAX_CHUNKS)), cols


_checked = CheckMemo()


def conv2d_backward_v2(x, kernel, dy, dx, dw, db, strides=1, padding="valid", partial=None,
                       stream=None):
    """Conv2D backward with the v2 kernels: arguments and results as
    ``kernels.conv2d.conv2d_backward`` (``partial``: ``partial_shape(...)``). The checks
    run once per (shapes, buffers) and are remembered."""
    arrays, settings = (x, kernel, dy, dx, dw, db, partial), (strides, padding)
    geo = _checked.get(arrays, settings)
    if geo is None:
        shape = conv2d_output_shape(x.shape, kernel.shape, strides, padding, "conv2d_backward")
        if not fits(kernel.shape):
            raise ValueError(f"conv2d_backward: v2 holds at most {MAX_TAPS} taps of a kernel in "
                             f"registers; {tuple(kernel.shape)} has more: use version='v1'.")
        check_array("conv2d_backward: x", x, np.float32, ndim=4)
        check_array("conv2d_backward: kernel", kernel, np.float32, ndim=4)
        check_backward_arrays(x, kernel, dy, dx, dw, db, partial, shape,
                              partial_shape(x.shape, kernel.shape, strides, padding, db is not None))
        check_size("conv2d_backward", x, dy)
        geo = geometry(x.shape, kernel.shape, strides, padding)
        if partial is not None:              # a per-call scratch is new each call: not kept
            _checked.put(arrays, settings, geo)
    b, oh = x.shape[0], geo[10]
    part_shape = partial_shape(x.shape, kernel.shape, strides, padding, db is not None)
    if partial is None:
        partial = cuda.device_array(part_shape, np.float32, stream=stream or 0)
    if dx is not None and dx.size:
        pixels = dx.size // geo[2]
        blocks = max(1, min(-(-pixels // DX_WARPS), DX_MAX_BLOCKS))
        launch(dx_kernel(geo), blocks, (LANES, DX_WARPS), stream, flat(dy), flat(kernel),
               flat(dx), np.uint32(pixels))
    chunks, cols = part_shape
    rows = b * oh
    launch(dw_kernel(geo, db is not None), (chunks, grid_rows(-(-geo[5] // LANES))),
           (LANES, DW_WARPS), stream, flat(x), flat(dy), partial, np.uint32(rows),
           np.uint32(-(-rows // chunks)))
    dw_flat = flat(dw)
    launch(dw_finish_v2, (-(-cols // LANES),), (LANES, FINISH_WARPS), stream, partial, dw_flat,
           db if db is not None else dw_flat)
    return dx, dw, db


_SCRATCH_SHAPES = {}     # (v2, shapes, settings) -> the partial-sum scratch's shape


def _scratch_shape(v2, x_shape, kernel_shape, strides, padding, with_bias):
    """``partial_shape`` (v2) or ``dw_partial_shape`` (v1), remembered per arguments: the
    step asks every call, and working it out again costs tens of µs of Python."""
    key = (v2, tuple(x_shape), tuple(kernel_shape), repr(strides), padding, with_bias)
    shape = _SCRATCH_SHAPES.get(key)
    if shape is None:
        shape = (partial_shape if v2 else dw_partial_shape)(x_shape, kernel_shape, strides,
                                                            padding, with_bias)
        _SCRATCH_SHAPES[key] = shape
    return shape


def backward(x, kernel, dy, dx, dw, db, strides=1, padding="valid", scratch=None, stream=None):
    """The library's Conv2D backward on a GPU: v2 where it exists (``fits``), else v1.
    ``scratch(shape)``: returns the float32 partial-sum buffer of that shape (a device's
    scratch); None makes one per call."""
    v2 = fits(kernel.shape)
    shape = _scratch_shape(v2, x.shape, kernel.shape, strides, padding, db is not None)
    partial = scratch(shape) if scratch is not None else None
    run = conv2d_backward_v2 if v2 else conv2d_backward
    return run(x, kernel, dy, dx, dw, db, strides, padding, partial, stream)
