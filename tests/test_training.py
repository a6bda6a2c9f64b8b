"""Training on mirrored replicas: the invariants, the lab workflow, the custom loop.

The key invariant: N replicas with global batch B reach the same
weights as one replica with batch B, step after step, to float32 rounding; and
the replicas' copies stay bitwise equal.
"""

import numpy as np
import pytest

import mirrored as tf
from mirrored.values import MirroredVariable

#: float32's machine epsilon (2**-23): the relative spacing of float32 numbers near 1.
EPS32 = float(np.finfo(np.float32).eps)


def equivalence_atol(weights, steps, summed_terms):
    """How far N replicas' weights may lie from one replica's after ``steps`` steps.

    Both runs do the same arithmetic except the order of float32 additions: one replica
    adds all B examples' gradient terms at once, N replicas add their shares and the ring
    adds the N partial sums; and BLAS sums the ``din``- and ``hidden``-term dot products of
    a share's rows in blocks of another shape. A float32 sum of n terms is within
    n * EPS32 * (the sum of the magnitudes) of the exact one, whatever the order, so one
    step's update of a weight may differ by about EPS32 * ``summed_terms`` (every term that
    is summed on the way to it: B + din + hidden) times the scale of the quantities it is
    made of, which the weights set (unit-scale inputs): max |w|. The differences of
    successive steps add up: times ``steps``.

    Measured (60 seeds, 2 CPUs, this file's sizes): the worst difference was 16.6 *
    EPS32 * max|w| with Adam, 2.0 with SGD; this bound is (33 + 20 + 16) * 10 = 690 times
    that scale. Adam has the heavy tail: it divides by sqrt(v), so where a gradient nearly
    cancels its relative rounding error, and its update's, grows; a fixed 2e-6 (16.6 *
    EPS32 * |w| is 1.1e-6 here) failed once at 2.045e-6. A real bug is far above the
    bound (tried once each): a loss scaled by the replica's batch instead of the global
    one failed all six cases below by 0.013 to 0.54; a scale of 1/(B - 1) failed every
    SGD case (by 0.0055 to 0.025) and adam-CPU-4 (5.8e-5); Adam is blind to a uniform
    scale of the gradient by design, so the SGD cases are the ones that catch it.
    """
    scale = max(float(np.abs(w).max()) for w in weights)
    return EPS32 * summed_terms * steps * scale
LONG = "/job:localhost/replica:0/task:0/device:"


def tiny_model(strategy, din, hidden, classes, optimizer, last_activation=None, from_logits=True):
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(hidden, activation="relu", input_shape=(din,)),
            tf.keras.layers.Dense(classes, activation=last_activation)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits),
                  optimizer=optimizer, metrics=["accuracy"])
    return model


def assert_replicas_bitwise_equal(model):
    for v in model.trainable_variables:
        if isinstance(v, MirroredVariable):
            first = v.values[0].numpy()
            for c in v.values[1:]:
                assert np.array_equal(first, c.numpy()), f"{c.name} drifted from {v.values[0].name}"


