"""Conv2D(relu) + MaxPooling2D for few input channels on the CPU: SIMD across output channels.

Why. The lab ConvNet's first conv reads ONE input channel (28x28x1 -> 26x26x32). Its
column matrix (kernels/cpu_loops.py ``conv2d_relu_pool``) is 43,264 x 9: a BLAS product
with K = 9 spends more time making and reading the columns than multiplying, and the
general backward (``cpu_loops.conv2d_relu_pool_backward``) writes the conv's whole
gradient dz (64x26x26x32 floats, 5.5 MB) only for dW = cols^T @ dz to read it back.
Here each input value is a scalar broadcast against a row of the kernel: in channels-last
memory the Cout = 32 output channels of a pixel are contiguous, and so are the kernel's
32 weights of one tap, so the innermost loop of both ways is one SIMD loop over output
channels (no fastmath needed: the vector runs across channels, never across a sum):

    forward    for each image and pooled row, the conv rows under that row's windows into
               a small scratch (PH x OW x Cout floats: 2 x 26 x 32 for the lab, L1-resident):
                   acc[ow, :] = 0;  for each tap (kh, kw, ci) inside x:
                       acc[ow, :] += x[n, ih, iw, ci] * W[kh, kw, ci, :]
                   acc[ow, :] = relu(acc[ow, :] + bias)
               then the max-pool with arg-max straight from the scratch, the same
               comparisons in the same order as ``pooling.max_pool_ref`` (first maximum in
               row-major window order, NaN taken first), writing only the pooled output
               and arg (the encoding a*PW + b every backward reads). The pre-pool tensor
               is never written.
    backward   dW, db with no dz, no im2col, no BLAS: for each pooled pixel p and each
               position pos of its window (a conv pixel), the vector select
                   m[:] = dy[p, :] where arg[p, :] == pos and y[p, :] > 0, else 0
               (y: the pooled output, i.e. the ReLU's value at the arg-max: its mask), then
               for each tap (kh, kw, ci) of that pixel inside x:
                   dW[kh, kw, ci, :] += x[n, ih, iw, ci] * m[:]
               (x is a scalar: the pixel's position does not depend on the channel).
               db[:] += dy[p, :] where y[p, :] > 0. No dX: the first layer's is never
               needed; ``pays`` sends convs that need one to the other paths.

Work. 12.5 M multiply-adds each way for the lab (64 x 26 x 26 x 9 x 32), the same as the
BLAS product; the select costs 4 vector compares per pooled pixel. A pixel that is in no
window (an odd conv row or column the pool drops) is not computed forward (its value is
never read) and gets no term backward.

Thread -> data. Images are cut in fixed blocks (``cpu_loops.image_blocks``); a block is
one call of the loop, run on one of ``product_threads()`` threads (``cpu_loops.run_parts``)
and writing only its own images' pooled outputs (forward) or its own partial dW and db
(backward).

Order of sums. Forward: each conv value is the sum of its taps in ascending (kh, kw, ci)
order, padding taps skipped, then + bias: the reference's (im2col @ W, then + bias) terms
in an order of our own, so equal to float32 rounding, not bitwise (BLAS's order, with
FMA, is its own). Backward: a block's dW terms in (image, pooled row, pooled column,
window position, tap) order into float32, each image's db in pooled-pixel order into
float32; the blocks' dW and the images' db are added in float64 in order
(``cpu_loops.add_in_order``). The order depends on the shapes only: the same bits with
any thread count, on every replica. No FMA: Numba does not contract a*b + c without
fastmath.

Neighbours: kernels/cpu_loops.py (the general forward and backward, the blocks and
threads), kernels/cpu_conv_pool.py (the backward by arg-max terms for long kernel rows,
and ``conv_pool_geometry``), kernels/conv2d.py and kernels/pooling.py (the references),
mirrored/backends.py (``CpuOps`` calls ``forward`` and ``backward`` where ``pays``),
tests/test_cpu_conv_one_channel.py.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import cpu_loops
from kernels.cpu_conv_pool import conv_pool_geometry
from kernels.cpu_loops import add_in_order, check_out, image_blocks, outputs_touching, run_parts, taps_inside

#: The output channels are handled CHUNK at a time, one vector each (one AVX-512 register
#: of float32; LLVM splits it into two AVX2 or four SSE registers on other CPUs). Cout
#: must be a multiple of it (``pays``). Why vectors written out in LLVM IR (below) and
#: not plain Numba loops over the channels: a loop over a run-time Cout = 32 was compiled
#: for 64 values per turn (4 vectors unrolled) and ran the lab's 32 in its scalar
#: remainder; a loop of a constant 16 was unrolled into scalar code (the compiler cannot
#: tell that the arrays do not overlap); and a sum kept in memory between calls cost
#: loop overhead per tap. Measured here, one thread, the lab's forward (batch 64): 2.6,
#: 6.0 and 3.6 ms; with ``_dot`` below: see the module's docstring.
CHUNK = 32
_JIT = dict(cache=True, nogil=True)


def pays(kernel_shape, dx_needed):
    """True where ``forward``/``backward`` are the CPU's path for a Conv2D(relu) +
    MaxPooling2D pair: one input channel, Cout a multiple of ``CHUNK``, and (backward)
    no dX wanted (a first layer)."""
    return kernel_shape[2] == 1 and kernel_shape[3] % CHUNK == 0 and not dx_needed


# --- vectors of CHUNK float32, written in LLVM IR ----------------------------------------------
# Each helper reads and writes CHUNK consecutive elements of flat 1-D C-contiguous arrays
# from the given offsets, unchecked: the loops below keep every offset in bounds. Products
# and sums are rounded separately (no FMA), as Numba's own arithmetic.

_F32 = ir.VectorType(ir.FloatType(), CHUNK)
_I32 = ir.VectorType(ir.IntType(32), CHUNK)
_ZERO = ir.Constant(_F32, [0.0] * CHUNK)
_ONE = ir.Constant(ir.IntType(64), 1)


def _data(context, builder, aryty, ary):
    return context.make_array(aryty)(context, builder, ary).data


def _at(context, builder, aryty, ary, offset, vector=_F32):
    """A pointer to ``vector`` (CHUNK elements) at ary[offset]."""
    return builder.bitcast(builder.gep(_data(context, builder, aryty, ary), [offset]), vector.as_pointer())


def _splat(builder, value, vector=_F32):
    """``value`` in every lane of ``vector``."""
    undef = ir.Constant(vector, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_I32, [0] * CHUNK))


def _vector(builder, base, offset):
    """The CHUNK float32 at base[offset] (base: an element pointer)."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), _F32.as_pointer()), align=4)


