"""The CPU backend's dense products cut in fixed blocks (kernels/cpu_loops.py ``matmul_split``,
``CpuOps.gemm``): rows or columns, whichever side of the output is longer, the same bits
on 1, 2, 3 or 5 threads, equal to a float64 product to float32 rounding; the dense
layer's three products (forward, dW = x^T dz, dx = dz W^T) as the CPU backend calls them.

    python -m pytest -q tests/test_cpu_dense_split.py
"""
import numpy as np
import pytest

from conftest import poisoned_host
from kernels import cpu_loops, gemm
from mirrored.backends import CpuOps


@pytest.mark.parametrize("m, k, n", [(33, 517, 31), (5, 64, 517), (517, 31, 7), (3, 9, 2)])
def test_split_products_do_not_depend_on_the_threads(monkeypatch, rng, m, k, n):
    monkeypatch.setattr(cpu_loops, "SPLIT_MIN_MADDS", 0)          # split even these small ones
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    dz = rng.standard_normal((m, n), dtype=np.float32)
    ops = CpuOps(device=None)
    seen = []
    for threads in ("1", "2", "3", "5"):
        monkeypatch.setenv(cpu_loops.THREADS_VAR, threads)
        y, dw, dx = poisoned_host((m, n)), poisoned_host((k, n)), poisoned_host((m, k))
        ops.gemm(x, w, y)                                           # forward
        ops.gemm(x, dz, dw, trans_a=True)                           # dW = x^T dz
        ops.gemm(dz, w, dx, trans_b=True)                           # dx = dz W^T
        seen.append((y, dw, dx))
    for got in seen[1:]:
        for g, first in zip(got, seen[0]):
            np.testing.assert_array_equal(g, first)
    x64, w64, dz64 = (a.astype(np.float64) for a in (x, w, dz))
    for g, want in zip(seen[0], (x64 @ w64, x64.T @ dz64, dz64 @ w64.T)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_what_the_split_does_not_take_goes_to_the_reference(rng):
    """alpha, beta, float64: ``gemm_ref`` itself (the same bits)."""
    a = rng.standard_normal((6, 5), dtype=np.float32)
    b = rng.standard_normal((5, 4), dtype=np.float32)
    out = rng.standard_normal((6, 4), dtype=np.float32)
    want = gemm.gemm_ref(a, b, out.copy(), alpha=0.5, beta=2.0)
    np.testing.assert_array_equal(CpuOps(device=None).gemm(a, b, out, alpha=0.5, beta=2.0), want)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_array_equal(CpuOps(device=None).gemm(a64, b64, np.empty((6, 4))), gemm.gemm_ref(a64, b64))
