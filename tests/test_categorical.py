"""One-hot labels as Keras 3 has them: to_categorical, CategoricalCrossentropy, accuracy.

* ``keras.utils.to_categorical`` gives Keras 3's arrays (float64, trailing 1 dropped).
* ``fit`` with ``loss='categorical_crossentropy'`` (label smoothing, a softmax layer whose
  logits are used, or ``from_logits=True``) on 2 replicas with an uneven last batch trains
  to the weights of a float64 oracle of Keras's math (SGD, mean over the batch) within
  float32 tolerance: the oracle is written here from Keras's formulas, independent of the
  kernels. ``evaluate`` reports the oracle's loss and categorical accuracy.
* keras.io's ConvNet recipe (to_categorical, "accuracy", validation_split) runs as written.
* The custom-loop metric ``CategoricalAccuracy`` and the compile rules for accuracy names.
(TensorFlow itself is not installed here: tests/test_keras_agreement.py holds the TF oracles.)
"""
import numpy as np
import pytest

import mirrored as tf

#: float32 training against float64 math over a few SGD steps: each weight's error stays a few
#: ulps of the sums that made it; 1e-5 relative to the weights' scale is ample and still fails
#: on any real difference (a wrong smoothing, batch scale or gradient is >1e-3).
TOL = 1e-5


def test_to_categorical_is_keras_3s():
    y = np.array([2, 0, 1, 2])
    got = tf.keras.utils.to_categorical(y)
    assert got.dtype == np.float64 and got.shape == (4, 3)
    np.testing.assert_array_equal(got, np.eye(3)[y])
    col = tf.keras.utils.to_categorical(y.reshape(4, 1).astype(np.uint8), num_classes=5)   # cifar10's (n, 1)
    np.testing.assert_array_equal(col, np.eye(5)[y])
    grid = tf.keras.utils.to_categorical(np.array([[1, 0], [0, 1]]), 2)
    assert grid.shape == (2, 2, 2) and grid[0, 0, 1] == 1.0 and grid[0, 1, 0] == 1.0
    np.testing.assert_array_equal(tf.keras.utils.to_categorical([3.0, 1.0], 4), np.eye(4)[[3, 1]])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        tf.keras.utils.to_categorical([0, 3], num_classes=3)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        tf.keras.utils.to_categorical([-1, 2], num_classes=3)       # Keras would wrap to class 2
    with pytest.raises(ValueError, match="whole numbers"):
        tf.keras.utils.to_categorical([0.5])


def _oracle_step(w1, b1, w2, b2, x, y, smoothing, lr, mistake=None):
    """One SGD step of Dense(relu) -> Dense(softmax) with Keras's categorical cross-entropy
    (mean over the batch), float64; returns the new weights and the batch's mean loss.
    ``mistake``: a deliberate error, to show the bound catches it."""
    c = y.shape[1]
    ys = y * (1 - smoothing) + smoothing / c
    if mistake == "smoothing over C - 1":             # a common misreading of label smoothing
        ys = y * (1 - smoothing) + (1 - y) * smoothing / (c - 1)
    h_pre = x @ w1 + b1
    h = np.maximum(h_pre, 0)
    z = h @ w2 + b2
    log_softmax = z - z.max(1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
    loss = -(ys * log_softmax).sum(1).mean()
    dz = (np.exp(log_softmax) * ys.sum(1, keepdims=True) - ys) / len(x)
    if mistake == "summed, not averaged":
        dz *= len(x)
    dw2, db2 = h.T @ dz, dz.sum(0)
    dh = (dz @ w2.T) * (h_pre > 0)
    dw1, db1 = x.T @ dh, dh.sum(0)
    return [w1 - lr * dw1, b1 - lr * db1, w2 - lr * dw2, b2 - lr * db2], loss


@pytest.mark.parametrize("from_logits,smoothing", [(False, 0.0), (False, 0.2), (True, 0.1)])
def test_fit_trains_to_the_float64_oracle(devices, rng, from_logits, smoothing):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    features, hidden, classes, n, batch, lr = 6, 5, 4, 13, 5, 0.5        # batches of 5, 5, 3
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = tf.keras.utils.to_categorical(rng.integers(0, classes, n), classes)
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(hidden, activation="relu", input_shape=(features,)),
            tf.keras.layers.Dense(classes, activation=None if from_logits else "softmax")])
        loss = ("categorical_crossentropy" if not smoothing else
                tf.keras.losses.CategoricalCrossentropy(from_logits=from_logits, label_smoothing=smoothing))
        model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(lr), metrics=["accuracy"])
    weights = [w.astype(np.float64) for w in model.get_weights()]
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    for i in range(0, n, batch):
        weights, _ = _oracle_step(*weights, x[i:i + batch].astype(np.float64), y[i:i + batch], smoothing, lr)
    for got, want in zip(model.get_weights(), weights):
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL * scale)
    # evaluate: the oracle's mean loss and Keras's categorical accuracy
    _, want_loss = _oracle_step(*weights, x.astype(np.float64), y, smoothing, 0.0)
    w1, b1, w2, b2 = weights
    want_acc = np.mean((np.maximum(x @ w1 + b1, 0) @ w2 + b2).argmax(1) == y.argmax(1))
    got_loss, got_acc = model.evaluate(x, y, batch_size=batch, verbose=0)
    assert abs(got_loss - want_loss) <= TOL * max(1.0, abs(want_loss))
    assert got_acc == pytest.approx(want_acc, abs=1e-12)


