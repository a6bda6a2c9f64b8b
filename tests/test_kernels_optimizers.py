"""Optimizer kernels (kernels/optimizers.py) against float64 oracles of Keras's formulas.

Several steps in a row (so velocity/m/v carry over), buffers of awkward sizes and any
shape (1, 33, 1000, (7, 9), (2, 3, 5)), the float32 reference against the kernel, and
bad input raising before any launch.
"""
import math

import numpy as np
import pytest
from numba import cuda

import kernels.optimizers as opt
from conftest import assert_close, device_zeros

#: A float32 update against the float64 oracle after STEPS steps: each step rounds a few
#: times at ~6e-8 relative; 1e-5 of the value's magnitude (or of 1e-3, the typical size
#: of one update) leaves room without hiding a wrong formula (those err by >1e-3).
RTOL_F32 = 1e-5
ATOL_F32 = 1e-8
#: Kernel against the float32 reference: same float32 scalars, same order of operations;
#: only NVVM's fused multiply-adds may change the last bit or two.
RTOL_KERNEL_VS_REF = 1e-6
#: The float64 references against the float64 oracles.
RTOL_F64 = 1e-12
STEPS = 3
SHAPES = [(1,), (33,), (1000,), (7, 9), (2, 3, 5)]




# --- float64 oracles, straight from the Keras source, one element at a time -----------

def oracle_sgd(w, g, vel, lr, momentum, nesterov):
    w, vel = w.astype(np.float64), vel.astype(np.float64)
    for i in np.ndindex(w.shape):
        if momentum:
            vel[i] = momentum * vel[i] - lr * g[i]
            w[i] += momentum * vel[i] - lr * g[i] if nesterov else vel[i]
        else:
            w[i] -= lr * g[i]
    return w, vel


def oracle_adam(w, g, m, v, lr, t, b1=0.9, b2=0.999, eps=1e-7):
    w, m, v = (a.astype(np.float64) for a in (w, m, v))
    alpha = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    for i in np.ndindex(w.shape):
        m[i] += (g[i] - m[i]) * (1 - b1)
        v[i] += (g[i] ** 2 - v[i]) * (1 - b2)
        w[i] -= alpha * m[i] / (math.sqrt(v[i]) + eps)
    return w, m, v


