"""``self.add_loss(value)`` in a custom layer's ``call`` inside a model trained by ``fit``
(keras.io, "Making new layers and models via subclassing": ActivityRegularizationLayer).

Keras's math: each replica's loss = its share of the compiled loss (sum over its rows / global
batch) + the layer's added loss on its rows x 1/N (MirroredStrategy scales ``model.losses`` by
1/num_replicas_in_sync); the gradients summed over replicas. A float64 NumPy oracle of that.
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import keras, values


class ActivityRegularizationLayer(keras.layers.Layer):
    def __init__(self, rate=1e-2):
        super().__init__()
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * tf.reduce_sum(inputs))
        return inputs


def oracle(weights, x, y, rate, replicas, lr, batch, steps):
    w1, b1, w2, b2 = [w.astype(np.float64) for w in weights]
    x, y = x.astype(np.float64), y.astype(np.float64)
    for s in range(steps):
        xb, yb = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
        h = xb @ w1 + b1
        out = h @ w2 + b2
        dout = 2 * (out - yb) / (batch * out.shape[1])          # mse: mean over outputs and rows
        dh = dout @ w2.T + rate / replicas                      # each replica's added loss x 1/N
        gw2, gb2, gw1, gb1 = h.T @ dout, dout.sum(0), xb.T @ dh, dh.sum(0)
        w1, b1, w2, b2 = w1 - lr * gw1, b1 - lr * gb1, w2 - lr * gw2, b2 - lr * gb2
    return [w1, b1, w2, b2]


@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_adds_the_layers_added_loss_to_the_models_loss(devices, replicas):
    devices(cpus=2)
    rng = np.random.default_rng()
    rate, lr, batch, steps = float(rng.uniform(0.05, 0.2)), 0.1, 8, 3
    x = rng.standard_normal((batch * steps, 3)).astype(np.float32)
    y = rng.standard_normal((batch * steps, 2)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  ActivityRegularizationLayer(rate), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    start = model.get_weights()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    want = oracle(start, x, y, rate, replicas, lr, batch, steps)
    for got, w in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    for v in model.trainable_variables:                         # replicas bitwise equal
        copies = [c.numpy() for c in values.components(v)]
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])
    # without the added loss's gradient the first layer's bias would move by the data term only
    plain = oracle(start, x, y, 0.0, replicas, lr, batch, steps)
    assert np.abs(model.get_weights()[1] - plain[1]).max() > 1e-3


def test_predict_runs_a_model_whose_layer_adds_a_loss(devices):
    devices(cpus=1)
    with tf.distribute.MirroredStrategy(["CPU:0"]).scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(2)(ActivityRegularizationLayer()(inputs)))
    x = np.random.default_rng().standard_normal((4, 3)).astype(np.float32)
    w, b = model.get_weights()
    np.testing.assert_allclose(model.predict(x, verbose=0), x @ w + b, rtol=1e-5, atol=1e-5)
