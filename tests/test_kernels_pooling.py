"""MaxPooling2D kernels (kernels/pooling.py) against independent float64 oracles.

The oracle is a plain loop over every window, picking the first maximum in row-major
order (the first NaN when there is one), as TensorFlow's CPU kernel does. Inputs are
drawn from a few small integers so that ties are everywhere (MNIST's blank background),
with NaNs sprinkled in; shapes are odd, batch 1, stride 2, "same", overlapping windows.

    python -m pytest -q tests/test_kernels_pooling.py     # CUDA simulator: a few seconds
"""
import numpy as np
import pytest
from numba import cuda

import kernels.pooling as pool
from conftest import assert_close, device_zeros, poisoned

#: Backward sums: at most a few dy values per input (overlapping windows), added in
#: float32 in another order than the oracle's: each rounding is within 2^-24 of the
#: partial sum, so the error is bounded relative to sum |dy|, not to the (possibly
#: cancelling) result.
SUM_F32_REL = 1e-6

#: (x shape, pool_size, strides, padding)
CASES = [
    ((2, 5, 5, 3), 2, None, "valid"),         # odd size: the last row and column are dropped
    ((1, 7, 7, 1), 2, None, "same"),          # batch 1, one channel, "same" pads bottom/right
    ((1, 6, 7, 2), 3, 2, "same"),             # overlapping windows, stride 2
    ((2, 5, 4, 1), (2, 3), (1, 2), "valid"),  # non-square pool, overlapping rows
]


# --- float64 oracles: loops ----------------------------------------------------------------

