"""fit running a model's own ``train_step`` (keras.io, "Customizing what happens in fit() with
TensorFlow"), evaluate its ``test_step``, predict its ``predict_step`` (keras/custom_step.py).

The guide's CustomModel, a functional subclass (``CustomModel(inputs, outputs)``) whose
``train_step`` calls ``self.compute_loss``, ``self.optimizer.apply`` and updates ``self.metrics``,
trains under MirroredStrategy on 2 logical CPUs, on 1, and with no strategy. Each is compared
with a float64 NumPy oracle of the same batches from the same initial weights (float32
tolerance: the products are BLAS's), which also gives the per-epoch loss and MAE that History
must hold. The 2-replica batches are uneven (7 rows: 4 + 3; 5 rows: 3 + 2), so a loss divided
by anything but the global batch would show. The replicas' copies are compared bitwise: the
update is one all-reduce and the same kernel on every copy.

    python -m pytest -n 0 -q tests/test_custom_train_step.py
"""
import warnings

import numpy as np
import pytest

import mirrored as tf
from mirrored import keras
from mirrored.traced_function import EagerFallbackWarning
from mirrored.values import components

TOL = dict(rtol=2e-4, atol=2e-5)        # float32 against float64, a few steps of Adam
LR = 0.01


class CustomModel(keras.Model):
    """keras.io's first example, word for word but for the names of our modules."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class EvalModel(keras.Model):
    """keras.io's test_step example."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def strategy_for(replicas):
    if replicas is None:
        return None
    return tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])


def build(cls, strategy, features, hidden, outputs=1):
    scope = strategy.scope() if strategy is not None else tf.device("CPU:0")
    with scope:
        inputs = keras.Input(shape=(features,))
        h = keras.layers.Dense(hidden, activation="relu")(inputs)
        out = keras.layers.Dense(outputs)(h)
        model = cls(inputs, out)
        model.compile(optimizer=keras.optimizers.Adam(LR), loss="mse", metrics=["mae"])
    return model


# -- the float64 oracle ------------------------------------------------------------------------
def forward(ws, x):
    k1, b1, k2, b2 = ws
    z = x @ k1 + b1
    h = np.maximum(z, 0.0)
    return z, h, h @ k2 + b2


def mse_grads(ws, x, y):
    """Keras's MSE over the batch (mean over outputs, then over examples) and its gradients."""
    k1, b1, k2, b2 = ws
    z, h, p = forward(ws, x)
    loss = np.mean(np.mean((p - y) ** 2, axis=-1))
    dp = 2.0 * (p - y) / (p.shape[0] * p.shape[1])
    dk2, db2 = h.T @ dp, dp.sum(0)
    dz = (dp @ k2.T) * (z > 0)
    return loss, p, [x.T @ dz, dz.sum(0), dk2, db2]


def adam_oracle(ws, x, y, batch, epochs):
    """Adam (Keras's formula) over the batches in order; per epoch, the mean of the batches'
    losses (the guide's loss tracker) and the mean absolute error over every example."""
    ws = [w.astype(np.float64) for w in ws]
    m = [np.zeros_like(w) for w in ws]
    v = [np.zeros_like(w) for w in ws]
    t, history = 0, {"loss": [], "mae": []}
    for _ in range(epochs):
        losses, abs_err, count = [], 0.0, 0
        for i in range(0, len(x), batch):
            xb, yb = x[i:i + batch].astype(np.float64), y[i:i + batch].astype(np.float64)
            loss, p, grads = mse_grads(ws, xb, yb)
            losses.append(loss)
            abs_err += np.abs(p - yb).mean(axis=-1).sum()
            count += len(xb)
            t += 1
            alpha = LR * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
            for w, g, mk, vk in zip(ws, grads, m, v):
                mk += (g - mk) * 0.1
                vk += (g * g - vk) * 0.001
                w -= alpha * mk / (np.sqrt(vk) + 1e-7)
        history["loss"].append(float(np.mean(losses)))
        history["mae"].append(abs_err / count)
    return ws, history


