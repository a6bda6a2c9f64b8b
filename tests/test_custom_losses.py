"""Losses written in ops in ``compile(loss=...)`` (a function, a ``keras.losses.Loss`` subclass)
and called on their own: float64 NumPy oracles, the built-in fused losses, 1 and 2 replicas."""
import numpy as np
import pytest

import mirrored as tf
from mirrored.values import MirroredVariable
from conftest import replica_strategy


def my_huber(y_true, y_pred):
    """The course's custom Huber."""
    error = y_true - y_pred
    small = tf.abs(error) <= 1
    return tf.where(small, tf.square(error) / 2, tf.abs(error) - 0.5)


class MyMSE(tf.keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred - y_true), axis=-1)


class MyCrossentropy(tf.keras.losses.Loss):
    """Cross-entropy of the model's OUTPUT (probabilities after a softmax layer)."""

    def call(self, y_true, y_pred):
        return -tf.reduce_sum(y_true * tf.math.log(y_pred), axis=-1)


_strategy = replica_strategy


def _linear(strategy, din, dout, loss, lr, activation=None):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(dout, activation=activation, input_shape=(din,))])
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(lr))
    return model


def _replicas_equal(model):
    for v in model.trainable_variables:
        if isinstance(v, MirroredVariable):
            for c in v.values[1:]:
                assert np.array_equal(v.values[0].numpy(), c.numpy())


def _huber64(e):
    return np.where(np.abs(e) <= 1, e * e / 2, np.abs(e) - 0.5)


@pytest.mark.parametrize("n,kind", [(1, "CPU"), (2, "CPU"), (2, "GPU")])
def test_custom_huber_trains_like_a_float64_oracle(devices, rng, n, kind):
    din, batch, steps, lr = 3, 10, 5, 0.2
    model = _linear(_strategy(devices, n, kind), din, 1, my_huber, lr)
    w, b = (a.astype(np.float64) for a in model.get_weights())
    xs = rng.standard_normal((steps, batch, din)).astype(np.float32)
    ys = (3 * rng.standard_normal((steps, batch))).astype(np.float32)     # some errors beyond 1
    for s in range(steps):
        x = xs[s].astype(np.float64)
        e = ys[s][:, None] - (x @ w + b)
        de = np.where(np.abs(e) <= 1, e, np.sign(e)) / e.size             # d mean / d e
        w, b = w + lr * x.T @ de, b + lr * de.sum(0)                       # d e / d pred = -1
        model.train_step(xs[s], ys[s])
        _replicas_equal(model)
    got_w, got_b = model.get_weights()
    np.testing.assert_allclose(got_w, w, rtol=0, atol=2e-6)
    np.testing.assert_allclose(got_b, b, rtol=0, atol=2e-6)
    x, y = xs[0], ys[0]
    want = _huber64(y[:, None] - (x.astype(np.float64) @ w + b)).mean()
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=batch, verbose=0), want, rtol=1e-5)


def test_fit_reports_the_custom_loss(devices, rng):
    model = _linear(_strategy(devices, 2), 2, 1, my_huber, 0.0)            # lr 0: weights fixed
    x = rng.standard_normal((12, 2)).astype(np.float32)
    y = (3 * rng.standard_normal(12)).astype(np.float32)
    w, b = model.get_weights()
    want = _huber64(y[:, None] - (x.astype(np.float64) @ w + b)).mean()
    history = model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], want, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2])
def test_a_loss_subclass_trains_like_the_builtin_mse(devices, rng, n):
    strategy = _strategy(devices, n)
    custom = _linear(strategy, 4, 3, MyMSE(), 0.1)
    builtin = _linear(strategy, 4, 3, "mse", 0.1)
    builtin.set_weights(custom.get_weights())
    for _ in range(3):
        x = rng.standard_normal((7, 4)).astype(np.float32)
        t = rng.standard_normal((7, 3)).astype(np.float32)
        custom.train_step(x, t)
        builtin.train_step(x, t)
    for a, b in zip(custom.get_weights(), builtin.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    _replicas_equal(custom)


def test_the_loss_gets_the_softmax_output_as_keras_gives_it(devices, rng):
    strategy = _strategy(devices, 2)
    custom = _linear(strategy, 4, 3, MyCrossentropy(), 0.5, activation="softmax")
    builtin = _linear(strategy, 4, 3, tf.keras.losses.CategoricalCrossentropy(), 0.5, activation="softmax")
    builtin.set_weights(custom.get_weights())
    x = rng.standard_normal((6, 4)).astype(np.float32)
    t = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 6)]
    for _ in range(3):
        custom.train_step(x, t)
        builtin.train_step(x, t)
    for a, b in zip(custom.get_weights(), builtin.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    np.testing.assert_allclose(custom.evaluate(x, t, verbose=0), builtin.evaluate(x, t, verbose=0), rtol=1e-5)


def test_called_on_its_own_it_returns_a_tensor(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        y_true, y_pred = np.array([[1.0], [3.0]], np.float32), tf.constant([[0.5], [0.0]])
        np.testing.assert_allclose(my_huber(tf.constant(y_true), y_pred).numpy(), [[0.125], [2.5]])
        loss = MyMSE()
        assert loss.name == "my_mse"
        np.testing.assert_allclose(loss(y_true, y_pred).numpy(), (0.25 + 9) / 2)
        np.testing.assert_allclose(MyMSE(reduction="none")(y_true, y_pred).numpy(), [0.25, 9.0])
        wrapped = tf.keras.losses.LossFunctionWrapper(my_huber)
        np.testing.assert_allclose(wrapped(np.array([1.0, 3.0]), tf.constant([[0.5], [0.0]])).numpy(), 1.3125)