def oracle_windows(x_shape, pool_size, strides, padding):
    """Yield (n, oh, ow, [(k, ih, iw), ...]) for every window: its positions inside x."""
    b, h, w, _ = x_shape
    ph, pw = (pool_size, pool_size) if isinstance(pool_size, int) else pool_size
    strides = (ph, pw) if strides is None else strides
    sh, sw = (strides, strides) if isinstance(strides, int) else strides
    if padding == "valid":
        out_h, out_w, pt, pl = (h - ph) // sh + 1, (w - pw) // sw + 1, 0, 0
    else:
        out_h, out_w = -(-h // sh), -(-w // sw)
        pt = max((out_h - 1) * sh + ph - h, 0) // 2
        pl = max((out_w - 1) * sw + pw - w, 0) // 2
    for n in range(b):
        for oh in range(out_h):
            for ow in range(out_w):
                cells = [(a * pw + bb, oh * sh - pt + a, ow * sw - pl + bb)
                         for a in range(ph) for bb in range(pw)]
                yield n, oh, ow, [(k, i, j) for k, i, j in cells if 0 <= i < h and 0 <= j < w]


def oracle_forward(x, pool_size, strides, padding):
    windows = list(oracle_windows(x.shape, pool_size, strides, padding))
    out_h = 1 + max(oh for _, oh, _, _ in windows)
    out_w = 1 + max(ow for _, _, ow, _ in windows)
    out = np.empty((x.shape[0], out_h, out_w, x.shape[3]))
    arg = np.empty(out.shape, np.int64)
    for n, oh, ow, cells in windows:
        for c in range(x.shape[3]):
            values = [(k, float(x[n, i, j, c])) for k, i, j in cells]
            nans = [k for k, v in values if np.isnan(v)]
            if nans:
                out[n, oh, ow, c], arg[n, oh, ow, c] = np.nan, nans[0]
            else:
                top = max(v for _, v in values)
                out[n, oh, ow, c] = top
                arg[n, oh, ow, c] = next(k for k, v in values if v == top)   # the first one
    return out, arg


def oracle_backward(dy, arg, x_shape, pool_size, strides, padding):
    dx = np.zeros(x_shape)
    for n, oh, ow, cells in oracle_windows(x_shape, pool_size, strides, padding):
        for c in range(x_shape[3]):
            for k, i, j in cells:
                if k == arg[n, oh, ow, c]:
                    dx[n, i, j, c] += float(dy[n, oh, ow, c])
    return dx


def tied_input(rng, shape, nans=0):
    """Values from {0, 0, 0, 1, 2}: many ties, as on MNIST's blank background."""
    x = rng.choice(np.array([0, 0, 0, 1, 2], np.float32), size=shape)
    if nans:
        x.reshape(-1)[rng.choice(x.size, nans, replace=False)] = np.nan
    return x


# --- kernels ---------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape,pool_size,strides,padding", CASES)
@pytest.mark.parametrize("nans", [0, 3])
def test_forward_and_backward(rng, x_shape, pool_size, strides, padding, nans):
    x = tied_input(rng, x_shape, nans)
    want_out, want_arg = oracle_forward(x, pool_size, strides, padding)
    out, arg = poisoned(want_out.shape), poisoned(want_out.shape, np.int32)
    pool.max_pool(cuda.to_device(x), out, arg, pool_size, strides, padding)
    got_out, got_arg = out.copy_to_host(), arg.copy_to_host()
    where = f"{x_shape} pool={pool_size} strides={strides} {padding} nans={nans}"
    assert np.array_equal(got_out, want_out, equal_nan=True), f"max_pool out differs: {where}"
    assert np.array_equal(got_arg, want_arg), f"max_pool arg-max differs (first max?): {where}"
    dy = rng.standard_normal(want_out.shape).astype(np.float32)
    want_dx = oracle_backward(dy, want_arg, x_shape, pool_size, strides, padding)
    scale = oracle_backward(np.abs(dy), want_arg, x_shape, pool_size, strides, padding)
    dx = poisoned(x_shape)
    pool.max_pool_backward(cuda.to_device(dy), arg, dx, pool_size, strides, padding)
    assert_close(f"max_pool_backward {where}", dx.copy_to_host(), want_dx, rtol=0.0,
                 atol=SUM_F32_REL * float(scale.max()))


def test_dropped_row_and_column_get_zero_gradient(rng):
    x = rng.standard_normal((1, 5, 5, 2)).astype(np.float32)
    x[0, 4, :, :] = x[0, :, 4, :] = 100.0      # the largest values, but in no window
    out, arg = poisoned((1, 2, 2, 2)), poisoned((1, 2, 2, 2), np.int32)
    pool.max_pool(cuda.to_device(x), out, arg)
    assert out.copy_to_host().max() < 100.0
    dx = poisoned((1, 5, 5, 2))
    pool.max_pool_backward(cuda.to_device(np.ones((1, 2, 2, 2), np.float32)), arg, dx)
    dx = dx.copy_to_host()
    assert not dx[0, 4].any() and not dx[0, :, 4].any()
    assert dx.sum() == 8.0                      # each window's gradient lands once


def test_all_equal_window_sends_gradient_to_its_first_position():
    x = np.zeros((1, 4, 4, 1), np.float32)      # a blank patch: every window ties
    out, arg = poisoned((1, 2, 2, 1)), poisoned((1, 2, 2, 1), np.int32)
    pool.max_pool(cuda.to_device(x), out, arg)
    assert not arg.copy_to_host().any()          # position 0: top-left of each window
    dx = poisoned((1, 4, 4, 1))
    pool.max_pool_backward(cuda.to_device(np.ones((1, 2, 2, 1), np.float32)), arg, dx)
    assert dx.copy_to_host()[0, ::2, ::2, 0].tolist() == [[1, 1], [1, 1]]
    assert dx.copy_to_host().sum() == 4


# --- references ------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape,pool_size,strides,padding", CASES)
def test_references_match_oracles(rng, x_shape, pool_size, strides, padding):
    for x in (tied_input(rng, x_shape, 3).astype(np.float64),
              rng.standard_normal(x_shape) - 10.0):            # all negative: padding is no 0
        want_out, want_arg = oracle_forward(x, pool_size, strides, padding)
        out, arg = pool.max_pool_ref(x, pool_size, strides, padding)
        assert np.array_equal(out, want_out, equal_nan=True)
        assert np.array_equal(arg, want_arg) and arg.dtype == np.int32
        dy = rng.standard_normal(out.shape)
        assert_close("max_pool_backward_ref",
                     pool.max_pool_backward_ref(dy, arg, x_shape, pool_size, strides, padding),
                     oracle_backward(dy, arg, x_shape, pool_size, strides, padding), 1e-12,
                     atol=1e-12)             # overlapping windows: sums that may cancel


# --- bad input --------------------------------------------------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(pool)


def test_bad_input_raises_before_launch(no_launch):
    x = device_zeros((2, 5, 5, 3))
    out, arg = device_zeros((2, 2, 2, 3)), device_zeros((2, 2, 2, 3), np.int32)
    with pytest.raises(ValueError, match=r"pool is 6 along height but the input is only 5"):
        pool.max_pool(x, out, arg, pool_size=6)
    with pytest.raises(ValueError, match=r"4-D \(batch, height, width, channels\).*channel axis"):
        pool.max_pool(device_zeros((2, 5, 5)), out, arg)
    with pytest.raises(ValueError, match="pool_size must be a positive integer"):
        pool.max_pool(x, out, arg, pool_size=0)
    with pytest.raises(ValueError, match="strides must be a positive integer"):
        pool.max_pool(x, out, arg, strides=(2, -1))
    with pytest.raises(ValueError, match="padding must be 'valid' or 'same'"):
        pool.max_pool(x, out, arg, padding="causal")
    with pytest.raises(ValueError, match=r"out has shape \(2, 2, 2, 3\), expected \(2, 3, 3, 3\)"):
        pool.max_pool(x, out, arg, padding="same")
    with pytest.raises(TypeError, match="int32"):
        pool.max_pool(x, out, device_zeros((2, 2, 2, 3)))
    with pytest.raises(ValueError, match=r"dy has shape \(2, 2, 2, 2\), expected \(2, 2, 2, 3\)"):
        pool.max_pool_backward(device_zeros((2, 2, 2, 2)), arg, x)
    buf = device_zeros(150)
    with pytest.raises(ValueError, match="shares memory"):      # dx over dy
        pool.max_pool_backward(buf[:24].reshape(2, 2, 2, 3), arg, buf.reshape(2, 5, 5, 3))