def check_copies_equal(model):
    for v in model.trainable_variables:
        copies = [c.numpy() for c in components(v)]
        for c in copies[1:]:
            assert np.array_equal(c, copies[0]), f"replicas' copies of {v.name} differ"


@pytest.mark.parametrize("replicas", [2, 1, None])
def test_the_guides_custom_model_trains_as_the_float64_oracle(devices, rng, replicas):
    devices(cpus=max(replicas or 1, 1))
    strategy = strategy_for(replicas)
    features, hidden, batch, epochs = 5, 4, 7, 2
    x = rng.standard_normal((19, features)).astype(np.float32)       # batches of 7, 7, 5
    y = rng.standard_normal((19, 1)).astype(np.float32)
    model = build(CustomModel, strategy, features, hidden)
    assert type(model).__name__ == "CustomModel" and isinstance(model, CustomModel)
    start = model.get_weights()
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    want, want_history = adam_oracle(start, x, y, batch, epochs)
    for got, w in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, w, **TOL)
    assert sorted(history.history) == ["loss", "mae"]
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], want_history[key], **TOL)
    assert model.optimizer.iterations.numpy() == 3 * epochs
    check_copies_equal(model)


def test_the_progress_line_shows_what_train_step_returned(devices, rng, capsys):
    devices(cpus=2)
    model = build(CustomModel, strategy_for(2), 3, 2)
    model.fit(rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal((8, 1)).astype(np.float32),
              batch_size=4, epochs=1, verbose=1)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "2/2" in line and " - loss: " in line and " - mae: " in line, line


def test_a_test_step_of_ones_own_in_evaluate(devices, rng):
    devices(cpus=2)
    strategy = strategy_for(2)
    x = rng.standard_normal((11, 4)).astype(np.float32)
    y = rng.standard_normal((11, 1)).astype(np.float32)
    model = build(EvalModel, strategy, 4, 3)
    ws = [w.astype(np.float64) for w in model.get_weights()]
    losses, abs_err = [], 0.0
    for i in range(0, 11, 4):
        loss, p, _ = mse_grads(ws, x[i:i + 4].astype(np.float64), y[i:i + 4].astype(np.float64))
        losses.append(loss)
        abs_err += np.abs(p - y[i:i + 4]).mean(axis=-1).sum()
    result = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    assert sorted(result) == ["loss", "mae"]
    np.testing.assert_allclose(result["loss"], np.mean(losses), **TOL)
    np.testing.assert_allclose(result["mae"], abs_err / 11, **TOL)
    assert model.optimizer.iterations.numpy() == 0                # evaluate trains nothing


def test_a_predict_step_of_ones_own(devices, rng):
    devices(cpus=2)

    class Doubled(keras.Model):
        def predict_step(self, data):
            return self(data, training=False) * 2.0

    model = build(Doubled, strategy_for(2), 3, 2)
    x = rng.standard_normal((9, 3)).astype(np.float32)
    _, _, p = forward([w.astype(np.float64) for w in model.get_weights()], x.astype(np.float64))
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0), 2 * p, **TOL)