def _add_product(builder, acc, xs, x_at, vector):
    """acc (an alloca'd vector) += x[x_at] * vector, fused into one rounding where the CPU
    has a fused multiply-add (``llvm.fmuladd``; BLAS's products use it too), else a
    product and a sum."""
    fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3),
                                             f"llvm.fmuladd.v{CHUNK}f32")
    xv = _splat(builder, builder.load(builder.gep(xs, [x_at])))
    builder.store(builder.call(fmuladd, [vector, xv, builder.load(acc)]), acc)


#: ``_conv`` computes this many output pixels at once: their sums are independent chains
#: of fused multiply-adds, so the CPU overlaps them (one pixel at a time waited on each
#: addition: measured here, the lab's forward 0.69 ms on one thread, the conv itself
#: bound by the latency of its 9 taps), and each kernel vector loaded serves them all.
PIXELS = 4


@intrinsic
def _conv(typingctx, dst, d0, x, x0, x_step, x_row, w, w0, w_row, cout, pixels, rows, cols, bias, b0):
    """The conv of ``pixels`` output pixels of one row, CHUNK of their channels: for
    k < pixels,
        v = sum over i < rows, j < cols (i, then j, ascending) of
            x[x0 + k*x_step + i*x_row + j] * w[w0 + i*w_row + j*cout : ... + CHUNK]
        dst[d0 + k*cout : ... + CHUNK] = relu(v + bias[b0:b0 + CHUNK])
    (one input channel: a kernel row's taps are consecutive in x; relu as
    ``cpu_loops._max_pool_forward``'s: v < 0 gives 0, NaN stays). ``PIXELS`` pixels at a
    time, then the rest one by one; the sums live in registers until they are stored."""
    def codegen(context, builder, sig, args):
        dst, d0, x, x0, x_step, x_row, w, w0, w_row, cout, pixels, rows, cols, bias, b0 = args
        ds, xs, ws = (_data(context, builder, sig.args[i], a) for i, a in ((0, dst), (2, x), (6, w)))
        b = builder.load(_at(context, builder, sig.args[13], bias, b0), align=4)
        accs = [cgutils.alloca_once(builder, _F32) for _ in range(PIXELS)]   # registers (mem2reg)
        i64 = ir.IntType(64)

        def block(first, width):
            """Pixels first .. first + width - 1."""
            for acc in accs[:width]:
                builder.store(_ZERO, acc)
            with cgutils.for_range(builder, rows) as i:
                xi = builder.add(builder.add(x0, builder.mul(first, x_step)), builder.mul(i.index, x_row))
                wi = builder.add(w0, builder.mul(i.index, w_row))
                with cgutils.for_range(builder, cols) as j:
                    wv = _vector(builder, ws, builder.add(wi, builder.mul(j.index, cout)))
                    for k, acc in enumerate(accs[:width]):
                        at = builder.add(builder.add(xi, j.index), builder.mul(ir.Constant(i64, k), x_step))
                        _add_product(builder, acc, xs, at, wv)
            for k, acc in enumerate(accs[:width]):
                v = builder.fadd(builder.load(acc), b)
                at = builder.add(d0, builder.mul(builder.add(first, ir.Constant(i64, k)), cout))
                builder.store(builder.select(builder.fcmp_ordered("<", v, _ZERO), _ZERO, v),
                              builder.bitcast(builder.gep(ds, [at]), _F32.as_pointer()), align=4)

        whole = builder.mul(builder.sdiv(pixels, ir.Constant(i64, PIXELS)), ir.Constant(i64, PIXELS))
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), whole, ir.Constant(i64, PIXELS)) as (k, _):
            block(k, PIXELS)
        with cgutils.for_range_slice(builder, whole, pixels, _ONE) as (k, _):
            block(k, 1)
    return types.void(dst, d0, x, x0, x_step, x_row, w, w0, w_row, cout, pixels, rows, cols, bias, b0), codegen


