"""keras.io's guide "Making new layers and models via subclassing" (Keras 3 version), example
by example, with ``import mirrored as tf`` / ``from mirrored import keras`` / ``from
mirrored.keras import layers, ops`` for its imports; each against a float64 NumPy oracle.

The classes are the guide's, word for word (tiny sizes instead of MNIST's). The VAE's
``Sampling`` draws from ``keras.random.normal``; the oracle tests replace that function with
one that returns a fixed epsilon per column (the same for every row, so 2 replicas = 1
replica on the global batch holds), which the oracle uses too.

    python -m pytest -q tests/test_subclassing_guide.py
"""
import sys

import numpy as np
import pytest

import mirrored as tf
from mirrored import keras, values
from mirrored.keras import layers, ops

TOL = dict(rtol=2e-5, atol=2e-6)      # float32 against float64, a few steps of tiny sums


# --- the guide's layers ----------------------------------------------------------------------
class Linear(keras.layers.Layer):
    def __init__(self, units=32, input_dim=32):
        super().__init__()
        self.w = self.add_weight(shape=(input_dim, units), initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class ComputeSum(keras.layers.Layer):
    def __init__(self, input_dim):
        super().__init__()
        self.total = self.add_weight(initializer="zeros", shape=(input_dim,), trainable=False)

    def call(self, inputs):
        self.total.assign_add(ops.sum(inputs, axis=0))
        return self.total


class LazyLinear(keras.layers.Layer):            # the guide's second Linear: weights in build
    def __init__(self, units=32, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal",
                                 trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b

    def get_config(self):
        config = super().get_config()
        config.update({"units": self.units})
        return config


class MLPBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.linear_1 = LazyLinear(32)
        self.linear_2 = LazyLinear(32)
        self.linear_3 = LazyLinear(1)

    def call(self, inputs):
        x = self.linear_1(inputs)
        x = keras.activations.relu(x)
        x = self.linear_2(x)
        x = keras.activations.relu(x)
        return self.linear_3(x)


class ActivityRegularizationLayer(keras.layers.Layer):
    def __init__(self, rate=1e-2):
        super().__init__()
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * ops.mean(inputs))
        return inputs


class OuterLayer(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.activity_reg = ActivityRegularizationLayer(1e-2)

    def call(self, inputs):
        return self.activity_reg(inputs)


class OuterLayerWithKernelRegularizer(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(32, kernel_regularizer=keras.regularizers.l2(1e-3))

    def call(self, inputs):
        return self.dense(inputs)


class CustomDropout(keras.layers.Layer):
    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs, training=None):
        if training:
            return keras.random.dropout(inputs, rate=self.rate, seed=self.seed_generator)
        return inputs


# --- the guide's VAE -------------------------------------------------------------------------
class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class Encoder(layers.Layer):
    """Maps MNIST digits to a triplet (z_mean, z_log_var, z)."""

    def __init__(self, latent_dim=32, intermediate_dim=64, name="encoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_mean = layers.Dense(latent_dim)
        self.dense_log_var = layers.Dense(latent_dim)
        self.sampling = Sampling()

    def call(self, inputs):
        x = self.dense_proj(inputs)
        z_mean = self.dense_mean(x)
        z_log_var = self.dense_log_var(x)
        z = self.sampling((z_mean, z_log_var))
        return z_mean, z_log_var, z


class Decoder(layers.Layer):
    """Converts z, the encoded digit vector, back into a readable digit."""

    def __init__(self, original_dim, intermediate_dim=64, name="decoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_output = layers.Dense(original_dim, activation="sigmoid")

    def call(self, inputs):
        x = self.dense_proj(inputs)
        return self.dense_output(x)


class VariationalAutoEncoder(keras.Model):
    """Combines the encoder and decoder into an end-to-end model for training."""

    def __init__(self, original_dim, intermediate_dim=64, latent_dim=32, name="autoencoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.original_dim = original_dim
        self.encoder = Encoder(latent_dim=latent_dim, intermediate_dim=intermediate_dim)
        self.decoder = Decoder(original_dim, intermediate_dim=intermediate_dim)

    def call(self, inputs):
        z_mean, z_log_var, z = self.encoder(inputs)
        reconstructed = self.decoder(z)
        # Add KL divergence regularization loss.
        kl_loss = -0.5 * ops.mean(z_log_var - ops.square(z_mean) - ops.exp(z_log_var) + 1)
        self.add_loss(kl_loss)
        return reconstructed


# --- the same VAE in the TensorFlow guide's spelling (tf.shape, tf.random.normal, tf.exp) -------
class TFSampling(layers.Layer):
    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = tf.shape(z_mean)[0]
        dim = tf.shape(z_mean)[1]
        epsilon = tf.random.normal(shape=(batch, dim))
        return z_mean + tf.exp(0.5 * z_log_var) * epsilon


class TFVariationalAutoEncoder(VariationalAutoEncoder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.encoder.sampling = TFSampling()

    def call(self, inputs):
        z_mean, z_log_var, z = self.encoder(inputs)
        reconstructed = self.decoder(z)
        kl_loss = -0.5 * tf.reduce_mean(z_log_var - tf.square(z_mean) - tf.exp(z_log_var) + 1)
        self.add_loss(kl_loss)
        return reconstructed


# --- the oracle's pieces ----------------------------------------------------------------------
def f64(ws):
    return [np.asarray(w, np.float64) for w in ws]


def vae_forward(w, x, eps):
    """The VAE in float64; w in ``vae.trainable_weights``' order (encoder's three Dense, then
    the decoder's two). Returns the loss (MSE + KL) and what the backward needs."""
    w1, b1, wm, bm, wl, bl, w3, b3, w4, b4 = w
    hp = x @ w1 + b1
    h = np.maximum(hp, 0)
    zm, zl = h @ wm + bm, h @ wl + bl
    z = zm + np.exp(0.5 * zl) * eps
    h2p = z @ w3 + b3
    h2 = np.maximum(h2p, 0)
    out = 1 / (1 + np.exp(-(h2 @ w4 + b4)))
    kl = -0.5 * np.mean(zl - zm ** 2 - np.exp(zl) + 1)
    return np.mean((x - out) ** 2) + kl, (hp, h, zm, zl, z, h2p, h2, out)


def vae_grads(w, x, eps):
    """d (MSE + KL) / d w by hand, float64."""
    w1, b1, wm, bm, wl, bl, w3, b3, w4, b4 = w
    hp, h, zm, zl, z, h2p, h2, out = vae_forward(w, x, eps)[1]
    n_out, n_kl = out.size, zm.size
    da4 = 2 * (out - x) / n_out * out * (1 - out)
    dh2p = (da4 @ w4.T) * (h2p > 0)
    dz = dh2p @ w3.T
    dzm = dz + zm / n_kl
    dzl = dz * eps * 0.5 * np.exp(0.5 * zl) - 0.5 * (1 - np.exp(zl)) / n_kl
    dhp = (dzm @ wm.T + dzl @ wl.T) * (hp > 0)
    return [x.T @ dhp, dhp.sum(0), h.T @ dzm, dzm.sum(0), h.T @ dzl, dzl.sum(0),
            z.T @ dh2p, dh2p.sum(0), h2.T @ da4, da4.sum(0)]


def sgd_oracle(w, batches, eps, lr):
    """The weights after SGD on ``batches``, and each step's loss (MSE + KL) before its update."""
    w, losses = f64(w), []
    for x in batches:
        x = np.asarray(x, np.float64)
        losses.append(vae_forward(w, x, eps)[0])
        w = [p - lr * g for p, g in zip(w, vae_grads(w, x, eps))]
    return w, losses


@pytest.fixture
def fixed_epsilon(monkeypatch):
    """``keras.random.normal`` replaced by a fixed epsilon per column (every row the same)."""
    holder = {}

    def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        batch, dim = int(shape[0]), int(shape[1])
        if "eps" not in holder:
            holder["eps"] = np.random.default_rng().standard_normal(dim).astype(np.float32)
        return ops.ones((batch, dim)) * holder["eps"]          # on the device of the call

    def tf_normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None, name=None):
        return normal([int(n) for n in shape])

    monkeypatch.setattr(keras.random, "normal", normal)
    monkeypatch.setattr(tf.random, "normal", tf_normal)
    return holder


@pytest.fixture
def on_cpu(devices):
    """One CPU device, and new tensors there (a machine with a GPU, or the CUDA simulator, would
    otherwise take the eager examples: TensorFlow places on a GPU first)."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        yield


def assert_replicas_equal(model):
    for v in model.trainable_variables:
        copies = [c.numpy() for c in values.components(v)]
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])


# --- keras.ops: Keras 3's names for the op table's rows ----------------------------------------
def test_keras_ops_compute_what_numpy_does(on_cpu):
    rng = np.random.default_rng()
    a = rng.uniform(0.5, 2, (3, 4)).astype(np.float32)
    b = rng.uniform(0.5, 2, (4, 2)).astype(np.float32)
    x = a.astype(np.float64)
    cases = [(ops.matmul(a, b), x @ b), (ops.sum(a, axis=0), x.sum(0)), (ops.mean(a), x.mean()),
             (ops.max(a, axis=1, keepdims=True), x.max(1, keepdims=True)), (ops.min(a), x.min()),
             (ops.square(a), x ** 2), (ops.exp(a), np.exp(x)), (ops.log(a), np.log(x)),
             (ops.sqrt(a), np.sqrt(x)), (ops.power(a, 3.0), x ** 3), (ops.clip(a, 1.0, 1.5), np.clip(x, 1, 1.5)),
             (ops.concatenate([a, a], axis=1), np.concatenate([x, x], 1)), (ops.ones((2, 3)), np.ones((2, 3))),
             (ops.zeros((2,)), np.zeros(2)), (ops.relu(a - 1), np.maximum(x - 1, 0)),
             (ops.sigmoid(a), 1 / (1 + np.exp(-x))), (ops.reshape(a, (4, 3)), x.reshape(4, 3)),
             (ops.transpose(a), x.T), (ops.argmax(a, axis=1), x.argmax(1)), (ops.argmax(a), x.argmax())]
    for got, want in cases:
        np.testing.assert_allclose(np.asarray(got.numpy(), np.float64), want, rtol=1e-6, atol=1e-6)
    assert ops.shape(a) == (3, 4) and isinstance(ops.shape(a)[0], int)


# --- the tests, in the guide's order -------------------------------------------------------------
def test_linear_with_add_weight_in_init(on_cpu):
    x = ops.ones((2, 2))
    linear_layer = Linear(4, 2)
    y = linear_layer(x)
    assert linear_layer.weights == [linear_layer.w, linear_layer.b]
    w, b = f64(linear_layer.get_weights())
    np.testing.assert_allclose(y.numpy(), np.ones((2, 2)) @ w + b, **TOL)
    np.testing.assert_array_equal(b, 0)


def test_compute_sum_keeps_a_non_trainable_total(on_cpu):
    x = ops.ones((2, 2))
    my_sum = ComputeSum(2)
    np.testing.assert_array_equal(my_sum(x).numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(my_sum(x).numpy(), [4.0, 4.0])
    assert (len(my_sum.weights), len(my_sum.non_trainable_weights), my_sum.trainable_weights) == (1, 1, [])


def test_lazy_linear_and_the_mlp_block_track_their_weights(on_cpu):
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    mlp = MLPBlock()
    y = mlp(x)                                   # the first call creates the weights
    assert (len(mlp.weights), len(mlp.trainable_weights)) == (6, 6)
    w1, b1, w2, b2, w3, b3 = f64(mlp.get_weights())
    want = np.maximum(np.maximum(x @ w1 + b1, 0) @ w2 + b2, 0) @ w3 + b3
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)


def test_add_loss_is_reset_at_each_outermost_call(on_cpu):
    layer = OuterLayer()
    assert len(layer.losses) == 0                # never called yet
    _ = layer(ops.zeros((1, 1)))
    assert len(layer.losses) == 1
    x = np.random.default_rng().standard_normal((3, 2)).astype(np.float32)
    _ = layer(x)
    assert len(layer.losses) == 1                # the loss of the call above only
    np.testing.assert_allclose(float(layer.losses[0].numpy()), 1e-2 * np.mean(x.astype(np.float64)), **TOL)


def test_losses_hold_an_inner_dense_kernel_penalty(on_cpu):
    layer = OuterLayerWithKernelRegularizer()
    _ = layer(ops.zeros((1, 1)))
    (penalty,) = layer.losses
    kernel = np.asarray(layer.dense.kernel.numpy(), np.float64)
    np.testing.assert_allclose(float(penalty.numpy()), 1e-3 * np.sum(kernel ** 2), **TOL)


@pytest.mark.parametrize("replicas", [1, 2])
def test_add_loss_in_fit_with_and_without_a_compiled_loss(devices, replicas):
    """The guide's functional model of one ActivityRegularizationLayer (no weights at all):
    ``compile(optimizer="adam", loss="mse")`` reports MSE + the added term,
    ``compile(optimizer="adam")`` the added term alone."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    x, y = np.random.random((2, 3)), np.random.random((2, 3))
    with strategy.scope():
        inputs = keras.Input(shape=(3,))
        outputs = ActivityRegularizationLayer()(inputs)
        model = keras.Model(inputs, outputs)
    added = 1e-2 * np.mean(x)                    # on 2 replicas: each row's own, averaged over rows
    model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, y, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], np.mean((x - y) ** 2) + added, **TOL)
    model.compile(optimizer="adam")
    history = model.fit(x, y, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], added, **TOL)


def test_compile_without_a_loss_refuses_a_model_that_adds_none(on_cpu):
    inputs = keras.Input(shape=(3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam")
    with pytest.raises(ValueError, match="No loss to compute.*add_loss"):
        model.fit(np.zeros((2, 3)), np.zeros((2, 2)), verbose=0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_model_losses_in_the_guides_custom_loop(devices, replicas):
    """The guide's loop snippet (``loss_value += sum(model.losses)``) on a functional model
    Dense -> ActivityRegularizationLayer: after ``model(x)``, ``model.losses`` holds this call's
    term (not the build's trial on zeros), and the weights move as a float64 oracle says. Under
    N replicas each replica adds its share, ``tf.nn.scale_regularization_loss``, as TF's guides do."""
    devices(cpus=2)
    rng = np.random.default_rng()
    lr, batch, steps, rate = 0.1, 4, 2, float(rng.uniform(0.5, 2))
    x = rng.standard_normal((batch * steps, 3)).astype(np.float32)
    y = rng.standard_normal((batch * steps, 2)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        inputs = keras.Input(shape=(3,))
        model = keras.Model(inputs, ActivityRegularizationLayer(rate)(keras.layers.Dense(2)(inputs)))
        optimizer = keras.optimizers.SGD(learning_rate=lr)
        loss_fn = keras.losses.MeanSquaredError()
    w, b = f64(model.get_weights())
    seen = []

    def step(x_batch_train, y_batch_train):
        with tf.GradientTape() as tape:
            logits = model(x_batch_train)
            loss_value = loss_fn(y_batch_train, logits)
            (term,) = model.losses
            seen.append((x_batch_train.numpy().astype(np.float64), float(term.numpy())))
            loss_value += tf.nn.scale_regularization_loss(sum(model.losses))
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    for xb, yb in strategy.experimental_distribute_dataset(dataset):
        strategy.run(step, args=(xb, yb))
    for s in range(steps):
        xb, yb = x[s * batch:(s + 1) * batch].astype(np.float64), y[s * batch:(s + 1) * batch]
        for x_r, term in [t for t in seen if t[0].shape[0] and np.isin(t[0], xb).all()]:
            np.testing.assert_allclose(term, rate * np.mean(x_r @ w + b), **TOL)   # this call's term
        out = xb @ w + b
        dout = 2 * (out - yb) / out.size + rate / out.size                   # mse + rate * mean(out)
        w, b = w - lr * xb.T @ dout, b - lr * dout.sum(0)
    np.testing.assert_allclose(model.get_weights()[0], w, **TOL)
    np.testing.assert_allclose(model.get_weights()[1], b, **TOL)
    assert len(seen) == steps * replicas
    assert_replicas_equal(model)


def test_a_conv_layer_inside_a_call_of_layers_and_ops_is_refused_by_name(on_cpu):
    """Only Dense (and layers written with call) run as ops inside such a call: Conv2D says so."""
    class ConvThenScale(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = keras.layers.Conv2D(2, 3)
            self.flat = keras.layers.Flatten()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(self.flat(self.conv(x))) * 2.0     # ops on a layer's output

    with pytest.raises(NotImplementedError, match=r"Conv2D 'conv2d.*\['Dense'\].*functional model"):
        ConvThenScale()(np.zeros((2, 5, 5, 1), np.float32))


def test_get_config_and_from_config():
    layer = LazyLinear(64)
    config = layer.get_config()
    assert config == {"name": layer.name, "trainable": True, "dtype": "float32", "units": 64}
    new_layer = LazyLinear.from_config(config)
    assert (new_layer.units, new_layer.name) == (64, layer.name)


def test_custom_dropout_drops_in_training_only(on_cpu):
    x = np.random.default_rng().uniform(1, 2, (4, 8)).astype(np.float32)
    layer = CustomDropout(0.5)
    np.testing.assert_array_equal(layer(x).numpy(), x)
    y = layer(x, training=True).numpy()
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / 0.5, rtol=1e-6)
    assert 0 < kept.sum() < x.size


def test_the_vae_eagerly_lists_its_kl_loss(on_cpu, fixed_epsilon):
    x = np.random.default_rng().uniform(0, 1, (5, 7)).astype(np.float32)
    vae = VariationalAutoEncoder(7, 4, 3)
    reconstructed = vae(x)
    assert reconstructed.shape == (5, 7)
    (kl,) = vae.losses                           # the last call's, once
    _ = vae(x)
    assert len(vae.losses) == 1
    w = f64(w.numpy() for w in vae.trainable_weights)
    loss, (*_, out) = vae_forward(w, x.astype(np.float64), fixed_epsilon["eps"].astype(np.float64))
    np.testing.assert_allclose(reconstructed.numpy(), out, **TOL)
    np.testing.assert_allclose(float(kl.numpy()), loss - np.mean((x - out) ** 2), **TOL)


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_vae_custom_loop_matches_a_float64_oracle(devices, fixed_epsilon, replicas):
    """The guide's loop (GradientTape, ``loss += sum(vae.losses)``, apply_gradients, a Mean
    metric) inside ``strategy.run``: Keras 3's loss object already takes 1/N of its mean there,
    and ``tf.nn.scale_regularization_loss`` 1/N of the added terms, so the gradients the
    optimizer sums over the replicas are the global batch's (on 1 replica: the guide's loop)."""
    devices(cpus=2)
    rng = np.random.default_rng()
    lr, batch, steps = 0.5, 8, 2
    x_train = rng.uniform(0, 1, (batch * steps, 7)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        vae = VariationalAutoEncoder(7, 4, 3)
        optimizer = keras.optimizers.SGD(learning_rate=lr)
        mse_loss_fn = keras.losses.MeanSquaredError()
        loss_metric = keras.metrics.Mean()
        vae.build((None, 7))
    start = [w.numpy() for w in vae.trainable_weights]
    train_dataset = tf.data.Dataset.from_tensor_slices(x_train).batch(batch)

    def step(x_batch_train):
        with tf.GradientTape() as tape:
            reconstructed = vae(x_batch_train)
            loss = mse_loss_fn(x_batch_train, reconstructed)      # x 1/N under N replicas (Keras 3)
            loss += tf.nn.scale_regularization_loss(sum(vae.losses))   # sum / N, as TF's guides add it
        grads = tape.gradient(loss, vae.trainable_weights)
        optimizer.apply_gradients(zip(grads, vae.trainable_weights))
        return loss

    for x_batch_train in strategy.experimental_distribute_dataset(train_dataset):
        loss_metric(strategy.reduce("SUM", strategy.run(step, args=(x_batch_train,)), axis=None))
    eps = fixed_epsilon["eps"].astype(np.float64)
    want, losses = sgd_oracle(start, np.split(x_train, steps), eps, lr)
    for got, w in zip(vae.trainable_weights, want):
        np.testing.assert_allclose(got.numpy(), w, **TOL)
    assert_replicas_equal(vae)
    np.testing.assert_allclose(float(loss_metric.result()), np.mean(losses), **TOL)   # the replicas' sum


def test_each_replica_reads_its_own_added_losses_under_thread_switches(devices, fixed_epsilon):
    """The race behind a once-in-a-suite failure of the custom loop above on 2 replicas: the
    values ``call`` gave ``add_loss`` during ``vae(x)`` (an untraceable model, run op by op:
    ``model_call.call_eagerly``) were one list per layer shared by the replica threads, so one
    replica's call could clear or append to it between the other's call and its read of
    ``vae.losses``, which then held the other replica's KL term (on the other device), none, or
    two. With the interpreter switching threads every microsecond that shows within a few
    steps; each replica must read exactly its own term, on its own device, every step."""
    devices(cpus=2)
    x = np.random.default_rng().uniform(0, 1, (8, 7)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        vae = VariationalAutoEncoder(7, 4, 3)
        vae.build((None, 7))
    dist_x = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(8))))

    wrong = []                                   # list.append: safe from both threads

    def step(x_batch):
        y = vae(x_batch)
        on = [t.device for t in vae.losses]
        if on != [y.device]:
            wrong.append(f"a replica on {y.device} read losses on {on}")

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(60):
            strategy.run(step, args=(dist_x,))
    finally:
        sys.setswitchinterval(before)
    assert not wrong, f"{len(wrong)} of 120 reads: {wrong[:3]}"


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_vae_fit_matches_a_float64_oracle(devices, fixed_epsilon, replicas):
    """``vae.compile(optimizer, loss=MeanSquaredError()); vae.fit(x_train, x_train)``: the KL
    term the model adds joins the loss that is differentiated and the loss fit reports."""
    devices(cpus=2)
    rng = np.random.default_rng()
    lr, batch, steps = 0.5, 8, 3
    x_train = rng.uniform(0, 1, (batch * steps, 7)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        vae = VariationalAutoEncoder(7, 4, 3)
        vae.compile(keras.optimizers.SGD(learning_rate=lr), loss=keras.losses.MeanSquaredError())
        vae.build((None, 7))
    start = [w.numpy() for w in vae.trainable_weights]
    history = vae.fit(x_train, x_train, epochs=1, batch_size=batch, shuffle=False, verbose=0)
    eps = fixed_epsilon["eps"].astype(np.float64)
    want, losses = sgd_oracle(start, np.split(x_train, steps), eps, lr)
    for got, w in zip(vae.trainable_weights, want):
        np.testing.assert_allclose(got.numpy(), w, **TOL)
    assert_replicas_equal(vae)
    # Keras reports the compiled loss plus the added ones (the KL term), averaged over the epoch
    np.testing.assert_allclose(history.history["loss"][0], np.mean(losses), **TOL)
    evaluated = vae.evaluate(x_train, x_train, batch_size=batch, verbose=0)     # evaluate's too
    np.testing.assert_allclose(evaluated, np.mean([vae_forward(want, xb, eps)[0] for xb in
                                                   np.split(x_train.astype(np.float64), steps)]), **TOL)


def test_the_tf_spelling_of_the_vae_trains_in_the_guides_loop_and_in_fit(devices, fixed_epsilon):
    """The TensorFlow-era guide's loop, word for word on one device (``loss += sum(vae.losses)``),
    then fit on 2 replicas from the same start: both against the float64 oracle."""
    devices(cpus=2)
    rng = np.random.default_rng()
    lr, batch, steps = 0.5, 6, 2
    x_train = rng.uniform(0, 1, (batch * steps, 7)).astype(np.float32)
    with tf.device("CPU:0"):
        vae = TFVariationalAutoEncoder(7, 4, 3)
        vae.build((None, 7))
        start = [w.numpy() for w in vae.trainable_weights]
        optimizer = keras.optimizers.SGD(learning_rate=lr)
        mse_loss_fn = keras.losses.MeanSquaredError()
        loss_metric = keras.metrics.Mean()
        train_dataset = tf.data.Dataset.from_tensor_slices(x_train).batch(batch)
        for step, x_batch_train in enumerate(train_dataset):
            with tf.GradientTape() as tape:
                reconstructed = vae(x_batch_train)
                loss = mse_loss_fn(x_batch_train, reconstructed)
                loss += sum(vae.losses)  # Add KLD regularization loss
            grads = tape.gradient(loss, vae.trainable_weights)
            optimizer.apply_gradients(zip(grads, vae.trainable_weights))
            loss_metric(loss)
    eps = fixed_epsilon["eps"].astype(np.float64)
    want, losses = sgd_oracle(start, np.split(x_train, steps), eps, lr)
    for got, w in zip(vae.trainable_weights, want):
        np.testing.assert_allclose(got.numpy(), w, **TOL)
    np.testing.assert_allclose(float(loss_metric.result()), np.mean(losses), **TOL)

    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        vae = TFVariationalAutoEncoder(7, 4, 3)
        vae.compile(keras.optimizers.SGD(learning_rate=lr), loss=keras.losses.MeanSquaredError())
        vae.build((None, 7))
    vae.set_weights(start)
    history = vae.fit(x_train, x_train, epochs=1, batch_size=batch, shuffle=False, verbose=0)
    for got, w in zip(vae.trainable_weights, want):
        np.testing.assert_allclose(got.numpy(), w, **TOL)
    np.testing.assert_allclose(history.history["loss"][0], np.mean(losses), **TOL)
    assert_replicas_equal(vae)


def test_the_guides_vae_trains_with_adam_and_its_random_draws(devices):
    """The guide as written (keras.random.normal with a SeedGenerator, Adam): both loops run
    on 2 replicas, the replicas stay bitwise equal and the loss goes down."""
    devices(cpus=2)
    x_train = np.random.default_rng().uniform(0, 1, (64, 7)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        vae = VariationalAutoEncoder(7, 4, 3)
        optimizer = keras.optimizers.Adam(learning_rate=1e-2)
        vae.compile(optimizer, loss=keras.losses.MeanSquaredError())
    history = vae.fit(x_train, x_train, epochs=4, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert_replicas_equal(vae)


def test_real_keras_reads_the_vaes_weights_and_we_read_its(devices, tmp_path):
    """Where Keras 3 is installed (skipped otherwise): the guide's VAE classes, their source run
    again with Keras's own ``keras``, ``layers`` and ``ops``; .weights.h5 files go both ways and
    the encoders' z_mean and the decoders' outputs agree."""
    import inspect
    import os
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    real = pytest.importorskip("keras")
    devices(cpus=1)
    source = "\n".join(inspect.getsource(c) for c in (Sampling, Encoder, Decoder, VariationalAutoEncoder))
    theirs_ns = {"keras": real, "layers": real.layers, "ops": real.ops}
    exec(source, theirs_ns)                                           # noqa: S102 (the guide's classes)
    x = np.random.default_rng().uniform(0, 1, (4, 7)).astype(np.float32)

    def outputs(vae):
        z_mean = vae.encoder(x)[0]
        return np.asarray(z_mean), np.asarray(vae.decoder(z_mean))

    ours = VariationalAutoEncoder(7, 4, 3)
    ours(x)
    ours.set_weights([np.random.default_rng().standard_normal(w.shape).astype(np.float32) * 0.5
                      for w in ours.get_weights()])
    ours.save_weights(tmp_path / "ours.weights.h5")
    theirs = theirs_ns["VariationalAutoEncoder"](7, 4, 3)
    theirs(x)
    theirs.load_weights(tmp_path / "ours.weights.h5")
    for a, b in zip(outputs(theirs), (t.numpy() for t in (ours.encoder(x)[0], ours.decoder(ours.encoder(x)[0])))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    theirs.save_weights(tmp_path / "theirs.weights.h5")
    back = VariationalAutoEncoder(7, 4, 3)
    back(x)
    back.load_weights(tmp_path / "theirs.weights.h5")
    for a, b in zip(back.get_weights(), theirs.get_weights()):
        np.testing.assert_array_equal(a, np.asarray(b))
