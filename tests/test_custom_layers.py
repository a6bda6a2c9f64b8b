"""Layers written as Keras writes them (``build`` + ``add_weight`` + a ``call`` made of ops):
in Sequential and functional models, in ``fit`` and in a GradientTape loop, on 1 and 2
replicas (logical CPUs), their weights in the model's packed buffer.

The oracles: the built-in ``Dense`` (the engine's fused kernels) from the same initial
weights, and a float64 NumPy forward/backward of the same SGD steps.
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.values import MirroredVariable
from conftest import replica_strategy


class SimpleDense(tf.keras.layers.Layer):
    """keras.io's SimpleDense (with an optional relu)."""

    def __init__(self, units=32, activation=None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.activation_name = units, activation

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal",
                                 trainable=True, name="kernel")
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True, name="bias")

    def call(self, inputs):
        y = tf.matmul(inputs, self.w) + self.b
        return tf.nn.relu(y) if self.activation_name == "relu" else y


class Linear(tf.keras.layers.Layer):
    """keras.io's Linear: weights made in __init__, no build."""

    def __init__(self, units=32, input_dim=32):
        super().__init__()
        self.w = self.add_weight(shape=(input_dim, units), initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return tf.matmul(inputs, self.w) + self.b


_strategy = replica_strategy


def _models(strategy, din, hidden, classes, lr):
    with strategy.scope():
        custom = tf.keras.Sequential([SimpleDense(hidden, activation="relu", input_shape=(din,)),
                                      SimpleDense(classes)])
        builtin = tf.keras.Sequential([tf.keras.layers.Dense(hidden, activation="relu", input_shape=(din,)),
                                       tf.keras.layers.Dense(classes)])
    for m in (custom, builtin):
        m.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(lr), metrics=["accuracy"])
    builtin.set_weights(custom.get_weights())
    return custom, builtin


def _assert_replicas_equal(model):
    for v in model.trainable_variables:
        if isinstance(v, MirroredVariable):
            for c in v.values[1:]:
                assert np.array_equal(v.values[0].numpy(), c.numpy()), f"{c.name} drifted"


