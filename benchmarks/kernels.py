"""Kernel benchmarks: every GEMM version against cuBLAS, the memory-bound kernels
against the measured copy bandwidth.

    python -m benchmarks.kernels                          # on a CUDA GPU
    python -m benchmarks.kernels --smoke --out k.json     # tiny sizes, CUDA simulator
    python -m benchmarks.kernels --gemm "square 1024"     # some GEMMs only (lab 04's cell)

On a GPU it prints a table and writes benchmarks/results/kernels-<gpu>-<date>.json.
Without one it says so and exits 0, writing nothing. ``--smoke`` runs tiny sizes in
Numba's CUDA simulator with perf_counter timing: it proves the program works (the
test suite runs it), its times mean nothing, and it writes JSON only to ``--out``.

What is counted (the floors), per call:
    GEMM             2 * M * N * K flops                    -> GFLOP/s, and / cuBLAS
    binary add       3 * 4n bytes (read x, y; write out)    -> GB/s, and / copy GB/s
    softmax_xent     B*C*4 logits + B*4 labels (int32) read;
                     B*C*4 grad + B*4 loss + B*4 correct written
    sgd (momentum)   5 * 4n bytes (read w, g, v; write w, v)
    adam             7 * 4n bytes (read w, g, m, v; write w, m, v)
    conv2d, max_pool the course lab's layers at batch 64 and 512, v1 beside v3, the fused
                     conv + ReLU + pool and the v2 backward kernels, and the tutorials'
                     second conv (bench_conv_pool counts them); timed through CUDA graphs
    copy             2 * nbytes (read + write): the practical memory ceiling

Peers: cuBLAS SGEMM through CuPy or PyTorch, whichever imports, with TF32 off (TF32
would round the inputs to 10-bit mantissas: a different, faster computation).

Targets on an H100: v3 >= 50% of cuBLAS FP32 at 4096^3; elementwise, softmax-xent and
the optimizers >= 80% of copy bandwidth at >= 64 MB; conv2d v2 and max-pool >= 60% of
copy bandwidth for the lab's layer at batch 512. The JSON records whether
each was met, when it was measured.

Every implementation's output is checked before it is timed (as llm.c does): a wrong
kernel is reported as failed and never timed.
"""
import argparse
import collections
import os
import sys

import numpy as np

from benchmarks import common

#: (name, M, N, K, trans_a, trans_b). MNIST's 784-64-10 MLP at batch 64, forward and
#: backward (dW = x.T @ dy, dx = dy @ W.T), then squares big enough to be compute-bound.
GEMM_SHAPES = [
    ("dense1 forward  x @ W", 64, 64, 784, False, False),
    ("dense1 backward x.T @ dy", 784, 64, 64, True, False),
    ("dense1 backward dy @ W.T", 64, 784, 64, False, True),
    ("dense2 forward  h @ W", 64, 10, 64, False, False),
    ("dense2 backward h.T @ dy", 64, 10, 64, True, False),
    ("dense2 backward dy @ W.T", 64, 64, 10, False, True),
    ("square 1024", 1024, 1024, 1024, False, False),
    ("square 4096", 4096, 4096, 4096, False, False),
]
#: Tiny shapes for --smoke: the simulator runs a Python thread per CUDA thread.
SMOKE_GEMM_SHAPES = [("smoke transposed", 9, 17, 5, True, True)]
#: --smoke timing: the checked first call warms up; two samples give a median.
SMOKE_WARMUP = 0
SMOKE_REPEAT = 2

#: Memory-bound kernels move arrays of this many bytes each: the issue's ">= 64 MB",
#: far beyond the H100's 50 MB L2, so DRAM bandwidth is what is measured.
MEM_BYTES = 64 * 2**20
SMOKE_MEM_BYTES = 2 * 1024
#: softmax_xent's class count: MNIST's 10.
XENT_CLASSES = 10

#: The course lab's Conv2D(32, 3, activation="relu") on (28, 28, 1) images, then
#: MaxPooling2D(): batch 512 (the target says "batch >= 512"), 26 x 26 x 32 conv outputs.
CONV_BATCH, CONV_HW, CONV_CIN, CONV_COUT, CONV_K = 512, 28, 1, 32, 3
#: The batches the conv and pooling cases run at (``--batch``): the lab's 64 per replica, where
#: a kernel is shorter than its host call, and 512, where the targets were set.
CONV_BATCHES = (64, 512)
#: The official tutorials' second conv, Conv2D(64, 3) on the first block's 13x13x32 output:
#: (image side, in channels, out channels); tiny ones for --smoke (the same code paths).
SECOND_CONV = (13, 32, 64)
SMOKE_SECOND_CONV = (5, 4, 8)
#: Issue 24's targets on an H100, microseconds per call: {case name prefix: {batch: us}}.
CONV_US_TARGETS = {
    "conv2d v3 forward+relu": {512: 25.0, 64: 5.0},
    "conv2d v3 fused +relu+pool": {512: 25.0},
    "max_pool 2x2 backward v2 +relu mask": {512: 30.0},
    "conv2d backward v2 dW+db": {512: 40.0},
    "conv2d second conv backward v2 dX+dW+db": {512: 35.0},
}
#: --smoke: batch 2 of 6 x 6 images (4 x 4 x 32 outputs), for the simulator.
SMOKE_CONV_BATCH, SMOKE_CONV_HW = 2, 6
#: Conv checks: |got - want| <= CONV_CHECK_REL * (the same sum over |terms|), far above
#: float32 rounding of these sums (~1e-6 of it) and far below any wrong index (~1).
CONV_CHECK_REL = 1e-4

