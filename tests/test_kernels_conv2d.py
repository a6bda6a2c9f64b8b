"""Conv2D kernels (kernels/conv2d.py) against independent float64 oracles.

The oracles below are plain loops over every output and tap, with TensorFlow's padding
rule written out again here (not imported), so a wrong rule in the library fails.
Awkward shapes: batch of 1, odd sizes, stride 2, "same" with an odd total padding,
1 and 3 channels, a non-square kernel, a kernel as large as the input. Outputs are
NaN-poisoned before every launch; bad input must raise before any launch.

    python -m pytest -q tests/test_kernels_conv2d.py      # CUDA simulator: ~30 s
"""
import numpy as np
import pytest
from numba import cuda

import kernels.conv2d as conv
from conftest import assert_close, device_zeros, poisoned

#: A float32 sum of n products is within about n * 2^-24 * sum |products| of the exact
#: value; 1e-6 * n * that scale leaves a margin of ~16x.
SUM_F32_REL = 1e-6
#: The float64 references against the float64 oracles: a few roundings of a short sum.
RTOL_F64 = 1e-12

#: (x shape, kernel shape, strides, padding). Tiny: the simulator runs a Python thread
#: per CUDA thread.
CASES = [
    ((1, 5, 5, 1), (3, 3, 1, 4), 1, "valid"),        # batch 1, one input channel (MNIST-like)
    ((2, 7, 6, 3), (3, 3, 3, 2), 2, "same"),         # stride 2, "same", odd total padding
    ((2, 6, 7, 1), (2, 3, 1, 3), (2, 1), "same"),    # even kernel height, mixed strides
    ((1, 4, 5, 3), (4, 5, 3, 2), 1, "valid"),        # the kernel covers the whole input
    ((2, 5, 3, 2), (1, 1, 2, 3), (1, 2), "valid"),   # a 1x1 kernel
]


# --- float64 oracles: loops ---------------------------------------------------------------