def randn(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_sgd_kernel(rng, shape, momentum, nesterov):
    lr = 0.01
    w, vel = randn(rng, shape), np.zeros(shape, np.float32)
    d_w, d_v = cuda.to_device(w), cuda.to_device(vel)
    w_ref, v_ref = w.copy(), vel.copy()
    want_w, want_v = w.astype(np.float64), vel.astype(np.float64)
    for _ in range(STEPS):
        g = randn(rng, shape)
        hyper = opt.sgd_scalars(lr, momentum)                   # (2,) float32
        opt.sgd(d_w, cuda.to_device(g), d_v if momentum else None, cuda.to_device(hyper), nesterov)
        opt.sgd_ref(w_ref, g, v_ref if momentum else None, hyper, nesterov)
        want_w, want_v = oracle_sgd(want_w, g, want_v, lr, momentum, nesterov)
    name = f"sgd momentum={momentum} nesterov={nesterov} {shape}"
    assert_close(name + " w", d_w.copy_to_host(), want_w, RTOL_F32, ATOL_F32)
    assert_close(name + " w vs ref", d_w.copy_to_host(), w_ref, RTOL_KERNEL_VS_REF, ATOL_F32)
    if momentum:
        assert_close(name + " velocity", d_v.copy_to_host(), want_v, RTOL_F32, ATOL_F32)


@pytest.mark.parametrize("shape", SHAPES)
def test_adam_kernel(rng, shape):
    lr = 1e-3
    w, m, v = randn(rng, shape), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    dev = [cuda.to_device(a) for a in (w, m, v)]
    ref = [a.copy() for a in (w, m, v)]
    want = [a.astype(np.float64) for a in (w, m, v)]
    # m is a running mean of gradients of both signs: it can cancel to almost 0 while
    # its float32 rounding error stays at the size of its terms. So m's errors are
    # measured against m_terms = the same running mean of |g| (w and v do not cancel).
    m_terms = np.zeros(shape)
    for t in range(1, STEPS + 1):
        g = randn(rng, shape)
        hyper = opt.adam_scalars(lr, t)                         # (4,) float32 for step t
        opt.adam(dev[0], cuda.to_device(g), dev[1], dev[2], cuda.to_device(hyper))
        opt.adam_ref(ref[0], g, ref[1], ref[2], hyper)
        want = list(oracle_adam(*want[:1], g, *want[1:], lr, t))
        m_terms = 0.9 * m_terms + 0.1 * np.abs(g)
    for name, d, r, o in zip("wmv", dev, ref, want):
        scale = m_terms if name == "m" else 0.0
        assert_close(f"adam {name} {shape}", d.copy_to_host(), o, RTOL_F32,
                     ATOL_F32 + RTOL_F32 * scale)
        assert_close(f"adam {name} vs ref {shape}", d.copy_to_host(), r, RTOL_KERNEL_VS_REF,
                     ATOL_F32 + RTOL_KERNEL_VS_REF * scale)


def test_refs_in_float64_match_oracles(rng):
    shape = (7, 9)
    for momentum, nesterov in [(0.0, False), (0.5, False), (0.5, True)]:
        w, vel = rng.standard_normal(shape), rng.standard_normal(shape)
        g = rng.standard_normal(shape)
        want_w, want_v = oracle_sgd(w, g, vel, 0.1, momentum, nesterov)
        opt.sgd_ref(w, g, vel if momentum else None, opt.sgd_scalars(0.1, momentum, np.float64), nesterov)
        assert_close("sgd_ref w", w, want_w, RTOL_F64, 0.0)
        if momentum:
            assert_close("sgd_ref velocity", vel, want_v, RTOL_F64, 0.0)
    w, m, v = rng.standard_normal(shape), rng.standard_normal(shape), rng.random(shape)
    g = rng.standard_normal(shape)
    want = oracle_adam(w, g, m, v, 0.01, 4, 0.8, 0.99, 1e-7)
    opt.adam_ref(w, g, m, v, opt.adam_scalars(0.01, 4, 0.8, 0.99, 1e-7, np.float64))
    for name, got, o in zip("wmv", (w, m, v), want):
        assert_close(f"adam_ref {name}", got, o, RTOL_F64, 0.0)


def test_adam_alpha_is_rounded_once_to_float32():
    hyper = opt.adam_scalars(1e-3, 1)
    assert hyper.dtype == np.float32 and hyper.shape == (opt.ADAM_HYPER_SIZE,)
    assert hyper[opt.ADAM_ALPHA] == np.float32(1e-3 * math.sqrt(1 - 0.999) / (1 - 0.9))
    assert hyper[opt.ADAM_EPSILON] == np.float32(1e-7)
    with pytest.raises(ValueError, match="step"):
        opt.adam_scalars(1e-3, 0)


def test_kernels_read_the_hyper_vector_at_run_time(rng):
    """Two launches with the SAME arguments but new numbers written into the hyper
    buffer in between update with the new numbers (what a replayed CUDA graph relies on)."""
    w = randn(rng, (33,))
    g = randn(rng, (33,))
    d_w, d_g = cuda.to_device(w), cuda.to_device(g)
    d_hyper = cuda.to_device(opt.sgd_scalars(0.5, 0.0))
    opt.sgd(d_w, d_g, None, d_hyper)
    d_hyper.copy_to_device(opt.sgd_scalars(0.25, 0.0))
    opt.sgd(d_w, d_g, None, d_hyper)
    assert_close("sgd after lr 0.5 then 0.25", d_w.copy_to_host(), w - 0.75 * g.astype(np.float64),
                 RTOL_F32, ATOL_F32)


# --- bad input ---------------------------------------------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(opt)


_dev = device_zeros


def test_bad_input_raises_before_launch(no_launch):
    w, g, a, b = _dev(10), _dev(10), _dev(10), _dev(10)
    h2, h4 = cuda.to_device(opt.sgd_scalars(0.1, 0.9)), cuda.to_device(opt.adam_scalars(1e-3, 1))
    with pytest.raises(TypeError, match="float32"):
        opt.sgd(_dev(10, np.float64), g, a, h2)
    with pytest.raises(ValueError, match="shape"):
        opt.sgd(w, _dev(11), a, h2)
    with pytest.raises(ValueError, match="hyper"):
        opt.adam(w, g, a, b, h2)               # SGD's (shorter) vector handed to Adam (a longer one
                                               # may carry gradient_transforms.py's tail)
    with pytest.raises(TypeError, match="hyper"):
        opt.adam(w, g, a, b, cuda.to_device(opt.adam_scalars(1e-3, 1, dtype=np.float64)))
    with pytest.raises(ValueError, match="C-contiguous"):
        opt.adam(_dev(20)[::2], g, a, b, h4)
    with pytest.raises(ValueError, match="shares memory"):
        opt.adam(w, g, a, a, h4)               # m and v in one buffer
    with pytest.raises(ValueError, match="shares memory"):
        opt.sgd(w, w, a, h2)                   # gradient buffer is the weights
