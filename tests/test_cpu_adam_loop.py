"""The CPU backend's compiled Adam (kernels/optimizers.py ``adam_cpu``) against ``adam_ref``:
the same float32 operations in the same order, so the same bits, on fresh random buffers
(odd sizes, zeros in g and v, large and tiny values), over several steps; and the
reference's path for what the loop does not take (float64, overlapping buffers).

    python -m pytest -q tests/test_cpu_adam_loop.py
"""
import numpy as np
import pytest

from kernels import optimizers


def buffers(rng, n):
    w = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32) * np.float32(10.0) ** rng.integers(-8, 2, n).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    g[: n // 7] = 0.0                                   # zero gradients: v may stay 0 (sqrt(0) + eps)
    return w, g, m, v


@pytest.mark.parametrize("n", [1, 31, 33, 1000, 347_210])
def test_compiled_adam_is_the_reference_bitwise_step_after_step(rng, n):
    ref = buffers(rng, n)
    mine = [a.copy() for a in ref]
    start = ref[0].copy()
    for step in range(1, 5):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
        g[: n // 5] = 0.0
        hyper = optimizers.adam_scalars(1e-3 * step, step)
        ref[1][...] = mine[1][...] = g
        optimizers.adam_ref(*ref, hyper)
        assert optimizers.adam_cpu(*mine, hyper) is mine[0]
        for a, b in zip(ref, mine):
            np.testing.assert_array_equal(b, a)
    assert not np.array_equal(mine[0], start)           # the steps moved the weights
    w64 = [a.astype(np.float64) for a in buffers(rng, 7)]
    want = [a.copy() for a in w64]
    optimizers.adam_ref(*want, optimizers.adam_scalars(1e-2, 1, dtype=np.float64))
    optimizers.adam_cpu(*w64, optimizers.adam_scalars(1e-2, 1, dtype=np.float64))   # the reference's path
    for a, b in zip(want, w64):
        np.testing.assert_array_equal(b, a)


def test_compiled_adam_against_float64_oracle(rng):
    w, g, m, v = buffers(rng, 999)
    g[...] = rng.standard_normal(999, dtype=np.float32)
    hyper = optimizers.adam_scalars(0.01, 3)
    alpha, b1, b2, eps = (float(h) for h in hyper)
    m64 = m + (g.astype(np.float64) - m) * b1
    v64 = v + (g.astype(np.float64) ** 2 - v) * b2
    w64 = w - alpha * m64 / (np.sqrt(v64) + eps)
    optimizers.adam_cpu(w, g, m, v, hyper)
    np.testing.assert_allclose(m, m64, rtol=1e-6)
    np.testing.assert_allclose(v, v64, rtol=1e-6)
    np.testing.assert_allclose(w, w64, rtol=1e-6, atol=1e-7)


def test_overlapping_buffers_take_the_references_path(rng):
    w, g, m, v = buffers(rng, 64)
    g[...] = np.abs(rng.standard_normal(64, dtype=np.float32))   # m >= 0: v's half of it stays >= 0
    hyper = optimizers.adam_scalars(0.01, 1)
    ref_w, ref_both = w.copy(), np.concatenate([m, v])
    optimizers.adam_ref(ref_w, g, ref_both[:64], ref_both[32:96], hyper)
    got_w, got_both = w.copy(), np.concatenate([m, v])
    optimizers.adam_cpu(got_w, g, got_both[:64], got_both[32:96], hyper)     # m and v overlap
    np.testing.assert_array_equal(got_w, ref_w)
    np.testing.assert_array_equal(got_both, ref_both)
    assert not np.array_equal(got_w, w)
