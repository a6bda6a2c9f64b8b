"""TF's guide "Basic training loops" (guide/basic_training_loops), its last part: the linear
model written as a subclassed ``tf.keras.Model`` whose ``call`` is made of ops and its own
``tf.Variable``s, trained by the guide's GradientTape loop and then by ``compile``/``fit``
(issue 48). The imports changed only; checked against a float64 NumPy oracle of the same
steps, on 1 and 2 replicas of a MirroredStrategy (replicas bitwise equal).

Neighbours: tests/test_tf_guides.py (the other guides), mirrored/keras/model_call.py (how
such a model runs: one node whose layer runs the model's ``call``).
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.values import components

TRUE_W, TRUE_B, NUM_EXAMPLES = 3.0, 2.0, 1000


class MyModelKeras(tf.keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.w = tf.Variable(5.0)
        self.b = tf.Variable(0.0)

    def call(self, x):
        return self.w * x + self.b


def loss(target_y, predicted_y):                      # the guide's loss
    return tf.reduce_mean(tf.square(target_y - predicted_y))


def train(model, x, y, learning_rate):                # the guide's train step
    with tf.GradientTape() as t:
        current_loss = loss(y, model(x))
    dw, db = t.gradient(current_loss, [model.w, model.b])
    model.w.assign_sub(learning_rate * dw)
    model.b.assign_sub(learning_rate * db)


def _oracle_steps(w, b, x, y, steps, lr=0.1):
    """Full-batch gradient descent on the mean squared error, float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    for _ in range(steps):
        r = w * x + b - y
        w, b = w - lr * 2 * np.mean(r * x), b - lr * 2 * np.mean(r)
    return w, b


def _equal_replicas(v):
    first = components(v)[0].numpy()
    for c in components(v)[1:]:
        assert np.array_equal(c.numpy(), first), "replicas differ"


@pytest.mark.parametrize("replicas", [1, 2])
def test_basic_training_loops_keras_model(devices, replicas):
    devices(cpus=replicas)
    rng = np.random.default_rng()
    x = rng.standard_normal(NUM_EXAMPLES).astype(np.float32)
    y = (x * TRUE_W + TRUE_B + rng.standard_normal(NUM_EXAMPLES)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        keras_model = MyModelKeras()
    assert keras_model.variables[0] is keras_model.w and keras_model.variables[1] is keras_model.b
    assert [id(v) for v in keras_model.trainable_variables] == [id(keras_model.w), id(keras_model.b)]

    y_pred = keras_model(x)                            # x (1000,): one scalar per example
    assert tuple(y_pred.shape) == (NUM_EXAMPLES,)
    np.testing.assert_allclose(y_pred.numpy(), 5.0 * x, rtol=1e-6)

    for _ in range(3):                                  # the guide's training_loop, 3 epochs
        train(keras_model, x, y, learning_rate=0.1)
    w, b = _oracle_steps(5.0, 0.0, x, y, 3)
    np.testing.assert_allclose([keras_model.w.numpy(), keras_model.b.numpy()], [w, b], rtol=1e-5, atol=1e-5)

    with tf.GradientTape() as t:                        # gradients for model.variables
        current_loss = loss(y, keras_model(x))
    grads = t.gradient(current_loss, keras_model.variables)
    r = w * x.astype(np.float64) + b - y
    np.testing.assert_allclose([g.numpy() for g in grads], [2 * np.mean(r * x), 2 * np.mean(r)],
                               rtol=1e-4, atol=1e-5)

    keras_model.compile(run_eagerly=False, optimizer=tf.keras.optimizers.SGD(learning_rate=0.1),
                        loss=tf.keras.losses.mean_squared_error)
    history = keras_model.fit(x, y, epochs=10, batch_size=1000, verbose=0)
    w, b = _oracle_steps(w, b, x, y, 10)
    np.testing.assert_allclose([keras_model.w.numpy(), keras_model.b.numpy()], [w, b], rtol=1e-5, atol=1e-5)
    _equal_replicas(keras_model.w)
    _equal_replicas(keras_model.b)
    assert history.history["loss"][-1] < history.history["loss"][0]
    r = w * x.astype(np.float64) + b - y
    np.testing.assert_allclose(keras_model.evaluate(x, y, verbose=0), np.mean(r * r), rtol=1e-4)
    np.testing.assert_allclose(keras_model.predict(x, verbose=0), w * x + b, rtol=1e-5, atol=1e-5)


def test_mean_squared_error_function():
    rng = np.random.default_rng()
    a, p = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    want = ((a.astype(np.float64) - p) ** 2).mean(-1)
    np.testing.assert_allclose(tf.keras.losses.mean_squared_error(a, p).numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(tf.keras.losses.mse(a, p).numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(tf.keras.losses.mean_absolute_error(a, p).numpy(), np.abs(a - p.astype(np.float64)).mean(-1),
                               rtol=1e-6)


class Linear(tf.keras.Model):
    """Weights of rank 2 as attributes, call a matmul: one node running call (model_call.py)."""

    def __init__(self, w):
        super().__init__()
        self.w = tf.Variable(w)
        self.b = tf.Variable(np.zeros(w.shape[1], np.float32))

    def call(self, x, training=None):
        return tf.matmul(x, self.w) + self.b


def test_a_model_of_ops_on_its_own_matrices_fits_on_two_replicas(devices):
    devices(cpus=2)
    rng = np.random.default_rng()
    x, y = rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float32)
    w0 = rng.standard_normal((3, 2)).astype(np.float32)
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        model = Linear(w0)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, epochs=2, batch_size=6, shuffle=False, verbose=0)
    w, b, xd = w0.astype(np.float64), np.zeros(2), x.astype(np.float64)
    for _ in range(2):
        r = xd @ w + b - y
        w, b = w - 0.1 * 2 * xd.T @ r / r.size, b - 0.1 * 2 * r.sum(0) / r.size
    np.testing.assert_allclose(model.w.numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.b.numpy(), b, rtol=1e-5, atol=1e-6)
    _equal_replicas(model.w)
    assert model.predict(x, verbose=0).shape == (6, 2) and len(model.get_weights()) == 2