@pytest.mark.parametrize("kind,n", [("CPU", 2), ("CPU", 4), ("GPU", 2)])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_n_replicas_train_exactly_like_one_replica_on_the_global_batch(devices, rng, kind, n, opt):
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    din, hidden, classes, batch = (5, 4, 3, 7) if kind == "GPU" else (20, 16, 10, 33)  # B not divisible by N
    steps = 10
    xs = rng.standard_normal((steps, batch, din)).astype(np.float32)
    ys = rng.integers(0, classes, (steps, batch))
    make_opt = {"sgd": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
                "adam": lambda: tf.keras.optimizers.Adam(0.01)}[opt]
    multi = tiny_model(tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)]),
                       din, hidden, classes, make_opt())
    single = tiny_model(tf.distribute.OneDeviceStrategy("CPU:0"), din, hidden, classes, make_opt())
    single.set_weights(multi.get_weights())
    for s in range(steps):
        multi.train_step(xs[s], ys[s])
        single.train_step(xs[s], ys[s])
        assert_replicas_bitwise_equal(multi)
    atol = equivalence_atol(single.get_weights(), steps, batch + din + hidden)
    for a, b in zip(multi.get_weights(), single.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
    assert not np.allclose(multi.get_weights()[0], single.get_weights()[0] * 0), "weights trained"


def _numpy_gradients(weights, x, y):
    """Float64 forward/backward of Dense(relu) -> Dense, mean softmax cross-entropy."""
    w1, b1, w2, b2 = (w.astype(np.float64) for w in weights)
    x = x.astype(np.float64)
    z1 = x @ w1 + b1
    a1 = np.maximum(z1, 0)
    z2 = a1 @ w2 + b2
    p = np.exp(z2 - z2.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y]).mean()
    dz2 = p.copy()
    dz2[np.arange(len(y)), y] -= 1
    dz2 /= len(y)
    dw2, db2 = a1.T @ dz2, dz2.sum(0)
    dz1 = (dz2 @ w2.T) * (z1 > 0)
    return loss, [x.T @ dz1, dz1.sum(0), dw2, db2]


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_one_sgd_step_matches_a_float64_numpy_oracle(devices, rng, kind):
    devices(cpus=2, gpus=2 if kind == "GPU" else 0)
    din, hidden, classes, batch = (6, 5, 4, 5) if kind == "GPU" else (30, 17, 10, 33)
    lr = 0.5
    model = tiny_model(tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"]), din, hidden, classes,
                       tf.keras.optimizers.SGD(lr))
    x = rng.standard_normal((batch, din)).astype(np.float32)
    y = rng.integers(0, classes, batch)
    before = model.get_weights()
    loss, grads = _numpy_gradients(before, x, y)
    model.train_step(x, y)
    for w0, g, w1 in zip(before, grads, model.get_weights()):
        np.testing.assert_allclose(w1, w0 - lr * g, rtol=1e-4, atol=1e-5)
    logs = model._logs()
    assert logs["loss"] == pytest.approx(loss, rel=1e-5)


def test_softmax_output_with_probability_loss_uses_the_logits_like_keras(devices, rng):
    devices(cpus=1)
    s = tf.distribute.OneDeviceStrategy("CPU:0")
    a = tiny_model(s, 8, 6, 4, tf.keras.optimizers.SGD(0.1), last_activation="softmax", from_logits=False)
    b = tiny_model(s, 8, 6, 4, tf.keras.optimizers.SGD(0.1), last_activation=None, from_logits=True)
    b.set_weights(a.get_weights())
    x = rng.standard_normal((9, 8)).astype(np.float32)
    y = rng.integers(0, 4, 9)
    a.train_step(x, y)
    b.train_step(x, y)
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(wa, wb)
    probs = a.predict(x, verbose=0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
    with pytest.raises(NotImplementedError, match="from_logits"):
        tiny_model(s, 8, 6, 4, "sgd", last_activation="softmax", from_logits=True)


def test_lab_workflow_on_the_bundled_subset(devices, capsys, monkeypatch):
    """The course lab, tf -> mirrored, the ConvNet replaced by the dense stack, 2 replicas."""
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    devices(cpus=2)
    tf.keras.utils.set_random_seed(1)
    datasets, info = tf.datasets.load(name="mnist", with_info=True, as_supervised=True)
    mnist_train, mnist_test = datasets["train"], datasets["test"]
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    BATCH_SIZE = 64 * strategy.num_replicas_in_sync

    def scale(image, label):
        image = tf.cast(image, tf.float32)
        image /= 255
        return image, label

    train_dataset = mnist_train.map(scale).cache().shuffle(10000).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Flatten(input_shape=(28, 28, 1)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),   # outside the scope
                  optimizer=tf.keras.optimizers.Adam(), metrics=["accuracy"])
    history = model.fit(train_dataset, epochs=2)
    out = capsys.readouterr().out
    steps = -(-info.splits["train"].num_examples // BATCH_SIZE)
    assert "Epoch 1/2" in out and "Epoch 2/2" in out
    import re
    line = re.compile(rf"^{steps}/{steps} \[={{30}}\] - \d+s \d+(us|ms|s)/step - loss: \d\.\d{{4}} - accuracy: \d\.\d{{4}}$",
                      re.M)
    assert len(line.findall(out)) == 2, out
    assert history.history["loss"][1] < history.history["loss"][0]
    assert set(history.history) == {"loss", "accuracy"} and history.epoch == [0, 1]
    assert_replicas_bitwise_equal(model)
    loss, acc = model.evaluate(eval_dataset, verbose=0)
    assert acc >= 0.88, acc


def test_custom_training_loop_with_gradient_tape(devices, rng):
    """The MirroredStrategy tutorial's custom loop, on 2 replicas."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    GLOBAL_BATCH_SIZE = 24
    x_all = rng.standard_normal((96, 12)).astype(np.float32)
    y_all = (x_all[:, 0] > 0).astype(np.int64) + 2 * (x_all[:, 1] > 0)       # learnable labels
    dataset = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(GLOBAL_BATCH_SIZE)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", input_shape=(12,)),
                                     tf.keras.layers.Dense(4)])
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        optimizer = tf.keras.optimizers.SGD(0.5)
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    # the loss of the first step equals the float64 mean over the global batch
    first = next(iter(dist_dataset))
    expected, _ = _numpy_gradients(model.get_weights(), x_all[:24], y_all[:24])
    assert float(distributed_train_step(first)) == pytest.approx(expected, rel=1e-5)
    assert_replicas_bitwise_equal(model)
    losses = []
    for epoch in range(15):
        total_loss, num_batches = 0.0, 0
        for x in dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        losses.append(float(total_loss / num_batches))
        assert_replicas_bitwise_equal(model)
    assert losses[-1] < 0.6 * losses[0], losses
    assert train_accuracy.result().numpy() > 0.5
    assert int(optimizer.iterations) == 1 + 15 * 4


def test_custom_loop_gradients_equal_fit_gradients(devices, rng):
    """tape.gradient under 2 replicas (summed) == the float64 gradient of the global mean loss."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu", input_shape=(7,)),
                                     tf.keras.layers.Dense(3)])
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = rng.standard_normal((9, 7)).astype(np.float32)
    y = rng.integers(0, 3, 9)
    _, expected = _numpy_gradients(model.get_weights(), x, y)
    (batch,) = list(strategy.experimental_distribute_dataset([(x, y)]))

    def step(inputs):
        xs, ys = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(ys, model(xs, training=True)), global_batch_size=9)
        grads = tape.gradient(loss, model.trainable_variables)
        return tf.distribute.get_replica_context().all_reduce("SUM", grads)

    summed = strategy.run(step, args=(batch,))
    for g, e in zip(summed, expected):
        for comp in strategy.experimental_local_results(g):
            np.testing.assert_allclose(comp.numpy(), e, rtol=1e-5, atol=1e-6)