def _numpy_sgd(weights, xs, ys, lr):
    """Float64 SGD on Dense(relu) -> Dense, mean softmax cross-entropy."""
    w1, b1, w2, b2 = (w.astype(np.float64) for w in weights)
    for x, y in zip(xs, ys):
        x = x.astype(np.float64)
        z1 = x @ w1 + b1
        a1 = np.maximum(z1, 0)
        z2 = a1 @ w2 + b2
        p = np.exp(z2 - z2.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        dz2 = p.copy()
        dz2[np.arange(len(y)), y] -= 1
        dz2 /= len(y)
        dz1 = (dz2 @ w2.T) * (z1 > 0)
        w1, b1, w2, b2 = w1 - lr * x.T @ dz1, b1 - lr * dz1.sum(0), w2 - lr * a1.T @ dz2, b2 - lr * dz2.sum(0)
    return [w1, b1, w2, b2]


@pytest.mark.parametrize("n,kind", [(1, "CPU"), (2, "CPU"), (2, "GPU")])
def test_simple_dense_trains_like_dense_and_a_float64_oracle(devices, rng, n, kind):
    din, hidden, classes, batch, steps, lr = 6, 5, 4, 9, 4, 0.5
    custom, builtin = _models(_strategy(devices, n, kind), din, hidden, classes, lr)
    start = custom.get_weights()
    assert [w.shape for w in start] == [(din, hidden), (hidden,), (hidden, classes), (classes,)]
    assert [v.name for v in custom.trainable_variables][:2] == [
        f"{custom.layers[0].name}/kernel:0", f"{custom.layers[0].name}/bias:0"]
    assert np.std(start[0]) < 0.2 and np.std(start[0]) > 0.01          # random_normal(0, 0.05)
    xs = rng.standard_normal((steps, batch, din)).astype(np.float32)
    ys = rng.integers(0, classes, (steps, batch))
    for s in range(steps):
        custom.train_step(xs[s], ys[s])
        builtin.train_step(xs[s], ys[s])
        _assert_replicas_equal(custom)
    want = _numpy_sgd(start, xs, ys, lr)
    for got, same, w, w0 in zip(custom.get_weights(), builtin.get_weights(), want, start):
        np.testing.assert_allclose(got, w, rtol=0, atol=2e-5)
        np.testing.assert_allclose(got, same, rtol=0, atol=2e-5)
        assert not np.allclose(got, w0), "the weights trained"


def test_fit_and_evaluate_in_a_functional_model_with_linear(devices, rng):
    strategy = _strategy(devices, 2)
    din, classes = 4, 3
    with strategy.scope():
        inputs = tf.keras.Input(shape=(din,))
        layer = Linear(classes, din)
        model = tf.keras.Model(inputs, layer(inputs))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(0.3))
    w0 = [w.astype(np.float64) for w in model.get_weights()]
    x = rng.standard_normal((8, din)).astype(np.float32)
    y = rng.integers(0, classes, 8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    z = x @ w0[0] + w0[1]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = p.copy()
    dz[np.arange(8), y] -= 1
    dz /= 8
    np.testing.assert_allclose(model.get_weights()[0], w0[0] - 0.3 * x.T @ dz, atol=2e-6)
    _assert_replicas_equal(model)
    logits = x @ model.get_weights()[0] + model.get_weights()[1]
    np.testing.assert_allclose(model.predict(x, verbose=0), logits, atol=1e-5)
    loss = model.evaluate(x, y, verbose=0)
    lp = logits - logits.max(1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
    np.testing.assert_allclose(loss, -lp[np.arange(8), y].mean(), rtol=1e-5)


def test_gradient_tape_loop_under_two_replicas_matches_fit(devices, rng):
    strategy = _strategy(devices, 2)
    din, hidden, classes, batch = 5, 4, 3, 8
    custom, builtin = _models(strategy, din, hidden, classes, 0.2)
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(y, custom(x, training=True)), global_batch_size=batch)
        grads = tape.gradient(loss, custom.trainable_variables)
        custom.optimizer.apply_gradients(zip(grads, custom.trainable_variables))
        return loss

    x = rng.standard_normal((batch, din)).astype(np.float32)
    y = rng.integers(0, classes, batch)
    ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))
    for inputs in ds:
        strategy.run(step, args=(inputs,))
    builtin.train_step(x, y)
    for got, want in zip(custom.get_weights(), builtin.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    _assert_replicas_equal(custom)


def test_eager_call_builds_and_differentiates(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        layer = SimpleDense(3)
        x = tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4))
        with tf.GradientTape() as tape:
            y = layer(x)
            loss = tf.reduce_sum(y * y)
    assert layer.built and [w.shape for w in layer.weights] == [(4, 3), (3,)]
    w, b = layer.w.numpy(), layer.b.numpy()
    np.testing.assert_allclose(y.numpy(), x.numpy() @ w + b, rtol=1e-6, atol=1e-6)
    dw, db = tape.gradient(loss, layer.trainable_weights)
    np.testing.assert_allclose(dw.numpy(), x.numpy().T @ (2 * y.numpy()), rtol=1e-5)
    np.testing.assert_allclose(db.numpy(), (2 * y.numpy()).sum(0), rtol=1e-5)


