"""Activation kernels (kernels/activations.py) against independent float64 oracles.

Awkward (B, N): batch of 1, widths 1, 17, 31, 33, 65; outputs poisoned with NaN before
every launch; in-place use; bad input raising before any launch.
"""
import numpy as np
import pytest
from numba import cuda

import kernels.activations as act
from conftest import assert_close, device_zeros, poisoned

#: float32 elementwise results: one rounding of x + bias, so 2**-24 relative; 1e-6
#: allows a couple of roundings.
RTOL_ELEMENTWISE_F32 = 1e-6
#: float32 softmax: exp and a C-term sum, a few ulps; 1e-5 with C <= 65.
RTOL_SOFTMAX_F32 = 1e-5
#: The float64 references against the float64 oracles.
RTOL_F64 = 1e-12

#: (B, N): a batch of 1, widths that are not multiples of anything, and a block's
#: worth of elements plus change (17 * 65 = 1105 > 1024 threads of the simulated grid).
SHAPES = [(1, 1), (1, 65), (17, 31), (33, 17), (17, 65)]






# --- float64 oracles, written as plain loops over rows -------------------------------

def oracle_bias_relu(x, bias):
    return np.array([[max(float(x[i, j]) + float(bias[j]), 0.0) for j in range(x.shape[1])]
                     for i in range(x.shape[0])])


def oracle_softmax(x):
    out = np.empty(x.shape)
    for i, row in enumerate(x.astype(np.float64)):
        e = np.exp(row - row.max())
        out[i] = e / e.sum()
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_bias_relu_and_bias_add(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    bias = rng.standard_normal(shape[1]).astype(np.float32)
    want_relu = oracle_bias_relu(x, bias)
    want_add = x.astype(np.float64) + bias
    out = poisoned(shape)
    act.bias_relu(cuda.to_device(x), cuda.to_device(bias), out)
    assert_close(f"bias_relu {shape}", out.copy_to_host(), want_relu, RTOL_ELEMENTWISE_F32)
    out = poisoned(shape)
    act.bias_add(cuda.to_device(x), cuda.to_device(bias), out)
    assert_close(f"bias_add {shape}", out.copy_to_host(), want_add, RTOL_ELEMENTWISE_F32)
    # In place: out is x.
    d_x = cuda.to_device(x)
    act.bias_relu(d_x, cuda.to_device(bias), d_x)
    assert_close(f"bias_relu in place {shape}", d_x.copy_to_host(), want_relu,
                 RTOL_ELEMENTWISE_F32)


@pytest.mark.parametrize("shape", SHAPES)
def test_relu_backward(rng, shape):
    y = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)  # ReLU output
    dy = rng.standard_normal(shape).astype(np.float32)
    want = np.where(y.astype(np.float64) > 0, dy.astype(np.float64), 0.0)
    out = poisoned(shape)
    act.relu_backward(cuda.to_device(dy), cuda.to_device(y), out)
    assert np.array_equal(out.copy_to_host(), want.astype(np.float32)), "relu_backward differs"
    d_dy = cuda.to_device(dy)
    act.relu_backward(d_dy, cuda.to_device(y), d_dy)  # in place over dy
    assert np.array_equal(d_dy.copy_to_host(), want.astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES + [(3, 10)])
def test_softmax(rng, shape):
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    x[0, 0] = 80.0  # exp(80) overflows float32 without the max subtraction
    want = oracle_softmax(x)
    out = poisoned(shape)
    act.softmax(cuda.to_device(x), out)
    assert_close(f"softmax {shape}", out.copy_to_host(), want, RTOL_SOFTMAX_F32, atol=1e-30)
    d_x = cuda.to_device(x)
    act.softmax(d_x, d_x)  # in place
    assert_close(f"softmax in place {shape}", d_x.copy_to_host(), want, RTOL_SOFTMAX_F32,
                 atol=1e-30)


# --- references -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,rtol", [(np.float64, RTOL_F64), (np.float32, RTOL_SOFTMAX_F32)])
def test_refs_match_oracles(rng, dtype, rtol):
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(dtype)
        bias = rng.standard_normal(shape[1]).astype(dtype)
        assert_close("bias_relu_ref", act.bias_relu_ref(x, bias), oracle_bias_relu(x, bias), rtol)
        assert_close("bias_add_ref", act.bias_add_ref(x, bias), x.astype(np.float64) + bias, rtol)
        out = np.full(shape, np.nan, dtype)
        assert act.bias_relu_ref(x, bias, out) is out
        assert_close("bias_relu_ref out=", out, oracle_bias_relu(x, bias), rtol)
        assert_close("softmax_ref", act.softmax_ref(x), oracle_softmax(x), rtol, atol=1e-300)
        y = np.maximum(x, 0)
        dy = rng.standard_normal(shape).astype(dtype)
        want = np.where(y > 0, dy, 0.0)
        assert np.array_equal(act.relu_backward_ref(dy, y), want)
        assert np.array_equal(act.relu_backward_ref(dy, y, out=y), want)  # out may be y
        x_copy = x.copy()
        act.softmax_ref(x_copy, out=x_copy)
        assert_close("softmax_ref in place", x_copy, oracle_softmax(x), rtol, atol=1e-300)


# --- bad input ---------------------------------------------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(act)


_dev = device_zeros


def test_bad_input_raises_before_launch(no_launch):
    x, b, out = _dev((4, 6)), _dev((6,)), _dev((4, 6))
    with pytest.raises(TypeError, match="float32"):
        act.bias_relu(_dev((4, 6), np.float64), b, out)
    with pytest.raises(ValueError, match=r"expected \(6,\)"):
        act.bias_relu(x, _dev((5,)), out)
    with pytest.raises(ValueError, match="shape"):
        act.bias_add(x, b, _dev((6, 4)))
    with pytest.raises(ValueError, match="C-contiguous"):
        act.bias_add(_dev((4, 12))[:, ::2], b, out)
    buf = _dev((5, 6))
    with pytest.raises(ValueError, match="shares memory"):  # out one row into x
        act.bias_relu(buf[0:4], b, buf[1:5])
    with pytest.raises(ValueError, match="shares memory"):  # out over the bias
        flat = _dev((24,))
        act.bias_add(x, flat[0:6], flat.reshape(4, 6))
    with pytest.raises(ValueError, match="shape"):
        act.relu_backward(x, _dev((4, 5)), out)
    with pytest.raises(ValueError, match="2-D"):
        act.softmax(_dev((6,)), _dev((6,)))
