"""The kernels compiled per layer shape against float64 oracles, in the CUDA simulator:
conv2d v3 forward, the fused conv + bias + ReLU + 2x2 max-pool (kernels/conv2d_v3.py),
dW + db and dX v2 (kernels/conv2d_grad.py), max-pool backward v2 with the ReLU mask
(kernels/pooling.py); and v2's grid, with the launch stubbed.

The oracles are tests/test_kernels_conv2d.py's and tests/test_kernels_pooling.py's loops
(TensorFlow's padding rule written out there, not imported from the library). Shapes are
the lab's (1 -> 32 channels, 3x3) and the tutorials' second conv (32 -> 64; narrowed to
16 -> 32 for the backward), on tiny images: the simulator runs a Python thread per CUDA thread. Outputs are poisoned first.

    python -m pytest -q tests/test_kernels_conv_v3.py
"""
import numpy as np
import pytest
from numba import cuda

import kernels.conv2d as conv
import kernels.conv2d_grad as grad
import kernels.conv2d_v3 as v3
import kernels.pooling as pooling
from conftest import assert_close, poisoned
from test_kernels_conv2d import check_sum, make_case, oracle_backward, oracle_forward
from test_kernels_pooling import oracle_backward as pool_oracle_backward
from test_kernels_pooling import oracle_forward as pool_oracle_forward

#: (x shape, kernel shape, strides, padding): the lab's layer and the tutorials' second,
#: strides 1 and 2, 'valid' and 'same', odd sizes, Cout not a multiple of the 32 lanes.
CASES = [
    ((2, 7, 9, 1), (3, 3, 1, 32), 1, "valid"),      # the lab's 1 -> 32, 3x3
    ((1, 7, 9, 1), (3, 3, 1, 32), 2, "same"),       # stride 2, odd total padding
    ((1, 4, 4, 16), (3, 3, 16, 32), 1, "valid"),    # the tutorials' second conv, narrowed: 4 channel chunks
    ((1, 5, 5, 3), (3, 3, 3, 33), (2, 1), "same"),  # 33 out channels: a second lane block
    ((2, 4, 5, 2), (2, 3, 2, 5), 1, "same"),        # even kernel height
]
#: The forward kernels also get the tutorials' layer at full width (32 -> 64: 8 channel
#: chunks, two lane blocks). Its backward, checked above at 16 -> 32, took 80 s in the
#: simulator at full width (dW's cost there goes with Cin x Cout, not with the image).
FORWARD_CASES = CASES + [((1, 5, 6, 32), (3, 3, 32, 64), 1, "valid")]


def device(*arrays):
    return [cuda.to_device(a) for a in arrays]


@pytest.mark.parametrize("x_shape,k_shape,strides,padding", FORWARD_CASES)
def test_forward_v3_matches_the_oracle_and_v1(rng, x_shape, k_shape, strides, padding):
    x, k, bias = make_case(rng, x_shape, k_shape)
    want, scale = oracle_forward(x, k, bias, strides, padding)
    d_x, d_k, d_b = device(x, k, bias)
    for relu in (False, True):
        out = poisoned(want.shape)
        v3.conv2d_v3(d_x, d_k, d_b, out, strides, padding, relu=relu)
        got = out.copy_to_host()
        check_sum(f"v3 relu={relu} {x_shape} {k_shape} s={strides} {padding}", got,
                  np.maximum(want, 0) if relu else want, scale, int(np.prod(k_shape[:3])) + 1)
    if k_shape[2] * 9 <= v3.MAX_TAPS and padding == "valid":   # one chunk, no padding: v1's sum
        ref = poisoned(want.shape)
        conv.conv2d(d_x, d_k, d_b, ref, strides, padding, relu=True, version="v1")
        assert np.array_equal(got, ref.copy_to_host()), "v3 != v1 bitwise"


@pytest.mark.parametrize("x_shape,k_shape,strides,padding", FORWARD_CASES)
def test_fused_conv_relu_pool_matches_conv_then_pool(rng, x_shape, k_shape, strides, padding):
    x, k, bias = make_case(rng, x_shape, k_shape)
    x[0, :2] = -abs(x[0, :2])                    # ReLU zeros in some windows: ties at 0
    want_conv, scale = oracle_forward(x, k, bias, strides, padding)
    y = np.maximum(want_conv, 0)
    want, want_arg = pool_oracle_forward(y, 2, 2, "valid")
    d_x, d_k, d_b = device(x, k, bias)
    out, arg = poisoned(want.shape), cuda.to_device(np.full(want.shape, -7, np.int8))
    v3.conv2d_relu_pool(d_x, d_k, d_b, out, arg, strides, padding)
    got, got_arg = out.copy_to_host(), arg.copy_to_host()
    check_sum(f"fused {x_shape} {k_shape}", got, want, scale[:, :want.shape[1] * 2:2,
                                                              :want.shape[2] * 2:2],
              int(np.prod(k_shape[:3])) + 1)
    # the arg-max is the oracle's wherever the window's maximum is clear of rounding
    conv_out = poisoned(want_conv.shape)
    v3.conv2d_v3(d_x, d_k, d_b, conv_out, strides, padding, relu=True)
    pooled, arg_ref = pooling.max_pool_ref(conv_out.copy_to_host(), 2, 2, "valid")
    assert np.array_equal(got, pooled) and np.array_equal(got_arg, arg_ref), \
        "fused != v3 conv then pool, bitwise"
    assert got_arg.dtype == np.int8 and set(np.unique(got_arg)) <= {0, 1, 2, 3}


