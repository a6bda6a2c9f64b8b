"""TensorFlow's and keras.io's beginner pages, run as a student types them (issue 48).

Each test follows one page's code cells closely, with only the imports changed
(``import mirrored as tf``, ``from mirrored import keras``), on small data (the bundled
MNIST subset, offline, or random arrays) and few steps, and checks what the page prints or
trains against NumPy (float64 oracles, fresh random values) or against the same program run
eagerly. The pages:

1. "TensorFlow 2 quickstart for beginners" (tutorials/quickstart/beginner)
2. "TensorFlow 2 quickstart for experts" (tutorials/quickstart/advanced)

Neighbours: tests/test_tf_tutorials.py and tests/test_tf_pages.py (the tf.distribute pages),
tests/test_custom_train_step.py (keras.io's "Customizing what happens in fit()").
"""
import warnings

import numpy as np
import pytest

import mirrored as tf
from mirrored import devices as registry
from mirrored import traced_function


@pytest.fixture
def cpu(monkeypatch, devices):
    """A machine without a GPU (not even the simulator's), one CPU device, MNIST offline:
    where a student's laptop runs the quickstarts."""
    monkeypatch.setattr(registry, "cuda_mode", lambda: "none")
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    devices(cpus=1)


def _mnist(n_train, n_test):
    """The page's first cell, on the first rows: ``mnist.load_data()`` scaled to [0, 1]."""
    mnist = tf.keras.datasets.mnist
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                   # the bundled subset's one notice
        (x_train, y_train), (x_test, y_test) = mnist.load_data()
    x_train, x_test = x_train / 255.0, x_test / 255.0
    return (x_train[:n_train], y_train[:n_train]), (x_test[:n_test], y_test[:n_test])


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _xent(logits, y):
    """Mean sparse softmax cross-entropy of logits, float64."""
    p = _softmax(logits)
    return -np.log(p[np.arange(len(y)), np.asarray(y)]).mean()


# --- 1. quickstart for beginners ----------------------------------------------------------------

def test_quickstart_for_beginners(cpu):
    (x_train, y_train), (x_test, y_test) = _mnist(384, 128)
    model = tf.keras.models.Sequential([
        tf.keras.layers.Flatten(input_shape=(28, 28)),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.2),
        tf.keras.layers.Dense(10)
    ])
    predictions = model(x_train[:1]).numpy()                 # logits: (1, 10) float32
    assert predictions.shape == (1, 10) and predictions.dtype == np.float32
    probs = tf.nn.softmax(predictions).numpy()
    np.testing.assert_allclose(probs, _softmax(predictions), rtol=1e-5)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    first = loss_fn(y_train[:1], predictions).numpy()
    np.testing.assert_allclose(first, _xent(predictions, y_train[:1]), rtol=1e-5)
    assert 1.0 < first < 4.0                                 # the page: close to -log(1/10) ~= 2.3

    model.compile(optimizer='adam', loss=loss_fn, metrics=['accuracy'])
    history = model.fit(x_train, y_train, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0] and history.history["accuracy"][-1] > 0.5, history.history

    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    logits = model.predict(x_test, verbose=0)                # the evaluated model, in inference
    np.testing.assert_allclose(loss, _xent(logits, y_test), rtol=1e-4)
    np.testing.assert_allclose(accuracy, (logits.argmax(1) == y_test).mean(), atol=1e-6)

    probability_model = tf.keras.Sequential([model, tf.keras.layers.Softmax()])
    out = probability_model(x_test[:5]).numpy()              # (5, 10) probabilities
    np.testing.assert_allclose(out, _softmax(logits[:5]), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)


# --- 2. quickstart for experts --------------------------------------------------------------------

