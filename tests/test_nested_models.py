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
from oracles import bce_logits, leaky_mlp, leaky_mlp_backward

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
def test_a_nested_model_trains_like_the_flat_model_and_a_float64_oracle(devices, rng, tmp_path, n, kind):
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
    # saved and loaded: the nested model's config and the trained weights (weights file and archive)
    model.save_weights(tmp_path / "n.weights.h5")
    with strategy.scope():
        again, _ = _nested(kind)
    again.load_weights(tmp_path / "n.weights.h5")
    for got, want in zip(again.get_weights(), w):
        np.testing.assert_array_equal(got, want)
    if kind != "subclassed":                      # no get_config: Keras 3 refuses to save it whole too
        model.save(tmp_path / "n.keras")
        loaded = keras.models.load_model(tmp_path / "n.keras")
        assert [type(l).__name__ for l in loaded.layers] == [type(l).__name__ for l in model.layers]
        for got, want in zip(loaded.get_weights(), w):
            np.testing.assert_array_equal(got, want)
        _close(loaded.predict(x, verbose=0), model.predict(x, verbose=0), "the loaded model")   # other devices


# --- gradients across models: keras.io's GAN loop ---------------------------------------------------
LATENT, DATA, HIDDEN, SLOPE = 3, 2, 4, 0.2


def _gan(strategy):
    with strategy.scope():
        generator = keras.Sequential([keras.Input((LATENT,)), L.Dense(HIDDEN), L.LeakyReLU(negative_slope=SLOPE),
                                      L.Dense(DATA)], name="generator")
        discriminator = keras.Sequential([keras.Input((DATA,)), L.Dense(HIDDEN),
                                          L.LeakyReLU(negative_slope=SLOPE), L.Dense(1)], name="discriminator")
    return generator, discriminator


def test_gradients_flow_from_a_discriminator_into_a_generator_and_its_input(devices, rng):
    strategy = _strategy(devices, 1)
    generator, discriminator = _gan(strategy)
    z = rng.normal(size=(5, LATENT)).astype(np.float32)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    with tf.device("CPU:0"):                      # the strategy's device (not the simulated GPU)
        zt = tf.constant(z)
        with tf.GradientTape() as tape:
            tape.watch(zt)                        # the generator's input too: dx through both models
            predictions = discriminator(generator(zt, training=True), training=True)
            g_loss = loss_fn(tf.zeros((5, 1)), predictions)
        grads = tape.gradient(g_loss, [zt] + generator.trainable_weights)
    gw = [w.astype(np.float64) for w in generator.get_weights()]
    dw = [w.astype(np.float64) for w in discriminator.get_weights()]

    def loss(gw, z):
        return bce_logits(leaky_mlp(dw, leaky_mlp(gw, z, SLOPE)[0], SLOPE)[0], 0.0)[0]
    eps = 1e-6                                    # central differences of the composed float64 loss
    for i, (g, w) in enumerate(zip(grads, [z.astype(np.float64)] + gw)):
        numeric = np.zeros_like(w)
        for idx in np.ndindex(w.shape):
            up, down = w.copy(), w.copy()
            up[idx] += eps
            down[idx] -= eps
            args_up = (gw, up) if i == 0 else (gw[:i - 1] + [up] + gw[i:], z.astype(np.float64))
            args_down = (gw, down) if i == 0 else (gw[:i - 1] + [down] + gw[i:], z.astype(np.float64))
            numeric[idx] = (loss(*args_up) - loss(*args_down)) / (2 * eps)
        assert g is not None, f"no gradient for source {i}"
        np.testing.assert_allclose(g.numpy(), numeric, rtol=1e-4, atol=1e-6, err_msg=f"source {i}")


