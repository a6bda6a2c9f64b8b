"""Conv2D(relu) + MaxPooling2D with ONE input channel on the CPU: SIMD across output channels.

Why. The lab ConvNet's first conv reads one input channel (28x28x1 -> 26x26x32). Through
im2col (kernels/cpu_loops.py ``conv2d_relu_pool``) its column matrix is 43,264 x 9: the
BLAS product with K = 9 costs less than making the columns and pooling the 5.5 MB
pre-pool tensor it writes, and the general backward (``cpu_loops.conv2d_relu_pool_backward``)
writes the conv's whole gradient dz (64x26x26x32 floats, 5.5 MB again) only for
dW = cols^T @ dz to read it back. Here an input value is a scalar broadcast against a
vector of kernel weights: channels-last, a pixel's Cout outputs are contiguous and so
are one tap's Cout weights, so every inner step is one vector operation across output
channels (``CHUNK`` = 32 of them), and no large intermediate is written:

    forward    per image and pooled row, the conv rows under that row's windows into a
               scratch of PH x OW x Cout floats (2 x 26 x 32 for the lab: 6.5 KB, in L1):
                   v = sum over the taps (kh, kw) inside x of x[n, ih, iw] * W[kh, kw, 0, :]
                   rows[a, ow, :] = relu(v + bias)            (``_conv``, 4 pixels at once)
               then each pooled pixel's max and arg-max over its window straight from the
               scratch (``_pool``): the comparisons of ``pooling.max_pool_ref`` in its
               order (first maximum in row-major window order, NaN taken first), the
               arg encoding a*PW + b that every backward reads.
    backward   dW and db, no dX (a first layer's is never needed; ``pays`` sends convs
               that want one to the other paths). Per image and pooled row: the pooled
               gradient sent back through the pool and the ReLU into the same kind of
               scratch (``_unpool``: for each window position pos, where arg == pos and
               the pooled output y > 0 (y is the ReLU's value at the arg-max: its mask),
               dy, else 0; db += dy where y > 0); then for each of those conv rows and
               kernel row kh inside x (``_dot_add_row``: a 3-wide kernel row's three taps
               at once; ``_dot_add``: one tap):
                   dW[kh, kw, 0, :] += sum over ow of x[n, ih, ow*sw - pl + kw] * rows[a, ow, :]

The vector steps are written in LLVM IR (``numba.extending.intrinsic``): plain Numba
loops over 32 channels did not become vector code (``CHUNK``'s comment says why and what
they cost). Each sum stays in registers until it is stored, in several independent
chains (4 pixels forward, even/odd pixels backward), so that the CPU overlaps them.

Work and time. 12.5 M multiply-adds each way for the lab (64 x 26 x 26 x 9 x 32), the
BLAS product's count; a pixel in no window (an odd row or column the pool drops) is not
computed forward and gets zero backward. Timed alone (lab shapes, batch 64, median of
200 calls, this 2-core machine, no GPU, load 0.5-0.6 from other work; the old path: the
im2col + BLAS forward, the general backward from the forward's own columns):

    threads   forward old -> here      backward old -> here
    1         1.43 -> 0.56-0.66 ms     1.26-1.30 -> 0.63-0.67 ms
    2         0.81 -> 0.39-0.42 ms     1.12-1.19 -> 0.46 ms

Thread -> data. Images are cut in fixed blocks (``cpu_loops.image_blocks``); a block is
one call of ``_forward`` or ``_backward`` on one of ``product_threads()`` threads
(``cpu_loops.run_parts``), writing only its own images' pooled outputs (forward) or its
own dW part and its images' db rows (backward). Inside a call: image, pooled row, then
pixels; CHUNK output channels per vector.

Order of sums. Forward: each conv value is its taps in ascending (kh, kw) order, padding
taps skipped, by fused multiply-adds where the CPU has them (``llvm.fmuladd``, as
OpenBLAS's kernels), then + bias: on this machine the same bits as the im2col + BLAS
path in the lab-shaped case timed (random inputs, batch 64), but not promised
(tests/test_cpu_conv_one_channel.py checks float32 rounding against a float64 oracle). Backward: a block's dW in float32, in
(image, pooled row, window row, kernel row, pixel) order, each dot in two halves (even
and odd pixels) added at its end; each image's db in pooled-pixel order in float32; the
blocks' dW and the images' db then added in float64 in order (``cpu_loops.add_in_order``).
The order depends on the shapes only: the same bits with any thread count and on every
replica of a MirroredStrategy (a CPU without FMA rounds the products apart: other bits,
still the same on every replica).

Neighbours: kernels/cpu_loops.py (the general forward and backward for any conv, the
blocks and threads), kernels/cpu_conv_pool.py (the backward by arg-max terms for long
kernel rows, and ``conv_pool_geometry``), kernels/conv2d.py and kernels/pooling.py (the
references), mirrored/backends.py (``CpuOps`` calls ``forward`` and ``backward`` where
``pays``), tests/test_cpu_conv_one_channel.py.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import cpu_loops, disk_cache
from kernels.cpu_conv_pool import conv_pool_geometry
from kernels.cpu_loops import add_in_order, check_out, image_blocks, outputs_touching, run_parts, taps_inside

#: The output channels are handled CHUNK at a time, one vector each (two AVX-512
#: registers of float32; LLVM splits it for AVX2 or SSE on other CPUs). Cout must be a
#: multiple of it (``pays``: the lab's and TF's tutorial's first convs have 32). Why
#: vectors written out in LLVM IR and not Numba loops over the channels, measured here
#: on the lab's forward (batch 64, one thread): a loop over a run-time Cout = 32 was
#: compiled for 64 values per turn and ran the lab's 32 in its scalar remainder (2.6 ms);
#: a loop of a constant 16 was unrolled into scalar code, the compiler unable to tell
#: that the arrays do not overlap (6.0 ms); vector steps of 16 with the sum kept in
#: memory between them (3.6 ms); sums in registers, one pixel at a time (0.69 ms: each
#: pixel's 9 taps wait on each other); 4 pixels at a time (0.57 ms).
CHUNK = 32
#: cache=: numba keeps each compiled loop on disk, where that folder is ours alone
#: (kernels/disk_cache.py, trusted_for: its files are pickles).
_CACHE = disk_cache.trusted_for(__file__)
_JIT = dict(cache=_CACHE, nogil=True)


def pays(kernel_shape, dx_needed):
    """True where ``forward``/``backward`` are the CPU's path for a Conv2D(relu) +
    MaxPooling2D pair: one input channel, Cout a multiple of ``CHUNK``, and (backward)
    no dX wanted (a first layer)."""
    return kernel_shape[2] == 1 and kernel_shape[3] % CHUNK == 0 and not dx_needed


# --- vectors of CHUNK float32, written in LLVM IR ----------------------------------------------
# Each helper reads and writes CHUNK consecutive elements of flat 1-D C-contiguous arrays
# from the given offsets, unchecked: the loops below keep every offset in bounds (the
# tests run every geometry against the references). Products are added by fused
# multiply-adds where the CPU has them (``_add_product``).

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
    a*OW*Cout) by ``_conv``: the pixels whose kernel rows are all inside x in one call
    ([ow_a, ow_b), ``PIXELS`` at a time), each edge pixel with its taps inside in a call
    of its own; then each pooled pixel's max and arg-max over its window (``_pool``)."""
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
    """The blocks' threads for ``run_parts``: ``product_threads()`` (None) past
    ``cpu_loops.PIPELINE_MIN_MADDS`` multiply-adds (about 4 conv pixels per pooled one:
    the lab's 12.5 M), else this thread alone."""
    madds = shape[0] * shape[1] * shape[2] * int(np.prod(kernel.shape)) * 4
    return None if madds >= cpu_loops.PIPELINE_MIN_MADDS else 1


def forward(x, kernel, bias, out, arg, strides=1, padding="valid", pool_size=2, pool_strides=None,
            pool_padding="valid"):
    """``max_pool_ref(conv2d_ref(x, kernel, bias, strides, padding, relu=True), pool_size,
    pool_strides, pool_padding)`` into out (B, QH, QW, Cout) float32 and arg (B, QH, QW,
    Cout) int32, x (B, H, W, 1) float32, Cout a multiple of ``CHUNK``: the module's
    forward, equal to the references to float32 rounding (the arg-max: the same window
    position wherever the window's values are not within rounding of a tie, and on exact
    ties). ValueError for wrong shapes, types or layouts, before anything is written."""
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
    row: the gradient reaching its conv rows into ``rows`` (zeroed first: pixels in no
    window stay 0) and db's terms (``_unpool``, per pooled pixel); then for each of those
    conv rows and each kernel row kh inside x, dW[kh, kw, :] += the dot of the row's x
    values under tap (kh, kw) with the row's gradient: a 3-wide kernel row's three taps
    in one ``_dot_add_row`` over the pixels [row_lo, row_hi) whose whole kernel row is
    inside x, each tap's other pixels (the padding's edges) and other kernel widths by
    ``_dot_add``."""
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