#: The backward's ``_dot_add_row`` adds this many taps of a kernel row at once (Keras's
#: usual 3x3 kernels; other widths take one tap at a time): each gradient vector loaded
#: serves the three, and their sums are independent chains the CPU overlaps.
ROW_TAPS = 3


def _dot_add_intrinsic(taps):
    """The intrinsic ``(dst, d0, d_tap, x, x0, x_col, src, s0, s_col, count)``: for t < ``taps``,
        dst[d0 + t*d_tap : ... + CHUNK] += sum over j < count of
            x[x0 + t + j*x_col] * src[s0 + j*s_col : ... + CHUNK]
    (with one input channel a kernel row's taps are consecutive in x, and in dW), each
    sum in two halves, the even j and the odd j (independent chains), added at the end."""
    def typer(typingctx, dst, d0, d_tap, x, x0, x_col, src, s0, s_col, count):
        def codegen(context, builder, sig, args):
            dst, d0, d_tap, x, x0, x_col, src, s0, s_col, count = args
            xs, ss = _data(context, builder, sig.args[3], x), _data(context, builder, sig.args[6], src)
            i64 = ir.IntType(64)
            accs = [[cgutils.alloca_once(builder, _F32) for _ in range(2)] for _ in range(taps)]
            for pair in accs:
                for acc in pair:
                    builder.store(_ZERO, acc)

            def terms(j, half):
                g = _vector(builder, ss, builder.add(s0, builder.mul(j, s_col)))
                xj = builder.add(x0, builder.mul(j, x_col))
                for t in range(taps):
                    _add_product(builder, accs[t][half], xs, builder.add(xj, ir.Constant(i64, t)), g)

            two = ir.Constant(i64, 2)
            whole = builder.mul(builder.sdiv(count, two), two)
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), whole, two) as (j, _):
                terms(j, 0)
                terms(builder.add(j, _ONE), 1)
            with cgutils.for_range_slice(builder, whole, count, _ONE) as (j, _):
                terms(j, 0)
            for t in range(taps):
                pd = _at(context, builder, sig.args[0], dst, builder.add(d0, builder.mul(d_tap, ir.Constant(i64, t))))
                total = builder.fadd(builder.load(accs[t][0]), builder.load(accs[t][1]))
                builder.store(builder.fadd(builder.load(pd, align=4), total), pd, align=4)
        return types.void(dst, d0, d_tap, x, x0, x_col, src, s0, s_col, count), codegen
    typer.__name__ = f"_dot_add_{taps}"
    return intrinsic(typer)


