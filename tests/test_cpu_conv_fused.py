"""The CPU conv family for any channel counts (kernels/cpu_loops.py, issue 25) against
the NumPy references (kernels/conv2d.py, kernels/pooling.py, kernels/activations.py,
imported, not copied): the fused forward conv + bias + ReLU + max-pool, the pool backward
with the ReLU's mask, dW by BLAS on the column matrix and dX by BLAS then col2im.

Which claim is which (README, "What our tests claim bitwise"): the products are BLAS's,
whose bits depend on the machine (a block of rows and the whole product may differ by an
ulp: OpenBLAS on an AMD EPYC did), so the conv before its bias, dW and dX are checked
against float64 within a float32 bound scaled by the sum of |terms| (``assert_product_close``).
What our own loops order is bitwise: the bias, the ReLU and the pooling of OUR conv output
(the pooled values and the arg-max, ties and NaN included), the pool backward without
overlapping windows, and the same call on 1, 2, 3 or 5 threads. The cases are the issue's:
1->32, 32->64 and 3->16 channels, strides 1 and 2, 'valid' and 'same', on small awkward
images (odd sizes, batch 1). Outputs start as NaN (poisoned).
"""
import os

import numpy as np
import pytest

from conftest import poisoned_host
from kernels import activations, conv2d, cpu_loops, pooling

RTOL = 2e-6            # float32 sums in another order (db)
#: A float32 dot product of K terms, in any order, is within K * 2^-24 * sum(|terms|) of
#: the exact one (each add rounds once); 2x that leaves room for the products' rounding.
PRODUCT_ULPS = 2 * 2.0 ** -24
#: (x shape, kernel shape): the issue's channel pairs, small odd images.
CHANNELS = [((2, 9, 7, 1), (3, 3, 1, 32)),
            ((1, 7, 8, 32), (3, 3, 32, 64)),
            ((3, 6, 5, 3), (3, 3, 3, 16))]
GEOMETRY = [(1, "valid"), (1, "same"), (2, "valid"), (2, "same")]