def test_save_and_load_weights_round_trip(devices, rng, tmp_path):
    strategy = _strategy(devices, 2)
    custom, _ = _models(strategy, 4, 3, 2, 0.1)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    custom.fit(x, rng.integers(0, 2, 6), epochs=1, verbose=0)
    path = str(tmp_path / "m.weights.h5")
    custom.save_weights(path)
    other, _ = _models(strategy, 4, 3, 2, 0.1)
    assert not np.allclose(other.get_weights()[0], custom.get_weights()[0])
    other.load_weights(path)
    for a, b in zip(other.get_weights(), custom.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(other.predict(x, verbose=0), custom.predict(x, verbose=0))


def test_add_weight_regularizer_adds_its_penalty(devices, rng):
    devices(cpus=1)

    class Reg(SimpleDense):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal",
                                     regularizer=tf.keras.regularizers.L2(0.5))
            self.b = self.add_weight(shape=(self.units,), initializer="zeros")

    with tf.distribute.OneDeviceStrategy("CPU:0").scope():
        model = tf.keras.Sequential([Reg(2, input_shape=(3,))])
    model.compile(loss="mse", optimizer=tf.keras.optimizers.SGD(0.1))
    w0 = model.get_weights()
    x = rng.standard_normal((4, 3)).astype(np.float32)
    t = rng.standard_normal((4, 2)).astype(np.float32)
    model.train_step(x, t)
    err = x @ w0[0] + w0[1] - t
    dw = x.T @ (2 * err / err.size) + 2 * 0.5 * w0[0]
    np.testing.assert_allclose(model.get_weights()[0], w0[0] - 0.1 * dw, atol=1e-5)
    assert len(model.layers[0].losses) == 1


def test_clear_errors(devices):
    devices(cpus=1)

    class Frozen(tf.keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(2,), trainable=False)

        def call(self, x):
            return x

    with tf.device("CPU:0"):                     # add_weight(trainable=False): state, now taken
        frozen = Frozen()
        frozen(np.zeros((1, 2), np.float32))
    assert not frozen.trainable_weights and len(frozen.non_trainable_weights) == 1

    class Wrong(tf.keras.layers.Layer):
        def call(self, x):
            return tf.cast(x, tf.float64)

    with tf.device("CPU:0"), pytest.raises(TypeError, match="float32"):
        tf.keras.Sequential([Wrong(input_shape=(2,)), tf.keras.layers.Dense(1)])


def test_fit_on_simulated_gpus_replays_a_custom_layer_like_the_cpu(devices, rng):
    """fit's compiled step (captured or replayed per batch size) runs the layer's ops anew on
    each batch: 2 simulated GPUs end where 2 logical CPUs do, from the same weights."""
    x = rng.random((16, 3)).astype(np.float32)
    y = rng.random((16, 2)).astype(np.float32)
    results = []
    for kind in ("CPU", "GPU"):
        strategy = _strategy(devices, 2, kind)
        with strategy.scope():
            model = tf.keras.Sequential([SimpleDense(4, activation="relu", input_shape=(3,)), SimpleDense(2)])
        model.compile(loss="mse", optimizer=tf.keras.optimizers.SGD(0.1))
        if results:
            model.set_weights(results[0][0])
        start = model.get_weights()
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
        _assert_replicas_equal(model)
        results.append((start, model.get_weights(), history.history["loss"]))
    (_, cpu, cpu_loss), (_, gpu, gpu_loss) = results
    for a, b, w0 in zip(cpu, gpu, results[0][0]):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-6)
        assert not np.allclose(a, w0)
    np.testing.assert_allclose(gpu_loss, cpu_loss, rtol=1e-5)
    assert gpu_loss[-1] < gpu_loss[0]


class ConfiguredDense(SimpleDense):
    """SimpleDense with Keras's get_config, so model.save can write its arguments."""

    def get_config(self):
        return dict(super().get_config(), units=self.units, activation=self.activation_name)


