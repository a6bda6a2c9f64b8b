"""The kernels of kernels/optimizers_more.py (RMSprop, Adagrad) and kernels/gradient_transforms.py
(clipnorm, global_clipnorm, clipvalue, weight decay) in the CUDA simulator, against their
float32 NumPy references and float64 oracles of Keras 3's formulas.

Several steps in a row (the slots carry over), awkward sizes, outputs poisoned before the
first launch where a kernel writes a buffer whole (``sq``), bad input raising before a launch.

    python -m pytest -n 0 -q tests/test_kernels_optimizers_more.py
"""
import math

import numpy as np
import pytest
from numba import cuda

import kernels.gradient_transforms as gt
import kernels.optimizers_more as om
from conftest import assert_close, device_zeros

#: float32 against float64 after STEPS steps (a few roundings each, ~6e-8 relative).
RTOL_F32 = 2e-5
ATOL_F32 = 1e-7
#: Kernel against the float32 reference: the same float32 scalars and order; NVVM's fused
#: multiply-adds, and the kernel's float32 tree sum of squares against the reference's
#: float64 sum, may move the last bits.
RTOL_KERNEL_VS_REF = 2e-6
STEPS = 3
SIZES = [1, 33, 130]


def randn(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def oracle_rmsprop(w, g, vel, mom, avg, lr, rho, momentum, eps, centered):
    vel[...] = rho * vel + (1 - rho) * g * g
    if centered:
        avg[...] = rho * avg + (1 - rho) * g
        denominator = vel - avg ** 2 + eps
    else:
        denominator = vel + eps
    inc = lr * g / np.sqrt(denominator)
    if momentum > 0:
        mom[...] = momentum * mom + inc
        w -= mom
    else:
        w -= inc


@pytest.mark.parametrize("momentum,centered", [(0.0, False), (0.7, False), (0.0, True), (0.7, True)])
@pytest.mark.parametrize("n", SIZES)
def test_rmsprop_kernel(rng, n, momentum, centered):
    lr, rho, eps = 0.01, 0.85, 1e-7
    w = randn(rng, n)
    slots = [np.zeros(n, np.float32) for _ in range(3)]                 # velocity, momentum, average
    use = [True, momentum > 0, centered]
    dev = [cuda.to_device(a) for a in [w] + slots]
    ref = [a.copy() for a in [w] + slots]
    want = [a.astype(np.float64) for a in [w] + slots]
    for _ in range(STEPS):
        g = randn(rng, n)
        hyper = om.rmsprop_scalars(lr, rho, momentum, eps)                 # (5,) float32
        om.rmsprop(dev[0], cuda.to_device(g), dev[1], dev[2] if use[1] else None, dev[3] if use[2] else None,
                   cuda.to_device(hyper))
        om.rmsprop_ref(ref[0], g, ref[1], ref[2] if use[1] else None, ref[3] if use[2] else None, hyper)
        oracle_rmsprop(*want[:1], g.astype(np.float64), *want[1:], lr, rho, momentum, eps, centered)
    for name, d, r, o, used in zip(("w", "velocity", "momentum", "average"), dev, ref, want, [True] + use):
        got = d.copy_to_host()
        if not used:
            assert not got.any(), f"rmsprop wrote the {name} slot it does not have"
            continue
        assert_close(f"rmsprop {name} n={n}", got, o, RTOL_F32, ATOL_F32)
        assert_close(f"rmsprop {name} vs ref n={n}", got, r, RTOL_KERNEL_VS_REF, ATOL_F32)


@pytest.mark.parametrize("n", SIZES)
def test_adagrad_kernel(rng, n):
    lr, eps, init = 0.05, 1e-7, 0.1
    w, acc = randn(rng, n), np.full(n, init, np.float32)
    d_w, d_a = cuda.to_device(w), cuda.to_device(acc)
    r_w, r_a = w.copy(), acc.copy()
    o_w, o_a = w.astype(np.float64), acc.astype(np.float64)
    for _ in range(STEPS):
        g = randn(rng, n)
        hyper = om.adagrad_scalars(lr, eps)
        om.adagrad(d_w, cuda.to_device(g), d_a, cuda.to_device(hyper))
        om.adagrad_ref(r_w, g, r_a, hyper)
        o_a += g.astype(np.float64) ** 2
        o_w -= lr * g / np.sqrt(o_a + eps)
    assert_close(f"adagrad w n={n}", d_w.copy_to_host(), o_w, RTOL_F32, ATOL_F32)
    assert_close(f"adagrad accumulator n={n}", d_a.copy_to_host(), o_a, RTOL_F32, ATOL_F32)
    assert_close(f"adagrad w vs ref n={n}", d_w.copy_to_host(), r_w, RTOL_KERNEL_VS_REF, ATOL_F32)


# --- gradient transforms: the tail of a per-step vector at offset ``at`` ------------------------

def tail_vector(rng, lr, wd, clip):
    """A per-step vector with 2 scalars of some optimizer in front, then the transforms' tail."""
    return np.concatenate([randn(rng, 2), gt.transform_scalars(lr, wd, clip)]), 2


def test_decay_kernel(rng):
    w = randn(rng, 65)
    hyper, at = tail_vector(rng, 0.01, 0.3, None)
    d = cuda.to_device(w)
    gt.decay(d, cuda.to_device(hyper), at)
    ref = gt.decay_ref(w.copy(), hyper, at)
    assert_close("decay vs oracle", d.copy_to_host(), w.astype(np.float64) * (1 - 0.3 * 0.01), RTOL_F32, 0.0)
    assert_close("decay vs ref", d.copy_to_host(), ref, RTOL_KERNEL_VS_REF, 0.0)


def test_clip_value_kernel(rng):
    g = 3 * randn(rng, 65)
    hyper, at = tail_vector(rng, 0.01, None, 0.5)
    d = cuda.to_device(g)
    gt.clip_value(d, cuda.to_device(hyper), at)
    np.testing.assert_array_equal(d.copy_to_host(), np.clip(g, -0.5, 0.5))
    assert (np.abs(g) > 0.5).any(), "the test clips nothing"


@pytest.mark.parametrize("global_norm", [False, True])
def test_clip_norm_kernel(rng, global_norm):
    sizes = [7, 1, 70, 33, 0 + 3]                          # segments under, over and around a block
    g = randn(rng, sum(sizes))
    g[7] = 0.0                                             # a variable whose gradient is all zeros
    starts = gt.segment_starts(sizes)                      # (6,) int64
    c = 1.5
    hyper, at = tail_vector(rng, 0.01, None, c)
    d_g = cuda.to_device(g)
    d_sq = cuda.to_device(np.full(len(sizes), np.nan, np.float32))        # poisoned
    gt.clip_norm(d_g, cuda.to_device(starts), d_sq, cuda.to_device(hyper), at, global_norm)
    want = g.astype(np.float64)
    segs = [want[starts[s]:starts[s + 1]] for s in range(len(sizes))]
    if global_norm:
        n = math.sqrt(sum(float(np.sum(s * s)) for s in segs))
        want = want * (c * min(1 / n, 1 / c))
    else:
        want = np.concatenate([s * c / max(math.sqrt(float(np.sum(s * s))), c) for s in segs])
    assert not np.allclose(want, g), "the test clips nothing"
    assert_close(f"clip_norm global={global_norm}", d_g.copy_to_host(), want, RTOL_F32, ATOL_F32)
    ref_g, ref_sq = g.copy(), np.empty(len(sizes), np.float32)
    gt.segment_sum_squares_ref(ref_g, starts, ref_sq)
    gt.clip_norm_ref(ref_g, starts, ref_sq, hyper, at, global_norm)
    assert_close("sum of squares vs ref", d_sq.copy_to_host(), ref_sq, RTOL_KERNEL_VS_REF, 0.0)
    assert_close("clip_norm vs ref", d_g.copy_to_host(), ref_g, RTOL_KERNEL_VS_REF, ATOL_F32)


def test_bad_input_raises_before_launch(forbid_launches):
    forbid_launches(om)
    forbid_launches(gt)
    w, g, v = device_zeros(10), device_zeros(10), device_zeros(10)
    with pytest.raises(ValueError, match="hyper has 2 scalars, expected 5"):
        om.rmsprop(w, g, v, None, None, cuda.to_device(om.adagrad_scalars(0.1)))
    with pytest.raises(ValueError, match="shape"):
        om.adagrad(w, device_zeros(11), v, cuda.to_device(om.adagrad_scalars(0.1)))
    with pytest.raises(ValueError, match="shares memory"):
        om.adagrad(w, g, w, cuda.to_device(om.adagrad_scalars(0.1)))
    with pytest.raises(ValueError, match="offset 1 do not fit"):
        gt.decay(w, cuda.to_device(np.zeros(3, np.float32)), 1)
    with pytest.raises(ValueError, match="shape"):
        gt.clip_norm(g, cuda.to_device(np.zeros(3, np.int64)), device_zeros(3), cuda.to_device(
            np.zeros(3, np.float32)), 0, False)
