"""Keras's metrics by name and class (keras/metrics.py), and ``compile(metrics=[...])`` with
Keras's names, a user-written ``keras.metrics.Metric`` subclass and a plain function in fit's
own step (no train_step override: the outputs are read on the host after each step,
keras/custom_step.py's ``update_from_programs``) and in evaluate.

Each metric is checked against a float64 NumPy oracle of Keras's math over several batches
(fresh random inputs, sample weights, awkward shapes); fit's History against a float64 SGD
oracle that computes the metrics from each batch's outputs BEFORE that batch's update, as Keras
does, on 2 logical CPUs with uneven shares.

    python -m pytest -n 0 -q tests/test_keras_metrics.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import keras

TOL = dict(rtol=1e-5, atol=1e-6)          # the metrics sum in float64 on the host
FIT_TOL = dict(rtol=2e-4, atol=2e-5)      # float32 training against float64


def batches_of(rng, shape, n=3):
    """n batches of awkward sizes (1, 7, 5 rows ...)."""
    return [rng.standard_normal((b,) + shape) for b in (1, 7, 5)[:n]]


@pytest.mark.parametrize("name,cls,per_example", [
    ("mae", keras.metrics.MeanAbsoluteError, lambda t, p: np.abs(t - p).mean(-1)),
    ("mse", keras.metrics.MeanSquaredError, lambda t, p: ((t - p) ** 2).mean(-1)),
])
def test_regression_metrics_against_float64(rng, name, cls, per_example):
    m, by_name = cls(), keras.metrics.get(name)
    values, weighted, weights = [], 0.0, 0.0
    for p in batches_of(rng, (3,)):
        t = rng.standard_normal(p.shape)
        w = rng.uniform(0.1, 2.0, len(p))
        m.update_state(t.astype(np.float32), p.astype(np.float32))
        by_name.update_state(t, p, sample_weight=w)
        values.append(per_example(t, p))
        weighted += (per_example(t, p) * w).sum()
        weights += w.sum()
    np.testing.assert_allclose(float(m.result()), np.concatenate(values).mean(), **TOL)
    np.testing.assert_allclose(float(by_name.result()), weighted / weights, **TOL)
    assert by_name.name == name                     # the log shows the name as given, as Keras's
    m.reset_state()
    assert float(m.result()) == 0.0


def test_targets_of_shape_b_against_outputs_b_1(rng):
    t, p = rng.standard_normal(6), rng.standard_normal((6, 1))
    m = keras.metrics.MeanAbsoluteError()
    m.update_state(t, p)
    np.testing.assert_allclose(float(m.result()), np.abs(t - p[:, 0]).mean(), **TOL)


def test_mean_is_keras_weighted_mean(rng):
    m = keras.metrics.Mean(name="loss")
    a, wa = rng.standard_normal((4, 3)), rng.uniform(0, 1, 4)     # (B,) weights over (B, 3) values
    b = rng.standard_normal(5)
    m.update_state(a, sample_weight=wa)
    m.update_state(b)
    m.update_state(np.float32(2.5))
    total = (a * wa[:, None]).sum() + b.sum() + 2.5
    count = 3 * wa.sum() + 5 + 1
    np.testing.assert_allclose(float(m.result()), total / count, **TOL)
    assert m.name == "loss"


@pytest.mark.parametrize("threshold", [0.5, 0.2])
def test_binary_accuracy(rng, threshold):
    m = keras.metrics.BinaryAccuracy(threshold=threshold)
    hits = []
    for p in batches_of(rng, (2,)):
        p = 1 / (1 + np.exp(-p))
        t = rng.integers(0, 2, p.shape).astype(np.float32)
        m.update_state(t, p)
        hits.append((t == (p > threshold)).mean(-1))
    np.testing.assert_allclose(float(m.result()), np.concatenate(hits).mean(), **TOL)


@pytest.mark.parametrize("label_shape", ["(B,)", "(B, 1)"])
def test_sparse_categorical_accuracy(rng, label_shape):
    m = keras.metrics.SparseCategoricalAccuracy()
    hits = []
    for p in batches_of(rng, (4,)):
        t = rng.integers(0, 4, len(p))
        m.update_state(t if label_shape == "(B,)" else t[:, None], p)
        hits.append(p.argmax(-1) == t)
    np.testing.assert_allclose(float(m.result()), np.concatenate(hits).mean(), **TOL)


def test_accuracy_by_name_picks_keras_kind(rng):
    p = rng.standard_normal((9, 3))
    t = rng.integers(0, 3, 9)
    acc = keras.metrics.get("accuracy")
    acc.update_state(t, p)
    np.testing.assert_allclose(float(acc.result()), (p.argmax(-1) == t).mean(), **TOL)
    binary = keras.metrics.get("accuracy")
    q, u = rng.uniform(0, 1, (9, 1)), rng.integers(0, 2, (9, 1))
    binary.update_state(u, q)
    np.testing.assert_allclose(float(binary.result()), (u == (q > 0.5)).mean(), **TOL)


def test_get_refuses_what_it_does_not_know():
    with pytest.raises(NotImplementedError, match="auc"):
        keras.metrics.get("auc")


# -- compile(metrics=[...]) in fit's own step -------------------------------------------------------
class SumSquaredError(keras.metrics.Metric):
    """A user-written metric with add_weight: the epoch's total squared error."""

    def __init__(self, name="sse", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_weight(name="total", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.reduce_sum(tf.square(tf.constant(y_true) - tf.constant(y_pred))))

    def result(self):
        return self.total


def abs_error_sum(y_true, y_pred):
    """A plain function metric written in ops: one value per example."""
    return tf.reduce_sum(tf.abs(tf.constant(y_true) - tf.constant(y_pred)), axis=-1)


def sgd_oracle(w, b, x, y, batch, epochs, lr):
    """Linear regression, MSE, SGD in float64; per epoch the loss (mean over examples, as fit's
    own step counts it), mae, sse and abs_error_sum of the outputs before each update."""
    w, b = w.astype(np.float64), b.astype(np.float64)
    hist = {"loss": [], "mae": [], "sse": [], "abs_error_sum": []}
    for _ in range(epochs):
        sq, ab, n = 0.0, 0.0, 0
        per_loss = []
        for i in range(0, len(x), batch):
            xb, yb = x[i:i + batch].astype(np.float64), y[i:i + batch].astype(np.float64)
            p = xb @ w + b
            per_loss.append(((p - yb) ** 2).mean(-1))
            sq += ((p - yb) ** 2).sum()
            ab += np.abs(p - yb).sum()
            n += len(xb)
            dp = 2 * (p - yb) / p.size
            w, b = w - lr * xb.T @ dp, b - lr * dp.sum(0)
        outputs = y.shape[1]
        hist["loss"].append(np.concatenate(per_loss).mean())
        hist["mae"].append(ab / (n * outputs))
        hist["sse"].append(sq)
        hist["abs_error_sum"].append(ab / n)
    return w, b, hist


def test_compile_metrics_names_a_metric_subclass_and_a_function_in_fit_and_evaluate(devices, rng):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    features, outputs, batch, epochs, lr = 4, 2, 7, 2, 0.05
    x = rng.standard_normal((19, features)).astype(np.float32)       # 7 = 4 + 3, 5 = 3 + 2
    y = rng.standard_normal((19, outputs)).astype(np.float32)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(outputs, input_shape=(features,))])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse",
                  metrics=["mae", SumSquaredError(), abs_error_sum])
    assert model.metrics_names == ["loss", "mae", "sse", "abs_error_sum"]
    w0, b0 = model.get_weights()
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    w, b, want = sgd_oracle(w0, b0, x, y, batch, epochs, lr)
    np.testing.assert_allclose(model.get_weights()[0], w, **FIT_TOL)
    for key in want:
        np.testing.assert_allclose(history.history[key], want[key], **FIT_TOL, err_msg=key)
    got = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    p = x.astype(np.float64) @ model.get_weights()[0].astype(np.float64) + model.get_weights()[1]
    np.testing.assert_allclose(got["mae"], np.abs(p - y).mean(), **FIT_TOL)
    np.testing.assert_allclose(got["sse"], ((p - y) ** 2).sum(), **FIT_TOL)
    np.testing.assert_allclose(got["abs_error_sum"], np.abs(p - y).sum(-1).mean(), **FIT_TOL)
    np.testing.assert_allclose(got["loss"], ((p - y) ** 2).mean(), **FIT_TOL)


def test_a_host_accuracy_agrees_with_the_one_counted_on_the_devices(devices, rng):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(4, activation="softmax", input_shape=(3,))])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.SparseCategoricalAccuracy(name="host_acc")])
    x = rng.standard_normal((23, 3)).astype(np.float32)
    y = rng.integers(0, 4, 23)
    h = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    np.testing.assert_allclose(h.history["host_acc"], h.history["accuracy"], rtol=0, atol=1e-7)
    assert model.metrics_names == ["loss", "accuracy", "host_acc"]


def test_a_keras_file_keeps_the_metrics_it_can_name(devices, rng, tmp_path):
    """Keras's names ("mae") go into the .keras file's compile config; a metric object of one's
    own is left out of it (it has no name a loader could resolve) rather than failing the load."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae", SumSquaredError()])
        path = str(tmp_path / "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    assert loaded.metrics_names == ["loss", "mae"]
    x = rng.standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
