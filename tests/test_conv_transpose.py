"""Conv2DTranspose (mirrored/keras/conv_transpose.py) against float64 NumPy oracles of Keras 3's
math: the forward as a scatter-add of each input pixel times the kernel (written independently
of the layer's zeros-between-pixels correlation), its adjointness with a TensorFlow 'same'
Conv2D oracle (the padding split), the gradients by central differences, fit on 1 and 2
replicas (bitwise-equal replicas), a simulated GPU, and the .weights.h5 / .keras round trips.
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.values import components
from oracles import numeric_grad

TOL = dict(rtol=2e-4, atol=2e-5)


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print("seed", seed)
    return np.random.default_rng(seed)


# --- float64 oracles ------------------------------------------------------------------------------
def out_len(n, k, s, padding):
    """Keras 3's deconv_output_length (output_padding=None) and TF's 'same' padding before."""
    if padding == "valid":
        return n * s + max(k - s, 0), 0
    return n * s, max(k - s, 0) // 2


def conv_t_ref(x, kernel, bias, strides, padding):
    """y[n, i*s + a - pt, j*s + b - pl, f] += x[n, i, j, :] . kernel[a, b, f, :], one pixel at a time."""
    n, h, w, _ = x.shape
    kh, kw, f, _ = kernel.shape
    (oh, pt), (ow, pl) = out_len(h, kh, strides[0], padding), out_len(w, kw, strides[1], padding)
    y = np.zeros((n, oh, ow, f))
    for i in range(h):
        for j in range(w):
            for a in range(kh):
                for b in range(kw):
                    r, q = i * strides[0] + a - pt, j * strides[1] + b - pl
                    if 0 <= r < oh and 0 <= q < ow:
                        y[:, r, q, :] += x[:, i, j, :] @ kernel[a, b].T
    return y + (0.0 if bias is None else bias)


def conv_ref(z, kernel, strides, out_hw):
    """TensorFlow's Conv2D 'same' (HWIO kernel, pad_top = total // 2) from z (n, H, W, I) to
    out_hw pixels: the forward whose input gradient a 'same' Conv2DTranspose is."""
    n, hh, ww, _ = z.shape
    kh, kw, _, o = kernel.shape
    pt = max((out_hw[0] - 1) * strides[0] + kh - hh, 0) // 2
    pl = max((out_hw[1] - 1) * strides[1] + kw - ww, 0) // 2
    y = np.zeros((n,) + tuple(out_hw) + (o,))
    for i in range(out_hw[0]):
        for j in range(out_hw[1]):
            for a in range(kh):
                for b in range(kw):
                    r, q = i * strides[0] + a - pt, j * strides[1] + b - pl
                    if 0 <= r < hh and 0 <= q < ww:
                        y[:, i, j, :] += z[:, r, q, :] @ kernel[a, b]
    return y


CASES = [  # (padding, strides, kernel_size, input (h, w, c), filters)
    ("valid", (1, 1), (3, 3), (4, 5, 2), 3),
    ("valid", (2, 2), (3, 3), (3, 4, 1), 2),
    ("valid", (2, 3), (2, 3), (3, 3, 3), 1),
    ("valid", (3, 3), (2, 2), (2, 3, 2), 2),     # k < s: Keras's in * s (trailing zeros + bias)
    ("same", (1, 1), (3, 3), (5, 4, 3), 2),
    ("same", (2, 2), (3, 3), (3, 5, 2), 4),
    ("same", (2, 1), (4, 2), (3, 3, 1), 3),      # even kernel: the split puts the odd cell after
    ("same", (3, 2), (2, 5), (2, 3, 2), 1),
]


def f32(a):
    return a.astype(np.float32)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_gradients_against_float64(devices, rng, case):
    devices(cpus=1)
    padding, strides, ks, shape, filters = CASES[case]
    layer = tf.keras.layers.Conv2DTranspose(filters, ks, strides=strides, padding=padding,
                                            bias_initializer="random_normal")
    x = f32(rng.normal(size=(2,) + shape)).astype(np.float64)
    with tf.device("CPU:0"):
        xt = tf.constant(f32(x))
        layer.build(shape)                                             # one example's shape
        kernel, bias = (w.numpy().astype(np.float64) for w in (layer.kernel, layer.bias))
        assert kernel.shape == ks + (filters, shape[2])                   # Keras's (kh, kw, filters, in)
        want = conv_t_ref(x, kernel, bias, strides, padding)
        v = rng.normal(size=want.shape)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt)
            loss = tf.reduce_sum(y * tf.constant(f32(v)))
        dx, dk, db = tape.gradient(loss, [xt, layer.kernel, layer.bias])
    assert tuple(layer.compute_output_shape((2,) + shape)) == want.shape
    np.testing.assert_allclose(y.numpy(), want, **TOL)
    grads = [numeric_grad(lambda z: (conv_t_ref(z, kernel, bias, strides, padding) * v).sum(), x),
             numeric_grad(lambda k: (conv_t_ref(x, k, bias, strides, padding) * v).sum(), kernel),
             numeric_grad(lambda b: (conv_t_ref(x, kernel, b, strides, padding) * v).sum(), bias)]
    for got, g in zip((dx, dk, db), grads):
        np.testing.assert_allclose(got.numpy(), g, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("strides, ks", [((2, 2), (3, 3)), ((2, 1), (4, 2)), ((1, 1), (2, 2)), ((3, 2), (2, 3))])
def test_same_is_the_adjoint_of_tensorflows_same_conv2d(rng, strides, ks):
    """<conv2d_same(z, K), x> = <z, conv2d_transpose_same(x, K)>: the oracle's padding split is
    TensorFlow's conv2d_transpose (the input gradient of its 'same' Conv2D), checked in float64."""
    x = rng.normal(size=(2, 3, 4, 2))                              # the transpose's input
    kernel = rng.normal(size=ks + (3, 2))                          # (kh, kw, filters, in)
    z = rng.normal(size=(2, 3 * strides[0], 4 * strides[1], 3))    # the transpose's output shape
    lhs = (conv_ref(z, kernel, strides, (3, 4)) * x).sum()
    rhs = (z * conv_t_ref(x, kernel, None, strides, "same")).sum()
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)


