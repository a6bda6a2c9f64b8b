"""Conv2D and MaxPooling2D layers (mirrored/keras/layers.py) in training.

Against a float64 NumPy oracle written here (direct loops over output pixels, no
im2col, no shared geometry code), and the key invariant on a tiny ConvNet: N replicas
train like one replica on the global batch, with bitwise-equal copies, on CPU devices
and on simulated logical GPUs. The shapes are tiny: the simulator runs a Python thread
per CUDA thread.

    python -m pytest -q tests/test_conv_layers.py
"""
import math
import re

import numpy as np
import pytest

import mirrored as tf
from tests.test_training import assert_replicas_bitwise_equal, equivalence_atol

layers = tf.keras.layers

#: SGD step vs the oracle: float32 forward/backward against float64 finite differences.
STEP_RTOL, STEP_ATOL = 1e-4, 1e-5
#: Central-difference step in float64 (truncation ~ EPS^2, rounding ~ 1e-16 / EPS).
EPS = 1e-6


# --- the float64 oracle ------------------------------------------------------------------------

def _pads(size, window, stride, padding):
    """(outputs, pad before, pad after) along one axis: TensorFlow's 'same' puts the odd
    extra after."""
    if padding == "valid":
        return (size - window) // stride + 1, 0, 0
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + window - size, 0)
    return out, total // 2, total - total // 2


def conv_f64(x, kernel, bias, strides, padding):
    """x (B, H, W, Cin), kernel (KH, KW, Cin, Cout): one output pixel at a time."""
    b, h, w, _ = x.shape
    kh, kw, _, cout = kernel.shape
    (oh, pt, pb), (ow, pl, pr) = _pads(h, kh, strides[0], padding), _pads(w, kw, strides[1], padding)
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    out = np.empty((b, oh, ow, cout))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, i * strides[0]:i * strides[0] + kh, j * strides[1]:j * strides[1] + kw, :]
            out[:, i, j, :] = np.tensordot(patch, kernel, axes=([1, 2, 3], [0, 1, 2]))
    return out + (0 if bias is None else bias)


def maxpool_f64(x, pool, strides, padding):
    b, h, w, c = x.shape
    (oh, pt, pb), (ow, pl, pr) = _pads(h, pool[0], strides[0], padding), _pads(w, pool[1], strides[1], padding)
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=-np.inf)   # padding never wins
    out = np.empty((b, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            win = xp[:, i * strides[0]:i * strides[0] + pool[0], j * strides[1]:j * strides[1] + pool[1], :]
            out[:, i, j, :] = win.max(axis=(1, 2))
    return out


def loss_f64(model, weights, x, y, masks=()):
    """Mean softmax cross-entropy of ``model``'s layers (read for their settings only),
    computed in float64 with ``weights`` (Keras's order); ``masks``: the keep mask (bool,
    shaped like the layer's input) of each Dropout layer, in order."""
    a, k, masks = x.astype(np.float64), 0, iter(masks)
    for layer in model.layers:
        if isinstance(layer, layers.Dropout):
            a = np.where(next(masks), a / (1 - layer.rate), 0)
        elif isinstance(layer, layers.Conv2D):
            bias = weights[k + 1] if layer.use_bias else None
            a = conv_f64(a, weights[k], bias, layer.strides, layer.padding)
            k += 2 if layer.use_bias else 1
        elif isinstance(layer, layers.MaxPooling2D):
            a = maxpool_f64(a, layer.pool_size, layer.strides, layer.padding)
        elif isinstance(layer, layers.Flatten):
            a = a.reshape(a.shape[0], -1)             # (h, w, c) order, as Keras
        else:
            a = a @ weights[k] + weights[k + 1]
            k += 2
        if getattr(layer, "activation", None) == "relu":
            a = np.maximum(a, 0)
    z = a - a.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(y)), y].mean()


def grads_f64(model, weights, x, y, masks=()):
    """d loss / d every weight by central differences in float64."""
    return central_differences(lambda ws: loss_f64(model, ws, x, y, masks), weights)


