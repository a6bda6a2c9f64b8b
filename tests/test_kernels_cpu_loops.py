"""The CPU backend's compiled loops (kernels/cpu_loops.py) against the NumPy references.

Each loop must compute what its reference does (kernels/conv2d.py, pooling.py,
activations.py): bitwise where the same operations run in the same order
(pooling forward with ties and NaN, pooling backward without overlap, the ReLU backward),
to float32 rounding where a sum runs in another order (the conv's gradients).
Outputs are poisoned with NaN first, so an element a loop forgets to write shows up.
Shapes are small and awkward: odd sizes, batch 1, strides, "same" padding, overlap.

    python -m pytest -q tests/test_kernels_cpu_loops.py
"""
import numpy as np
import pytest

from conftest import poisoned_host
from kernels import activations, conv2d, cpu_loops, pooling

RTOL = 2e-6            # float32 sums of up to ~100 terms in another order
CONV_CASES = [((1, 5, 5, 1), (3, 3, 1, 4), 1, "valid"),
              ((2, 7, 9, 2), (3, 2, 2, 5), (2, 1), "same"),
              ((3, 6, 7, 3), (2, 3, 3, 4), 2, "same"),
              ((2, 5, 5, 3), (5, 5, 3, 2), 1, "valid"),
              ((2, 8, 6, 1), (3, 3, 1, 32), 1, "valid")]     # the lab's layer, small
POOL_CASES = [((2, 6, 6, 3), 2, None, "valid"),
              ((1, 7, 5, 2), 2, None, "valid"),               # odd: the last row/column dropped
              ((2, 7, 9, 4), (3, 2), (2, 1), "same"),          # overlapping windows
              ((2, 6, 7, 3), 3, 2, "same"),
              ((3, 5, 5, 1), 2, 3, "valid")]                  # strides > pool: inputs in no window


def assert_close(got, want, what):
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert np.all(np.isfinite(got)), f"{what}: unwritten or non-finite elements"
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:.0e}"


@pytest.mark.parametrize("x_shape, k_shape, strides, padding", CONV_CASES)
@pytest.mark.parametrize("relu", [False, True])
def test_conv2d_forward_is_the_reference(rng, x_shape, k_shape, strides, padding, relu):
    x = rng.standard_normal(x_shape, dtype=np.float32)
    k = rng.standard_normal(k_shape, dtype=np.float32)
    bias = rng.standard_normal(k_shape[3], dtype=np.float32)
    want = conv2d.conv2d_ref(x, k, bias, strides, padding, relu)
    out = poisoned_host(want.shape)
    cols = poisoned_host(cpu_loops.cols_shape(x_shape, k_shape, strides, padding))
    cpu_loops.conv2d_forward(x, k, bias, out, strides, padding, relu, cols)
    assert_close(out, want, "conv2d_forward")
    np.testing.assert_array_equal(cols, conv2d.im2col_ref(x, k_shape[:2], strides, padding))
    if relu:
        assert (out >= 0).all()
        np.testing.assert_array_equal(out == 0, want == 0)       # the same outputs clipped
    out2 = poisoned_host(want.shape)                       # no bias, no cols buffer given
    cpu_loops.conv2d_forward(x, k, None, out2, strides, padding, relu)
    assert_close(out2, conv2d.conv2d_ref(x, k, None, strides, padding, relu), "conv2d_forward (no bias)")


@pytest.mark.parametrize("x_shape, k_shape, strides, padding", CONV_CASES)
def test_conv2d_backward_is_the_reference(rng, x_shape, k_shape, strides, padding):
    x = rng.standard_normal(x_shape, dtype=np.float32)
    k = rng.standard_normal(k_shape, dtype=np.float32)
    y_shape = conv2d.conv2d_output_shape(x_shape, k_shape, strides, padding)
    dy = rng.standard_normal(y_shape, dtype=np.float32)
    want_dx, want_dw, want_db = conv2d.conv2d_backward_ref(x, k, dy, strides, padding)
    dx, dw, db = poisoned_host(x_shape), poisoned_host(k_shape), poisoned_host(k_shape[3])
    cpu_loops.conv2d_backward(x, k, dy, dx, dw, db, strides, padding)
    assert_close(dx, want_dx, "dx")
    assert_close(dw, want_dw, "dW")
    assert_close(db, want_db, "db")
    # A first layer: no dx asked, none computed; no bias: db left alone.
    dw2 = poisoned_host(k_shape)
    assert cpu_loops.conv2d_backward(x, k, dy, None, dw2, None, strides, padding)[0] is None
    np.testing.assert_array_equal(dw2, dw)


@pytest.mark.parametrize("x_shape, pool_size, strides, padding", POOL_CASES)
def test_max_pool_is_the_reference_bitwise_with_ties_and_nan(rng, x_shape, pool_size, strides, padding):
    x = rng.integers(-2, 3, x_shape).astype(np.float32)       # many ties, as MNIST's zeros
    x.reshape(-1)[rng.choice(x.size, max(1, x.size // 25), replace=False)] = np.nan
    want_out, want_arg = pooling.max_pool_ref(x, pool_size, strides, padding)
    out, arg = poisoned_host(want_out.shape), poisoned_host(want_arg.shape, np.int32)
    cpu_loops.max_pool_forward(x, out, arg, pool_size, strides, padding)
    np.testing.assert_array_equal(out, want_out)               # NaN where the reference has NaN
    np.testing.assert_array_equal(arg, want_arg)               # the FIRST maximum (or NaN)

    dy = rng.standard_normal(want_out.shape, dtype=np.float32)
    want_dx = pooling.max_pool_backward_ref(dy, want_arg, x_shape, pool_size, strides, padding)
    dx = poisoned_host(x_shape)
    cpu_loops.max_pool_backward(dy, arg, dx, pool_size, strides, padding)
    ph, pw = (pool_size, pool_size) if isinstance(pool_size, int) else pool_size
    sh, sw = (ph, pw) if strides is None else ((strides, strides) if isinstance(strides, int) else strides)
    if sh >= ph and sw >= pw:                                   # no overlap: one term per input
        np.testing.assert_array_equal(dx, want_dx)
    else:
        assert_close(dx, want_dx, "max_pool_backward (overlapping windows)")


def test_relu_backward_is_the_reference_bitwise_in_place_or_not(rng):
    y = rng.standard_normal((3, 5, 4, 7), dtype=np.float32)
    y[0, 0, 0, :3] = (0.0, np.nan, -0.0)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    want = activations.relu_backward_ref(dy, y)
    out = poisoned_host(y.shape)
    np.testing.assert_array_equal(cpu_loops.relu_backward(dy, y, out), want)
    d = dy.copy()
    cpu_loops.relu_backward(d, y, d)                              # the layers' in-place use
    np.testing.assert_array_equal(d, want)
    yy = y.copy()
    cpu_loops.relu_backward(dy, yy, yy)                           # into y: the reference's path
    np.testing.assert_array_equal(yy, want)


def test_wrong_output_shapes_are_refused(rng):
    x = rng.standard_normal((1, 5, 5, 1), dtype=np.float32)
    k = rng.standard_normal((3, 3, 1, 2), dtype=np.float32)
    with pytest.raises(ValueError, match=r"conv2d_forward: expected a float32 array of shape \(1, 3, 3, 2\)"):
        cpu_loops.conv2d_forward(x, k, None, np.empty((1, 3, 3, 3), np.float32))
    with pytest.raises(ValueError, match="max_pool_forward: arg must be int32"):
        cpu_loops.max_pool_forward(x, np.empty((1, 2, 2, 1), np.float32), np.empty((1, 2, 2, 1), np.int64))