#: Checks before timing. GEMM: |got - want| <= GEMM_CHECK_RTOL * K * max|want|, a
#: float32 K-term sum's worst case with margin. Memory-bound kernels: float32 roundings.
GEMM_CHECK_RTOL = 1e-6
ELEMENTWISE_CHECK_RTOL = 1e-5

TARGET_GEMM_FRACTION = 0.50  # v3 / cuBLAS at 4096^3
TARGET_BANDWIDTH_FRACTION = 0.80  # elementwise and softmax-xent / copy, >= 64 MB
TARGET_CONV_POOL_FRACTION = 0.60  # conv2d v2 and max_pool forward / copy, lab layer, batch 512


# --- peers -------------------------------------------------------------------------------

def cublas_peer():
    """(description, prepare) where prepare(a, b, out, ta, tb) returns a no-argument
    callable computing out = op(a) @ op(b) with cuBLAS on our device arrays (no
    copies); or (None, reason) when neither CuPy nor PyTorch can run it."""
    reasons = []
    try:
        import cupy

        def prepare(a, b, out, ta, tb):
            A, B, C = cupy.asarray(a), cupy.asarray(b), cupy.asarray(out)
            A, B = (A.T if ta else A), (B.T if tb else B)
            return lambda: cupy.matmul(A, B, out=C)
        return f"cuBLAS via CuPy {cupy.__version__}", prepare
    except Exception as exc:  # not installed, or no CUDA for it
        reasons.append(f"CuPy: {type(exc).__name__}: {exc}"[:120])
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")

        def prepare(a, b, out, ta, tb):
            A, B, C = (torch.as_tensor(x, device="cuda") for x in (a, b, out))
            A, B = (A.T if ta else A), (B.T if tb else B)
            return lambda: torch.matmul(A, B, out=C)
        return f"cuBLAS via PyTorch {torch.__version__}", prepare
    except Exception as exc:
        reasons.append(f"PyTorch: {type(exc).__name__}: {exc}"[:120])
    return None, "; ".join(reasons)


# --- checks ------------------------------------------------------------------------------