def central_differences(loss, arrays, eps=EPS):
    """d loss(arrays) / d every element of every array, by central differences in float64
    (``loss`` takes the list of arrays; also tests/test_merge_layers.py's gradients)."""
    arrays = [a.astype(np.float64) for a in arrays]
    grads = []
    for w in arrays:
        g = np.empty_like(w)
        for idx in np.ndindex(w.shape):
            keep = w[idx]
            w[idx] = keep + eps
            up = loss(arrays)
            w[idx] = keep - eps
            down = loss(arrays)
            w[idx] = keep
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def compiled(strategy, make_layers, optimizer):
    with strategy.scope():
        model = tf.keras.Sequential(make_layers())
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=optimizer, metrics=["accuracy"])
    return model


def tiny_convnet(input_shape=(6, 6, 1), filters=2, classes=3):
    """The lab's ConvNet in miniature: Conv2D(relu) -> MaxPooling2D -> Flatten -> Dense."""
    return lambda: [layers.Conv2D(filters, 3, activation="relu", input_shape=input_shape),
                    layers.MaxPooling2D(), layers.Flatten(), layers.Dense(classes)]


def two_convs():
    """A conv after a conv (so the first conv's dx is used), stride 2 with 'same', an
    overlapping 'same' pool, a conv without bias."""
    return [layers.Conv2D(2, 3, strides=2, padding="same", activation="relu", input_shape=(7, 7, 1)),
            layers.Conv2D(3, (2, 1), activation="relu", use_bias=False),
            layers.MaxPooling2D(2, strides=1, padding="same"), layers.Flatten(),
            layers.Dense(8, activation="relu"), layers.Dense(3)]


# --- forward/backward against the oracle ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["CPU", "GPU"])
@pytest.mark.parametrize("make_layers", [tiny_convnet(), two_convs], ids=["convnet", "two_convs"])
def test_one_sgd_step_matches_a_float64_oracle(devices, rng, kind, make_layers):
    devices(cpus=2, gpus=2 if kind == "GPU" else 0)
    lr = 0.5
    model = compiled(tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"]), make_layers,
                     tf.keras.optimizers.SGD(lr))
    shape = model.input_shape[1:]
    batch = 5                                                   # 3 + 2 rows over the replicas
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    y = rng.integers(0, 3, batch)
    before = model.get_weights()
    before = [w + rng.uniform(0.01, 0.1, w.shape).astype(np.float32) * (w == 0) for w in before]
    model.set_weights(before)                                   # nonzero biases: they must count
    grads = grads_f64(model, before, x, y)
    model.train_step(x, y)
    for v, w0, g, w1 in zip(model.trainable_variables, before, grads, model.get_weights()):
        np.testing.assert_allclose(w1, w0 - lr * g, rtol=STEP_RTOL, atol=STEP_ATOL, err_msg=v.name)
    assert model._logs()["loss"] == pytest.approx(loss_f64(model, before, x, y), rel=1e-5)
    assert_replicas_bitwise_equal(model)


# --- the invariant ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,n,opt", [("CPU", 2, "sgd"), ("CPU", 2, "adam"), ("CPU", 3, "adam"),
                                        ("GPU", 2, "adam")])
def test_n_replicas_train_a_convnet_exactly_like_one_replica(devices, rng, kind, n, opt):
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    batch, steps = (5, 3) if kind == "GPU" else (11, 8)          # B not divisible by N
    make_opt = {"sgd": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
                "adam": lambda: tf.keras.optimizers.Adam(0.01)}[opt]
    multi = compiled(tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)]), tiny_convnet(),
                     make_opt())
    single = compiled(tf.distribute.OneDeviceStrategy("CPU:0"), tiny_convnet(), make_opt())
    single.set_weights(multi.get_weights())
    start = multi.get_weights()
    xs = rng.random((steps, batch, 6, 6, 1), dtype=np.float32)
    ys = rng.integers(0, 3, (steps, batch))
    for s in range(steps):
        multi.train_step(xs[s], ys[s])
        single.train_step(xs[s], ys[s])
        assert_replicas_bitwise_equal(multi)
    # summed terms: a kernel gradient adds B x 4 x 4 output positions; the conv's dot
    # products 3 x 3 x 1 terms, the Dense's 2 x 2 x 2
    atol = equivalence_atol(single.get_weights(), steps, batch * 16 + 9 + 8)
    for a, b, w0 in zip(multi.get_weights(), single.get_weights(), start):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
        assert not np.array_equal(a, w0), "every weight trained"