_dot_add = _dot_add_intrinsic(1)
_dot_add_row = _dot_add_intrinsic(ROW_TAPS)


@intrinsic
def _pool(typingctx, out, arg, o, src, s0, s_row, s_col, a_lo, a_hi, b_lo, b_hi, pw_n):
    """One pooled pixel's CHUNK channels: over its window's positions (a, b), a in
    [a_lo, a_hi), b in [b_lo, b_hi), in row-major order, v = src[s0 + a*s_row + b*s_col:
    ... + CHUNK]; take = (v > best) | (isnan(v) & ~isnan(best)) (the comparison of
    ``pooling.max_pool_ref`` and ``cpu_loops._max_pool_forward``), where take: best = v,
    pos = a*pw_n + b. Then out[o:o + CHUNK] = best, arg[o:...] = pos (int32). best starts
    at -inf: every value after the ReLU is >= 0 or NaN, so the first position is always
    taken, as the references take their first."""
    def codegen(context, builder, sig, args):
        out, arg, o, src, s0, s_row, s_col, a_lo, a_hi, b_lo, b_hi, pw_n = args
        ss = _data(context, builder, sig.args[3], src)
        best, where = cgutils.alloca_once(builder, _F32), cgutils.alloca_once(builder, _I32)
        builder.store(ir.Constant(_F32, [float("-inf")] * CHUNK), best)
        builder.store(ir.Constant(_I32, [0] * CHUNK), where)
        with cgutils.for_range_slice(builder, a_lo, a_hi, _ONE) as (a, _):
            with cgutils.for_range_slice(builder, b_lo, b_hi, _ONE) as (b, _):
                at = builder.add(s0, builder.add(builder.mul(a, s_row), builder.mul(b, s_col)))
                v = builder.load(builder.bitcast(builder.gep(ss, [at]), _F32.as_pointer()), align=4)
                old = builder.load(best)
                take = builder.or_(builder.fcmp_ordered(">", v, old),
                                   builder.and_(builder.fcmp_unordered("uno", v, v),
                                                builder.fcmp_ordered("ord", old, old)))
                pos = builder.trunc(builder.add(builder.mul(a, pw_n), b), ir.IntType(32))
                builder.store(builder.select(take, v, old), best)
                builder.store(builder.select(take, _splat(builder, pos, _I32), builder.load(where)), where)
        builder.store(builder.load(best), _at(context, builder, sig.args[0], out, o), align=4)
        builder.store(builder.load(where), _at(context, builder, sig.args[1], arg, o, _I32), align=4)
    return types.void(out, arg, o, src, s0, s_row, s_col, a_lo, a_hi, b_lo, b_hi, pw_n), codegen


@intrinsic
def _unpool(typingctx, dst, d0, d_row, d_col, dy, arg, y, p, a_lo, a_hi, b_lo, b_hi, pw_n, db, b0):
    """The pooled gradient of one pooled pixel, CHUNK channels, sent back through the
    max-pool and the ReLU: g = where(y[p:p + CHUNK] > 0, dy[p:...], 0) (y: the pooled
    output, i.e. the ReLU's value at the arg-max: its mask); db[b0:b0 + CHUNK] += g; and
    for each window position (a, b), a in [a_lo, a_hi), b in [b_lo, b_hi):
        dst[d0 + a*d_row + b*d_col : ... + CHUNK] += where(arg[p:...] == a*pw_n + b, g, 0)."""
    def codegen(context, builder, sig, args):
        dst, d0, d_row, d_col, dy, arg, y, p, a_lo, a_hi, b_lo, b_hi, pw_n, db, b0 = args
        ds = _data(context, builder, sig.args[0], dst)
        yv = builder.load(_at(context, builder, sig.args[6], y, p), align=4)
        g = builder.select(builder.fcmp_ordered(">", yv, _ZERO),
                           builder.load(_at(context, builder, sig.args[4], dy, p), align=4), _ZERO)
        where = builder.load(_at(context, builder, sig.args[5], arg, p, _I32), align=4)
        pb = _at(context, builder, sig.args[13], db, b0)
        builder.store(builder.fadd(builder.load(pb, align=4), g), pb, align=4)
        with cgutils.for_range_slice(builder, a_lo, a_hi, _ONE) as (a, _):
            with cgutils.for_range_slice(builder, b_lo, b_hi, _ONE) as (b, _):
                pos = builder.trunc(builder.add(builder.mul(a, pw_n), b), ir.IntType(32))
                term = builder.select(builder.icmp_signed("==", where, _splat(builder, pos, _I32)), g, _ZERO)
                at = builder.add(d0, builder.add(builder.mul(a, d_row), builder.mul(b, d_col)))
                pd = builder.bitcast(builder.gep(ds, [at]), _F32.as_pointer())
                builder.store(builder.fadd(builder.load(pd, align=4), term), pd, align=4)
    return types.void(dst, d0, d_row, d_col, dy, arg, y, p, a_lo, a_hi, b_lo, b_hi, pw_n, db, b0), codegen