def test_arrays_validation_data_and_callbacks(devices, rng, capsys):
    devices(cpus=1)
    model = tiny_model(tf.distribute.OneDeviceStrategy("CPU:0"), 10, 8, 3, "adam")
    x = rng.standard_normal((50, 10)).astype(np.float32)
    y = rng.integers(0, 3, 50)
    seen = []
    cb = tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, dict(logs))))
    h = model.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), callbacks=[cb], verbose=2)
    out = capsys.readouterr().out
    assert out.count("4/4 - ") == 2 and "val_loss" in out and "val_accuracy" in out
    assert [e for e, _ in seen] == [0, 1]
    assert set(h.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert model.predict(x, verbose=0).shape == (50, 3)
    assert len(model.evaluate(x, y, verbose=0)) == 2


def test_weights_round_trip_and_atomic_save(devices, tmp_path, rng, monkeypatch):
    from mirrored.keras import saving
    devices(cpus=2)
    model = tiny_model(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]), 6, 4, 3, "sgd")
    path = tmp_path / "w.weights.h5"
    model.save_weights(path)
    saved = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in saved])
    assert_replicas_bitwise_equal(model)
    model.load_weights(path)
    for a, b in zip(model.get_weights(), saved):
        np.testing.assert_array_equal(a, b)
    assert_replicas_bitwise_equal(model)
    # a failing save leaves the old file intact and no temporary files behind
    good = path.read_bytes()

    def broken(model, target):
        with open(target, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")
    monkeypatch.setattr(saving, "_write_h5", broken)
    with pytest.raises(OSError, match="disk full"):
        model.save_weights(path)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.weights.h5"]
    with pytest.raises(ValueError, match="shape"):
        model.set_weights([np.zeros((2, 2))] + saved[1:])
    with pytest.raises(ValueError, match="4 weight arrays"):
        model.set_weights(saved[:2])
    with pytest.raises(FileNotFoundError):
        model.load_weights(tmp_path / "missing.weights.h5")


class _Copy(tf.keras.layers.Layer):
    """A layer written against the layer protocol only (layers.py): y = x, dx = dy, each a
    launch into the layer's own per-batch-size buffers. The step knows nothing of it."""

    def make_buffers(self, state, b):
        (features,) = self.input_shape
        return (state.dev.empty((b, features), np.float32),                          # y: (b, features)
                state.dev.empty((b, features), np.float32) if state.need_dx else None)  # dx

    def forward(self, state, x, training=False):
        y, _ = state.buffers(x.shape[0])
        state.ops.binary_scalar("mul", x, 1.0, y)
        return y

    def backward(self, state, dy):
        _, dx = state.buffers(dy.shape[0])
        if dx is None:
            return None
        state.ops.binary_scalar("mul", dy, 1.0, dx)
        return dx


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_a_new_layer_plugs_into_the_step_without_touching_it(devices, rng, kind):
    devices(cpus=2, gpus=2 if kind == "GPU" else 0)
    din, hidden, classes, batch = (5, 4, 3, 7) if kind == "GPU" else (12, 8, 4, 19)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"])
    plain = tiny_model(strategy, din, hidden, classes, tf.keras.optimizers.Adam(0.01))
    with strategy.scope():
        copied = tf.keras.Sequential([_Copy(input_shape=(din,)),
                                      tf.keras.layers.Dense(hidden, activation="relu"), _Copy(),
                                      tf.keras.layers.Dense(classes), _Copy()])
    copied.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   optimizer=tf.keras.optimizers.Adam(0.01), metrics=["accuracy"])
    copied.set_weights(plain.get_weights())
    for _ in range(2):
        x = rng.standard_normal((batch, din)).astype(np.float32)
        y = rng.integers(0, classes, batch)
        plain.train_step(x, y)
        copied.train_step(x, y)
    for a, b in zip(plain.get_weights(), copied.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert_replicas_bitwise_equal(copied)
    assert copied._logs() == plain._logs()


@pytest.mark.parametrize("resident", [False, True])
def test_a_model_without_an_input_shape_builds_from_its_first_batch(devices, rng, resident):
    """As Keras: no input_shape, the first batch of fit (host or resident) builds it."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.random((21, 3, 2, 1), dtype=np.float32)
    y = rng.integers(0, 4, 21)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    if resident:
        ds = strategy.experimental_distribute_dataset(
            ds, tf.distribute.InputOptions(experimental_place_dataset_on_device=True))
    models = []
    for input_shape in [(3, 2, 1), None]:
        tf.keras.utils.set_random_seed(7)
        with strategy.scope():
            flatten = tf.keras.layers.Flatten(input_shape=input_shape)
            model = tf.keras.Sequential([flatten, tf.keras.layers.Dense(5, activation="relu"),
                                         tf.keras.layers.Dense(4)])
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.Adam(0.01), metrics=["accuracy"])
        model.fit(ds, epochs=2, verbose=0)
        models.append(model)
    built, unbuilt = models
    assert unbuilt.input_shape == (None, 3, 2, 1)
    for a, b in zip(built.get_weights(), unbuilt.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert unbuilt.history.history == built.history.history


def test_summary_and_unsupported_layers(devices, capsys):
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.layers.Flatten(input_shape=(28, 28, 1)),
                                 tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.summary()
    out = capsys.readouterr().out
    assert "(None, 784)" in out and "50240" in out and "Total params: 50,890" in out
    with pytest.raises(NotImplementedError, match=r"LSTM is not implemented.*Flatten, Dense, Conv2D"):
        tf.keras.layers.LSTM(32)
    with pytest.raises(ValueError, match="unknown activation 'hyperbolic'"):
        tf.keras.layers.Dense(3, activation="hyperbolic")
    with pytest.raises(RuntimeError, match="compile"):
        model.fit(np.zeros((2, 28, 28, 1)), np.zeros(2), verbose=0)


def test_a_replica_with_an_empty_slice_in_the_custom_loop(devices, rng):
    """A last batch of 1 row over 2 replicas: replica 1 gets nothing and contributes zero."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Flatten(input_shape=(2, 3)),
                                     tf.keras.layers.Dense(4, activation="relu"),
                                     tf.keras.layers.Dense(3)])
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = rng.standard_normal((1, 2, 3)).astype(np.float32)
    y = rng.integers(0, 3, 1)
    _, expected = _numpy_gradients(model.get_weights(), x.reshape(1, 6), y)
    (batch,) = list(strategy.experimental_distribute_dataset([(x, y)]))
    assert [t.shape[0] for t in batch[0].values] == [1, 0]

    def step(inputs):
        xs, ys = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(ys, model(xs, training=True)), global_batch_size=1)
        return tf.distribute.get_replica_context().all_reduce(
            "SUM", tape.gradient(loss, model.trainable_variables))

    summed = strategy.run(step, args=(batch,))
    for g, e in zip(summed, expected):
        np.testing.assert_allclose(strategy.experimental_local_results(g)[1].numpy(), e, rtol=1e-5, atol=1e-6)