def oracle_geometry(h, w, kh, kw, strides, padding):
    """(out_h, out_w, pad_top, pad_left) by TensorFlow's rule (the odd pad goes after)."""
    sh, sw = (strides, strides) if isinstance(strides, int) else strides
    if padding == "valid":
        return (h - kh) // sh + 1, (w - kw) // sw + 1, 0, 0, sh, sw
    out_h, out_w = -(-h // sh), -(-w // sw)
    pad_h = max((out_h - 1) * sh + kh - h, 0)
    pad_w = max((out_w - 1) * sw + kw - w, 0)
    return out_h, out_w, pad_h // 2, pad_w // 2, sh, sw


def taps(x_shape, k_shape, strides, padding):
    """Yield (n, oh, ow, kh, kw, ih, iw) for every tap that lands inside the input."""
    b, h, w, _ = x_shape
    kh_n, kw_n = k_shape[:2]
    out_h, out_w, pt, pl, sh, sw = oracle_geometry(h, w, kh_n, kw_n, strides, padding)
    for n in range(b):
        for oh in range(out_h):
            for ow in range(out_w):
                for kh in range(kh_n):
                    for kw in range(kw_n):
                        ih, iw = oh * sh - pt + kh, ow * sw - pl + kw
                        if 0 <= ih < h and 0 <= iw < w:
                            yield n, oh, ow, kh, kw, ih, iw


def oracle_forward(x, k, bias, strides, padding):
    """(out, scale): the float64 convolution, and the same sum over |terms| (for tolerances)."""
    b, h, w, _ = x.shape
    out_h, out_w = oracle_geometry(h, w, k.shape[0], k.shape[1], strides, padding)[:2]
    x, k = x.astype(np.float64), k.astype(np.float64)
    out = np.zeros((b, out_h, out_w, k.shape[3])) + bias
    scale = np.zeros_like(out) + np.abs(bias)
    for n, oh, ow, kh, kw, ih, iw in taps(x.shape, k.shape, strides, padding):
        out[n, oh, ow] += x[n, ih, iw] @ k[kh, kw]          # (Cin,) @ (Cin, Cout)
        scale[n, oh, ow] += np.abs(x[n, ih, iw]) @ np.abs(k[kh, kw])
    return out, scale


def oracle_backward(x, k, dy, strides, padding):
    """(dx, dw, db) in float64 by scattering every tap's contribution."""
    x, k, dy = x.astype(np.float64), k.astype(np.float64), dy.astype(np.float64)
    dx, dw = np.zeros_like(x), np.zeros_like(k)
    for n, oh, ow, kh, kw, ih, iw in taps(x.shape, k.shape, strides, padding):
        dx[n, ih, iw] += k[kh, kw] @ dy[n, oh, ow]           # (Cin, Cout) @ (Cout,)
        dw[kh, kw] += np.outer(x[n, ih, iw], dy[n, oh, ow])
    return dx, dw, dy.sum(axis=(0, 1, 2))


def check_sum(name, got, want, scale, terms):
    assert_close(name, got, want, rtol=0.0, atol=SUM_F32_REL * max(terms, 1) * float(np.max(scale)))


def make_case(rng, x_shape, k_shape):
    x = rng.standard_normal(x_shape).astype(np.float32)
    k = rng.standard_normal(k_shape).astype(np.float32)
    bias = rng.standard_normal(k_shape[3]).astype(np.float32)
    return x, k, bias


# --- forward -------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape,k_shape,strides,padding", CASES)
def test_forward_v1_v2_and_relu(rng, x_shape, k_shape, strides, padding):
    x, k, bias = make_case(rng, x_shape, k_shape)
    want, scale = oracle_forward(x, k, bias, strides, padding)
    terms = int(np.prod(k_shape[:3])) + 1
    d_x, d_k, d_b = cuda.to_device(x), cuda.to_device(k), cuda.to_device(bias)
    assert conv.conv2d_output_shape(x_shape, k_shape, strides, padding) == want.shape
    results = {}
    for version in conv.VERSIONS:
        for relu in (False, True):
            out = poisoned(want.shape)
            conv.conv2d(d_x, d_k, d_b, out, strides, padding, relu=relu, version=version)
            got = out.copy_to_host()
            check_sum(f"conv2d {version} relu={relu} {x_shape} {k_shape} s={strides} {padding}",
                      got, np.maximum(want, 0) if relu else want, scale, terms)
            results[version, relu] = got
    for relu in (False, True):       # v2 adds the same terms in the same order as v1
        assert np.array_equal(results["v1", relu], results["v2", relu]), "v2 != v1 bitwise"


def test_forward_default_version_falls_back_to_v1_when_v2_does_not_fit(rng):
    k_shape = (3, 3, 4, conv.V2_KERNEL_FLOATS // 36 + 1)      # 3*3*4*Cout > V2_KERNEL_FLOATS
    assert not conv.v2_fits(k_shape, (1, 1)) and conv.v2_fits((3, 3, 1, 32), (1, 1))
    x, k, bias = make_case(rng, (1, 3, 3, 4), k_shape)
    want, scale = oracle_forward(x, k, bias, 1, "valid")
    out = poisoned(want.shape)
    conv.conv2d(cuda.to_device(x), cuda.to_device(k), cuda.to_device(bias), out)
    check_sum("conv2d default (v1)", out.copy_to_host(), want, scale, 37)
    with pytest.raises(ValueError, match="v2 holds at most"):
        conv.conv2d(cuda.to_device(x), cuda.to_device(k), cuda.to_device(bias), out,
                    version="v2")


# --- backward ------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape,k_shape,strides,padding", CASES)
def test_backward_dx_dw_db(rng, x_shape, k_shape, strides, padding):
    x, k, _ = make_case(rng, x_shape, k_shape)
    out_shape = conv.conv2d_output_shape(x_shape, k_shape, strides, padding)
    dy = rng.standard_normal(out_shape).astype(np.float32)
    want_dx, want_dw, want_db = oracle_backward(x, k, dy, strides, padding)
    _, scale_dw, _ = oracle_backward(np.abs(x), np.abs(k), np.abs(dy), strides, padding)
    scale_dx, _, _ = oracle_backward(np.abs(x), np.abs(k), np.abs(dy), strides, padding)
    d_x, d_k, d_dy = cuda.to_device(x), cuda.to_device(k), cuda.to_device(dy)
    runs = []
    for _ in range(2):
        dx, dw, db = poisoned(x_shape), poisoned(k_shape), poisoned(k_shape[3])
        conv.conv2d_backward(d_x, d_k, d_dy, dx, dw, db, strides, padding)
        runs.append([a.copy_to_host() for a in (dx, dw, db)])
    got_dx, got_dw, got_db = runs[0]
    where = f"{x_shape} {k_shape} s={strides} {padding}"
    check_sum(f"dx {where}", got_dx, want_dx, scale_dx, k_shape[0] * k_shape[1] * k_shape[3])
    check_sum(f"dw {where}", got_dw, want_dw, scale_dw, int(np.prod(out_shape[:3])))
    check_sum(f"db {where}", got_db, want_db, np.abs(dy).sum(axis=(0, 1, 2)),
              int(np.prod(out_shape[:3])))
    for a, b in zip(*runs):          # no atomics: the same bits every run
        assert np.array_equal(a, b), "conv2d_backward is not bitwise reproducible"


def test_backward_without_dx_and_bias_and_with_a_given_scratch(rng):
    x_shape, k_shape, strides, padding = CASES[1]
    x, k, _ = make_case(rng, x_shape, k_shape)
    out_shape = conv.conv2d_output_shape(x_shape, k_shape, strides, padding)
    dy = rng.standard_normal(out_shape).astype(np.float32)
    _, want_dw, _ = oracle_backward(x, k, dy, strides, padding)
    _, scale, _ = oracle_backward(np.abs(x), np.abs(k), np.abs(dy), strides, padding)
    part_shape = conv.dw_partial_shape(x_shape, k_shape, strides, padding, with_bias=False)
    assert part_shape[1] == int(np.prod(k_shape))
    dw = poisoned(k_shape)
    conv.conv2d_backward(cuda.to_device(x), cuda.to_device(k), cuda.to_device(dy), None, dw,
                         None, strides, padding, partial=poisoned(part_shape))
    check_sum("dw (no dx, no db)", dw.copy_to_host(), want_dw, scale, int(np.prod(out_shape[:3])))


def test_backward_of_an_empty_batch_is_zero():
    """A replica whose slice of the global batch is empty still reports zero gradients."""
    k_shape = (3, 3, 1, 4)
    dx, dw, db = poisoned((0, 5, 5, 1)), poisoned(k_shape), poisoned(4)
    conv.conv2d_backward(device_zeros((0, 5, 5, 1)), device_zeros(k_shape),
                         device_zeros((0, 3, 3, 4)), dx, dw, db)
    assert not dw.copy_to_host().any() and not db.copy_to_host().any()


# --- references -------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape,k_shape,strides,padding", CASES)
def test_references_match_oracles(rng, x_shape, k_shape, strides, padding):
    x = rng.standard_normal(x_shape)
    k = rng.standard_normal(k_shape)
    bias = rng.standard_normal(k_shape[3])
    want, _ = oracle_forward(x, k, bias, strides, padding)
    assert_close("conv2d_ref", conv.conv2d_ref(x, k, bias, strides, padding), want, RTOL_F64,
                 atol=1e-12)
    assert_close("conv2d_ref relu", conv.conv2d_ref(x, k, bias, strides, padding, relu=True),
                 np.maximum(want, 0), RTOL_F64, atol=1e-12)
    dy = rng.standard_normal(want.shape)
    cols = conv.im2col_ref(x, k_shape[:2], strides, padding)
    assert_close("conv2d_ref with cols", conv.conv2d_ref(x, k, bias, strides, padding, cols=cols),
                 want, RTOL_F64, atol=1e-12)
    for given in (None, cols):       # the forward's column matrix may be reused
        got = conv.conv2d_backward_ref(x, k, dy, strides, padding, cols=given)
        for name, g, w in zip(("dx", "dw", "db"), got, oracle_backward(x, k, dy, strides, padding)):
            assert_close(f"conv2d_backward_ref {name}", g, w, RTOL_F64, atol=1e-12)
    assert conv.conv2d_backward_ref(x, k, dy, strides, padding, need_dx=False)[0] is None
    x32 = x.astype(np.float32)
    assert conv.conv2d_ref(x32, k.astype(np.float32), None, strides, padding).dtype == np.float32


def test_padding_rule_puts_the_odd_extra_after():
    # H = 6, K = 3, s = 2, "same": OH = 3, total = (3-1)*2 + 3 - 6 = 1 -> 0 on top, 1 below.
    assert conv.window_geometry("t", (6, 7), 3, 2, "same") == (3, 4, (0, 1, 1, 1))
    assert conv.window_geometry("t", (28, 28), 3, 1, "valid") == (26, 26, (0, 0, 0, 0))
    assert conv.window_geometry("t", (5, 5), 2, 2, "valid") == (2, 2, (0, 0, 0, 0))


# --- bad input --------------------------------------------------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(conv)


_dev = device_zeros


def test_bad_input_raises_before_launch(no_launch):
    x, k, b, out = _dev((2, 5, 5, 1)), _dev((3, 3, 1, 4)), _dev(4), _dev((2, 3, 3, 4))
    with pytest.raises(ValueError, match=r"kernel is 3 along height but the input is only 2"):
        conv.conv2d(_dev((2, 2, 5, 1)), k, b, out)
    with pytest.raises(ValueError, match=r"4-D \(batch, height, width, channels\).*channel axis"):
        conv.conv2d(_dev((2, 5, 5)), k, b, out)
    with pytest.raises(ValueError, match=r"3 channel\(s\).*expects Cin = 1.*\(B, H, W, 1\)"):
        conv.conv2d(_dev((2, 5, 5, 3)), k, b, out)
    with pytest.raises(ValueError, match="strides must be a positive integer"):
        conv.conv2d(x, k, b, out, strides=0)
    with pytest.raises(ValueError, match="strides must be a positive integer"):
        conv.conv2d(x, k, b, out, strides=(1, 1.5))
    with pytest.raises(ValueError, match="padding must be 'valid' or 'same'"):
        conv.conv2d(x, k, b, out, padding="full")
    with pytest.raises(ValueError, match=r"out has shape \(2, 3, 3, 4\), expected \(2, 5, 5, 4\)"):
        conv.conv2d(x, k, b, out, padding="same")
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(4,\)"):
        conv.conv2d(x, k, _dev(3), out)
    with pytest.raises(TypeError, match="float32"):
        conv.conv2d(_dev((2, 5, 5, 1), np.float64), k, b, out)
    with pytest.raises(ValueError, match="unknown version"):
        conv.conv2d(x, k, b, out, version="v9")
    with pytest.raises(ValueError, match=r"kernel must be 4-D.*every size >= 1"):
        conv.conv2d(x, _dev((3, 0, 1, 4)), b, out)
    buf = _dev(72)
    with pytest.raises(ValueError, match="shares memory"):   # out over the input
        conv.conv2d(buf[:50].reshape(2, 5, 5, 1), k, b, buf.reshape(2, 3, 3, 4))
    with pytest.raises(ValueError, match=r"dy has shape \(2, 3, 3, 3\), expected \(2, 3, 3, 4\)"):
        conv.conv2d_backward(x, k, _dev((2, 3, 3, 3)), _dev((2, 5, 5, 1)), _dev((3, 3, 1, 4)),
                             _dev(4))
    with pytest.raises(ValueError, match=r"partial has shape"):
        conv.conv2d_backward(x, k, out, None, _dev((3, 3, 1, 4)), _dev(4), partial=_dev((1, 1)))
    with pytest.raises(ValueError, match="shares memory"):
        dw = _dev((3, 3, 1, 4))
        conv.conv2d_backward(x, k, out, None, dw, dw.reshape(36)[:4])


def test_the_gpu_launch_constants(monkeypatch, rng):
    """The simulator normally runs 32-thread blocks: run v2's patch and kernel staging and
    the dW pass with the GPU's 256-thread blocks once (a few blocks: still quick)."""
    from kernels import launch
    monkeypatch.setattr(launch, "THREADS_1D", 256)
    monkeypatch.setattr(conv, "V2_THREADS", 256)
    monkeypatch.setattr(conv, "DW_THREADS", 256)
    x_shape, k_shape, strides, padding = (1, 9, 10, 2), (3, 3, 2, 20), 1, "same"
    x, k, bias = make_case(rng, x_shape, k_shape)          # 360 weights: 2 dW blocks
    want, scale = oracle_forward(x, k, bias, strides, padding)
    d_x, d_k = cuda.to_device(x), cuda.to_device(k)
    out = poisoned(want.shape)
    conv.conv2d(d_x, d_k, cuda.to_device(bias), out, strides, padding, version="v2")
    check_sum("conv2d v2, 256-thread blocks", out.copy_to_host(), want, scale, 19)
    dy = rng.standard_normal(want.shape).astype(np.float32)
    want_dx, want_dw, want_db = oracle_backward(x, k, dy, strides, padding)
    scale_dx, scale_dw, _ = oracle_backward(np.abs(x), np.abs(k), np.abs(dy), strides, padding)
    dx, dw, db = poisoned(x_shape), poisoned(k_shape), poisoned(k_shape[3])
    conv.conv2d_backward(d_x, d_k, cuda.to_device(dy), dx, dw, db, strides, padding)
    check_sum("dx, 256-thread blocks", dx.copy_to_host(), want_dx, scale_dx, 180)
    check_sum("dw, 256-thread blocks", dw.copy_to_host(), want_dw, scale_dw, 90)
    check_sum("db, 256-thread blocks", db.copy_to_host(), want_db, np.abs(dy).sum((0, 1, 2)), 90)