@pytest.mark.parametrize("mistake", ["smoothing over C - 1", "summed, not averaged"])
def test_a_wrong_oracle_misses_the_bound(devices, rng, mistake):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((10, 6)).astype(np.float32)
    y = tf.keras.utils.to_categorical(rng.integers(0, 4, 10), 4)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu", input_shape=(6,)),
                                     tf.keras.layers.Dense(4, activation="softmax")])
        model.compile(loss=tf.keras.losses.CategoricalCrossentropy(label_smoothing=0.2),
                      optimizer=tf.keras.optimizers.SGD(0.5))
    weights = [w.astype(np.float64) for w in model.get_weights()]
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    for i in range(0, 10, 5):
        weights, _ = _oracle_step(*weights, x[i:i + 5].astype(np.float64), y[i:i + 5], 0.2, 0.5, mistake)
    misses = [np.abs(got - want).max() > TOL * np.abs(want).max() for got, want in zip(model.get_weights(), weights)]
    assert any(misses), f"an oracle with '{mistake}' was within the bound"


def test_keras_io_convnet_recipe_runs(devices, rng):
    """keras.io's MNIST ConvNet, shrunk: to_categorical labels, 'categorical_crossentropy',
    'accuracy', validation_split, imports changed."""
    devices(cpus=1)
    x = rng.random((24, 8, 8, 1)).astype(np.float32)
    y = tf.keras.utils.to_categorical(rng.integers(0, 3, 24).astype(np.uint8), 3)
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu", input_shape=(8, 8, 1)),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(3, activation="softmax")])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=8, epochs=2, validation_split=0.25, verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(np.isfinite(v).all() for v in history.history.values())
    score = model.evaluate(x, y, verbose=0)
    assert 0.0 <= score[1] <= 1.0 and score[0] > 0


def test_accuracy_names_follow_the_labels(devices):
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, activation="softmax", input_shape=(2,))])
    model.compile(loss="categorical_crossentropy", optimizer="sgd",
                  metrics=[tf.keras.metrics.CategoricalAccuracy()])
    assert model.metrics_names == ["loss", "categorical_accuracy"]
    with pytest.raises(ValueError, match="categorical_accuracy"):
        model.compile(loss="categorical_crossentropy", optimizer="sgd", metrics=["sparse_categorical_accuracy"])
    with pytest.raises(ValueError, match="sparse_categorical_accuracy"):
        model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd", metrics=["categorical_accuracy"])
    with pytest.raises(NotImplementedError, match="activation='softmax'"):
        plain = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(2,))])
        plain.compile(loss="categorical_crossentropy", optimizer="sgd")
        plain.fit(np.zeros((2, 2), np.float32), np.eye(3)[:2], verbose=0)


def test_categorical_accuracy_metric_counts_argmax_hits():
    metric = tf.keras.metrics.CategoricalAccuracy()
    metric.update_state(np.eye(3)[[0, 1, 2, 2]], np.array([[.8, .1, .1], [.2, .7, .1], [.5, .2, .3], [0, .4, .6]]))
    assert float(metric.result().numpy()) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="same shape"):
        metric.update_state(np.array([0, 1]), np.zeros((2, 3)))


def test_labels_of_the_other_kind_say_which_loss_fits(devices):
    devices(cpus=1)
    x = np.zeros((4, 2), np.float32)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, activation="softmax", input_shape=(2,))])
    model.compile(loss="categorical_crossentropy", optimizer="sgd", metrics=["accuracy"])
    with pytest.raises(ValueError, match="to_categorical"):
        model.fit(x, np.array([0, 1, 2, 1]), verbose=0)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd", metrics=["accuracy"])
    with pytest.raises(ValueError, match="loss='categorical_crossentropy'"):
        model.fit(x, np.eye(3)[[0, 1, 2, 1]], verbose=0)
