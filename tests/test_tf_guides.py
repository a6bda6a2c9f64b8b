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


# --- 3. "Introduction to gradients and automatic differentiation" (guide/autodiff) -------------

def test_autodiff_guide_gradients_of_variables_and_structures(cpu):
    rng = np.random.default_rng()
    x = tf.Variable(3.0)
    with tf.GradientTape() as tape:
        y = x**2
    assert tape.gradient(y, x).numpy() == 6.0                              # dy/dx = 2x

    w0 = rng.standard_normal((3, 2)).astype(np.float32)
    w = tf.Variable(w0, name='w')
    b = tf.Variable(tf.zeros(2, dtype=tf.float32), name='b')
    x = [[1., 2., 3.]]
    with tf.GradientTape(persistent=True) as tape:
        y = x @ w + b
        loss = tf.reduce_mean(y**2)
    [dl_dw, dl_db] = tape.gradient(loss, [w, b])
    y64 = np.asarray(x, np.float64) @ w0                                  # (1, 2)
    np.testing.assert_allclose(dl_db.numpy(), y64[0], rtol=1e-5)          # d mean(y^2)/dy = y
    np.testing.assert_allclose(dl_dw.numpy(), np.asarray(x, np.float64).T @ y64, rtol=1e-5)
    my_vars = {'w': w, 'b': b}
    grad = tape.gradient(loss, my_vars)                                    # a dict of sources
    np.testing.assert_allclose(grad['b'].numpy(), y64[0], rtol=1e-5)

    # gradients with respect to a model (a layer called on its own, outside a model)
    layer = tf.keras.layers.Dense(2)
    x = tf.constant([[1., 2., 3.]])
    with tf.GradientTape() as tape:
        y = layer(x)                                                        # y: (1, 2)
        loss = tf.reduce_mean(y**2)
    grad = tape.gradient(loss, layer.trainable_variables)
    kernel, bias = (v.numpy().astype(np.float64) for v in layer.trainable_variables)
    y64 = np.array([[1., 2., 3.]]) @ kernel + bias
    assert [g.shape for g in grad] == [(3, 2), (2,)]
    np.testing.assert_allclose(grad[0].numpy(), np.array([[1., 2., 3.]]).T @ y64, rtol=1e-5)
    np.testing.assert_allclose(grad[1].numpy(), y64[0], rtol=1e-5)
    np.testing.assert_allclose(layer(x).numpy(), y64, rtol=1e-5)            # called again: same weights


def test_autodiff_guide_what_the_tape_watches(cpu):
    x0 = tf.Variable(3.0, name='x0')
    x1 = tf.Variable(3.0, name='x1', trainable=False)                       # not trainable
    x2 = tf.Variable(2.0, name='x2') + 1.0                                  # a variable + a tensor is a tensor
    x3 = tf.constant(3.0, name='x3')                                        # not a variable
    with tf.GradientTape() as tape:
        y = (x0**2) + (x1**2) + (x2**2)
    grad = tape.gradient(y, [x0, x1, x2, x3])
    assert grad[0].numpy() == 6.0 and grad[1:] == [None, None, None]
    assert [var.name for var in tape.watched_variables()] == ['x0:0']

    x = tf.constant(3.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = x**2
    assert tape.gradient(y, x).numpy() == 6.0

    x0, x1 = tf.Variable(0.0), tf.Variable(10.0)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(x1)
        y0 = tf.math.sin(x0)
        y1 = tf.nn.softplus(x1)
        y = y0 + y1
        ys = tf.reduce_sum(y)
    grad = tape.gradient(ys, {'x0': x0, 'x1': x1})
    assert grad['x0'] is None                                               # not watched
    np.testing.assert_allclose(grad['x1'].numpy(), 1 / (1 + np.exp(-10.0)), rtol=1e-6)  # sigmoid(10)


def test_autodiff_guide_intermediates_persistent_and_non_scalar_targets(cpu):
    x = tf.constant(3.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = x * x
        z = y * y
    assert tape.gradient(z, y).numpy() == 18.0                              # dz/dy = 2y, y = 9

    x = tf.constant([1, 3.0])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = x * x
        z = y * y
    np.testing.assert_allclose(tape.gradient(z, x).numpy(), [4.0, 108.0])   # 4 x^3
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), [2.0, 6.0])
    del tape

    x = tf.Variable(2.0)
    with tf.GradientTape() as tape:
        y0 = x**2
        y1 = 1 / x
    assert tape.gradient({'y0': y0, 'y1': y1}, x).numpy() == 3.75            # a dict of targets: their sum
    with tf.GradientTape() as tape:
        y0, y1 = x**2, 1 / x
    assert tape.gradient([y0, y1], x).numpy() == 3.75
    with tf.GradientTape() as tape:
        y = x * [3., 4.]
    assert tape.gradient(y, x).numpy() == 7.0                               # non-scalar: its sum

    x = tf.linspace(-10.0, 10.0, 200 + 1)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.sigmoid(x)
    s = 1 / (1 + np.exp(-np.linspace(-10.0, 10.0, 201)))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), s * (1 - s), rtol=1e-5, atol=1e-7)


