"""Keras's activations on Dense and Conv2D beyond the ones their kernels fuse (relu, softmax):
``Dense(8, activation='tanh')`` is the layer's linear kernel then the activation's op, one node
more in the model's program (``composed_layers.unfused_activation``, ``functional.expand``), and
``keras.activations`` names the same functions.

Each is checked against a float64 NumPy oracle of Keras's math: the prediction, and one SGD step
(the activation's gradient from its op's rule) on 1 and 2 replicas, whose copies stay bitwise
equal; the config and a ``.keras`` file keep the name; ``model.layers`` and the summary's
counts are Keras's (the activation is not a layer there).
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import keras
from mirrored.values import components

#: the oracle of each activation (float64) and of its derivative, from its output z's input
ORACLES = {
    "sigmoid": (lambda z: 1 / (1 + np.exp(-z)), lambda z: np.exp(-z) / (1 + np.exp(-z)) ** 2),
    "tanh": (np.tanh, lambda z: 1 - np.tanh(z) ** 2),
    "elu": (lambda z: np.where(z > 0, z, np.expm1(z)), lambda z: np.where(z > 0, 1.0, np.exp(z))),
    "softplus": (lambda z: np.log1p(np.exp(z)), lambda z: 1 / (1 + np.exp(-z))),
    "swish": (lambda z: z / (1 + np.exp(-z)),
              lambda z: 1 / (1 + np.exp(-z)) + z * np.exp(-z) / (1 + np.exp(-z)) ** 2),
    "leaky_relu": (lambda z: np.where(z > 0, z, 0.2 * z), lambda z: np.where(z > 0, 1.0, 0.2)),
    "exponential": (np.exp, np.exp),
}
LR = 0.1


def sgd_step(weights, x, t, name):
    """float64: one SGD step of Dense(h, name) -> Dense(1) on the mean squared error."""
    f, df = ORACLES[name]
    k0, b0, k1, b1 = (w.astype(np.float64) for w in weights)
    z = x @ k0 + b0
    h = f(z)
    out = h @ k1 + b1
    dout = 2 * (out - t) / out.size
    dk1, db1 = h.T @ dout, dout.sum(0)
    dz = (dout @ k1.T) * df(z)
    dk0, db0 = x.T @ dz, dz.sum(0)
    return [k0 - LR * dk0, b0 - LR * db0, k1 - LR * dk1, b1 - LR * db1]


@pytest.mark.parametrize("name", sorted(ORACLES))
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dense_activation_predicts_and_trains_as_the_float64_oracle(devices, rng, name, replicas):
    devices(cpus=2)
    x = rng.standard_normal((10, 4)).astype(np.float32)
    t = rng.standard_normal((10, 1)).astype(np.float32)
    with tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)]).scope():
        keras.utils.set_random_seed(int(rng.integers(1 << 30)))
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation=name), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(LR), "mse")
    start = model.get_weights()
    f = ORACLES[name][0]
    want = f(x.astype(np.float64) @ start[0] + start[1]) @ start[2] + start[3]
    np.testing.assert_allclose(model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-5)
    model.fit(x, t, batch_size=10, epochs=1, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), sgd_step(start, x.astype(np.float64), t, name)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    for v in model.trainable_variables:
        copies = [c.numpy() for c in components(v)]
        assert all(np.array_equal(copies[0], c) for c in copies[1:])


def test_a_sigmoid_output_with_binary_crossentropy_and_a_tanh_conv(devices, rng, tmp_path):
    """A sigmoid last layer gives probabilities to binary_crossentropy (Keras's default
    from_logits=False); Conv2D(activation='tanh') is the convolution then tanh; both survive
    get_config and a .keras file; model.layers and the parameter count are Keras's."""
    devices(cpus=1)
    x = rng.standard_normal((6, 5, 5, 2)).astype(np.float32)
    y = (rng.random((6, 1)) > 0.5).astype(np.float32)
    model = keras.Sequential([keras.Input((5, 5, 2)), keras.layers.Conv2D(3, 3, activation="tanh"),
                              keras.layers.Flatten(), keras.layers.Dense(1, activation="sigmoid")])
    assert [type(layer).__name__ for layer in model.layers] == ["Conv2D", "Flatten", "Dense"]
    assert model.count_params() == (3 * 3 * 2 * 3 + 3) + (27 + 1)
    kernel, bias, k1, b1 = (w.astype(np.float64) for w in model.get_weights())
    conv = np.zeros((6, 3, 3, 3))
    for i in range(3):
        for j in range(3):
            conv[:, i, j] = np.einsum("nhwc,hwco->no", x[:, i:i + 3, j:j + 3], kernel)
    p = 1 / (1 + np.exp(-(np.tanh(conv + bias).reshape(6, -1) @ k1 + b1)))
    np.testing.assert_allclose(model.predict(x, verbose=0), p, rtol=1e-5, atol=1e-6)
    model.compile(keras.optimizers.SGD(LR), "binary_crossentropy")
    bce = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), bce, rtol=1e-5)
    assert [c["config"].get("activation") for c in model.get_config()["layers"]][-3::2] == ["tanh", "sigmoid"]
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_keras_activations_by_name_and_as_functions(devices, rng):
    devices(cpus=1)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(keras.activations.tanh(tf.constant(x)).numpy(), np.tanh(x), rtol=1e-6)
    assert keras.activations.get("sigmoid") is keras.activations.sigmoid
    assert keras.activations.serialize(keras.activations.swish) == "swish"
    layer = keras.layers.Dense(2, activation=keras.activations.elu)
    assert layer.get_config()["activation"] == "elu"
    with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
        keras.layers.Dense(2, activation="tanhh")
    with pytest.raises(ValueError, match="not one of Keras's activations"):
        keras.activations.serialize(lambda z: z)
