"""Models inside models, and one set of weights however shared (issue 49).

* Keras FAQ's feature extractor: ``feat = keras.Model(inp, hidden)`` beside ``model =
  keras.Model(inp, out)``. After ``model.fit``, ``feat.predict``, ``model.get_weights()`` and a
  save/load round trip use the trained weights (each model packs its weights; a variable
  lives in one pack at a time and a model claims its own before it runs:
  ``keras/custom_loop.py``). Oracle: the same model built from unshared layers with the same
  initial weights, trained on the same batches: the same program, so the same bits.
* A model used as a layer (``Sequential([model, Softmax()])``, ``model(keras.Input)``, inside
  a subclassed model's ``call``): the flat model of the same layers (the same program once
  nested models are expanded: the same bits), and a float64 NumPy oracle of SGD steps.
* keras.io's GAN loop: two models, two optimizers, ``tape.gradient`` across them; a float64
  NumPy oracle of the composed loss's gradients and of the SGD steps; replicas bitwise equal.

    python -m pytest -n 0 -q tests/test_nested_models.py
"""
import numpy as np
import pytest

import mirrored as tf

keras = tf.keras
L = keras.layers
RTOL, ATOL = 2e-5, 2e-6          # float32 against float64: a few ulps of sums of ~10 terms


def _strategy(devices, n):
    devices(cpus=n)
    return tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want)
    bound = ATOL + RTOL * np.abs(want)
    bad = np.argwhere(err > bound)
    assert not len(bad), (f"{what}: max abs err {err.max():.3g}, first bad index {tuple(bad[0])}, "
                          f"shape {got.shape}")


# --- one set of weights, two models ----------------------------------------------------------------
def _extractor(order):
    inp = keras.Input((5,))
    hidden = L.Dense(4, activation="relu")(inp)
    out = L.Dense(3)(hidden)
    if order == "model first":
        model = keras.Model(inp, out)
        feat = keras.Model(inp, hidden)
    else:
        feat = keras.Model(inp, hidden)
        model = keras.Model(inp, out)
    return model, feat


def _flat():
    return keras.Sequential([keras.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3)])