def test_optimizer_apply_equals_apply_gradients_in_a_custom_loop(devices, rng):
    devices(cpus=2)
    strategy = strategy_for(2)
    x = rng.standard_normal((10, 4)).astype(np.float32)
    y = rng.integers(0, 3, 10)
    models = []
    for _ in range(2):
        with strategy.scope():
            m = keras.Sequential([keras.layers.Dense(5, activation="relu", input_shape=(4,)),
                                  keras.layers.Dense(3)])
            opt = keras.optimizers.Adam(0.05)
        models.append((m, opt))
    models[1][0].set_weights(models[0][0].get_weights())
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)

    def step_with(model, opt, use_apply):
        def train_step(inputs):
            images, labels = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(labels, model(images, training=True)),
                                                  global_batch_size=5)
            grads = tape.gradient(loss, model.trainable_variables)
            if use_apply:
                opt.apply(grads, model.trainable_variables)
            else:
                opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return train_step

    for use_apply, (model, opt) in zip((True, False), models):
        fn = step_with(model, opt, use_apply)
        for _ in range(2):
            for batch in strategy.experimental_distribute_dataset(dataset):
                strategy.run(fn, args=(batch,))
    for a, b in zip(models[0][0].get_weights(), models[1][0].get_weights()):
        assert np.array_equal(a, b)
    assert models[0][1].iterations.numpy() == 4
    assert not np.array_equal(models[0][0].get_weights()[0], models[1][0].get_weights()[0] * 0)
    with pytest.raises(ValueError, match="trainable_variables"):
        models[0][1].apply([None])


def test_the_guides_lower_level_model_with_its_own_metrics_property(devices, rng):
    """keras.io's second example: compile(optimizer=...) only, a loss object, its own trackers
    and ``metrics`` property (so fit resets them each epoch)."""
    devices(cpus=1)

    class LowLevel(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    with tf.device("CPU:0"):
        inputs = keras.Input(shape=(3,))
        h = keras.layers.Dense(4, activation="relu")(inputs)
        model = LowLevel(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.Adam(LR))
        x = rng.standard_normal((12, 3)).astype(np.float32)
        y = rng.standard_normal((12, 1)).astype(np.float32)
        start = model.get_weights()
        history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    want, want_history = adam_oracle(start, x, y, 6, 2)
    for got, w in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, w, **TOL)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], want_history[key], **TOL)


def test_a_custom_compile_with_its_own_optimizer(devices, rng):
    """A ``compile`` of one's own that calls ``super().compile()`` (Keras's default optimizer,
    not implemented here, is accepted then) and keeps its own optimizer and loss."""
    devices(cpus=2)

    class OwnCompile(keras.Model):
        def compile(self, my_optimizer, loss_fn):
            super().compile()
            self.my_optimizer, self.loss_fn = my_optimizer, loss_fn

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                per_example = self.loss_fn(y, self(x, training=True))
                loss = tf.nn.compute_average_loss(per_example)
            grads = tape.gradient(loss, self.trainable_variables)
            self.my_optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"batch_loss": loss}     # not a metric's name: the mean over the replicas

    strategy = strategy_for(2)
    with strategy.scope():
        inputs = keras.Input(shape=(3,))
        h = keras.layers.Dense(4, activation="relu")(inputs)
        model = OwnCompile(inputs, keras.layers.Dense(1)(h))
        model.compile(keras.optimizers.Adam(LR), keras.losses.MeanSquaredError(reduction="none"))
    x = rng.standard_normal((8, 3)).astype(np.float32)
    y = rng.standard_normal((8, 1)).astype(np.float32)
    start = model.get_weights()
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    want, want_history = adam_oracle(start, x, y, 4, 1)
    for got, w in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, w, **TOL)
    # the returned loss is each replica's share of the last batch's loss (computed with the
    # weights after the first step); its key names no metric of model.metrics, so Keras 3
    # reduces it by the mean over the replicas (reduce_per_replica "auto" under
    # MirroredStrategy): half the batch's loss on 2 replicas, as Keras 3.15.1 reports it
    after_first, _ = adam_oracle(start, x[:4], y[:4], 4, 1)
    last_loss, _, _ = mse_grads(after_first, x[4:].astype(np.float64), y[4:].astype(np.float64))
    np.testing.assert_allclose(history.history["batch_loss"], [last_loss / 2], **TOL)
    with pytest.raises(NotImplementedError, match="RMSprop"):
        model.optimizer.apply_gradients([])


