"""Agreement with Keras for a two-conv model (TensorFlow's custom-training tutorial's
shape: Conv2D(relu) -> MaxPooling2D -> Conv2D(relu) -> MaxPooling2D -> Flatten ->
Dense(relu) -> Dense), under MirroredStrategy on 2 logical CPUs: the second conv needs
its input gradient (dX = col2im(dy W^T) on the CPU) and both pairs run fused
(kernels/cpu_loops.py ``conv2d_relu_pool``, ``max_pool_relu_backward``; issue 25).

Keras's math is written out in float64 here as in tests/test_keras_agreement.py (whose
data, optimizers, bound and draws this file reuses): cross-correlation, 'valid'; 2x2
pools whose gradient goes to the FIRST maximum; ReLU's gradient where z > 0; the mean
over the global batch. Sizes are small (16 and 8 filters, 20x20 images: an odd 9x9 map
into the second pool, which drops its last row and column).
"""
import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import mirrored as tf
from tests.test_keras_agreement import (OPTIMIZERS, REPLICAS, agreeing_draw, mnist_batches,
                                        oracle_weights, reaches)
from tests.test_training import assert_replicas_bitwise_equal

SIZE, FILTERS, HIDDEN, BATCH, STEPS = 20, (16, 8), 16, 8, 3


def _conv(x, kernel, bias):
    patches = sliding_window_view(x, kernel.shape[:2], axis=(1, 2))       # (B, OH, OW, Cin, kh, kw)
    return np.einsum("bhwcij,ijcf->bhwf", patches, kernel) + bias, patches


def _pool(a):
    b, oh, ow, c = a.shape
    ph, pw = oh // 2, ow // 2
    windows = (a[:, :2 * ph, :2 * pw].reshape(b, ph, 2, pw, 2, c)
               .transpose(0, 1, 3, 5, 2, 4).reshape(b, ph, pw, c, 4))     # (di, dj) row-major
    return windows.max(axis=-1), windows.argmax(axis=-1)                  # argmax = FIRST maximum


def _pool_back(dpooled, first, shape):
    b, ph, pw, c = dpooled.shape
    dwin = dpooled[..., None] * (np.arange(4) == first[..., None])
    da = np.zeros(shape)
    da[:, :2 * ph, :2 * pw] = (dwin.reshape(b, ph, pw, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
                               .reshape(b, 2 * ph, 2 * pw, c))
    return da


def two_conv_gradients(weights, x, y, replicas):
    """Gradients of the global batch's mean softmax cross-entropy, float64."""
    k0, c0, k1, c1, w1, b1, w2, b2 = weights
    z0, p0 = _conv(x, k0, c0)
    a0, f0 = _pool(np.maximum(z0, 0))
    z1, p1 = _conv(a0, k1, c1)
    a1, f1 = _pool(np.maximum(z1, 0))
    flat = a1.reshape(len(x), -1)                                         # (h, w, c) order
    z2 = flat @ w1 + b1
    h = np.maximum(z2, 0)
    logits = h @ w2 + b2
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    d = e / e.sum(axis=1, keepdims=True)
    d[np.arange(len(y)), y] -= 1.0
    d /= len(x)
    g_w2, g_b2 = h.T @ d, d.sum(0)
    dz2 = (d @ w2.T) * (z2 > 0)
    g_w1, g_b1 = flat.T @ dz2, dz2.sum(0)
    dz1 = _pool_back((dz2 @ w1.T).reshape(a1.shape), f1, z1.shape) * (z1 > 0)
    g_k1 = np.einsum("bhwcij,bhwf->ijcf", p1, dz1)
    da0 = np.zeros(a0.shape)                                              # dX of the second conv
    kh, kw = k1.shape[:2]
    for i in range(kh):
        for j in range(kw):
            da0[:, i:i + z1.shape[1], j:j + z1.shape[2]] += dz1 @ k1[i, j].T
    dz0 = _pool_back(da0, f0, z0.shape) * (z0 > 0)
    g_k0 = np.einsum("bhwcij,bhwf->ijcf", p0, dz0)
    return [g_k0, dz0.sum((0, 1, 2)), g_k1, dz1.sum((0, 1, 2)), g_w1, g_b1, g_w2, g_b2]


def two_conv_case(opt, grads_fn=two_conv_gradients):
    ours_opt, oracle_opt = OPTIMIZERS[opt]

    def case(rng):
        x, y = mnist_batches(rng, BATCH * STEPS, size=28)
        x = np.ascontiguousarray(x[:, 4:4 + SIZE, 4:4 + SIZE])           # the digit's middle
        tf.keras.utils.set_random_seed(int(rng.integers(2 ** 31)))
        strategy = tf.distribute.MirroredStrategy([f"CPU:{r}" for r in range(REPLICAS)])
        with strategy.scope():
            model = tf.keras.Sequential([
                tf.keras.layers.Conv2D(FILTERS[0], 3, activation="relu", input_shape=(SIZE, SIZE, 1)),
                tf.keras.layers.MaxPooling2D(),
                tf.keras.layers.Conv2D(FILTERS[1], 3, activation="relu"),
                tf.keras.layers.MaxPooling2D(),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(HIDDEN, activation="relu"),
                tf.keras.layers.Dense(10)])
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=ours_opt(), metrics=["accuracy"])
        start = model.get_weights()
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, verbose=0)
        ref = oracle_weights(start, x, y, BATCH, oracle_opt(), grads_fn=grads_fn)
        return model.get_weights(), ref, start, model
    return case


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_two_conv_model_on_2_cpu_replicas_reaches_kerass_weights(devices, rng, opt):
    devices(cpus=REPLICAS)
    end, _, start, model = agreeing_draw(two_conv_case(opt), rng)
    assert_replicas_bitwise_equal(model)
    assert all(not np.array_equal(a, w0) for a, w0 in zip(end, start)), "every array trained"
    states = model.step.programs[0].states
    assert states[0].fused is not None and states[2].fused is not None   # both pairs ran fused


def test_an_oracle_without_the_second_convs_input_gradient_misses_the_bound(devices, rng):
    """The check sees the second conv's dX: against an oracle that drops it (so the first
    conv does not train), our weights must miss the bound."""
    devices(cpus=REPLICAS)

    def no_dx(weights, x, y, replicas):
        g = two_conv_gradients(weights, x, y, replicas)
        return [np.zeros_like(g[0]), np.zeros_like(g[1])] + g[2:]
    end, wrong, start, _ = two_conv_case("sgd", grads_fn=no_dx)(rng)
    assert not reaches(end, wrong, start)