def test_keras_file_round_trip_through_custom_objects(devices, rng, tmp_path):
    """.keras files name a custom layer by class; load_model rebuilds it only from the class the
    caller passes (custom_objects), with the saved arguments and weights; without it, refused."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        model = tf.keras.Sequential([ConfiguredDense(4, activation="relu", input_shape=(3,)),
                                     tf.keras.layers.Dense(2)])
        model.compile(loss="mse", optimizer="adam")
        x = rng.random((6, 3)).astype(np.float32)
        model.fit(x, rng.random((6, 2)).astype(np.float32), verbose=0)
        path = tmp_path / "custom.keras"
        model.save(path)
        with pytest.raises(NotImplementedError, match="custom_objects"):
            tf.keras.models.load_model(path)
        loaded = tf.keras.models.load_model(path, custom_objects={"ConfiguredDense": ConfiguredDense})
        assert isinstance(loaded.layers[0], ConfiguredDense) and loaded.layers[0].units == 4
        assert loaded.layers[0].activation_name == "relu"
        for a, b in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


class CountingDense(SimpleDense):
    """SimpleDense that counts how often its Python ``call`` runs."""

    calls = 0

    def call(self, inputs):
        type(self).calls += 1
        return super().call(inputs)


class HostReadingDense(SimpleDense):
    """A call that reads a value on the host (an ``if`` on a tensor): never replayable."""

    calls = 0

    def call(self, inputs):
        type(self).calls += 1
        y = super().call(inputs)
        return y * 2.0 if float(tf.reduce_sum(inputs)) > 1e9 else y


@pytest.mark.parametrize("layer_class", [CountingDense, HostReadingDense])
def test_fit_replays_a_call_layers_launches_bitwise_as_running_its_python(devices, rng, layer_class):
    """fit records its step's first run per batch size, a call-layer's forward/backward with
    it, and replays the launches after (Keras traces its train step); the weights are bitwise
    those of running the Python every step (``run_eagerly=True``). A call that reads the host
    runs every step."""
    from test_custom_losses import my_huber
    strategy = _strategy(devices, 2)
    x = rng.random((40, 3)).astype(np.float32)
    y = (3 * rng.random((40, 2))).astype(np.float32)
    results = []
    for eager in (False, True):
        with strategy.scope():
            model = tf.keras.Sequential([layer_class(4, activation="relu", input_shape=(3,)), layer_class(2)])
        model.compile(loss=my_huber, optimizer=tf.keras.optimizers.SGD(0.1), run_eagerly=eager)
        if results:
            model.set_weights(results[0][0])
        start = model.get_weights()
        layer_class.calls = 0
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
        results.append((start, model.get_weights(), history.history["loss"], layer_class.calls))
        _assert_replicas_equal(model)
    (_, replayed, loss_r, calls_r), (_, eager_w, loss_e, calls_e) = results
    for a, b, w0 in zip(replayed, eager_w, results[0][0]):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, w0)
    np.testing.assert_array_equal(loss_r, loss_e)
    steps = 3 * 5 * 2 * 2                              # epochs x batches x replicas x layers
    assert calls_e >= steps
    if layer_class is CountingDense:
        assert calls_r <= 2 * 2 * 2, calls_r           # once per layer, replica and training flag
    else:
        assert calls_r >= steps                        # never replayed: its Python every step


def test_real_keras_reads_a_custom_layers_weights_and_we_read_its(devices, rng, tmp_path):
    """Where Keras 3 is installed (skipped otherwise): the same SimpleDense class written for
    each library; .weights.h5 files go both ways and the two predict the same numbers."""
    import os
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    keras = pytest.importorskip("keras")
    devices(cpus=1)

    def keras_model():
        class SimpleDense(keras.layers.Layer):      # the same class name: Keras keys weights by it
            def __init__(self, units, **kwargs):
                super().__init__(**kwargs)
                self.units = units

            def build(self, input_shape):
                self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal",
                                         name="kernel")
                self.b = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

            def call(self, inputs):
                return keras.ops.matmul(inputs, self.w) + self.b
        return keras.Sequential([keras.Input((3,)), SimpleDense(4), keras.layers.Dense(2)])

    x = rng.random((5, 3)).astype(np.float32)
    theirs = keras_model()
    theirs.set_weights([rng.standard_normal(w.shape).astype(np.float32) for w in theirs.get_weights()])
    theirs.save_weights(tmp_path / "k.weights.h5")
    with tf.device("CPU:0"):
        ours = tf.keras.Sequential([SimpleDense(4, input_shape=(3,)), tf.keras.layers.Dense(2)])
        ours.load_weights(tmp_path / "k.weights.h5")
        np.testing.assert_allclose(ours.predict(x, verbose=0), theirs.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
        ours.set_weights([w * 0.5 for w in ours.get_weights()])
        ours.save_weights(tmp_path / "m.weights.h5")
        back = keras_model()
        back.load_weights(tmp_path / "m.weights.h5")
        np.testing.assert_allclose(back.predict(x, verbose=0), ours.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