# --- forward -----------------------------------------------------------------------------------

@njit(**_JIT)
def _forward(x, w, bias, out, arg, geo, n0, n1):
    """Images n0..n1-1 (flat arrays; ``geo``: ``conv_pool_geometry``'s vector): for each
    pooled row qh, the conv rows its windows cover into ``rows`` (window row a at
    a*OW*Cout), each pixel's CHUNK channels one ``_dot`` over its taps inside x then
    ``_bias_relu``; then each pooled pixel's max and arg-max over its window in
    row-major order. The pooled value starts at -inf: every value after the ReLU is
    >= 0 or NaN, so the window's first position is always taken, as the references take
    their first."""
    h, wd, kh_n, kw_n, cout = geo[0], geo[1], geo[3], geo[4], geo[5]
    out_h, out_w, q_h, q_w, sh, sw, pt, pl = geo[6], geo[7], geo[8], geo[9], geo[10], geo[11], geo[12], geo[13]
    ph_n, pw_n, psh, psw, ppt, ppl = geo[14], geo[15], geo[16], geo[17], geo[18], geo[19]
    rows = np.empty(ph_n * out_w * cout, np.float32)
    ow_a = outputs_touching(0, sw, pl, out_w, wd)[0]               # [ow_a, ow_b): all kw inside
    ow_b = outputs_touching(kw_n - 1, sw, pl, out_w, wd)[1]
    for n in range(n0, n1):
        for qh in range(q_h):
            a_lo, a_hi = taps_inside(qh, psh, ppt, ph_n, out_h)
            for a in range(a_lo, a_hi):
                oh = qh * psh - ppt + a
                kh_lo, kh_hi = taps_inside(oh, sh, pt, kh_n, h)
                x_row = (n * h + oh * sh - pt + kh_lo) * wd       # x's offset of the first row inside
                r0 = a * out_w * cout
                for ow in range(out_w):
                    if ow == ow_a and ow_a < ow_b:                 # all taps inside: one call
                        for c0 in range(0, cout, CHUNK):
                            _conv(rows, r0 + ow * cout + c0, x, x_row + ow * sw - pl, sw, wd, w,
                                  kh_lo * kw_n * cout + c0, kw_n * cout, cout, ow_b - ow_a, kh_hi - kh_lo, kw_n,
                                  bias, c0)
                    elif ow < ow_a or ow >= ow_b:                  # the edges: the taps inside
                        kw_lo, kw_hi = taps_inside(ow, sw, pl, kw_n, wd)
                        for c0 in range(0, cout, CHUNK):
                            _conv(rows, r0 + ow * cout + c0, x, x_row + ow * sw - pl + kw_lo, sw, wd, w,
                                  (kh_lo * kw_n + kw_lo) * cout + c0, kw_n * cout, cout, 1, kh_hi - kh_lo,
                                  kw_hi - kw_lo, bias, c0)
            for qw in range(q_w):
                b_lo, b_hi = taps_inside(qw, psw, ppl, pw_n, out_w)
                for c0 in range(0, cout, CHUNK):
                    _pool(out, arg, ((n * q_h + qh) * q_w + qw) * cout + c0, rows, (qw * psw - ppl) * cout + c0,
                          out_w * cout, cout, a_lo, a_hi, b_lo, b_hi, pw_n)


