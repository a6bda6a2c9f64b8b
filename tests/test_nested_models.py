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