def test_fused_ties_and_nan_follow_the_pools_rule():
    """All-negative windows ReLU to four zeros: the arg-max is the first (0); a NaN input
    makes its windows NaN with the NaN's position."""
    x = -np.ones((1, 6, 6, 1), np.float32)
    x[0, 3, 4, 0] = np.nan
    k = np.ones((3, 3, 1, 2), np.float32)
    bias = np.zeros(2, np.float32)
    out, arg = poisoned((1, 2, 2, 2)), cuda.to_device(np.full((1, 2, 2, 2), -7, np.int8))
    v3.conv2d_relu_pool(*device(x, k, bias), out, arg)
    got, got_arg = out.copy_to_host(), arg.copy_to_host()
    want, want_arg = v3.conv2d_relu_pool_ref(x, k, bias)
    assert np.array_equal(got, want, equal_nan=True) and np.array_equal(got_arg, want_arg)
    assert got_arg[0, 0, 0, 0] == 0 and np.isnan(got[0, 1, 1, 0])


@pytest.mark.parametrize("x_shape,k_shape,strides,padding", CASES)
def test_backward_v2_matches_the_oracle(rng, x_shape, k_shape, strides, padding):
    x, k, _ = make_case(rng, x_shape, k_shape)
    out_shape = conv.conv2d_output_shape(x_shape, k_shape, strides, padding)
    dy = rng.standard_normal(out_shape).astype(np.float32)
    want_dx, want_dw, want_db = oracle_backward(x, k, dy, strides, padding)
    scale_dx, scale_dw, scale_db = oracle_backward(abs(x), abs(k), abs(dy), strides, padding)
    dx, dw, db = poisoned(x_shape), poisoned(k_shape), poisoned(k_shape[3:])
    d_x, d_k, d_dy = device(x, k, dy)
    part = cuda.to_device(np.full(grad.partial_shape(x_shape, k_shape, strides, padding),
                                  np.nan, np.float32))
    grad.conv2d_backward_v2(d_x, d_k, d_dy, dx, dw, db, strides, padding, part)
    rows = x_shape[0] * out_shape[1] * out_shape[2]
    check_sum("dx v2", dx.copy_to_host(), want_dx, scale_dx, k_shape[3] * 9)
    check_sum("dw v2", dw.copy_to_host(), want_dw, scale_dw, rows)
    check_sum("db v2", db.copy_to_host(), want_db, scale_db, rows)
    first = (dw.copy_to_host(), db.copy_to_host())
    grad.conv2d_backward_v2(d_x, d_k, d_dy, None, dw, None, strides, padding)  # 1st layer, no bias
    assert np.array_equal(dw.copy_to_host(), first[0]), "dW not bitwise reproducible"


def test_pool_backward_v2_with_and_without_the_relu_mask(rng):
    """Odd sizes (a dropped row and column get 0), the int32 arg of MaxPooling2D and the
    int8 arg of the fused kernel; with the mask, dy counts only where y > 0."""
    x = rng.standard_normal((2, 5, 7, 3)).astype(np.float32)
    x[0, :2] = 0.0                                          # all-zero windows: y == 0 masks
    y, arg = pool_oracle_forward(x, 2, 2, "valid")
    dy = rng.standard_normal(y.shape).astype(np.float32)
    want = pool_oracle_backward(dy, arg, x.shape, 2, 2, "valid")
    d_dy, d_y = device(dy, y.astype(np.float32))
    for arg_dtype in (np.int32, np.int8):
        d_arg = cuda.to_device(arg.astype(arg_dtype))
        dx = poisoned(x.shape)
        pooling.max_pool_backward(d_dy, d_arg, dx, version="v2" if arg_dtype == np.int32 else None,
                                  relu_y=None if arg_dtype == np.int32 else d_y)
        masked = want if arg_dtype == np.int32 else pool_oracle_backward(
            np.where(y > 0, dy, 0), arg, x.shape, 2, 2, "valid")
        assert_close(f"pool backward v2 {np.dtype(arg_dtype)}", dx.copy_to_host(), masked, 0.0)
    assert np.any(want != masked), "the mask changed something"