def _experts_loop(model, train_ds, test_ds, epochs, traced, seen_losses=None):
    """The page's training cells; ``traced``: with its ``@tf.function``s (else the same Python
    run eagerly, every step, which also keeps each step's loss in ``seen_losses``)."""
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.Adam()
    train_loss = tf.keras.metrics.Mean(name='train_loss')
    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name='train_accuracy')
    test_loss = tf.keras.metrics.Mean(name='test_loss')
    test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name='test_accuracy')

    def train_step(images, labels):
        with tf.GradientTape() as tape:
            # training=True is only needed if there are layers with different
            # behavior during training versus inference (e.g. Dropout).
            predictions = model(images, training=True)
            loss = loss_object(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_loss(loss)
        train_accuracy(labels, predictions)
        if seen_losses is not None:
            seen_losses.append(float(loss))

    def test_step(images, labels):
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss(t_loss)
        test_accuracy(labels, predictions)

    if traced:
        train_step, test_step = tf.function(train_step), tf.function(test_step)
    lines = []
    for epoch in range(epochs):
        # Reset the metrics at the start of the next epoch
        train_loss.reset_state()
        train_accuracy.reset_state()
        test_loss.reset_state()
        test_accuracy.reset_state()
        for images, labels in train_ds:
            train_step(images, labels)
        for test_images, test_labels in test_ds:
            test_step(test_images, test_labels)
        lines.append([float(m.result()) for m in (train_loss, train_accuracy, test_loss, test_accuracy)])
        # the page's print, as a student would see it
        print(f'Epoch {epoch + 1}, Loss: {train_loss.result():0.2f}, '
              f'Accuracy: {train_accuracy.result() * 100:0.2f}, '
              f'Test Loss: {test_loss.result():0.2f}, Test Accuracy: {test_accuracy.result() * 100:0.2f}')
    return lines, (train_step, test_step)


def test_quickstart_for_experts_traced_steps_match_the_eager_run(cpu, capsys):
    """The page's ``@tf.function`` steps call metrics (``train_loss(loss)``): they are traced
    once and replayed (no eager fallback), and every number equals the same loop run
    eagerly; the eager run's train_loss is the mean of its steps' losses."""
    from mirrored.keras import Model
    from mirrored.keras.layers import Conv2D, Dense, Flatten

    (x_train, y_train), (x_test, y_test) = _mnist(128, 64)
    # Add a channels dimension
    x_train = x_train[..., tf.newaxis].astype("float32")
    x_test = x_test[..., tf.newaxis].astype("float32")

    class MyModel(Model):
        def __init__(self):
            super().__init__()
            self.conv1 = Conv2D(8, 3, activation='relu')
            self.flatten = Flatten()
            self.d1 = Dense(32, activation='relu')
            self.d2 = Dense(10)

        def call(self, x):
            x = self.conv1(x)
            x = self.flatten(x)
            x = self.d1(x)
            return self.d2(x)

    seed = int(np.random.default_rng().integers(2 ** 31))
    runs, models = [], []
    for traced in (True, False):
        model = MyModel()
        model(x_train[:1])                                   # built, to start both runs alike
        if models:
            model.set_weights(start)
        else:
            start = model.get_weights()
        models.append(model)
        train_ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(10000, seed=seed).batch(32)
        test_ds = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(32)
        seen = None if traced else []
        with warnings.catch_warnings():
            warnings.simplefilter("error", traced_function.EagerFallbackWarning)
            lines, steps = _experts_loop(model, train_ds, test_ds, 2, traced, seen)
        runs.append(lines)
        if traced:
            assert [s.experimental_get_tracing_count() for s in steps] == [1, 1]   # replayed
    (traced_lines, eager_lines) = runs
    np.testing.assert_allclose(traced_lines, eager_lines, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(eager_lines[-1][0], np.mean(seen[-4:]), rtol=1e-5)  # 4 steps an epoch
    for a, b in zip(*(m.get_weights() for m in models)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    logits = models[0].predict(x_test, verbose=0)
    np.testing.assert_allclose(traced_lines[-1][2], _xent(logits, y_test), rtol=1e-4)
    np.testing.assert_allclose(traced_lines[-1][3], (logits.argmax(1) == y_test).mean(), atol=1e-6)
    assert "Epoch 2, Loss: " in capsys.readouterr().out


def test_a_function_returning_a_metric_call_runs_eagerly_with_its_value(cpu):
    """``return train_loss(loss)`` inside a ``@tf.function``: a replay could only hand back the
    first call's value, so the function runs eagerly from then on, with a warning, and each
    call returns the running mean it should."""
    mean = tf.keras.metrics.Mean()

    @tf.function
    def step(x):
        return mean(tf.reduce_sum(x))

    values = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    with pytest.warns(traced_function.EagerFallbackWarning, match="metric"):
        first = step(values[0])
    got = [float(first)] + [float(step(v)) for v in values[1:]]
    sums = values.astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(got, np.cumsum(sums) / np.arange(1, 4), rtol=1e-5)