def model_loss(params, x, t, strides, padding):
    y = conv_t_ref(x, params[0], params[1], strides, padding)
    p = y.reshape(len(x), -1) @ params[2] + params[3]
    return ((p - t) ** 2).mean(-1).mean()


@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_against_float64_sgd_bitwise_replicas(devices, rng, replicas):
    devices(cpus=replicas)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    strides, padding = (2, 2), "same"
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((3, 3, 2)),
            tf.keras.layers.Conv2DTranspose(2, 3, strides=strides, padding=padding, bias_initializer="ones"),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    x = f32(rng.normal(size=(2, 4, 3, 3, 2)))
    t = f32(rng.normal(size=(2, 4, 2)))
    params = [a.astype(np.float64) for a in model.get_weights()]
    for step in range(2):
        model.train_step(x[step], t[step])
        xs, ts = x[step].astype(np.float64), t[step].astype(np.float64)
        grads = [numeric_grad(lambda q, i=i: model_loss(params[:i] + [q] + params[i + 1:], xs, ts, strides, padding), p)
                 for i, p in enumerate(params)]
        params = [p - 0.05 * g for p, g in zip(params, grads)]
    for got, want in zip(model.get_weights(), params):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    for v in model.weights:
        copies = [c.numpy() for c in components(v)]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), v.name


def test_save_and_load_round_trips(devices, rng, tmp_path):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((3, 3, 2)),
            tf.keras.layers.Conv2DTranspose(3, (2, 3), strides=(2, 1), padding="valid", activation="relu"),
            tf.keras.layers.Conv2DTranspose(1, 3, padding="same", use_bias=False),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    x = f32(rng.normal(size=(4, 3, 3, 2)))
    model.fit(x, f32(rng.normal(size=(4, 2))), batch_size=4, verbose=0)
    weights = model.get_weights()
    assert [w.shape for w in weights[:3]] == [(2, 3, 3, 2), (3,), (3, 3, 1, 3)]
    config = model.layers[0].get_config()
    for key in ("filters", "kernel_size", "strides", "padding", "data_format", "dilation_rate", "activation",
                "use_bias", "kernel_initializer", "bias_initializer", "kernel_regularizer", "bias_regularizer",
                "activity_regularizer", "kernel_constraint", "bias_constraint"):
        assert key in config, key
    assert config["activation"] == "relu" and config["kernel_size"] == [2, 3] and config["strides"] == [2, 1]
    model.save_weights(str(tmp_path / "m.weights.h5"))
    model.save(str(tmp_path / "m.keras"))
    want = model.predict(x, verbose=0)
    with strategy.scope():
        loaded = tf.keras.models.load_model(str(tmp_path / "m.keras"))
    assert [type(layer).__name__ for layer in loaded.layers[:2]] == ["Conv2DTranspose"] * 2
    for a, b in zip(loaded.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    model.set_weights([np.zeros_like(w) for w in weights])
    model.load_weights(str(tmp_path / "m.weights.h5"))
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


def test_refusals_name_the_argument():
    layers = tf.keras.layers
    with pytest.raises(NotImplementedError, match="dilation_rate"):
        layers.Conv2DTranspose(2, 3, dilation_rate=2)
    with pytest.raises(NotImplementedError, match="output_padding"):
        layers.Conv2DTranspose(2, 3, strides=2, output_padding=1)
    with pytest.raises(NotImplementedError, match="data_format"):
        layers.Conv2DTranspose(2, 3, data_format="channels_first")
    with pytest.raises(ValueError, match="filters"):
        layers.Conv2DTranspose(0, 3)
    with pytest.raises(ValueError, match="padding"):
        layers.Conv2DTranspose(2, 3, padding="full")


def test_on_a_simulated_gpu(devices, rng):
    """One SGD step of a tiny model on two simulated GPUs: the ops' CUDA kernels."""
    devices(cpus=1, gpus=2)
    strategy = tf.distribute.MirroredStrategy(["GPU:0", "GPU:1"])
    strides, padding = (2, 2), "valid"
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((2, 2, 1)),
            tf.keras.layers.Conv2DTranspose(1, 2, strides=strides, padding=padding, bias_initializer="ones"),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    x = f32(rng.normal(size=(2, 2, 2, 1)))
    t = f32(rng.normal(size=(2, 1)))
    params = [a.astype(np.float64) for a in model.get_weights()]
    model.train_step(x, t)
    xs, ts = x.astype(np.float64), t.astype(np.float64)
    grads = [numeric_grad(lambda q, i=i: model_loss(params[:i] + [q] + params[i + 1:], xs, ts, strides, padding), p)
             for i, p in enumerate(params)]
    for got, p, g in zip(model.get_weights(), params, grads):
        np.testing.assert_allclose(got, p - 0.05 * g, rtol=1e-3, atol=1e-4)
    for v in model.weights:
        copies = [c.numpy() for c in components(v)]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), v.name