# --- Keras's arrays, shapes and counts ------------------------------------------------------------------

def lab_convnet():
    """The course lab's model, as written there."""
    return tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation='relu'),
        tf.keras.layers.Dense(10)])


def test_the_lab_model_has_kerass_weights_shapes_and_summary(devices, capsys):
    devices(cpus=1)
    tf.keras.utils.set_random_seed(3)
    model = lab_convnet()
    model.summary()
    out = capsys.readouterr().out
    rows = [r"conv2d(_\d+)? \(Conv2D\) +\(None, 26, 26, 32\) +320 ",      # Keras's names, numbered
            r"max_pooling2d(_\d+)? \(MaxPooling2D\) +\(None, 13, 13, 32\) +0 ",   # as Keras does
            r"flatten(_\d+)? \(Flatten\) +\(None, 5408\) +0 ",
            r"dense(_\d+)? \(Dense\) +\(None, 64\) +346176 ",
            r"dense_\d+ \(Dense\) +\(None, 10\) +650 ",
            r"Total params: 347,146\n"]
    for row in rows:
        assert re.search(row, out), (row, out)
    assert model.count_params() == 347146
    weights = model.get_weights()
    assert [w.shape for w in weights] == [(3, 3, 1, 32), (32,), (5408, 64), (64,), (64, 10), (10,)]
    limit = math.sqrt(6 / (9 * 1 + 9 * 32))                     # Glorot: fans = 3*3 * channels
    assert 0.9 * limit < np.abs(weights[0]).max() <= limit
    assert not weights[1].any()
    new = [np.full(w.shape, i, np.float32) for i, w in enumerate(weights)]
    model.set_weights(new)
    for a, b in zip(model.get_weights(), new):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"shape \(3, 3, 1, 32\)"):
        model.set_weights([w.reshape(-1) for w in new])


def test_flatten_after_a_conv_feeds_dense_in_hwc_order(devices, rng):
    """Dense's kernel row (h*W + w)*C + c multiplies pixel (h, w), channel c: Keras's order."""
    devices(cpus=1)
    model = compiled(tf.distribute.OneDeviceStrategy("CPU:0"), tiny_convnet((4, 5, 2), filters=3),
                     "sgd")
    x = rng.standard_normal((2, 4, 5, 2)).astype(np.float32)
    w = model.get_weights()
    want = conv_f64(x.astype(np.float64), w[0], w[1], (1, 1), "valid")
    want = maxpool_f64(np.maximum(want, 0), (2, 2), (2, 2), "valid").reshape(2, -1) @ w[2] + w[3]
    got = model.predict(x, verbose=0)                           # logits: (2, 3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# --- bad input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,match", [
    (lambda: layers.Conv2D(0, 3), "filters must be a positive integer"),
    (lambda: layers.Conv2D(2.5, 3), "filters must be a positive integer"),
    (lambda: layers.Conv2D(2, 0), "kernel_size must be a positive integer"),
    (lambda: layers.Conv2D(2, (3, 3, 3)), "kernel_size"),
    (lambda: layers.Conv2D(2, 3, strides="2"), "strides must be a positive integer"),
    (lambda: layers.Conv2D(2, 3, padding="full"), "padding must be 'valid' or 'same'"),
    (lambda: layers.MaxPooling2D(pool_size=-1), "pool_size must be a positive integer"),
    (lambda: layers.MaxPooling2D(strides=1.5), "strides must be a positive integer"),
])
def test_bad_layer_arguments_are_refused_when_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_unsupported_options_name_what_is_supported():
    with pytest.raises(NotImplementedError, match="only 'channels_last'"):
        layers.Conv2D(2, 3, data_format="channels_first")
    with pytest.raises(NotImplementedError, match="only 'channels_last'"):
        layers.MaxPooling2D(data_format="channels_first")
    with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
        layers.Conv2D(2, 3, activation="tanhh")
    with pytest.raises(NotImplementedError, match="dilation_rate=1"):
        layers.Conv2D(2, 3, dilation_rate=2)
    with pytest.raises(NotImplementedError, match="Conv2D, MaxPooling2D"):
        layers.LSTM(4)


