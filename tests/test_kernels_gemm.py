"""GEMM kernels (kernels/gemm.py) against an independent float64 oracle.

Every version, every (trans_a, trans_b), awkward shapes (1, 17, 31, 33, 65, and more
than one v3 block), outputs poisoned with NaN before each launch. Runs in the CUDA
simulator without a GPU: shapes stay tiny, since each CUDA thread is a Python thread.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

import kernels.gemm as gemm_mod
from kernels.gemm import DEFAULT_VERSION, VERSIONS, choose_version, gemm, gemm_ref
from conftest import device_zeros

#: float32 GEMM: each output is a K-term dot product; with float32 rounding each step
#: the error stays below ~K * 2**-24 relative to sum_k |a_ik * b_kj|. 1e-5 covers K <= 65
#: with a margin, and is 100x tighter than any indexing bug would give.
RTOL_F32 = 1e-5
#: The float64 reference against the float64 oracle: only summation order differs.
RTOL_F64 = 1e-12

#: (M, N, K): every size in {1, 17, 31, 33, 65} appears in every position, and a batch
#: of 1 (M = 1). None is a multiple of a tile edge (16, 128, 8), so every edge is ragged.
SHAPES = [(17, 33, 65), (65, 31, 17), (33, 17, 31), (31, 65, 33), (1, 65, 33), (1, 17, 31)]
#: More than one 128 x 64 v3 block in each direction (v1, v2 get many blocks anyway).
V3_MULTI_BLOCK = (130, 129, 5)


def shapes_for(version, trans_a, trans_b):
    """The simulator runs a Python thread per CUDA thread, so each (version, trans_a,
    trans_b) takes half of SHAPES: the even ones when the flags agree, the odd ones
    when they differ. So for each value of each flag every shape runs once per
    version. (1, 1, 1) runs everywhere."""
    picked = SHAPES[int(trans_a != trans_b)::2]
    extra = [V3_MULTI_BLOCK] if version == "v3" and not trans_b else []
    return [(1, 1, 1)] + picked + extra


def assert_close(name, got, want, rtol, scale):
    """Fail unless |got - want| <= rtol * scale elementwise (NaN fails), saying where."""
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)  # NaN where got is NaN
    bad = ~(err <= rtol * scale)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        rel = err / np.maximum(scale, np.finfo(np.float64).tiny)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.size} elements outside rtol={rtol} "
            f"(shape {got.shape}); max abs err {np.nanmax(err) if err.size else 0:.3g}, "
            f"max rel err {np.nanmax(rel) if rel.size else 0:.3g}; first bad index {idx}: "
            f"got {got[idx]!r}, want {want[idx]!r}. (The rng seed is printed above.)")


def operands(rng, m, n, k, trans_a, trans_b, dtype=np.float32):
    """Random A and B stored so that op(A) is (m, k) and op(B) is (k, n)."""
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    return a, b


def oracle(a, b, trans_a, trans_b, alpha=1.0, beta=0.0, c=None):
    """(float64 result, error scale): an explicit sum over k, independent of gemm_ref."""
    a64 = (a.T if trans_a else a).astype(np.float64)   # (M, K)
    b64 = (b.T if trans_b else b).astype(np.float64)   # (K, N)
    prod = (a64[:, :, None] * b64[None, :, :]).sum(axis=1)          # (M, N)
    mag = (np.abs(a64)[:, :, None] * np.abs(b64)[None, :, :]).sum(axis=1)
    want = alpha * prod
    scale = abs(alpha) * mag + 1e-30
    if beta != 0.0:
        want = want + beta * c.astype(np.float64)
        scale = scale + abs(beta) * np.abs(c.astype(np.float64))
    return want, scale


def run_gemm(a, b, trans_a, trans_b, version, alpha=1.0, beta=0.0, c=None):
    """Launch on device copies; ``out`` starts as ``c`` or, for beta == 0, all NaN."""
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    start = c if c is not None else np.full((m, n), np.nan, np.float32)  # poison
    out = cuda.to_device(start)
    gemm(cuda.to_device(a), cuda.to_device(b), out, trans_a, trans_b, alpha, beta,
         version=version)
    return out.copy_to_host()


TRANS = [(False, False), (False, True), (True, False), (True, True)]


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("version", VERSIONS)
def test_gemm_matches_float64_oracle(rng, version, trans_a, trans_b):
    for m, n, k in shapes_for(version, trans_a, trans_b):
        a, b = operands(rng, m, n, k, trans_a, trans_b)
        got = run_gemm(a, b, trans_a, trans_b, version, alpha=1.5)
        want, scale = oracle(a, b, trans_a, trans_b, alpha=1.5)
        assert_close(f"gemm {version} trans=({trans_a},{trans_b}) M,N,K={m},{n},{k}",
                     got, want, RTOL_F32, scale)


@pytest.mark.parametrize("version", VERSIONS)
def test_gemm_beta_accumulates_into_out(rng, version):
    m, n, k = 17, 31, 33
    a, b = operands(rng, m, n, k, True, False)
    c = rng.standard_normal((m, n)).astype(np.float32)
    got = run_gemm(a, b, True, False, version, alpha=-0.5, beta=0.75, c=c)
    want, scale = oracle(a, b, True, False, alpha=-0.5, beta=0.75, c=c)
    assert_close(f"gemm {version} beta=0.75", got, want, RTOL_F32, scale)


def test_default_version_is_v3():
    assert DEFAULT_VERSION == "v3"
    assert DEFAULT_VERSION in VERSIONS


@pytest.mark.parametrize("m, n, sms, want", [
    (64, 64, 132, "v2"),          # a Dense layer at batch 64: one v3 block, 131 SMs idle
    (784, 64, 132, "v2"),         # 7 v3 blocks
    (1024, 1024, 132, "v2"),      # 8 x 16 = 128 v3 blocks: four SMs would idle
    (1152, 1024, 132, "v3"),      # 9 x 16 = 144 blocks: every SM has one
    (4096, 4096, 132, "v3"),
    (64, 64, 1, "v3"),            # a one-SM device: any grid fills it
])
def test_choose_version_takes_v3_only_when_its_grid_fills_the_gpu(m, n, sms, want):
    assert choose_version(m, n, sm_count=sms) == want


def test_version_none_runs_the_chosen_version(rng, monkeypatch):
    """gemm(version=None) launches the kernel choose_version names, and its result is right."""
    import kernels.gemm as gemm_mod
    launched = []
    real_launch = gemm_mod.launch
    monkeypatch.setattr(gemm_mod, "launch",
                        lambda kernel, *rest: (launched.append(kernel), real_launch(kernel, *rest)))
    monkeypatch.setattr(gemm_mod, "_sm_count", lambda: 1000)      # small output: v2
    a, b = operands(rng, 9, 7, 5, False, False)
    got = run_gemm(a, b, False, False, None)
    assert launched == [gemm_mod.KERNELS["v2"][(False, False)]]
    want, scale = oracle(a, b, False, False)
    assert_close("gemm version=None", got, want, RTOL_F32, scale)


def test_k_zero_gives_zeros():
    a = np.zeros((3, 0), np.float32)
    b = np.zeros((0, 5), np.float32)
    got = run_gemm(a, b, False, False, None)
    assert np.array_equal(got, np.zeros((3, 5), np.float32))


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 33), n=st.integers(1, 33), k=st.integers(1, 40),
       trans_a=st.booleans(), trans_b=st.booleans(), version=st.sampled_from(VERSIONS),
       seed=st.integers(0, 2**32 - 1))
def test_gemm_property_any_shape(m, n, k, trans_a, trans_b, version, seed):
    rng = np.random.default_rng(seed)
    a, b = operands(rng, m, n, k, trans_a, trans_b)
    got = run_gemm(a, b, trans_a, trans_b, version)
    want, scale = oracle(a, b, trans_a, trans_b)
    assert_close(f"gemm {version} trans=({trans_a},{trans_b}) M,N,K={m},{n},{k} seed={seed}",
                 got, want, RTOL_F32, scale)


# --- the NumPy reference the CPU backend uses --------------------------------------

@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_ref_matches_oracle(rng, trans_a, trans_b):
    for m, n, k in SHAPES:
        for dtype, rtol in ((np.float64, RTOL_F64), (np.float32, RTOL_F32)):
            a, b = operands(rng, m, n, k, trans_a, trans_b, dtype)
            c = rng.standard_normal((m, n)).astype(dtype)
            want, scale = oracle(a, b, trans_a, trans_b, 2.0, 0.5, c)
            out = c.copy()
            got = gemm_ref(a, b, out, trans_a, trans_b, alpha=2.0, beta=0.5)
            assert got is out and got.dtype == dtype
            assert_close(f"gemm_ref {np.dtype(dtype)} beta=0.5", got, want, rtol, scale)
            want, scale = oracle(a, b, trans_a, trans_b, 2.0)
            got = gemm_ref(a, b, np.full((m, n), np.nan, dtype), trans_a, trans_b, alpha=2.0)
            assert_close(f"gemm_ref {np.dtype(dtype)} beta=0 into NaN", got, want, rtol, scale)
            got = gemm_ref(a, b, None, trans_a, trans_b, alpha=2.0, beta=0.5)  # beta ignored
            assert_close(f"gemm_ref {np.dtype(dtype)} out=None", got, want, rtol, scale)


# --- bad input: a clear error, and no launch ---------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(gemm_mod)


_dev = device_zeros


@pytest.mark.parametrize("case,error,match", [
    ("float64 a", TypeError, "must be float32"),
    ("1-D b", ValueError, "2-D"),
    ("inner mismatch", ValueError, "inner dimensions"),
    ("out shape", ValueError, "expected"),
    ("non-contiguous a", ValueError, "C-contiguous"),
    ("out aliases a", ValueError, "shares memory"),
    ("bad version", ValueError, "unknown version"),
])
def test_gemm_bad_input_raises_before_launch(no_launch, case, error, match):
    a, b, out, kw = _dev((4, 3)), _dev((3, 5)), _dev((4, 5)), {}
    if case == "float64 a":
        a = _dev((4, 3), np.float64)
    elif case == "1-D b":
        b = _dev((15,))
    elif case == "inner mismatch":
        b = _dev((2, 5))
    elif case == "out shape":
        out = _dev((5, 4))
    elif case == "non-contiguous a":
        a = _dev((4, 6))[:, ::2]
    elif case == "out aliases a":
        a = _dev((4, 5))
        b = _dev((5, 5))
        out = a
    elif case == "bad version":
        kw = {"version": "v9"}
    with pytest.raises(error, match=match):
        gemm(a, b, out, **kw)


# (That v3's accumulators live in registers, no spills, no stack frame, is checked with
# the real compiler for every kernel in tests/test_kernels_compile.py.)


@pytest.mark.gpu
@pytest.mark.parametrize("version", VERSIONS)
def test_gemm_mnist_shape_on_gpu(rng, version):
    """A real-size MNIST layer (64 x 784 x 64), too slow for the simulator."""
    a, b = operands(rng, 64, 64, 784, False, False)
    got = run_gemm(a, b, False, False, version)
    want, scale = oracle(a, b, False, False)
    assert_close(f"gemm {version} 64x784x64", got, want, RTOL_F32, scale)