def test_keras_default_train_step_runs_a_model_whose_layer_talks_across_replicas(devices, rng):
    """A layer marked ``cross_replica`` (BatchNormalization(synchronized=True) is one) makes fit
    and evaluate run Keras 3's default train_step/test_step under strategy.run, a thread per
    replica: on 2 replicas it trains to the fused step's weights (the same sums in the same
    order: bitwise here), reports the same loss and metric, and the copies stay equal."""
    devices(cpus=2)
    x = rng.standard_normal((48, 5)).astype(np.float32)
    y = rng.standard_normal((48, 1)).astype(np.float32)
    results = []
    for flagged in (False, True):
        with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                                      keras.layers.Dense(1)])
            model.layers[0].cross_replica = flagged
            model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
            history = model.fit(x, y, batch_size=12, epochs=2, verbose=0, shuffle=False).history
            scores = model.evaluate(x, y, verbose=0, return_dict=True)
        assert model._custom_train is flagged
        for v in model.trainable_variables:
            first, second = (c.numpy() for c in components(v))
            assert np.array_equal(first, second)
        results.append((history, scores, model.get_weights()))
    (h0, s0, w0), (h1, s1, w1) = results
    for key in ("loss", "mae"):
        np.testing.assert_allclose(h1[key], h0[key], rtol=1e-6)
        np.testing.assert_allclose(s1[key], s0[key], rtol=1e-6)
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)


class CountingModel(CustomModel):
    """The guide's model, counting how often its train_step's Python runs (each replica's)."""

    runs = 0

    def train_step(self, data):
        CountingModel.runs += 1
        return super().train_step(data)


class NumpyLogModel(CustomModel):
    """A step that returns a number it computed on the host while tracing: no metric gives it
    again after a replay, so fit runs this step eagerly from its second batch on."""

    def train_step(self, data):
        logs = super().train_step(data)
        return dict(logs, twice_mae=logs["compile_metrics"]["mae"] * np.float32(2.0))   # NumPy keeps the class


@pytest.mark.parametrize("cls", [CountingModel, NumpyLogModel])
def test_fit_traces_the_train_step_once_per_signature_and_replays_it(devices, rng, cls):
    """fit wraps the step as Keras wraps it in tf.function (traced_step.py): its Python runs
    once per input signature and replica (batches of 7, 7, 5: two signatures), the replays
    give the eager run's weights bit for bit (compile(run_eagerly=True): every batch runs the
    Python) and the same logs; no EagerFallbackWarning. A step returning a host number no
    metric gives again runs eagerly after its first batch, its logs still right."""
    devices(cpus=2)
    x = rng.standard_normal((19, 3)).astype(np.float32)
    y = rng.standard_normal((19, 1)).astype(np.float32)
    results = []
    for eagerly in (False, True):
        keras.utils.set_random_seed(11)
        model = build(cls, strategy_for(2), 3, 4)
        model.compile(optimizer=keras.optimizers.Adam(LR), loss="mse", metrics=["mae"], run_eagerly=eagerly)
        CountingModel.runs = 0
        with warnings.catch_warnings():
            warnings.simplefilter("error" if cls is CountingModel else "ignore", EagerFallbackWarning)
            history = model.fit(x, y, batch_size=7, epochs=3, shuffle=False, verbose=0).history
        if cls is CountingModel:
            assert CountingModel.runs == (2 * 9 if eagerly else 2 * 2)
        check_copies_equal(model)
        results.append((model.get_weights(), history))
    (traced, h_traced), (eager, h_eager) = results
    for a, b in zip(traced, eager):
        np.testing.assert_array_equal(a, b)
    assert sorted(h_traced) == sorted(h_eager)
    for key in ("loss", "mae"):        # read from the metrics once every replica is done
        np.testing.assert_allclose(h_traced[key], h_eager[key], rtol=1e-6)
    if cls is NumpyLogModel:           # each replica's own read of a metric other replicas add to
        assert np.all(np.isfinite(h_traced["twice_mae"])) and len(h_traced["twice_mae"]) == 3