@pytest.mark.parametrize("make_layers,match", [
    (lambda: [layers.Conv2D(2, 5, input_shape=(4, 4, 1)), layers.Flatten(), layers.Dense(2)],
     r"Conv2D 'conv2d\w*' \(input images \(4, 4, 1\)\): the kernel is 5 along height"),
    (lambda: [layers.Conv2D(2, 3, input_shape=(28, 28)), layers.Flatten(), layers.Dense(2)],
     r"input_shape=\(28, 28, 1\)"),
    (lambda: [layers.Conv2D(2, 3, input_shape=(6, 6, 1)), layers.MaxPooling2D(5), layers.Flatten(),
              layers.Dense(2)], r"MaxPooling2D 'max_pooling2d\w*' .*the pool is 5 along height"),
    (lambda: [layers.Conv2D(2, 3, input_shape=(6, 6, 1)), layers.Dense(2)], "Flatten"),
    (lambda: [layers.Flatten(input_shape=(6, 6, 1)), layers.Conv2D(2, 3), layers.Dense(2)],
     r"takes images of shape \(height, width, channels\), got examples of shape \(36,\)"),
])
def test_bad_shapes_are_refused_at_build_with_nothing_built(devices, make_layers, match):
    devices(cpus=1)
    made = make_layers()
    with pytest.raises(ValueError, match=match):
        tf.keras.Sequential(made)
    assert not any(layer.built or layer.weights for layer in made), "a layer was built anyway"


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_images_without_their_channel_axis_are_refused_before_any_launch(devices, rng, kind):
    devices(cpus=1, gpus=1 if kind == "GPU" else 0)
    model = compiled(tf.distribute.OneDeviceStrategy(f"{kind}:0"), tiny_convnet(), "sgd")
    before = model.get_weights()
    x = rng.random((4, 6, 6), dtype=np.float32)                 # no channel axis
    y = rng.integers(0, 3, 4)
    with pytest.raises(ValueError, match=r"\(6, 6, 1\).*\(6, 6\)\. Add the channel axis"):
        model.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="Add the channel axis"):
        model.predict(x, verbose=0)
    with pytest.raises(ValueError, match="Add the channel axis"):
        model.train_step(x, y)
    with pytest.raises(ValueError, match=r"takes images of shape \(6, 6, 1\).*got examples of shape \(6, 3, 2\)\.$"):
        model.train_step(x.reshape(4, 6, 3, 2), y)                # the same features, the wrong channels
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    model.fit(x[..., None], y, verbose=0)                        # with it, it trains
    assert not np.array_equal(model.get_weights()[0], before[0])


def test_custom_loop_gradients_of_a_convnet_match_the_oracle(devices, rng):
    """The tutorial's custom loop (strategy.run + GradientTape + all_reduce) on the ConvNet."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential(tiny_convnet()())
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = rng.random((5, 6, 6, 1), dtype=np.float32)
    y = rng.integers(0, 3, 5)
    expected = grads_f64(model, model.get_weights(), x, y)
    (batch,) = list(strategy.experimental_distribute_dataset([(x, y)]))

    def step(inputs):
        xs, ys = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(ys, model(xs, training=True)), global_batch_size=5)
        return tf.distribute.get_replica_context().all_reduce(
            "SUM", tape.gradient(loss, model.trainable_variables))

    summed = strategy.run(step, args=(batch,))
    for g, e in zip(summed, expected):
        for comp in strategy.experimental_local_results(g):
            np.testing.assert_allclose(comp.numpy(), e, rtol=1e-4, atol=1e-5)