def _check(got, want, atol, rtol=0.0):
    """None when |got - want| <= atol + rtol * |want| everywhere, else a message."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    err = np.abs(got - want)
    bad = ~(err <= atol + rtol * np.abs(want))
    if not bad.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} wrong, max abs err {np.nanmax(err):.3g}, "
            f"first at {idx}: got {got[idx]}, want {want[idx]}")


# --- the benchmarks ------------------------------------------------------------------------

def bench_gemm(shapes, timer, peer, results, skipped):
    from numba import cuda

    from kernels.gemm import VERSIONS, gemm

    rng = np.random.default_rng(0)
    peer_name, prepare = peer
    for name, m, n, k, ta, tb in shapes:
        a_h = rng.uniform(-1, 1, (k, m) if ta else (m, k)).astype(np.float32)
        b_h = rng.uniform(-1, 1, (n, k) if tb else (k, n)).astype(np.float32)
        a, b = cuda.to_device(a_h), cuda.to_device(b_h)
        out = cuda.device_array((m, n), np.float32)
        shape = f"{m}x{n}x{k}"
        trans = ("T" if ta else "N") + ("T" if tb else "N")
        flops = 2.0 * m * n * k
        want = None
        peer_gflops = None
        if prepare is not None:
            run_peer = prepare(a, b, out, ta, tb)
            run_peer()
            want = out.copy_to_host()
            t = timer(run_peer)
            peer_gflops = flops / t["median_s"] / 1e9
            results.append(dict(kind="gemm", name=name, shape=shape, trans=trans,
                                impl=peer_name, gflops=peer_gflops, **t))
        elif m * n * k <= 2**30:  # the host can afford a float64 check
            op_a = (a_h.T if ta else a_h).astype(np.float64)
            op_b = (b_h.T if tb else b_h).astype(np.float64)
            want = op_a @ op_b
        for version in VERSIONS:
            run = (lambda v=version: gemm(a, b, out, ta, tb, version=v))
            run()
            if want is None:
                skipped.append(dict(name=f"gemm {version} {shape}",
                                    reason="no cuBLAS peer and too large to check on the host; "
                                           "not timed unchecked"))
                continue
            bad = _check(out.copy_to_host(), want,
                         atol=GEMM_CHECK_RTOL * k * float(np.abs(want).max() or 1.0))
            if bad:
                skipped.append(dict(name=f"gemm {version} {shape} {trans}",
                                    reason=f"wrong result, not timed: {bad}"))
                continue
            t = timer(run)
            gflops = flops / t["median_s"] / 1e9
            results.append(dict(kind="gemm", name=name, shape=shape, trans=trans,
                                impl=f"gemm {version}", gflops=gflops,
                                vs_peer=gflops / peer_gflops if peer_gflops else None, **t))


#: One kernel (or launcher) to time or profile: ``run()`` launches it on the legacy
#: default stream, ``check()`` returns None when its output is right (else a message),
#: ``moved`` is the floor of bytes it reads and writes. ``memory_cases`` and
#: ``conv_pool_cases`` yield them; this program times them, benchmarks/profile.py
#: launches them under Nsight Compute.
Case = collections.namedtuple("Case", "name impl moved run check")


def bench_memory(nbytes, timer, results, skipped):
    """Copy bandwidth, then each memory-bound kernel at arrays of ``nbytes``; returns the
    copy bandwidth (GB/s), the ceiling the other rows are measured against."""
    copy_gbps, t = common.copy_bandwidth(nbytes, timer=timer)
    results.append(dict(kind="memory", name="device-to-device copy", impl=t["copy_method"],
                        bytes=2 * (nbytes // 4) * 4, gbps=copy_gbps, vs_copy=1.0, **t))
    for case in memory_cases(nbytes):
        _record(timer, copy_gbps, results, skipped, *case)
    return copy_gbps


def memory_cases(nbytes):
    """The memory-bound kernels at arrays of ``nbytes``, one ``Case`` at a time: an
    elementwise add, softmax cross-entropy (v2, the default, and v1) and the SGD-momentum
    and Adam updates. Each case owns its device arrays, made when it is reached and
    freed with it; its check holds for its first ``run()`` (the optimizers' for their
    first step), so check before running it again."""
    from kernels.softmax_xent import softmax_xent_ref

    rng = np.random.default_rng(0)
    n = nbytes // 4
    x_h, y_h = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    yield _add_case(x_h, y_h)
    b = max(1, nbytes // (4 * XENT_CLASSES))
    logits_h = rng.standard_normal((b, XENT_CLASSES), np.float32)
    labels_h = rng.integers(0, XENT_CLASSES, b).astype(np.int32)
    want = softmax_xent_ref(logits_h, labels_h, scale=1.0 / b)
    for name, version in (("softmax_xent (10 classes)", None), ("softmax_xent v1 (10 classes)", "v1")):
        yield _softmax_xent_case(name, version, logits_h, labels_h, want)
    w_h, g_h = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    yield _sgd_case(w_h, g_h)
    yield _adam_case(w_h, g_h)


def _add_case(x_h, y_h):
    """Elementwise add: read x, y; write out."""
    from numba import cuda

    from kernels.elementwise import binary
    n = x_h.size
    x, y, out = cuda.to_device(x_h), cuda.to_device(y_h), cuda.device_array(n, np.float32)
    return Case("elementwise add", "kernels.elementwise.binary", 3 * 4 * n,
                lambda: binary("add", x, y, out),
                lambda: _check(out.copy_to_host(), x_h + y_h, 0.0, ELEMENTWISE_CHECK_RTOL))


def _softmax_xent_case(name, version, logits_h, labels_h, want):
    """Softmax cross-entropy over B rows of XENT_CLASSES logits, ``want`` its reference."""
    from numba import cuda

    from kernels.softmax_xent import softmax_xent
    b = logits_h.shape[0]
    logits, labels = cuda.to_device(logits_h), cuda.to_device(labels_h)
    loss, correct = cuda.device_array(b, np.float32), cuda.device_array(b, np.float32)
    grad = cuda.device_array((b, XENT_CLASSES), np.float32)
    return Case(name, f"kernels.softmax_xent {version or 'default (v2)'}",
                4 * b * (2 * XENT_CLASSES + 3),
                lambda: softmax_xent(logits, labels, loss, grad, correct, 1.0 / b, version=version),
                lambda: (_check(loss.copy_to_host(), want[0], 1e-5, 1e-5)
                         or _check(grad.copy_to_host(), want[1], 1e-7 / b, 1e-5)
                         or _check(correct.copy_to_host(), want[2], 0.0)))


def _sgd_case(w_h, g_h):
    """SGD with momentum on one flat buffer of n parameters (checked on its first step)."""
    from numba import cuda

    from kernels.optimizers import sgd, sgd_ref, sgd_scalars
    n = w_h.size
    w, g, v = cuda.to_device(w_h), cuda.to_device(g_h), cuda.to_device(np.zeros(n, np.float32))
    w_ref, v_ref = w_h.copy(), np.zeros(n, np.float32)
    hyper_h = sgd_scalars(0.01, 0.9)                  # (2,) float32: lr, momentum
    hyper = cuda.to_device(hyper_h)
    sgd_ref(w_ref, g_h, v_ref, hyper_h)
    return Case("sgd momentum", "kernels.optimizers.sgd", 5 * 4 * n,
                lambda: sgd(w, g, v, hyper),
                lambda: _check(w.copy_to_host(), w_ref, 1e-6, 1e-6))


def _adam_case(w_h, g_h):
    """Adam on one flat buffer of n parameters (checked on its first step)."""
    from numba import cuda

    from kernels.optimizers import adam, adam_ref, adam_scalars
    n = w_h.size
    w, g = cuda.to_device(w_h), cuda.to_device(g_h)
    m, v = cuda.to_device(np.zeros(n, np.float32)), cuda.to_device(np.zeros(n, np.float32))
    w_ref, m_ref, v_ref = w_h.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    hyper_h = adam_scalars(1e-3, 1)                   # (4,) float32 for step 1
    hyper = cuda.to_device(hyper_h)
    adam_ref(w_ref, g_h, m_ref, v_ref, hyper_h)
    return Case("adam", "kernels.optimizers.adam", 7 * 4 * n,
                lambda: adam(w, g, m, v, hyper),
                lambda: _check(w.copy_to_host(), w_ref, 1e-6, 1e-6))


def _record(timer, copy_gbps, results, skipped, name, impl, moved, run, check):
    """Run once, check, and only then time ``run``: a memory-bound row in GB/s and as a
    fraction of the copy ceiling; a wrong result is listed under skipped, untimed."""
    run()
    bad = check()
    if bad:
        skipped.append(dict(name=name, reason=f"wrong result, not timed: {bad}"))
        return
    t = timer(run)
    gbps = moved / t["median_s"] / 1e9
    results.append(dict(kind="memory", name=name, impl=impl, bytes=moved, gbps=gbps,
                        vs_copy=gbps / copy_gbps, **t))


def bench_conv_pool(batch, hw, timer, copy_gbps, results, skipped, second=None):
    """Each of ``conv_pool_cases(batch, hw)`` checked, then timed (``_record``)."""
    for case in conv_pool_cases(batch, hw, second):
        _record(timer, copy_gbps, results, skipped, *case)


def conv_pool_cases(batch, hw, second=None):
    """The lab's Conv2D(32, 3, relu) and MaxPooling2D() at ``batch`` images of hw x hw,
    one ``Case`` at a time: conv2d v1 and v2 forward, its backward (dW + db alone, as for
    a first layer, and with dX), max_pool forward and backward, each with its check
    against the float64 NumPy reference; then the kernels compiled per shape
    (``conv_v3_cases``) and the tutorials' second conv (``second_conv_cases``, of size
    ``second``: default ``SECOND_CONV``). Every ``run`` takes ``stream=``, so ``time_gpu``
    times it through a captured graph.

    Bytes are the floor, each array read or written once (float32; int32 arg-max):
        conv2d forward    read x (B*H*W*Cin) + kernel + bias; write out (B*OH*OW*Cout)
        conv2d dW + db    read x + dy; write dW + db (pass 1's partials stay in L2)
        conv2d dX + dW    the same plus read kernel, write dx
        max_pool forward  read x (B*OH*OW*Cout); write out + arg (B*PH*PW*Cout each)
        max_pool backward read dy + arg; write dx
    """
    from numba import cuda

    from kernels.conv2d import (conv2d, conv2d_backward, conv2d_backward_ref, conv2d_ref,
                                conv2d_output_shape, dw_partial_shape, im2col_ref)
    from kernels.pooling import (max_pool, max_pool_backward, max_pool_backward_ref,
                                 max_pool_ref, pool_geometry)

    def near(got, want, scale):
        return _check(got, want, CONV_CHECK_REL * float(np.max(scale)))

    rng = np.random.default_rng(0)
    x_h = rng.standard_normal((batch, hw, hw, CONV_CIN), np.float32)      # (B, 28, 28, 1)
    k_h = rng.standard_normal((CONV_K, CONV_K, CONV_CIN, CONV_COUT), np.float32)
    b_h = rng.standard_normal(CONV_COUT, np.float32)                      # (32,)
    shape = conv2d_output_shape(x_h.shape, k_h.shape)                     # (B, 26, 26, 32)
    x, k, b = cuda.to_device(x_h), cuda.to_device(k_h), cuda.to_device(b_h)
    y = cuda.device_array(shape, np.float32)
    x64, k64 = x_h.astype(np.float64), k_h.astype(np.float64)
    want = conv2d_ref(x64, k64, b_h.astype(np.float64), relu=True)
    scale = conv2d_ref(np.abs(x64), np.abs(k64), np.abs(b_h).astype(np.float64))
    f = 4                                                                  # bytes per float32
    moved = f * (x_h.size + k_h.size + b_h.size + int(np.prod(shape)))
    label = f"{CONV_K}x{CONV_K} {CONV_CIN}->{CONV_COUT}, {hw}x{hw}, batch {batch}"
    for version in ("v1", "v2"):
        yield Case(f"conv2d {version} forward+relu ({label})", f"kernels.conv2d {version}", moved,
                   lambda stream=None, v=version: conv2d(x, k, b, y, relu=True, stream=stream, version=v),
                   lambda: near(y.copy_to_host(), want, scale))

    dy_h = rng.standard_normal(shape, np.float32)                          # (B, 26, 26, 32)
    dy = cuda.to_device(dy_h)
    dx = cuda.device_array(x_h.shape, np.float32)
    dw, db = cuda.device_array(k_h.shape, np.float32), cuda.device_array(CONV_COUT, np.float32)
    partial = cuda.device_array(dw_partial_shape(x_h.shape, k_h.shape), np.float32)
    cols = im2col_ref(x64, (CONV_K, CONV_K))                               # (B*26*26, 9)
    dy64 = dy_h.astype(np.float64)
    want_dx, want_dw, want_db = conv2d_backward_ref(x64, k64, dy64, cols=cols)
    scale_dx, scale_dw, scale_db = conv2d_backward_ref(np.abs(x64), np.abs(k64), np.abs(dy64),
                                                       cols=np.abs(cols))
    check_w = lambda: (near(dw.copy_to_host(), want_dw, scale_dw)            # noqa: E731
                       or near(db.copy_to_host(), want_db, scale_db))
    moved_w = f * (x_h.size + dy_h.size + k_h.size + CONV_COUT)
    yield Case(f"conv2d backward dW+db ({label})", "kernels.conv2d dw_partial + dw_finish",
               moved_w, lambda stream=None: conv2d_backward(x, k, dy, None, dw, db, partial=partial,
                                                            stream=stream),
               check_w)
    yield Case(f"conv2d backward dX+dW+db ({label})", "kernels.conv2d dx_v1 + dw",
               moved_w + f * (k_h.size + x_h.size),
               lambda stream=None: conv2d_backward(x, k, dy, dx, dw, db, partial=partial, stream=stream),
               lambda: near(dx.copy_to_host(), want_dx, scale_dx) or check_w())

    # MaxPooling2D() on the conv's output (ReLU'd: many ties at 0, as in training).
    y_h = np.maximum(dy_h, 0)                                              # (B, 26, 26, 32)
    p_shape = pool_geometry(shape)[0]                                      # (B, 13, 13, 32)
    py = cuda.to_device(y_h)
    pout = cuda.device_array(p_shape, np.float32)
    parg = cuda.device_array(p_shape, np.int32)
    want_p, want_arg = max_pool_ref(y_h)
    n_out = int(np.prod(p_shape))
    yield Case(f"max_pool 2x2 forward ({p_shape[1]}x{p_shape[2]}x{p_shape[3]}, batch {batch})",
               "kernels.pooling max_pool_v1", f * (y_h.size + 2 * n_out),
               lambda stream=None: max_pool(py, pout, parg, stream=stream),
               lambda: (_check(pout.copy_to_host(), want_p, 0.0)
                        or _check(parg.copy_to_host(), want_arg, 0.0)))
    pdy_h = rng.standard_normal(p_shape, np.float32)
    pdy, pdx = cuda.to_device(pdy_h), cuda.device_array(shape, np.float32)
    want_pdx = max_pool_backward_ref(pdy_h, want_arg, shape)
    yield Case(f"max_pool 2x2 backward ({p_shape[1]}x{p_shape[2]}x{p_shape[3]}, batch {batch})",
               "kernels.pooling max_pool_backward_v1", f * (2 * n_out + y_h.size),
               lambda stream=None: max_pool_backward(pdy, parg, pdx, stream=stream, version="v1"),
               lambda: _check(pdx.copy_to_host(), want_pdx, 0.0))

    yield from conv_v3_cases(batch, hw, x, k, b, x_h, k_h, b_h, want, scale, shape, dy, dy_h, dw, db,
                             check_w, moved_w, label, near)
    yield from second_conv_cases(batch, near, second)


def conv_v3_cases(batch, hw, x, k, b, x_h, k_h, b_h, want, scale, shape, dy, dy_h, dw, db, check_w,
                  moved_w, label, near):
    """The lab layer's kernels compiled per shape (issue 24): v3 forward, the fused
    conv + ReLU + 2x2 pool, dW + db v2, and pool backward v2 with the ReLU mask; each checked
    against the float64 references, then timed like v1 (CUDA events around a graph).

    Bytes: v3 as v1; fused: read x + kernel + bias, write the pooled out (float32) and arg
    (int8), B*PH*PW*Cout each; pool backward v2: read dy + arg (int8) + y, write dx."""
    from numba import cuda

    from kernels import conv2d_grad, conv2d_v3
    from kernels.pooling import max_pool_backward, max_pool_backward_ref, max_pool_ref, pool_geometry

    f = 4
    y3 = cuda.device_array(shape, np.float32)
    yield Case(f"conv2d v3 forward+relu ({label})", "kernels.conv2d_v3", f * (x_h.size + k_h.size + b_h.size
               + int(np.prod(shape))), lambda stream=None: conv2d_v3.conv2d_v3(x, k, b, y3, relu=True, stream=stream),
               lambda: near(y3.copy_to_host(), want, scale))
    p_shape = pool_geometry(shape)[0]                                      # (B, 13, 13, 32)
    pooled = cuda.device_array(p_shape, np.float32)
    arg8 = cuda.device_array(p_shape, conv2d_v3.FUSED_ARG_DTYPE)
    want_pool, want_arg = max_pool_ref(want.astype(np.float32))
    n_out = int(np.prod(p_shape))
    yield Case(f"conv2d v3 fused +relu+pool ({label})", "kernels.conv2d_v3 conv2d_relu_pool",
               f * (x_h.size + k_h.size + b_h.size + n_out) + n_out,
               lambda stream=None: conv2d_v3.conv2d_relu_pool(x, k, b, pooled, arg8, stream=stream),
               lambda: near(pooled.copy_to_host(), want_pool, max_pool_ref(scale.astype(np.float32))[0]))
    partial = cuda.device_array(conv2d_grad.partial_shape(x_h.shape, k_h.shape), np.float32)
    yield Case(f"conv2d backward v2 dW+db ({label})", "kernels.conv2d_grad dw_partial_v2 + dw_finish",
               moved_w, lambda stream=None: conv2d_grad.conv2d_backward_v2(
                   x, k, dy, None, dw, db, partial=partial, stream=stream), check_w)
    # Pool backward v2 with the ReLU mask, on the fused forward's kind of input (the pooled
    # output and an int8 arg-max), made here from the reference: the case runs alone too (--only).
    rng = np.random.default_rng(1)
    pdy_h = rng.standard_normal(p_shape, np.float32)
    pdy, pdx = cuda.to_device(pdy_h), cuda.device_array(shape, np.float32)
    ref_pooled = cuda.to_device(want_pool.astype(np.float32))
    ref_arg8 = cuda.to_device(want_arg.astype(conv2d_v3.FUSED_ARG_DTYPE))
    masked = pdy_h * (want_pool > 0)                                       # dz = 0 where y <= 0
    want_pdx = max_pool_backward_ref(masked, want_arg, shape)
    yield Case(f"max_pool 2x2 backward v2 +relu mask ({p_shape[1]}x{p_shape[2]}x{p_shape[3]}, batch {batch})",
               "kernels.pooling max_pool_backward_v2", 2 * f * n_out + n_out + f * int(np.prod(shape)),
               lambda stream=None: max_pool_backward(pdy, ref_arg8, pdx, relu_y=ref_pooled, stream=stream),
               lambda: _check(pdx.copy_to_host(), want_pdx, 0.0))


def second_conv_cases(batch, near, size=None):
    """The tutorials' second conv (``SECOND_CONV``: 13x13x32 -> 64, 3x3) at ``batch``: forward
    v1 against v3, and the backward with dX (the conv is not the first layer), v1 against v2.
    Bytes as the lab layer's."""
    from numba import cuda

    from kernels import conv2d_grad, conv2d_v3
    from kernels.conv2d import (conv2d, conv2d_backward, conv2d_backward_ref, conv2d_output_shape,
                                conv2d_ref, dw_partial_shape, im2col_ref)

    hw, cin, cout = size or SECOND_CONV
    rng = np.random.default_rng(2)
    x_h = rng.standard_normal((batch, hw, hw, cin), np.float32)
    k_h = (rng.standard_normal((CONV_K, CONV_K, cin, cout)) / np.sqrt(9 * cin)).astype(np.float32)
    b_h = rng.standard_normal(cout, np.float32)
    shape = conv2d_output_shape(x_h.shape, k_h.shape)                     # (B, 11, 11, 64)
    x, k, b = cuda.to_device(x_h), cuda.to_device(k_h), cuda.to_device(b_h)
    x64, k64 = x_h.astype(np.float64), k_h.astype(np.float64)
    want = conv2d_ref(x64, k64, b_h.astype(np.float64), relu=True)
    scale = conv2d_ref(np.abs(x64), np.abs(k64), np.abs(b_h).astype(np.float64))
    f = 4
    label = f"{CONV_K}x{CONV_K} {cin}->{cout}, {hw}x{hw}, batch {batch}"
    moved = f * (x_h.size + k_h.size + b_h.size + int(np.prod(shape)))
    y1, y3 = cuda.device_array(shape, np.float32), cuda.device_array(shape, np.float32)
    yield Case(f"conv2d second conv v1 forward+relu ({label})", "kernels.conv2d v1", moved,
               lambda stream=None: conv2d(x, k, b, y1, relu=True, stream=stream, version="v1"),
               lambda: near(y1.copy_to_host(), want, scale))
    yield Case(f"conv2d second conv v3 forward+relu ({label})", "kernels.conv2d_v3", moved,
               lambda stream=None: conv2d_v3.conv2d_v3(x, k, b, y3, relu=True, stream=stream),
               lambda: near(y3.copy_to_host(), want, scale))
    dy_h = rng.standard_normal(shape, np.float32)
    dy = cuda.to_device(dy_h)
    cols = im2col_ref(x64, (CONV_K, CONV_K))
    dy64 = dy_h.astype(np.float64)
    want_dx, want_dw, want_db = conv2d_backward_ref(x64, k64, dy64, cols=cols)
    s_dx, s_dw, s_db = conv2d_backward_ref(np.abs(x64), np.abs(k64), np.abs(dy64), cols=np.abs(cols))
    moved_b = f * (2 * x_h.size + dy_h.size + 2 * k_h.size + cout)
    for version, partial_of, run in (
            ("v1", dw_partial_shape, conv2d_backward),
            ("v2", conv2d_grad.partial_shape, conv2d_grad.conv2d_backward_v2)):
        dx, dw = cuda.device_array(x_h.shape, np.float32), cuda.device_array(k_h.shape, np.float32)
        db = cuda.device_array(cout, np.float32)
        partial = cuda.device_array(partial_of(x_h.shape, k_h.shape), np.float32)
        yield Case(f"conv2d second conv backward {version} dX+dW+db ({label})", f"kernels {version}",
                   moved_b,
                   lambda stream=None, run=run, dx=dx, dw=dw, db=db, partial=partial: run(
                       x, k, dy, dx, dw, db, partial=partial, stream=stream),
                   lambda dx=dx, dw=dw, db=db: (near(dx.copy_to_host(), want_dx, s_dx)
                                                or near(dw.copy_to_host(), want_dw, s_dw)
                                                or near(db.copy_to_host(), want_db, s_db)))


def targets(results):
    """Each target that was measured (module docstring): value, threshold, met."""
    out = []
    v3 = [r for r in results if r.get("impl") == "gemm v3" and r["shape"] == "4096x4096x4096"]
    if v3 and v3[0].get("vs_peer") is not None:
        out.append(dict(target="gemm v3 / cuBLAS FP32 at 4096^3", measured=v3[0]["vs_peer"],
                        threshold=TARGET_GEMM_FRACTION,
                        met=v3[0]["vs_peer"] >= TARGET_GEMM_FRACTION))
    # Every memory-bound kernel at >= 64 MB, the optimizers included.
    for name in ("elementwise add", "softmax_xent (10 classes)", "sgd momentum", "adam"):
        rows = [r for r in results if r.get("name") == name and r["bytes"] >= 64e6]
        if rows:
            out.append(dict(target=f"{name} / copy bandwidth at >= 64 MB",
                            measured=rows[0]["vs_copy"], threshold=TARGET_BANDWIDTH_FRACTION,
                            met=rows[0]["vs_copy"] >= TARGET_BANDWIDTH_FRACTION))
    # The lab's conv (v2) and pooling layers, batch >= 512.
    for prefix in ("conv2d v2 forward", "max_pool 2x2 forward"):
        rows = [r for r in results if r.get("name", "").startswith(prefix)
                and f"batch {CONV_BATCH}" in r["name"]]
        if rows:
            out.append(dict(target=f"{prefix} / copy bandwidth, lab layer, batch {CONV_BATCH}",
                            measured=rows[0]["vs_copy"], threshold=TARGET_CONV_POOL_FRACTION,
                            met=rows[0]["vs_copy"] >= TARGET_CONV_POOL_FRACTION))
    # Issue 24's kernels compiled per shape: microseconds per call through a graph.
    for prefix, by_batch in CONV_US_TARGETS.items():
        for batch, limit in by_batch.items():
            rows = [r for r in results if r.get("name", "").startswith(prefix)
                    and r["name"].endswith(f"batch {batch})")]
            if rows:
                us = rows[0]["median_s"] * 1e6
                out.append(dict(target=f"{prefix}, batch {batch}, us per call", measured=us,
                                threshold=limit, want="<=", met=us <= limit))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes in the CUDA simulator (checks the program runs; "
                             "times mean nothing)")
    parser.add_argument("--out", help="write the JSON here instead of benchmarks/results/ "
                                      "(--smoke writes JSON only when --out is given)")
    parser.add_argument("--batch", default=",".join(str(b) for b in CONV_BATCHES),
                        help="comma-separated batches for the conv and pooling cases "
                             f"(default {','.join(str(b) for b in CONV_BATCHES)}; --smoke: {SMOKE_CONV_BATCH})")
    parser.add_argument("--repeat", type=int, default=common.REPEAT,
                        help=f"timed samples per measurement (default {common.REPEAT})")
    parser.add_argument("--gemm", metavar="NAMES",
                        help="only the GEMMs whose names start with one of these (comma-separated, "
                             "e.g. 'dense1 forward,square 1024'), nothing else (lab 04's timing cell)")
    args = parser.parse_args(argv)

    common.choose_cuda(smoke=args.smoke)  # before anything imports numba.cuda
    os.environ.setdefault("CUPY_TF32", "0")  # read by CuPy at import: keep FP32 GEMMs FP32
    if args.smoke:
        from numba import cuda
        repeat, warmup = min(args.repeat, SMOKE_REPEAT), SMOKE_WARMUP

        def timer(fn):
            return common.time_host(fn, warmup=warmup, repeat=repeat, sync=cuda.synchronize)
        shapes, nbytes, peer = SMOKE_GEMM_SHAPES, SMOKE_MEM_BYTES, (None, None)
        conv_batches, conv_hw, second = (SMOKE_CONV_BATCH,), SMOKE_CONV_HW, SMOKE_SECOND_CONV
        skipped = [dict(name="cuBLAS peer", reason="smoke run in the CUDA simulator")]
    else:
        if common.no_gpu("benchmarks.kernels", "On a machine with a CUDA GPU run "
                         "`python -m benchmarks.kernels`; to check that this program works, "
                         "`python -m benchmarks.kernels --smoke --out /tmp/kernels.json`."):
            return 0
        repeat, warmup = args.repeat, common.WARMUP

        def timer(fn):
            return common.time_gpu(fn, warmup=warmup, repeat=repeat)
        shapes, nbytes = GEMM_SHAPES, MEM_BYTES
        try:
            conv_batches = tuple(int(b) for b in args.batch.split(","))
        except ValueError:
            parser.error(f"--batch takes comma-separated integers, got {args.batch!r}")
        conv_hw, second = CONV_HW, SECOND_CONV
        peer = cublas_peer()
        skipped = [] if peer[0] else [dict(name="cuBLAS peer", reason=peer[1])]
        if peer[0] is None:
            peer = (None, None)

    if args.gemm:
        prefixes = tuple(p.strip() for p in args.gemm.split(",") if p.strip())
        named = [s for s in shapes if s[0].startswith(prefixes)]
        if not named:
            parser.error(f"--gemm {args.gemm!r} names no GEMM of this run; they are: "
                         f"{', '.join(s[0] for s in shapes)}")
        shapes = named

    info = common.device_info()
    print(f"device: {info['device']}" + ("  (simulator: times mean nothing)" if args.smoke else ""))
    results = []
    bench_gemm(shapes, timer, peer, results, skipped)
    if not args.gemm:
        copy_gbps = bench_memory(nbytes, timer, results, skipped)
        for conv_batch in conv_batches:
            bench_conv_pool(conv_batch, conv_hw, timer, copy_gbps, results, skipped, second)

    for r in results:
        r["median_us"] = r["median_s"] * 1e6
    print()
    common.print_table([r for r in results if r["kind"] == "gemm"], [
        ("name", "GEMM", ""), ("shape", "MxNxK", ""), ("trans", "op", ""), ("impl", "impl", ""),
        ("median_us", "median µs", ".1f"), ("gflops", "GFLOP/s", ".1f"),
        ("vs_peer", "/ cuBLAS", ".2f")])
    if not args.gemm:
        print()
        common.print_table([r for r in results if r["kind"] == "memory"], [
            ("name", "memory-bound", ""), ("bytes", "bytes moved", ","), ("median_us", "median µs", ".1f"),
            ("gbps", "GB/s", ".1f"), ("vs_copy", "/ copy", ".2f")])
    met = targets(results)
    for t in met:
        print(f"target: {t['target']}: {t['measured']:.2f} (want {t.get('want', '>=')} {t['threshold']:.2f}) "
              f"{'met' if t['met'] else 'NOT met'}")
    for s in skipped:
        print(f"skipped: {s['name']}: {s['reason']}")

    payload = {
        "method": {"timer": "perf_counter (simulator)" if args.smoke else "CUDA events",
                   "statistic": "median seconds per call", "repeat": repeat,
                   "warmup": warmup, "smoke": args.smoke,
                   "memory_bytes_per_array": nbytes, "gemm_only": args.gemm},
        "results": results, "targets": met, "skipped": skipped,
    }
    if args.gemm and not args.out:      # a part of the benchmark: never beside the full runs
        print("\n(--gemm: a partial run, no --out given, nothing written)")
        return 0
    return common.save_results("kernels", payload, info, args.smoke, args.out)


if __name__ == "__main__":
    sys.exit(main())