def test_autodiff_guide_control_flow_and_the_cases_that_give_none(cpu):
    x = tf.constant(1.0)
    v0, v1 = tf.Variable(2.0), tf.Variable(2.0)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        if x > 0.0:
            result = v0
        else:
            result = v1**2
    dv0, dv1 = tape.gradient(result, [v0, v1])
    assert dv0.numpy() == 1.0 and dv1 is None                               # the branch taken only
    assert tape.gradient(result, x) is None                                 # the condition has none

    x, y = tf.Variable(2.), tf.Variable(3.)
    with tf.GradientTape() as tape:
        z = y * y
    assert tape.gradient(z, x) is None                                      # not connected
    x = tf.Variable(2.0)
    for epoch in range(2):
        with tf.GradientTape() as tape:
            y = x + 1
        g = tape.gradient(y, x)
        assert (g.numpy() == 1.0) if epoch == 0 else g is None              # x became a tensor
        x = x + 1
    x = tf.Variable([[1.0, 2.0], [3.0, 4.0]], dtype=tf.float32)
    with tf.GradientTape() as tape:
        x2 = x**2
        y = np.mean(x2, axis=0)                                             # through NumPy: lost
        y = tf.reduce_mean(y, axis=0)
    assert tape.gradient(y, x) is None
    x = tf.constant(10)
    with tf.GradientTape() as g:
        g.watch(x)
        y = x * x
    assert g.gradient(y, x) is None                                         # integers: none
    x0, x1 = tf.Variable(3.0), tf.Variable(0.0)
    with tf.GradientTape() as tape:
        x1.assign_add(x0)                                                   # stateful: not differentiable
        y = x1**2
    assert tape.gradient(y, x0) is None

    x, y = tf.Variable([2., 2.]), tf.Variable(3.)
    with tf.GradientTape() as tape:
        z = y**2
    zero = tape.gradient(z, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    np.testing.assert_array_equal(zero.numpy(), [0.0, 0.0])


# --- 3b. "Advanced automatic differentiation" (guide/advanced_autodiff) ---------------------------

def test_advanced_autodiff_guide_higher_order_and_jacobians(cpu):
    x = tf.Variable(1.0)
    with tf.GradientTape() as t2:
        with tf.GradientTape() as t1:
            y = x * x * x
        dy_dx = t1.gradient(y, x)
    d2y_dx2 = t2.gradient(dy_dx, x)
    assert dy_dx.numpy() == 3.0 and d2y_dx2.numpy() == 6.0

    x = tf.linspace(-10.0, 10.0, 200 + 1)
    delta = tf.Variable(0.0)
    with tf.GradientTape() as tape:
        y = tf.nn.sigmoid(x + delta)
    dy_dx = tape.jacobian(y, delta)                                         # (201,): one per output
    s = 1 / (1 + np.exp(-np.linspace(-10.0, 10.0, 201)))
    assert y.shape == dy_dx.shape == (201,)
    np.testing.assert_allclose(dy_dx.numpy(), s * (1 - s), rtol=1e-5, atol=1e-7)

    rng = np.random.default_rng()
    x = tf.constant(rng.standard_normal((7, 5)).astype(np.float32))
    layer = tf.keras.layers.Dense(10, activation='relu')
    with tf.GradientTape(persistent=True) as tape:
        y = layer(x)
    j = tape.jacobian(y, layer.kernel)
    assert j.shape == (7, 10, 5, 10)
    kernel, bias = (v.numpy().astype(np.float64) for v in layer.weights)
    on = (x.numpy().astype(np.float64) @ kernel + bias) > 0                 # (7, 10) relu's gate
    want = np.einsum("bi,bu,uv->buiv", x.numpy().astype(np.float64), on, np.eye(10))  # d y[b,u]/d k[i,v]
    np.testing.assert_allclose(j.numpy(), want, rtol=1e-5, atol=1e-6)
    g = tape.gradient(y, layer.kernel)
    np.testing.assert_allclose(tf.reduce_sum(j, axis=[0, 1]).numpy(), g.numpy(), rtol=1e-5, atol=1e-5)


# --- 4. "Basic training loops" (guide/basic_training_loops): tf.Module and assign_sub ----------

def test_basic_training_loops_guide_with_a_module(cpu):
    TRUE_W, TRUE_B, NUM_EXAMPLES = 3.0, 2.0, 201
    x = tf.linspace(-2, 2, NUM_EXAMPLES)
    x = tf.cast(x, tf.float32)

    def f(x):
        return x * TRUE_W + TRUE_B
    noise = tf.random.normal(shape=[NUM_EXAMPLES])
    y = f(x) + noise

    class MyModel(tf.Module):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            # Initialize the weights to `5.0` and the bias to `0.0`
            self.w = tf.Variable(5.0)
            self.b = tf.Variable(0.0)

        def __call__(self, x):
            return self.w * x + self.b

    model = MyModel()
    assert [v.numpy() for v in model.variables] == [0.0, 5.0]             # sorted by name: b, w
    assert model.trainable_variables == model.variables and model.name == "my_model"
    assert model(3.0).numpy() == 15.0

    def loss(target_y, predicted_y):
        return tf.reduce_mean(tf.square(target_y - predicted_y))

    def train(model, x, y, learning_rate):
        with tf.GradientTape() as t:
            current_loss = loss(y, model(x))
        dw, db = t.gradient(current_loss, [model.w, model.b])
        model.w.assign_sub(learning_rate * dw)
        model.b.assign_sub(learning_rate * db)

    xs, ys = x.numpy().astype(np.float64), y.numpy().astype(np.float64)
    w, b = 5.0, 0.0                                                          # the oracle's
    for epoch in range(10):
        train(model, x, y, learning_rate=0.1)
        r = w * xs + b - ys
        w, b = w - 0.1 * 2 * (r * xs).mean(), b - 0.1 * 2 * r.mean()
        np.testing.assert_allclose([model.w.numpy(), model.b.numpy()], [w, b], rtol=1e-5)
        current_loss = loss(y, model(x))
        np.testing.assert_allclose(current_loss.numpy(), ((w * xs + b - ys) ** 2).mean(), rtol=1e-5)
    assert abs(model.w.numpy() - TRUE_W) < abs(5.0 - TRUE_W)


def test_module_finds_variables_in_lists_dicts_submodules_and_layers(cpu):
    class Inner(tf.Module):
        def __init__(self):
            super().__init__(name="inner")
            self.v = tf.Variable(1.0)
            self.frozen = tf.Variable(2.0, trainable=False)

    class Outer(tf.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Inner(), {"b": tf.Variable(3.0), "a": tf.Variable(4.0)}]
            self.shared = self.layers[0]                                    # found once
            self.dense = tf.keras.layers.Dense(2)
            self.dense(np.zeros((1, 3), np.float32))                        # built: 2 weights

    outer = Outer()
    assert [float(v.numpy()) for v in outer.variables if v.shape == ()] == [2.0, 1.0, 4.0, 3.0]   # by name
    assert len(outer.variables) == 6 and len(outer.trainable_variables) == 5
    assert [m.name for m in outer.submodules] == ["inner"]
    with pytest.raises(ValueError, match="module name"):
        tf.Module(name="not a name")


# --- 5. keras.io "Making new layers and models via subclassing" -----------------------------------

def _subclassing_layers():
    from mirrored import keras

    class Linear(keras.layers.Layer):
        def __init__(self, units=32):
            super().__init__()
            self.units = units

        def build(self, input_shape):                       # deferred: the input's size known here
            self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal",
                                     trainable=True)
            self.b = self.add_weight(shape=(self.units,), initializer="random_normal", trainable=True)

        def call(self, inputs):
            return tf.matmul(inputs, self.w) + self.b

    class ActivityRegularizationLayer(keras.layers.Layer):
        def __init__(self, rate=1e-2):
            super().__init__()
            self.rate = rate

        def call(self, inputs):
            self.add_loss(self.rate * tf.reduce_sum(inputs))
            return inputs

    return keras, Linear, ActivityRegularizationLayer