def _check(x, kernel, out_or_dy, arg, y, what, strides, padding, pool_size, pool_strides, pool_padding):
    """The pooled shape and geometry vector, after checking the pair's buffers (ValueErrors
    naming ``what``, before anything is written)."""
    for name, a in (("x", x), ("kernel", kernel)):
        if a.dtype != np.float32:
            raise ValueError(f"{what}: {name} must be float32, got {a.dtype}.")
    shape, geo = conv_pool_geometry(x.shape, kernel.shape, strides, padding, pool_size,
                                    pool_strides, pool_padding, what)
    if not pays(kernel.shape, False):
        raise ValueError(f"{what}: kernel {tuple(kernel.shape)}; these loops take one input channel "
                         f"and a multiple of {CHUNK} output channels (kernels/cpu_loops.py's "
                         f"conv2d_relu_pool and its backward take any).")
    check_out(f"{what}: {out_or_dy[0]}", out_or_dy[1], shape)
    if tuple(arg.shape) != shape or arg.dtype != np.int32:
        raise ValueError(f"{what}: arg must be int32 of shape {shape}, got {arg.dtype} "
                         f"{tuple(arg.shape)}.")
    if y is not None:
        check_out(f"{what}: y", y, shape)
    return shape, geo


def _threads(shape, kernel):
    """Split over threads (None: ``product_threads()``) past ``PIPELINE_MIN_MADDS``."""
    madds = shape[0] * shape[1] * shape[2] * int(np.prod(kernel.shape)) * 4
    return None if madds >= cpu_loops.PIPELINE_MIN_MADDS else 1


def forward(x, kernel, bias, out, arg, strides=1, padding="valid", pool_size=2, pool_strides=None,
            pool_padding="valid"):
    """``max_pool_ref(conv2d_ref(x, kernel, bias, strides, padding, relu=True), pool_size,
    pool_strides, pool_padding)`` into out (B, QH, QW, Cout) float32 and arg (B, QH, QW,
    Cout) int32, x (B, H, W, 1) float32: the module's forward, equal to
    the references to float32 rounding (the arg-max: the same window position wherever
    the pooled values are not within rounding of a tie). ValueError for wrong shapes or
    types, before anything is written."""
    what = "conv2d_relu_pool"
    shape, geo = _check(x, kernel, ("out", out), arg, None, what, strides, padding, pool_size,
                        pool_strides, pool_padding)
    cout = kernel.shape[3]
    bias = np.zeros(cout, np.float32) if bias is None else np.ascontiguousarray(bias, np.float32)
    if not (out.flags.c_contiguous and arg.flags.c_contiguous):
        raise ValueError(f"{what}: out and arg must be C-contiguous (they are written through flat views).")
    x1, w1 = np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(kernel).reshape(-1)
    out1, arg1 = out.reshape(-1), arg.reshape(-1)      # views of the caller's arrays
    run_parts([(_forward, (x1, w1, bias, out1, arg1, geo, n0, n1)) for n0, n1 in image_blocks(x.shape[0])],
              _threads(shape, kernel))
    return out, arg


# --- backward ----------------------------------------------------------------------------------