@pytest.mark.parametrize("order", ["model first", "extractor first"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_shared_layer_trains_predicts_and_saves_as_one_set_of_weights(devices, rng, tmp_path, n, order):
    strategy = _strategy(devices, n)
    with strategy.scope():
        model, feat = _extractor(order)
        flat = _flat()
    flat.set_weights(model.get_weights())
    x = rng.normal(size=(13, 5)).astype(np.float32)              # 13: not divisible by 2 replicas
    y = rng.integers(0, 3, 13)
    for m in (model, flat):
        m.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # fit, the extractor in between (it claims the shared layer), fit again: Adam's state and
    # the weights carry on as if the extractor had never run
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    flat.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    feat.predict(x, verbose=0)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    flat.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    trained = flat.get_weights()
    for got, want in zip(model.get_weights(), trained):
        np.testing.assert_array_equal(got, want)                 # the same program, the same bits
    w, b = trained[0].astype(np.float64), trained[1].astype(np.float64)
    _close(feat.predict(x, verbose=0), np.maximum(x @ w + b, 0), "feat.predict after model.fit")
    for got, want in zip(feat.get_weights(), trained[:2]):
        np.testing.assert_array_equal(got, want)
    _close(model.predict(x, verbose=0), np.maximum(x @ w + b, 0) @ trained[2] + trained[3],
           "model.predict after feat.predict")
    # save and load: the file holds the trained weights
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for got, want in zip(loaded.get_weights(), trained):
        np.testing.assert_array_equal(got, want)
    with strategy.scope():
        again, again_feat = _extractor(order)
    again.load_weights(tmp_path / "m.weights.h5")
    for got, want in zip(again_feat.get_weights(), trained[:2]):
        np.testing.assert_array_equal(got, want)
    _close(again_feat.predict(x, verbose=0), np.maximum(x @ w + b, 0), "loaded extractor")


def test_set_weights_of_one_model_is_what_the_other_runs(devices, rng):
    strategy = _strategy(devices, 2)
    with strategy.scope():
        model, feat = _extractor("model first")
    x = rng.normal(size=(3, 5)).astype(np.float32)
    feat.predict(x, verbose=0)                                   # the extractor holds the layer now
    new = [rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()]
    model.set_weights(new)
    _close(feat.predict(x, verbose=0), np.maximum(x @ new[0].astype(np.float64) + new[1], 0),
           "feat after model.set_weights")
    _close(model(x).numpy(), np.maximum(x @ new[0].astype(np.float64) + new[1], 0) @ new[2] + new[3],
           "model(x) after feat.predict")


# --- a model used as a layer -------------------------------------------------------------------
def _mlp_oracle(weights, acts, x, y, lr, steps, batch):
    """float64 NumPy: SGD steps of mean sparse softmax cross-entropy through Dense layers
    (``weights`` kernel, bias, ...; ``acts`` 'relu' or None per layer), batches in order."""
    ws = [np.asarray(w, np.float64) for w in weights]
    for s in range(steps):
        lo = (s * batch) % len(x)
        xb, yb = x[lo:lo + batch].astype(np.float64), y[lo:lo + batch]
        hs = [xb]
        for i, act in enumerate(acts):
            z = hs[-1] @ ws[2 * i] + ws[2 * i + 1]
            hs.append(np.maximum(z, 0) if act == "relu" else z)
        p = np.exp(hs[-1] - hs[-1].max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        d = p
        d[np.arange(len(yb)), yb] -= 1
        d /= len(yb)
        grads = [None] * len(ws)
        for i in reversed(range(len(acts))):
            if acts[i] == "relu":
                d = d * (hs[i + 1] > 0)
            grads[2 * i], grads[2 * i + 1] = hs[i].T @ d, d.sum(0)
            d = d @ ws[2 * i].T
        ws = [w - lr * g for w, g in zip(ws, grads)]
    return ws


def _nested(kind):
    """(outer model, inner model): Dense(4, relu) -> Dense(3) inside, Dense(2) after it."""
    inner = keras.Sequential([keras.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3)])
    if kind == "sequential":
        return keras.Sequential([inner, L.Dense(2)]), inner
    if kind == "functional":
        inp = keras.Input((5,))
        return keras.Model(inp, L.Dense(2)(inner(inp))), inner
    if kind == "functional in functional":
        i2 = keras.Input((5,))
        middle = keras.Model(i2, inner(i2))                  # a functional model around the Sequential
        inp = keras.Input((5,))
        return keras.Model(inp, L.Dense(2)(middle(inp))), inner

    class Outer(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner, self.head = inner, L.Dense(2)

        def call(self, inputs, training=None):
            return self.head(self.inner(inputs))
    model = Outer()
    model.build((None, 5))
    return model, inner


@pytest.mark.parametrize("n", [1, 2])
def test_sequential_of_a_model_and_softmax_predicts_the_softmax_of_its_logits(devices, rng, n):
    strategy = _strategy(devices, n)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3)])
        probability_model = keras.Sequential([model, keras.layers.Softmax()])
    x = rng.normal(size=(7, 5)).astype(np.float32)
    w = [v.astype(np.float64) for v in model.get_weights()]
    logits = np.maximum(x @ w[0] + w[1], 0) @ w[2] + w[3]
    p = np.exp(logits - logits.max(1, keepdims=True))
    _close(probability_model.predict(x, verbose=0), p / p.sum(1, keepdims=True), "softmax of the logits")
    _close(model.predict(x, verbose=0), logits, "the model's own logits")
    assert [l.name for l in probability_model.layers] == [model.name, probability_model.layers[1].name]
    assert len(probability_model.get_weights()) == 4
    lines = []
    probability_model.summary(print_fn=lines.append)
    row = next(l for l in lines if "(Sequential)" in l)
    assert "(None, 3)" in row and " 39 " in row, row           # one row for the nested model, as Keras


@pytest.mark.parametrize("kind", ["sequential", "functional", "functional in functional", "subclassed"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_nested_model_trains_like_the_flat_model_and_a_float64_oracle(devices, rng, n, kind):
    strategy = _strategy(devices, n)
    with strategy.scope():
        model, inner = _nested(kind)
        flat = keras.Sequential([keras.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3), L.Dense(2)])
    w0 = model.get_weights()
    assert [w.shape for w in w0] == [(5, 4), (4,), (4, 3), (3,), (3, 2), (2,)]   # Keras's order
    flat.set_weights(w0)
    x = rng.normal(size=(12, 5)).astype(np.float32)
    y = rng.integers(0, 2, 12)
    lr, batch, steps = 0.3, 4, 6
    for m in (model, flat):
        m.compile(optimizer=keras.optimizers.SGD(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(x, y, batch_size=batch, epochs=steps * batch // len(x), shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), flat.get_weights()):
        np.testing.assert_array_equal(got, want)                 # one program: the same bits
    oracle = _mlp_oracle(w0, ["relu", None, None], x, y, lr, steps, batch)
    for i, (got, want) in enumerate(zip(model.get_weights(), oracle)):
        _close(got, want, f"weight {i} after {steps} SGD steps")
    # the inner model is the same weights: it predicts with the trained ones
    w = model.get_weights()
    _close(inner.predict(x, verbose=0), np.maximum(x @ w[0].astype(np.float64) + w[1], 0) @ w[2] + w[3],
           "the inner model after the outer's fit")