def assert_product_close(got, a, b, what):
    """got (any shape, float32) against the float64 product a @ b (2-D, flattened to
    got's rows): |got - a@b| <= PRODUCT_ULPS * K * (|a| @ |b|) elementwise, whatever
    order BLAS added the K terms in."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want, size = a64 @ b64, np.abs(a64) @ np.abs(b64)
    got2 = np.asarray(got, np.float64).reshape(want.shape)
    err, bound = np.abs(got2 - want), PRODUCT_ULPS * a.shape[1] * size + 1e-30
    assert (err <= bound).all(), (f"{what}: {int((err > bound).sum())} of {err.size} values "
                                  f"off by more than the float32 bound (worst {err.max():.3g}, "
                                  f"bound there {bound.flat[int(np.argmax(err - bound))]:.3g})")


def data(rng, x_shape, k_shape):
    x = rng.standard_normal(x_shape, dtype=np.float32)
    k = rng.standard_normal(k_shape, dtype=np.float32) / np.float32(np.sqrt(np.prod(k_shape[:3])))
    bias = rng.standard_normal(k_shape[3], dtype=np.float32) * np.float32(0.3)
    return x, k, bias


@pytest.mark.parametrize("x_shape, k_shape", CHANNELS)
@pytest.mark.parametrize("strides, padding", GEOMETRY)
def test_conv_backward_dx_by_blas_and_col2im_is_the_reference_bitwise(rng, x_shape, k_shape, strides, padding):
    x, k, _ = data(rng, x_shape, k_shape)
    dy = rng.standard_normal(conv2d.conv2d_output_shape(x_shape, k_shape, strides, padding),
                             dtype=np.float32)
    _, _, want_db = conv2d.conv2d_backward_ref(x, k, dy, strides, padding)
    dx, dw, db = poisoned_host(x_shape), poisoned_host(k_shape), poisoned_host(k_shape[3])
    cpu_loops.conv2d_backward(x, k, dy, dx, dw, db, strides, padding)
    cols = conv2d.im2col_ref(x, k_shape[:2], strides, padding)        # (B*OH*OW, KH*KW*Cin)
    dy2 = dy.reshape(-1, k_shape[3])
    assert_product_close(dw, cols.T, dy2, "dW = cols^T @ dy")          # BLAS's product
    # dX: BLAS's dcols = dy @ W^T, then col2im adds at most KH*KW of them per pixel
    want_dx = conv2d.conv2d_backward_ref(x.astype(np.float64), k.astype(np.float64),
                                         dy.astype(np.float64), strides, padding)[0]
    bound = conv2d.conv2d_backward_ref(np.abs(x).astype(np.float64), np.abs(k).astype(np.float64),
                                       np.abs(dy).astype(np.float64), strides, padding)[0]
    taps = k_shape[0] * k_shape[1]
    err = np.abs(dx - want_dx)
    assert (err <= PRODUCT_ULPS * (k_shape[3] + taps) * bound + 1e-30).all(), \
        f"dX off by {err.max():.3g} from float64"
    np.testing.assert_allclose(db, want_db, rtol=RTOL, atol=RTOL * float(np.abs(dy).sum(axis=(0, 1, 2)).max()))


@pytest.mark.parametrize("x_shape, k_shape", CHANNELS)
@pytest.mark.parametrize("strides, padding", GEOMETRY)
@pytest.mark.parametrize("pool", [(2, None, "valid"), (2, None, "same"), ((3, 2), (2, 1), "same")])
def test_fused_conv_relu_pool_is_the_references(rng, x_shape, k_shape, strides, padding, pool):
    """The conv before its bias (``z``, BLAS's product) to the float32 bound; then, bitwise,
    the bias, ReLU and pool of that very z as the references do them (our loops' order)."""
    x, k, bias = data(rng, x_shape, k_shape)
    pool_size, pool_strides, pool_padding = pool
    conv_shape = conv2d.conv2d_output_shape(x_shape, k_shape, strides, padding)
    if conv_shape[1] < 2 or conv_shape[2] < 2:
        pytest.skip("the conv's output is smaller than the pool")
    shape = pooling.pool_geometry(conv_shape, pool_size, pool_strides, pool_padding)[0]
    out, arg, z = poisoned_host(shape), poisoned_host(shape, np.int32), poisoned_host(conv_shape)
    cpu_loops.conv2d_relu_pool(x, k, bias, out, arg, strides, padding, pool_size, pool_strides,
                               pool_padding, z=z)
    assert_product_close(z, conv2d.im2col_ref(x, k_shape[:2], strides, padding),
                         k.reshape(-1, k_shape[3]), "the conv (before its bias)")
    y = activations.bias_relu_ref(z, bias)                             # (B, OH, OW, Cout)
    want, want_arg = pooling.max_pool_ref(y, pool_size, pool_strides, pool_padding)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(arg, want_arg)
    # Backward: pool then ReLU in one pass, from the pooled output alone.
    dy = rng.standard_normal(want.shape, dtype=np.float32)
    want_dz = activations.relu_backward_ref(
        pooling.max_pool_backward_ref(dy, want_arg, y.shape, pool_size, pool_strides, pool_padding),
        y, np.empty(y.shape, np.float32))
    dz = poisoned_host(y.shape)
    cpu_loops.max_pool_relu_backward(dy, arg, out, dz, pool_size, pool_strides, pool_padding)
    overlap = pool_strides is not None
    if overlap:                                        # an input's terms in another order
        np.testing.assert_allclose(dz, want_dz, rtol=RTOL, atol=RTOL * float(np.abs(dy).max()))
    else:
        np.testing.assert_array_equal(dz, want_dz)
    assert (dz[y <= 0] == 0).all()                     # the ReLU's mask


def test_fused_paths_keep_nan_and_relu_zeros_as_the_references(rng):
    x, k, bias = data(rng, (2, 6, 6, 3), (3, 3, 3, 4))
    x[0, 1, 1, 0] = np.nan                             # poisons the windows that read it
    bias[1] = -50.0                                    # channel 1: every output clipped to 0
    y_ref = conv2d.conv2d_ref(x, k, bias, 1, "valid", relu=True)
    out, arg = poisoned_host((2, 2, 2, 4)), poisoned_host((2, 2, 2, 4), np.int32)
    z = poisoned_host(y_ref.shape)
    cpu_loops.conv2d_relu_pool(x, k, bias, out, arg, z=z)
    np.testing.assert_array_equal(np.isnan(z), np.isnan(y_ref))   # NaN where the reference has NaN
    y = activations.bias_relu_ref(z, bias)                        # our conv, the reference's ReLU
    want, want_arg = pooling.max_pool_ref(y)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(arg, want_arg)
    clipped = out[..., 1][~np.isnan(out[..., 1])]
    assert np.isnan(out).any() and clipped.size and (clipped == 0).all()
    dz = poisoned_host(y.shape)
    cpu_loops.max_pool_relu_backward(np.ones(want.shape, np.float32), arg, out, dz)
    assert (dz[..., 1] == 0).all() and np.isfinite(dz).all()


def test_fused_calls_refuse_wrong_buffers_before_writing(rng):
    x, k, bias = data(rng, (1, 6, 6, 1), (3, 3, 1, 4))
    out, arg = poisoned_host((1, 2, 2, 4)), poisoned_host((1, 2, 2, 4), np.int32)
    with pytest.raises(ValueError, match=r"conv2d_relu_pool: out.*\(1, 2, 2, 4\)"):
        cpu_loops.conv2d_relu_pool(x, k, bias, poisoned_host((1, 3, 3, 4)), arg)
    with pytest.raises(ValueError, match="conv2d_relu_pool: arg must be int32"):
        cpu_loops.conv2d_relu_pool(x, k, bias, out, poisoned_host((1, 2, 2, 4)))
    assert np.isnan(out).all()
    with pytest.raises(ValueError, match="max_pool_relu_backward: y"):
        cpu_loops.max_pool_relu_backward(out, arg, poisoned_host((1, 2, 3, 4)), poisoned_host((1, 4, 4, 4)))


def test_a_two_conv_model_trains_bitwise_alike_fused_or_not(devices, monkeypatch, rng):
    """The tutorial's two-conv shape of model, small: Conv2D(relu) -> MaxPooling2D twice.
    The layers run each pair as one op on the CPU (``Conv2D.fuse_next``); the same steps
    with the fusion refused give the same weights, to float32 rounding (the fused backward
    sums dW by blocks of images, kernels/cpu_loops.py ``conv2d_relu_pool_backward``).
    SGD, not Adam: Adam divides each gradient by its own running size, so a weight whose
    gradient is near zero turns a rounding difference into a visible one (the suite saw
    1.9e-6 on a weight of 0.04 after four Adam steps, once in many runs)."""
    import mirrored as tf
    from mirrored.keras import layers

    def model():
        m = tf.keras.Sequential([
            tf.keras.layers.Conv2D(4, 3, activation="relu", input_shape=(12, 11, 1)),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(6, 3, activation="relu", padding="same"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(5, activation="relu"),
            tf.keras.layers.Dense(3)])
        m.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    devices(cpus=1)
    x = rng.standard_normal((7, 12, 11, 1)).astype(np.float32)
    y = rng.integers(0, 3, 7)
    with tf.device("CPU:0"):              # the CPU backend (a simulated GPU may be the default)
        fused = model()
        start = fused.get_weights()
        fused.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    states = fused.step.programs[0].states
    assert [s.fused is not None for s in states[:4]] == [True, True, True, True]
    monkeypatch.setattr(layers.Conv2D, "fuse_next", lambda self, layer, ops: False)
    with tf.device("CPU:0"):
        plain = model()
        plain.set_weights(start)
        plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert all(s.fused is None for s in plain.step.programs[0].states)
    for a, b in zip(fused.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not all(np.array_equal(a, b) for a, b in zip(start, fused.get_weights()))


def test_large_products_are_cut_in_blocks_whose_bits_do_not_depend_on_the_threads(monkeypatch, rng):
    """``matmul_rows`` cuts a large product (forced here on small ones: threshold 0) in
    ``PARTS`` row blocks run on 1, 2, 3 or 5 threads: the same bits every time (replicas
    must not drift apart as the load changes the thread count), the single call's result
    to float32 rounding; and the conv's forward, dW and dX through it match the references."""
    monkeypatch.setattr(cpu_loops, "SPLIT_MIN_MADDS", 0)
    a = rng.standard_normal((37, 29), dtype=np.float32)
    b = rng.standard_normal((29, 17), dtype=np.float32)
    x, k, bias = data(rng, (3, 9, 8, 5), (3, 3, 5, 7))
    dy = rng.standard_normal(conv2d.conv2d_output_shape(x.shape, k.shape, 1, "same"), dtype=np.float32)
    want_dx, want_dw, _ = conv2d.conv2d_backward_ref(x, k, dy, 1, "same")
    want_y = conv2d.conv2d_ref(x, k, bias, 1, "same", relu=True)
    seen = []
    for threads in ("1", "2", "3", "5"):
        monkeypatch.setenv(cpu_loops.THREADS_VAR, threads)
        assert cpu_loops.product_threads() == int(threads)
        out, at = poisoned_host((37, 17)), poisoned_host((29, 17))
        cpu_loops.matmul_rows(a, b, out)
        cpu_loops.matmul_rows(a.T, out, at)                        # a transposed view, as dW's
        dx, dw, y = poisoned_host(x.shape), poisoned_host(k.shape), poisoned_host(dy.shape)
        cpu_loops.conv2d_backward(x, k, dy, dx, dw, None, 1, "same")
        cpu_loops.conv2d_forward(x, k, bias, y, 1, "same", True)
        seen.append((out, at, dx, dw, y))
    for got in seen[1:]:
        for g, first in zip(got, seen[0]):
            np.testing.assert_array_equal(g, first)
    out, at, dx, dw, y = seen[0]
    for g, want in ((out, a.astype(np.float64) @ b), (at, a.T.astype(np.float64) @ out), (dx, want_dx),
                    (dw, want_dw), (y, want_y)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_the_thread_count_refuses_a_bad_value(monkeypatch):
    monkeypatch.setenv(cpu_loops.THREADS_VAR, "0")
    with pytest.raises(ValueError, match="MIRRORED_CPU_THREADS='0': expected 'auto' or a whole number"):
        cpu_loops.product_threads()
    monkeypatch.setenv(cpu_loops.THREADS_VAR, "auto")
    assert 1 <= cpu_loops.product_threads() <= len(os.sched_getaffinity(0))
