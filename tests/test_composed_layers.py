"""Activation, ReLU, LeakyReLU, Softmax, Reshape, Rescaling, Lambda (keras/composed_layers.py):
against NumPy, inside trained models (their gradients through the ops' rules), and in files."""
import numpy as np
import pytest

import mirrored as tf
from mirrored.keras import layers


def _np_softmax(z, axis=-1):
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


CASES = [
    (lambda: layers.Activation("relu"), lambda x: np.maximum(x, 0)),
    (lambda: layers.Activation("sigmoid"), lambda x: 1 / (1 + np.exp(-x))),
    (lambda: layers.Activation("tanh"), np.tanh),
    (lambda: layers.Activation("softmax"), _np_softmax),
    (lambda: layers.Activation("linear"), lambda x: x),
    (lambda: layers.Activation("leaky_relu"), lambda x: np.where(x >= 0, x, 0.2 * x)),
    (lambda: layers.ReLU(), lambda x: np.maximum(x, 0)),
    (lambda: layers.ReLU(max_value=0.5, negative_slope=0.1, threshold=-0.2),
     lambda x: np.minimum(np.where(x >= -0.2, x, 0.1 * (x + 0.2)), 0.5)),
    (lambda: layers.LeakyReLU(), lambda x: np.where(x >= 0, x, 0.3 * x)),
    (lambda: layers.LeakyReLU(negative_slope=0.1), lambda x: np.where(x >= 0, x, 0.1 * x)),
    (lambda: layers.Softmax(), _np_softmax),
    (lambda: layers.Softmax(axis=1), lambda x: _np_softmax(x, 1)),
    (lambda: layers.Reshape((3, 2)), lambda x: x.reshape(len(x), 3, 2)),
    (lambda: layers.Reshape((-1, 3)), lambda x: x.reshape(len(x), 2, 3)),
    (lambda: layers.Rescaling(1 / 255.0, offset=-1.0), lambda x: x / 255.0 - 1.0),
    (lambda: layers.Lambda(lambda t: t * 2.0 + 1.0), lambda x: x * 2 + 1),
]


@pytest.mark.parametrize("k", range(len(CASES)))
def test_each_layer_against_numpy(devices, rng, k):
    devices(cpus=1)
    make, want = CASES[k]
    x = rng.standard_normal((4, 6)).astype(np.float32)
    with tf.device("CPU:0"):
        got = make()(tf.constant(x)).numpy()
    np.testing.assert_allclose(got, want(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2])
def test_a_model_with_them_trains_like_its_numpy_oracle(devices, rng, n):
    """Rescaling -> Dense -> LeakyReLU -> Dense -> Activation('softmax'), sparse cross-entropy of
    the probabilities: the gradient flows back through every composed layer."""
    devices(cpus=n)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    din, hidden, classes, batch, lr = 4, 5, 3, 6, 0.5
    with strategy.scope():
        model = tf.keras.Sequential([layers.Rescaling(0.5, offset=0.1, input_shape=(din,)),
                                     layers.Dense(hidden), layers.LeakyReLU(negative_slope=0.1),
                                     layers.Reshape((hidden,)), layers.Dense(classes),
                                     layers.Activation("softmax")])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=tf.keras.optimizers.SGD(lr))
    w1, b1, w2, b2 = (w.astype(np.float64) for w in model.get_weights())
    x = rng.standard_normal((batch, din)).astype(np.float32)
    y = rng.integers(0, classes, batch)
    model.train_step(x, y)
    a0 = x.astype(np.float64) * 0.5 + 0.1
    z1 = a0 @ w1 + b1
    a1 = np.where(z1 >= 0, z1, 0.1 * z1)
    p = _np_softmax(a1 @ w2 + b2)
    dz2 = p.copy()
    dz2[np.arange(batch), y] -= 1
    dz2 /= batch
    dz1 = (dz2 @ w2.T) * np.where(z1 >= 0, 1.0, 0.1)
    want = [w1 - lr * a0.T @ dz1, b1 - lr * dz1.sum(0), w2 - lr * a1.T @ dz2, b2 - lr * dz2.sum(0)]
    for got, w in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0).sum(1), 1.0, rtol=1e-5)
    for v in model.trainable_variables:
        for c in getattr(v, "values", [v])[1:]:
            assert np.array_equal(c.numpy(), v.values[0].numpy())


def test_configs_are_keras_and_a_keras_file_round_trips(devices, rng, tmp_path):
    devices(cpus=1)
    assert layers.LeakyReLU().get_config()["negative_slope"] == 0.3
    assert layers.Reshape((2, -1)).get_config()["target_shape"] == [2, -1]
    assert layers.ReLU().get_config()["max_value"] is None
    assert layers.Softmax().get_config()["axis"] == -1
    with tf.distribute.OneDeviceStrategy("CPU:0").scope():
        model = tf.keras.Sequential([layers.Rescaling(2.0, input_shape=(3,)), layers.Dense(4),
                                     layers.ReLU(max_value=6.0), layers.Activation("tanh"), layers.Dense(2)])
    model.compile(loss="mse", optimizer="sgd")
    path = str(tmp_path / "m.keras")
    model.save(path)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    with tf.device("CPU:0"):
        loaded = tf.keras.models.load_model(path)
        assert [type(l).__name__ for l in loaded.layers] == ["Rescaling", "Dense", "ReLU", "Activation", "Dense"]
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_a_lambda_from_a_file_is_refused(devices, tmp_path):
    devices(cpus=1)
    with tf.distribute.OneDeviceStrategy("CPU:0").scope():
        model = tf.keras.Sequential([layers.Dense(2, input_shape=(3,)), layers.Lambda(lambda t: t * 3.0)])
    model.compile(loss="mse", optimizer="sgd")
    path = str(tmp_path / "lambda.keras")
    model.save(path)
    with tf.device("CPU:0"), pytest.raises(ValueError, match="Lambda.*not loaded from a file"):
        tf.keras.models.load_model(path)


def test_bad_arguments_say_what_to_do(devices):
    with pytest.raises(ValueError, match="unknown activation"):
        layers.Activation("nope")
    with pytest.raises(ValueError, match="at most one -1"):
        layers.Reshape((-1, -1))
    devices(cpus=1)
    with tf.device("CPU:0"), pytest.raises(ValueError, match="cannot become"):
        layers.Reshape((4,))(tf.constant(np.zeros((2, 3), np.float32)))
