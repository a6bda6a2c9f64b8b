"""Keras's ``sample_weight`` and ``class_weight`` in ``fit`` and ``evaluate`` (keras/sample_weights.py).

Oracle: Keras 3's math in float64 NumPy (``reduce_weighted_values``: the per-example losses
times their weights, summed, divided by the NUMBER of examples), SGD over a few batches of
awkward sizes (an uneven last batch, shares uneven across replicas), the epoch's loss as Keras
reports it (sum of w*l over the examples seen / examples) and its accuracy as a weighted mean
(sum of w*correct / sum of w), each batch's outputs taken BEFORE its update. Each replica's share
is divided by the GLOBAL batch, so 1 and 2 replicas match the same oracle (float32 tolerance), and
the replicas stay bitwise equal (our ring and kernels fix every order).

    python -m pytest -n 0 -q tests/test_sample_weights.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import keras
from mirrored.values import MirroredVariable
from conftest import replica_strategy

FIT_TOL = dict(rtol=2e-4, atol=2e-5)      # float32 training against float64


_strategy = replica_strategy


def _replicas_equal(model):
    for v in model.trainable_variables:
        if isinstance(v, MirroredVariable):
            for c in v.values[1:]:
                assert np.array_equal(v.values[0].numpy(), c.numpy()), f"{c.name} drifted"


def _classifier(strategy, din, hidden, classes, lr, loss="sparse", softmax=False):
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(hidden, activation="relu", input_shape=(din,)),
                                  keras.layers.Dense(classes, activation="softmax" if softmax else None)])
    if loss == "sparse":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=not softmax)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss, metrics=["accuracy"])
    return model


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def oracle(weights, x, y, w, batch, epochs, lr, onehot=False):
    """Keras 3's weighted sparse (or one-hot) cross-entropy through Dense(relu) -> Dense, SGD,
    float64. Returns the weights and per epoch the loss and the weighted accuracy."""
    w1, b1, w2, b2 = (a.astype(np.float64) for a in weights)
    hist = {"loss": [], "accuracy": []}
    for _ in range(epochs):
        wl = wc = ws = 0.0
        n = 0
        for i in range(0, len(x), batch):
            xb, yb, sw = x[i:i + batch].astype(np.float64), y[i:i + batch], w[i:i + batch].astype(np.float64)
            h = np.maximum(xb @ w1 + b1, 0.0)
            p = _softmax(h @ w2 + b2)                                    # (B, C)
            t = yb.astype(np.float64) if onehot else np.eye(p.shape[1])[yb]
            per = -(t * np.log(p)).sum(-1)                               # (B,) per-example loss
            correct = (p.argmax(-1) == t.argmax(-1)).astype(np.float64)
            wl, wc, ws, n = wl + (sw * per).sum(), wc + (sw * correct).sum(), ws + sw.sum(), n + len(xb)
            dz = sw[:, None] * (p - t) / len(xb)                         # d(sum w l / B) / d logits
            dh = (dz @ w2.T) * (h > 0)
            w1, b1, w2, b2 = (w1 - lr * xb.T @ dh, b1 - lr * dh.sum(0),
                              w2 - lr * h.T @ dz, b2 - lr * dz.sum(0))
        hist["loss"].append(wl / n)
        hist["accuracy"].append(wc / ws if ws else 0.0)
    return [w1, b1, w2, b2], hist


def _data(rng, n, din, classes):
    x = rng.standard_normal((n, din)).astype(np.float32)
    y = rng.integers(0, classes, n)
    return x, y


@pytest.mark.parametrize("n,kind", [(1, "CPU"), (2, "CPU"), (2, "GPU")])
def test_fit_sample_weight_trains_like_keras_float64(devices, rng, n, kind):
    din, hidden, classes, batch, epochs, lr = 4, 5, 3, 7, 2, 0.3
    if kind == "GPU":
        epochs = 1                     # the simulator runs a thread per element: one epoch says it
    model = _classifier(_strategy(devices, n, kind), din, hidden, classes, lr)
    x, y = _data(rng, 17 if kind == "GPU" else 19, din, classes)     # last batch 3 (5): shares 2+1 (3+2)
    w = rng.uniform(0.0, 3.0, len(x)).astype(np.float32)
    w[1] = 0.0                                                        # a weight of 0 counts, weighs nothing
    want_w, want = oracle(model.get_weights(), x, y, w, batch, epochs, lr)
    history = model.fit(x, y, sample_weight=w, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    for got, exp in zip(model.get_weights(), want_w):
        np.testing.assert_allclose(got, exp, **FIT_TOL)
    for key in want:
        np.testing.assert_allclose(history.history[key], want[key], **FIT_TOL, err_msg=key)
    _replicas_equal(model)
    # evaluate(sample_weight=): Keras's weighted loss (/ examples) and weighted accuracy
    got = model.evaluate(x, y, sample_weight=w, batch_size=batch, verbose=0, return_dict=True)
    _, once = oracle(model.get_weights(), x, y, w, batch, 1, 0.0)
    np.testing.assert_allclose(got["loss"], once["loss"][0], **FIT_TOL)
    np.testing.assert_allclose(got["accuracy"], once["accuracy"][0], **FIT_TOL)
    if kind == "GPU":
        return
    plain = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)   # nothing left behind
    _, unweighted = oracle(model.get_weights(), x, y, np.ones(len(x)), batch, 1, 0.0)
    np.testing.assert_allclose(plain["loss"], unweighted["loss"][0], **FIT_TOL)
    np.testing.assert_allclose(plain["accuracy"], unweighted["accuracy"][0], **FIT_TOL)


def test_class_weight_is_keras_sample_weight_of_each_class(devices, rng):
    din, hidden, classes, batch, epochs, lr = 3, 4, 3, 8, 2, 0.4
    strategy = _strategy(devices, 2)
    model = _classifier(strategy, din, hidden, classes, lr)
    x, y = _data(rng, 21, din, classes)
    class_weight = {0: 0.5, 2: 4.0}                                    # class 1 missing: weighs 1.0
    w = np.array([class_weight.get(int(c), 1.0) for c in y])
    want_w, want = oracle(model.get_weights(), x, y, w, batch, epochs, lr)
    history = model.fit(x, y, class_weight=class_weight, batch_size=batch, epochs=epochs, shuffle=False,
                        verbose=0)
    for got, exp in zip(model.get_weights(), want_w):
        np.testing.assert_allclose(got, exp, **FIT_TOL)
    np.testing.assert_allclose(history.history["loss"], want["loss"], **FIT_TOL)
    np.testing.assert_allclose(history.history["accuracy"], want["accuracy"], **FIT_TOL)
    _replicas_equal(model)


def test_one_hot_targets_class_weight_by_argmax_and_softmax_output(devices, rng):
    """CategoricalCrossentropy on a softmax layer: the class of a one-hot row is its argmax."""
    din, hidden, classes, batch, epochs, lr = 3, 4, 4, 6, 2, 0.3
    model = _classifier(_strategy(devices, 2), din, hidden, classes, lr, "categorical_crossentropy", True)
    x, labels = _data(rng, 13, din, classes)
    y = np.eye(classes, dtype=np.float32)[labels]
    class_weight = {0: 2.0, 1: 0.25, 3: 3.0}
    w = np.array([class_weight.get(int(c), 1.0) for c in labels])
    want_w, want = oracle(model.get_weights(), x, y, w, batch, epochs, lr, onehot=True)
    history = model.fit(x, y, class_weight=class_weight, batch_size=batch, epochs=epochs, shuffle=False,
                        verbose=0)
    for got, exp in zip(model.get_weights(), want_w):
        np.testing.assert_allclose(got, exp, **FIT_TOL)
    np.testing.assert_allclose(history.history["loss"], want["loss"], **FIT_TOL)
    _replicas_equal(model)


@pytest.mark.parametrize("how", ["dataset of triples", "class_weight on a dataset"])
def test_a_dataset_of_triples_and_class_weight_on_a_dataset(devices, rng, how):
    din, hidden, classes, batch, epochs, lr = 4, 3, 3, 5, 2, 0.3
    model = _classifier(_strategy(devices, 2), din, hidden, classes, lr)
    x, y = _data(rng, 12, din, classes)                              # batches 5, 5, 2
    if how == "dataset of triples":
        w = rng.uniform(0.1, 2.0, len(x)).astype(np.float32)
        ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(batch)
        kwargs = {}
    else:
        class_weight = {0: 3.0, 1: 0.5, 2: 1.5}
        w = np.array([class_weight[int(c)] for c in y])
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        kwargs = {"class_weight": class_weight}
    want_w, want = oracle(model.get_weights(), x, y, w, batch, epochs, lr)
    history = model.fit(ds, epochs=epochs, verbose=0, **kwargs)
    for got, exp in zip(model.get_weights(), want_w):
        np.testing.assert_allclose(got, exp, **FIT_TOL)
    np.testing.assert_allclose(history.history["loss"], want["loss"], **FIT_TOL)
    _replicas_equal(model)


def test_mse_and_a_custom_loss_weighted(devices, rng):
    """Float targets (the fused MSE kernel) and a loss written in ops (Loss.run_in): the same
    weighting after the kernel, against float64, on 2 replicas with uneven shares."""
    def my_mse(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred - y_true), axis=-1)

    din, dout, batch, lr = 3, 2, 5, 0.1
    x = rng.standard_normal((13, din)).astype(np.float32)
    y = rng.standard_normal((13, dout)).astype(np.float32)
    sw = rng.uniform(0.0, 2.0, 13).astype(np.float32)
    results = []
    for loss in ("mse", my_mse):
        strategy = _strategy(devices, 2)
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(dout, input_shape=(din,))])
        model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
        k, b = (a.astype(np.float64) for a in model.get_weights())
        wl, n = 0.0, 0
        for i in range(0, 13, batch):
            xb, yb, wb = (a[i:i + batch].astype(np.float64) for a in (x, y, sw))
            p = xb @ k + b
            per = ((p - yb) ** 2).mean(-1)
            wl, n = wl + (wb * per).sum(), n + len(xb)
            dp = wb[:, None] * 2 * (p - yb) / dout / len(xb)
            k, b = k - lr * xb.T @ dp, b - lr * dp.sum(0)
        h = model.fit(x, y, sample_weight=sw, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        np.testing.assert_allclose(model.get_weights()[0], k, **FIT_TOL)
        np.testing.assert_allclose(model.get_weights()[1], b, **FIT_TOL)
        np.testing.assert_allclose(h.history["loss"][0], wl / n, **FIT_TOL)
        _replicas_equal(model)
        results.append(model.get_weights()[0])


def test_validation_split_splits_the_weights_as_keras(devices, rng):
    din, hidden, classes, batch, lr = 3, 4, 3, 4, 0.2
    model = _classifier(_strategy(devices, 1), din, hidden, classes, lr)
    x, y = _data(rng, 10, din, classes)
    w = rng.uniform(0.5, 2.0, 10).astype(np.float32)
    want_w, _ = oracle(model.get_weights(), x[:8], y[:8], w[:8], batch, 1, lr)
    h = model.fit(x, y, sample_weight=w, validation_split=0.2, batch_size=batch, epochs=1, shuffle=False,
                  verbose=0)
    _, val = oracle(want_w, x[8:], y[8:], w[8:], batch, 1, 0.0)
    np.testing.assert_allclose(h.history["val_loss"][0], val["loss"][0], **FIT_TOL)
    for got, exp in zip(model.get_weights(), want_w):
        np.testing.assert_allclose(got, exp, **FIT_TOL)


def test_bad_weights_are_refused_and_change_nothing(devices, rng):
    model = _classifier(_strategy(devices, 1), 3, 4, 3, 0.1)
    x, y = _data(rng, 6, 3, 3)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="at the same time"):
        model.fit(x, y, sample_weight=np.ones(6), class_weight={0: 1.0}, verbose=0)
    with pytest.raises(ValueError, match="one weight per example"):
        model.fit(x, y, sample_weight=np.ones(5), verbose=0)
    with pytest.raises(ValueError, match="integer keys"):
        model.fit(x, y, class_weight={"a": 1.0}, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(3)
    with pytest.raises(ValueError, match="included as part of the dataset"):
        model.fit(ds, sample_weight=np.ones(6), verbose=0)
    triples = tf.data.Dataset.from_tensor_slices((x, y, np.ones(6, np.float32))).batch(3)
    with pytest.raises(ValueError, match="at the same time"):
        model.fit(triples, class_weight={0: 2.0}, verbose=0)
    for a, b in zip(before, model.get_weights()):
        assert np.array_equal(a, b)