def test_pool_backward_v2_with_same_padding(rng):
    x = rng.standard_normal((1, 5, 5, 2)).astype(np.float32)
    y, arg = pool_oracle_forward(x, 2, 2, "same")
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = poisoned(x.shape)
    pooling.max_pool_backward(*device(dy, arg.astype(np.int32)), dx, 2, 2, "same", version="v2")
    assert_close("pool backward v2 same", dx.copy_to_host(),
                 pool_oracle_backward(dy, arg, x.shape, 2, 2, "same"), 0.0)


# --- refusals, before any launch ---------------------------------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    return forbid_launches


def test_arrays_of_2_31_elements_are_refused():
    class Big:
        size, shape = 2**31, (2**16, 2**15)
    with pytest.raises(ValueError, match=r"32-bit arithmetic.*2\*\*31"):
        conv.check_size("conv2d", Big())
    conv.check_size("conv2d", np.zeros(3))


def test_bad_input_raises_before_launch(no_launch):
    no_launch(v3)
    no_launch(pooling)
    x, k, b = (cuda.to_device(np.zeros(s, np.float32)) for s in ((1, 6, 6, 1), (3, 3, 1, 4), (4,)))
    with pytest.raises(ValueError, match="has shape"):
        v3.conv2d_v3(x, k, b, poisoned((1, 5, 4, 4)))
    with pytest.raises(TypeError, match="int8"):
        v3.conv2d_relu_pool(x, k, b, poisoned((1, 2, 2, 4)), poisoned((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="more taps"):
        big = cuda.to_device(np.zeros((7, 7, 1, 4), np.float32))
        v3.conv2d_v3(x, big, b, poisoned((1, 0, 0, 4)), padding="same")
    with pytest.raises(ValueError, match="v2 needs strides equal"):
        arg = cuda.to_device(np.zeros((1, 5, 5, 4), np.int32))
        pooling.max_pool_backward(poisoned((1, 5, 5, 4)), arg, poisoned((1, 6, 6, 4)), 2, 1,
                                  version="v2")


# --- grids ---------------------------------------------------------------------------------------

def test_v2_has_one_block_per_tile_and_v3_one_row_per_warp(monkeypatch):
    """With the launch stubbed: v2's grid is one block per 8 x 8 tile (it was tiles / 256
    blocks, 32 at batch 512), v3's one warp per output row and one block column per 32
    output channels."""
    seen = []
    monkeypatch.setattr(conv, "launch", lambda k, grid, block, *a: seen.append((grid, block)))
    monkeypatch.setattr(v3, "launch", lambda k, grid, block, *a: seen.append((grid, block)))
    monkeypatch.setattr(conv, "V2_MAX_BLOCKS", 4096)
    monkeypatch.setattr(v3, "MAX_ROW_BLOCKS", 2048)
    x, k, b = device(np.zeros((3, 28, 28, 1), np.float32), np.zeros((3, 3, 1, 32), np.float32),
                     np.zeros(32, np.float32))
    conv.conv2d(x, k, b, poisoned((3, 26, 26, 32)), version="v2")
    assert seen[-1] == (3 * 4 * 4, conv.V2_THREADS)                 # 4 x 4 tiles of 8 x 8 per image
    assert conv.v2_grid((512, 26, 26, 32))[0] == 4096 >= 512 * 16 // 2
    v3.conv2d_v3(x, cuda.to_device(np.zeros((3, 3, 1, 40), np.float32)),
                 cuda.to_device(np.zeros(40, np.float32)), poisoned((3, 26, 26, 40)))
    (gx, gy), (lanes, warps) = seen[-1]
    assert (lanes, gy) == (32, 2) and gx == -(-3 * 26 // warps)     # ceil(78 rows / warps per block)


def test_checks_run_once_per_arrays_and_keep_nothing_alive(rng, monkeypatch):
    """The second call with the same buffers skips the checks; new buffers are checked; a
    memo entry does not keep its arrays alive (device memory is refunded when freed)."""
    import gc
    import weakref
    calls = []
    real = v3.conv2d_output_shape
    monkeypatch.setattr(v3, "conv2d_output_shape", lambda *a: calls.append(1) or real(*a))
    x, k, bias = device(*make_case(rng, (1, 4, 5, 1), (3, 3, 1, 2)))
    out = poisoned((1, 2, 3, 2))
    for _ in range(3):
        v3.conv2d_v3(x, k, bias, out)
    assert len(calls) == 1
    other = poisoned((1, 2, 3, 2))
    v3.conv2d_v3(x, k, bias, other)
    assert len(calls) == 2
    gone = weakref.ref(other)
    del other
    gc.collect()
    holders = [type(r).__name__ for r in gc.get_referrers(gone())] if gone() is not None else []
    assert gone() is None, f"the array is still held by: {holders}"
    with pytest.raises(ValueError, match="has shape"):     # a new, wrong buffer is checked
        v3.conv2d_v3(x, k, bias, poisoned((1, 3, 3, 2)))