def test_subclassing_guide_weights_state_and_composition(cpu):
    keras, Linear, _ = _subclassing_layers()

    class ComputeSum(keras.layers.Layer):
        def __init__(self, input_dim):
            super().__init__()
            self.total = self.add_weight(initializer="zeros", shape=(input_dim,), trainable=False)

        def call(self, inputs):
            self.total.assign_add(tf.reduce_sum(inputs, axis=0))
            return self.total

    x = tf.ones((2, 2))
    my_sum = ComputeSum(2)
    np.testing.assert_array_equal(my_sum(x).numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(my_sum(x).numpy(), [4.0, 4.0])
    assert (len(my_sum.weights), len(my_sum.non_trainable_weights), my_sum.trainable_weights) == (1, 1, [])

    class MLPBlock(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.linear_1 = Linear(32)
            self.linear_2 = Linear(32)
            self.linear_3 = Linear(1)

        def call(self, inputs):
            x = self.linear_1(inputs)
            x = tf.nn.relu(x)
            x = self.linear_2(x)
            x = tf.nn.relu(x)
            return self.linear_3(x)

    mlp = MLPBlock()
    x = np.random.default_rng().standard_normal((3, 64)).astype(np.float32)
    y = mlp(x)                                                # the first call builds every Linear
    assert len(mlp.weights) == 6 and len(mlp.trainable_weights) == 6
    w = [v.numpy().astype(np.float64) for v in mlp.weights]
    h = np.maximum(x @ w[0] + w[1], 0)
    h = np.maximum(h @ w[2] + w[3], 0)
    np.testing.assert_allclose(y.numpy(), h @ w[4] + w[5], rtol=1e-4, atol=1e-5)


def test_subclassing_guide_add_loss_in_a_gradient_tape_loop(cpu):
    """``self.add_loss(rate * sum(inputs))``: listed in ``layer.losses`` until the next outermost
    call (nested layers' too, never piling up), and the guide's loop
    ``loss_value += sum(model.losses)`` trains on it: one step against float64."""
    keras, Linear, ActivityRegularizationLayer = _subclassing_layers()

    class OuterLayer(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.activity_reg = ActivityRegularizationLayer(1e-2)

        def call(self, inputs):
            return self.activity_reg(inputs)

    layer = OuterLayer()
    assert len(layer.losses) == 0                             # no losses yet: never called
    _ = layer(tf.zeros((1, 1)))
    assert len(layer.losses) == 1                             # one, made by the call
    _ = layer(tf.zeros((1, 1)))
    assert len(layer.losses) == 1                             # reset at the start of each call

    class OuterLayerWithKernelRegularizer(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(32, kernel_regularizer=tf.keras.regularizers.l2(1e-3))

        def call(self, inputs):
            return self.dense(inputs)

    layer = OuterLayerWithKernelRegularizer()
    _ = layer(tf.zeros((1, 1)))
    kernel = layer.dense.kernel.numpy().astype(np.float64)
    (penalty,) = layer.losses
    np.testing.assert_allclose(penalty.numpy(), 1e-3 * (kernel ** 2).sum(), rtol=1e-5)

    class Net(keras.layers.Layer):                            # a layer that regularises its activity
        def __init__(self):
            super().__init__()
            self.linear = Linear(3)
            self.reg = ActivityRegularizationLayer(0.1)

        def call(self, inputs):
            return self.reg(self.linear(inputs))

    rng = np.random.default_rng()
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.integers(0, 3, 5)
    model = Net()
    model(x)
    w0, b0 = (v.numpy().astype(np.float64) for v in model.trainable_weights)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(learning_rate=0.5)
    with tf.GradientTape() as tape:
        logits = model(x)
        loss_value = loss_fn(y, logits)
        loss_value += sum(model.losses)                       # the activity penalty of this call
    assert len(model.losses) == 1
    grads = tape.gradient(loss_value, model.trainable_weights)
    optimizer.apply_gradients(zip(grads, model.trainable_weights))
    z = x.astype(np.float64) @ w0 + b0                         # (5, 3) logits
    np.testing.assert_allclose(loss_value.numpy(), _xent(z, y) + 0.1 * z.sum(), rtol=1e-5)
    d = _softmax(z)
    d[np.arange(5), y] -= 1
    d = d / 5 + 0.1                                            # d loss / d z: data term + penalty
    np.testing.assert_allclose(model.trainable_weights[0].numpy(), w0 - 0.5 * x.T.astype(np.float64) @ d,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.trainable_weights[1].numpy(), b0 - 0.5 * d.sum(0), rtol=1e-5, atol=1e-6)


def test_add_loss_inside_a_model_runs(cpu):
    """In a model, the added loss joins fit's loss (tests/test_add_loss.py); predict runs."""
    keras, _, ActivityRegularizationLayer = _subclassing_layers()
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(ActivityRegularizationLayer()(inputs)))
    assert model.predict(np.zeros((2, 3), np.float32), verbose=0).shape == (2, 2)