@njit(**_JIT)
def _backward(x, dy, arg, y, dw, db, geo, n0, n1):
    """Images n0..n1-1's terms into dw (KH*KW*Cout, this block's float32 part) and db
    (B*Cout: one float32 row per image), both zeroed here (flat arrays). For each pooled
    row: the gradient reaching its conv rows (``_add_selected``, per window position)
    into ``rows`` (zeroed; pixels in no window stay 0), then for each of those rows and
    each tap (kh, kw) inside x, dW[kh, kw, :] += the ``_dot`` of the row's x values under
    that tap with the row's gradient."""
    h, wd, kh_n, kw_n, cout = geo[0], geo[1], geo[3], geo[4], geo[5]
    out_h, out_w, q_h, q_w, sh, sw, pt, pl = geo[6], geo[7], geo[8], geo[9], geo[10], geo[11], geo[12], geo[13]
    ph_n, pw_n, psh, psw, ppt, ppl = geo[14], geo[15], geo[16], geo[17], geo[18], geo[19]
    rows = np.empty(ph_n * out_w * cout, np.float32)
    row_lo = outputs_touching(0, sw, pl, out_w, wd)[0]               # [row_lo, row_hi): all kw inside
    row_hi = max(row_lo, outputs_touching(kw_n - 1, sw, pl, out_w, wd)[1])
    dw[:] = 0.0
    db[n0 * cout:n1 * cout] = 0.0
    for n in range(n0, n1):
        for qh in range(q_h):
            a_lo, a_hi = taps_inside(qh, psh, ppt, ph_n, out_h)
            rows[:] = 0.0
            for qw in range(q_w):
                b_lo, b_hi = taps_inside(qw, psw, ppl, pw_n, out_w)
                for c0 in range(0, cout, CHUNK):
                    _unpool(rows, (qw * psw - ppl) * cout + c0, out_w * cout, cout, dy, arg, y,
                            ((n * q_h + qh) * q_w + qw) * cout + c0, a_lo, a_hi, b_lo, b_hi, pw_n, db, n * cout + c0)
            for a in range(a_lo, a_hi):
                oh = qh * psh - ppt + a
                kh_lo, kh_hi = taps_inside(oh, sh, pt, kh_n, h)
                for kh in range(kh_lo, kh_hi):
                    x_row = (n * h + oh * sh - pt + kh) * wd - pl
                    lo, hi = 0, 0                # [lo, hi): the pixels done by the whole row at once
                    if kw_n == ROW_TAPS:
                        lo, hi = row_lo, row_hi
                        for c0 in range(0, cout, CHUNK):
                            if lo < hi:
                                _dot_add_row(dw, kh * kw_n * cout + c0, cout, x, x_row + lo * sw, sw,
                                             rows, (a * out_w + lo) * cout + c0, cout, hi - lo)
                    for kw in range(kw_n):       # each tap over the pixels not done above
                        ow_lo, ow_hi = outputs_touching(kw, sw, pl, out_w, wd)
                        for p0, p1 in ((ow_lo, min(ow_hi, lo)), (max(ow_lo, hi), ow_hi)):
                            for c0 in range(0, cout, CHUNK):
                                if p0 < p1:
                                    _dot_add(dw, (kh * kw_n + kw) * cout + c0, 0, x, x_row + p0 * sw + kw, sw,
                                             rows, (a * out_w + p0) * cout + c0, cout, p1 - p0)


def backward(x, kernel, dy, arg, y, dw, db, strides=1, padding="valid", pool_size=2, pool_strides=None,
             pool_padding="valid"):
    """The gradients of ``forward``'s pooled output with respect to the kernel and bias
    (no dX: a first layer's), from the pooled gradient dy, the forward's arg (int32) and
    pooled output y (B, QH, QW, Cout): into dw (KH, KW, Cin, Cout) and db (Cout,) or None.
    ``conv2d_backward_ref(x, kernel, relu_backward_ref(max_pool_backward_ref(dy, arg, ...),
    z))``'s dW and db to float32 rounding (z: the conv's ReLU output), any pool (windows
    may overlap: each window adds its own term). ValueError for wrong shapes or types,
    before anything is written."""
    what = "conv2d_relu_pool_backward"
    shape, geo = _check(x, kernel, ("dy", dy), arg, y, what, strides, padding, pool_size,
                        pool_strides, pool_padding)
    check_out(f"{what}: dw", dw, tuple(kernel.shape))
    if db is not None:
        check_out(f"{what}: db", db, (kernel.shape[3],))
    b, cout = x.shape[0], kernel.shape[3]
    x1, dy1, arg1, y1 = (np.ascontiguousarray(a).reshape(-1) for a in (x, dy, arg, y))
    blocks = image_blocks(b)
    parts = np.empty((len(blocks), kernel.size), np.float32)
    db_parts = np.empty((b, cout), np.float32)
    run_parts([(_backward, (x1, dy1, arg1, y1, parts[i], db_parts.reshape(-1), geo, n0, n1))
               for i, (n0, n1) in enumerate(blocks)], _threads(shape, kernel))
    dw[...] = add_in_order(parts).reshape(kernel.shape)      # blocks in order, float64
    if db is not None:
        db[...] = add_in_order(db_parts)                     # images in order, float64
    return None, dw, db