@pytest.mark.parametrize("n", [1, 2])
def test_keras_io_gan_loop_trains_to_a_float64_oracle_and_replicas_stay_equal(devices, rng, n):
    strategy = _strategy(devices, n)
    generator, discriminator = _gan(strategy)
    lr, batch, steps = 0.2, 6, 3                     # 6 rows: 3 per replica on 2
    with strategy.scope():
        d_optimizer = keras.optimizers.SGD(lr)
        g_optimizer = keras.optimizers.SGD(lr)
        loss_fn = keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")
    gw = [w.astype(np.float64) for w in generator.get_weights()]
    dw = [w.astype(np.float64) for w in discriminator.get_weights()]
    latent = rng.normal(size=(steps * batch, LATENT)).astype(np.float32)
    real = rng.normal(size=(steps * batch, DATA)).astype(np.float32)

    def step(z, real_images):
        b = z.shape[0]
        generated = generator(z)                                   # outside the tape, as keras.io
        combined = tf.concat([generated, real_images], axis=0)
        labels = tf.concat([tf.ones((b, 1)), tf.zeros((b, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = discriminator(combined, training=True)
            d_loss = tf.nn.compute_average_loss(loss_fn(labels, predictions), global_batch_size=2 * batch)
        grads = tape.gradient(d_loss, discriminator.trainable_weights)
        d_optimizer.apply_gradients(zip(grads, discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            predictions = discriminator(generator(z, training=True), training=True)
            g_loss = tf.nn.compute_average_loss(loss_fn(tf.zeros((b, 1)), predictions), global_batch_size=batch)
        grads = tape.gradient(g_loss, generator.trainable_weights)
        g_optimizer.apply_gradients(zip(grads, generator.trainable_weights))

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((latent, real)).batch(batch))
    for s, (z, real_images) in enumerate(data):
        strategy.run(step, args=(z, real_images))
        # the oracle: the same two SGD steps in float64
        zs, rs = latent[s * batch:(s + 1) * batch].astype(np.float64), real[s * batch:(s + 1) * batch]
        fake = leaky_mlp(gw, zs, SLOPE)[0]
        lo, saved = leaky_mlp(dw, np.concatenate([fake, rs]), SLOPE)
        _, dlo = bce_logits(lo, np.concatenate([np.ones((batch, 1)), np.zeros((batch, 1))]))
        dgrads, _ = leaky_mlp_backward(dw, saved, dlo, SLOPE)
        dw = [w - lr * g for w, g in zip(dw, dgrads)]
        fake, gsaved = leaky_mlp(gw, zs, SLOPE)
        lo, dsaved = leaky_mlp(dw, fake, SLOPE)
        _, dlo = bce_logits(lo, np.zeros((batch, 1)))
        _, dfake = leaky_mlp_backward(dw, dsaved, dlo, SLOPE)
        ggrads, _ = leaky_mlp_backward(gw, gsaved, dfake, SLOPE)
        gw = [w - lr * g for w, g in zip(gw, ggrads)]
    for model, oracle in ((discriminator, dw), (generator, gw)):
        for v, want in zip(model.trainable_weights, oracle):
            copies = [c.numpy() for c in v.values] if hasattr(v, "values") else [v.numpy()]
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0])       # replicas: bitwise equal
            np.testing.assert_allclose(copies[0], want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{model.name} {v.name} after {steps} steps")


def test_the_course_loop_keeps_the_fused_path(devices, rng, monkeypatch):
    """``loss_object(labels, model(x))`` on data (no tape follows x): one loss kernel and the
    model's backward kernels (``GradientTape._fused_gradient``), never the graph walk."""
    strategy = _strategy(devices, 2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def no_walk(*args):
        raise AssertionError("the course loop left the fused path")
    monkeypatch.setattr(tf.GradientTape, "_graph_gradient", no_walk)
    x, y = rng.normal(size=(8, 5)).astype(np.float32), rng.integers(0, 3, 8)

    def step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(labels, model(images, training=True)),
                                              global_batch_size=8)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    for inputs in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8)):
        strategy.run(step, args=(inputs,))
