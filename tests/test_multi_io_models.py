"""Functional models with several inputs and outputs (``mirrored/keras/multi_io.py``,
``compile_utils.py``), as Keras 3 writes them: ``keras.Model([a, b], [o1, o2])`` with a loss,
a weight and metrics per output, trained under MirroredStrategy on 1 and 2 logical CPUs.

Which equality each test claims, and why it holds:
* weights after fit against a float64 NumPy oracle of the same SGD steps: float32 tolerance
  (BLAS computes the products);
* the replicas' copies of every weight against each other: bitwise (the same update, our
  order of sums, applied to every copy);
* 2 replicas against 1 on the same global batches: float32 tolerance (each replica's
  gradient is its share of the global batch's mean; the ring sums the shares).

    python -m pytest -q tests/test_multi_io_models.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import keras
from mirrored.keras import layers as L
from mirrored.values import components

F32 = np.float32
#: float32 training against the float64 oracle, a few SGD steps on values of order 1
RTOL, ATOL = 2e-4, 2e-5
LR, W1, W2 = 0.1, 1.0, 0.5                  # SGD's rate; loss_weights of o1 and o2


def two_by_two(strategy):
    """a (3,), b (2,) -> Dense(4, relu) each -> Concatenate -> o1 Dense(2), o2 Dense(1)."""
    with strategy.scope():
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        h = L.Concatenate(name="join")([L.Dense(4, activation="relu", name="da")(a),
                                        L.Dense(4, activation="relu", name="db")(b)])
        return keras.Model([a, b], [L.Dense(2, name="o1")(h), L.Dense(1, name="o2")(h)])


def data(rng, n):
    x = [rng.standard_normal((n, 3)).astype(F32), rng.standard_normal((n, 2)).astype(F32)]
    y = [rng.standard_normal((n, 2)).astype(F32), rng.standard_normal((n, 1)).astype(F32)]
    return x, y


def oracle_step(w, xa, xb, y1, y2):
    """One SGD step of W1 * mse(o1) + W2 * mae(o2) over the batch, in float64; the losses."""
    wa, ba, wb, bb, k1, c1, k2, c2 = w
    za, zb = xa @ wa + ba, xb @ wb + bb
    h = np.concatenate([np.maximum(za, 0), np.maximum(zb, 0)], axis=1)         # (B, 8)
    p1, p2 = h @ k1 + c1, h @ k2 + c2                                          # (B, 2), (B, 1)
    n = len(xa)
    d1 = W1 * 2 * (p1 - y1) / (n * 2)                                          # d loss / d p1
    d2 = W2 * np.sign(p2 - y2) / n                                             # d loss / d p2
    dh = d1 @ k1.T + d2 @ k2.T
    dza, dzb = dh[:, :4] * (za > 0), dh[:, 4:] * (zb > 0)
    grads = [xa.T @ dza, dza.sum(0), xb.T @ dzb, dzb.sum(0), h.T @ d1, d1.sum(0), h.T @ d2, d2.sum(0)]
    losses = (np.mean((p1 - y1) ** 2), np.mean(np.abs(p2 - y2)))
    return [v - LR * g for v, g in zip(w, grads)], losses


def strategy_on(devices, n):
    devices(cpus=n)
    return tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def check_replicas_equal(model):
    for v in model.trainable_variables:
        copies = [c.numpy() for c in components(v)]
        for c in copies[1:]:
            assert np.array_equal(c, copies[0]), f"{v.name}: the replicas' copies differ"


@pytest.mark.parametrize("replicas", [1, 2])
def test_two_inputs_two_outputs_train_to_the_float64_oracle(devices, rng, replicas):
    strategy = strategy_on(devices, replicas)
    model = two_by_two(strategy)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss={"o1": "mse", "o2": "mae"},
                  loss_weights=[W1, W2], metrics={"o1": ["mae"], "o2": "mse"})
    x, y = data(rng, 13)                               # batches of 5, 5, 3: uneven over 2 replicas
    w = [v.astype(np.float64) for v in model.get_weights()]
    history = model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0).history
    assert sorted(history) == ["loss", "o1_loss", "o1_mae", "o2_loss", "o2_mse"]
    seen = []
    for i in range(0, 13, 5):
        w, losses = oracle_step(w, x[0][i:i + 5], x[1][i:i + 5], y[0][i:i + 5], y[1][i:i + 5])
        seen.append((losses, len(x[0][i:i + 5])))
    for got, want, v in zip(model.get_weights(), w, model.trainable_variables):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=v.name)
    check_replicas_equal(model)
    o1 = sum(l[0] * n for l, n in seen) / 13           # each output's loss over the epoch's examples
    np.testing.assert_allclose(history["o1_loss"][0], o1, rtol=1e-4)
    np.testing.assert_allclose(history["o2_loss"][0], sum(l[1] * n for l, n in seen) / 13, rtol=1e-4)
    total = sum((W1 * l[0] + W2 * l[1]) * n for l, n in seen) / 13     # the weighted total, uneven shares too
    np.testing.assert_allclose(history["loss"][0], total, rtol=1e-4)


def test_two_replicas_train_as_one_on_the_global_batch(devices, rng):
    x, y = data(rng, 12)
    weights, results = None, []
    for replicas in (1, 2):
        model = two_by_two(strategy_on(devices, replicas))
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        model.compile(optimizer="sgd", loss=["mse", "mse"], loss_weights={"o2": 2.0})
        model.fit({"a": x[0], "b": x[1]}, {"o1": y[0], "o2": y[1]}, batch_size=4, epochs=2, shuffle=False,
                  verbose=0)
        results.append(model.get_weights())
        if replicas == 2:
            check_replicas_equal(model)
    for one, two in zip(*results):
        np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)


def test_calls_predict_and_dict_models_give_keras_structures(devices, rng):
    strategy = strategy_on(devices, 2)
    model = two_by_two(strategy)
    x, _ = data(rng, 7)
    wa, ba, wb, bb, k1, c1, k2, c2 = [w.astype(np.float64) for w in model.get_weights()]
    h = np.concatenate([np.maximum(x[0] @ wa + ba, 0), np.maximum(x[1] @ wb + bb, 0)], axis=1)
    want = [h @ k1 + c1, h @ k2 + c2]
    out = model.predict(x, batch_size=3, verbose=0)
    assert isinstance(out, list) and [o.shape for o in out] == [(7, 2), (7, 1)]
    for got, exp in zip(out, want):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
    eager = model({"a": x[0], "b": x[1]})                       # a dict keyed by the Input names
    np.testing.assert_allclose(eager[1].numpy(), want[1], rtol=1e-5, atol=1e-6)
    assert model.input_shape == [(None, 3), (None, 2)] and model.output_shape == [(None, 2), (None, 1)]
    assert model.output_names == ["o1", "o2"]
    with strategy.scope():                                      # the same layers, a dict model
        by_name = keras.Model({"a": model.inputs[0], "b": model.inputs[1]},
                              {"first": model.outputs[0], "second": model.outputs[1]})
    out = by_name.predict({"a": x[0], "b": x[1]}, verbose=0)
    assert sorted(out) == ["first", "second"]
    np.testing.assert_allclose(out["second"], want[1], rtol=1e-5, atol=1e-6)
    by_name.compile(optimizer="sgd", loss={"first": "mse"}, metrics={"second": ["mae"]})
    logs = by_name.evaluate({"a": x[0], "b": x[1]}, {"first": want[0], "second": want[1]}, verbose=0,
                            return_dict=True)
    assert sorted(logs) == ["loss", "second_mae"] and logs["loss"] < 1e-10 and logs["second_mae"] < 1e-5


def test_gradients_reach_every_output_and_every_input(devices, rng):
    model = two_by_two(strategy_on(devices, 1))
    x, _ = data(rng, 4)
    xa, xb = tf.constant(x[0]), tf.constant(x[1])
    with tf.GradientTape() as tape:
        tape.watch([xa, xb])
        o1, o2 = model([xa, xb], training=True)
        loss = tf.reduce_sum(o1 * o1) + 3.0 * tf.reduce_sum(o2)
    grads = tape.gradient(loss, [xa, xb] + model.trainable_variables)
    wa, ba, wb, bb, k1, c1, k2, c2 = [w.astype(np.float64) for w in model.get_weights()]
    za, zb = x[0] @ wa + ba, x[1] @ wb + bb
    h = np.concatenate([np.maximum(za, 0), np.maximum(zb, 0)], axis=1)
    d1, d2 = 2 * (h @ k1 + c1), np.full((4, 1), 3.0)
    dh = d1 @ k1.T + d2 @ k2.T
    dza, dzb = dh[:, :4] * (za > 0), dh[:, 4:] * (zb > 0)
    want = [dza @ wa.T, dzb @ wb.T, x[0].T @ dza, dza.sum(0), x[1].T @ dzb, dzb.sum(0),
            h.T @ d1, d1.sum(0), h.T @ d2, d2.sum(0)]
    for got, exp in zip(grads, want):
        np.testing.assert_allclose(got.numpy(), exp, rtol=1e-4, atol=1e-5)


def test_a_data_set_of_structures_trains(devices, rng):
    strategy = strategy_on(devices, 2)
    model = two_by_two(strategy)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", loss_weights=[W1, W2])
    x, y = data(rng, 6)
    w = [v.astype(np.float64) for v in model.get_weights()]
    ds = tf.data.Dataset.from_tensor_slices(((x[0], x[1]), (y[0], y[1]))).batch(6)
    model.fit(ds, epochs=1, verbose=0)
    wa, ba, wb, bb, k1, c1, k2, c2 = w
    za, zb = x[0] @ wa + ba, x[1] @ wb + bb
    h = np.concatenate([np.maximum(za, 0), np.maximum(zb, 0)], axis=1)
    d1 = W1 * 2 * (h @ k1 + c1 - y[0]) / 12
    d2 = W2 * 2 * (h @ k2 + c2 - y[1]) / 6
    np.testing.assert_allclose(model.get_weights()[7], c2 - LR * d2.sum(0), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(model.get_weights()[5], c1 - LR * d1.sum(0), rtol=RTOL, atol=ATOL)
    check_replicas_equal(model)


def test_structures_that_do_not_fit_are_refused_with_the_names_there_are(devices, rng):
    model = two_by_two(strategy_on(devices, 1))
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"key\(s\) \['oX'\].*outputs are \['o1', 'o2'\]"):
        model.compile(optimizer="sgd", loss={"o1": "mse", "oX": "mae"})
    with pytest.raises(ValueError, match="a list of 1 for a model of 2 outputs"):
        model.compile(optimizer="sgd", loss=["mse"])
    with pytest.raises(ValueError, match="a list of 3 for a model of 2 outputs"):
        model.compile(optimizer="sgd", loss="mse", metrics=["mae", "mse", "mae"])
    with pytest.raises(ValueError, match="loss_weights"):
        model.compile(optimizer="sgd", loss="mse", loss_weights={"o3": 1.0})
    with pytest.raises(ValueError, match="one entry per output or a dict"):
        model.compile(optimizer="sgd", loss="mse", metrics=keras.metrics.MeanAbsoluteError())
    assert model.loss is None                          # nothing changed by a refused compile
    x, y = data(rng, 4)
    with pytest.raises(ValueError, match=r"takes the inputs \['a', 'b'\].*missing: \['b'\]"):
        model.predict({"a": x[0]}, verbose=0)
    with pytest.raises(ValueError, match="takes 2 inputs"):
        model(x[0])
    with pytest.raises(ValueError, match=r"input 'b' takes examples of shape \(2,\)"):
        model([x[0], x[0]])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"2 outputs \['o1', 'o2'\], so y is a list"):
        model.fit(x, y[0], verbose=0)
    with pytest.raises(ValueError, match=r"none for the output\(s\) \['o2'\]"):
        model.fit(x, {"o1": y[0]}, verbose=0)
    for got, want in zip(model.get_weights(), before):
        assert np.array_equal(got, want)
    with pytest.raises(NotImplementedError, match="keras.layers.Softmax"):
        a = keras.Input((3,), name="a2")
        keras.Model(a, [L.Dense(2, activation="softmax")(a), L.Dense(1)(a)])


def test_save_and_load_keep_the_structures_the_losses_and_the_training(devices, rng, tmp_path):
    model = two_by_two(strategy_on(devices, 1))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss={"o1": "mse", "o2": "mae"},
                  loss_weights=[1.0, 0.5], metrics={"o1": ["mae"]})
    x, y = data(rng, 6)
    model.fit(x, y, verbose=0)                           # the momentum slots exist: saved with the weights
    model.save(str(tmp_path / "m.keras"))
    back = keras.models.load_model(str(tmp_path / "m.keras"))
    assert back.input_shape == [(None, 3), (None, 2)] and back.output_names == ["o1", "o2"]
    for got, want in zip(back.get_weights(), model.get_weights()):
        assert np.array_equal(got, want)                 # the file holds the bits
    for got, want in zip(back.predict(x, verbose=0), model.predict(x, verbose=0)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)       # BLAS: float32 tolerance
    first, second = model.fit(x, y, verbose=0).history, back.fit(x, y, verbose=0).history
    assert sorted(first) == sorted(second) == ["loss", "o1_loss", "o1_mae", "o2_loss"]
    for key in first:                                    # the same loss weights, momentum, step count
        # (SGD, not Adam: Adam's update of a gradient near zero is +-lr whatever its size, so one
        # ulp of BLAS noise could flip it; SGD's is proportional to it)
        np.testing.assert_allclose(second[key], first[key], rtol=1e-4)
    for got, want in zip(back.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    with tf.distribute.MirroredStrategy(["CPU:0"]).scope():
        by_name = keras.Model({"a": model.inputs[0], "b": model.inputs[1]},
                              {"first": model.outputs[0], "second": model.outputs[1]})
    by_name.save(str(tmp_path / "d.keras"))
    out = keras.models.load_model(str(tmp_path / "d.keras")).predict({"a": x[0], "b": x[1]}, verbose=0)
    assert sorted(out) == ["first", "second"]
    np.testing.assert_allclose(out["second"], model.predict(x, verbose=0)[1], rtol=1e-5, atol=1e-6)


def test_summary_lists_every_input_layer_and_connection(devices):
    model = two_by_two(strategy_on(devices, 1))
    lines = []
    model.summary(print_fn=lines.append)
    rows = {line.split()[0]: line for line in lines if line.startswith(" ") and line.split()}
    assert rows["a"].split()[1:] == ["(InputLayer)", "(None,", "3)", "0", "-"]
    assert rows["b"].split()[1:] == ["(InputLayer)", "(None,", "2)", "0", "-"]
    assert rows["da"].split()[-1] == "a[0][0]" and rows["db"].split()[-1] == "b[0][0]"
    assert rows["o2"].split()[-1] == "join[0][0]" and lines[-4] == "Total params: 55"


def test_real_keras_reads_our_two_input_two_output_file_and_we_read_its(rng, tmp_path):
    """Where Keras 3 is installed (not a dependency: skipped otherwise): our .keras file of a model
    of two inputs and two outputs loads in Keras and predicts what ours does; Keras's own file of
    a model of dicts loads here and predicts what Keras's does."""
    import os
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    real = pytest.importorskip("keras")
    ours = two_by_two(tf.distribute.get_strategy())
    x, _ = data(rng, 5)
    ours.save(str(tmp_path / "ours.keras"))
    theirs = real.models.load_model(tmp_path / "ours.keras")
    assert [l.name for l in theirs.layers] == ["a", "b", "da", "db", "join", "o1", "o2"]
    for got, want in zip(theirs.predict(x, verbose=0), ours.predict(x, verbose=0)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    a, b = real.Input((3,), name="a"), real.Input((2,), name="b")
    h = real.layers.Dense(3, name="d")(real.layers.Concatenate(name="c")([a, b]))
    made = real.Model({"a": a, "b": b},
                      {"x": real.layers.Dense(1, name="x")(h), "y": real.layers.Dense(2, name="y")(h)})
    made.save(tmp_path / "theirs.keras")
    back = keras.models.load_model(str(tmp_path / "theirs.keras"))
    got, want = back.predict({"a": x[0], "b": x[1]}, verbose=0), made.predict({"a": x[0], "b": x[1]}, verbose=0)
    assert sorted(got) == ["x", "y"]
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_validation_split_cuts_every_array_and_one_output_takes_keras_forms(devices, rng):
    model = two_by_two(strategy_on(devices, 2))
    model.compile(optimizer="sgd", loss="mse", metrics=[None, ["mae"]])
    x, y = data(rng, 10)
    logs = model.fit(x, y, validation_split=0.2, batch_size=4, epochs=1, verbose=0).history
    assert sorted(logs) == ["loss", "o1_loss", "o2_loss", "o2_mae", "val_loss", "val_o1_loss", "val_o2_loss",
                            "val_o2_mae"]
    want = model.evaluate([x[0][8:], x[1][8:]], [y[0][8:], y[1][8:]], verbose=0, return_dict=True)
    np.testing.assert_allclose([logs["val_o1_loss"][0], logs["val_o2_mae"][0]], [want["o1_loss"], want["o2_mae"]],
                               rtol=1e-6)                # the last 20% of every array, after the epoch
    np.testing.assert_allclose(model.evaluate([x[0][8:], x[1][8:]], [y[0][8:], y[1][8:]], verbose=0),
                               [want["loss"], want["o1_loss"], want["o2_loss"], want["o2_mae"]])   # Keras's order
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        a, b = keras.Input((3,), name="p"), keras.Input((2,), name="q")
        one = keras.Model({"p": a, "q": b}, L.Dense(1, name="out")(L.Concatenate()([a, b])))
    one.compile(optimizer="sgd", loss={"out": "mse"}, metrics={"out": "mae"})      # one output, by name
    logs = one.fit({"p": x[0], "q": x[1]}, y[1], batch_size=5, verbose=0).history
    assert sorted(logs) == ["loss", "mae"]


def test_two_simulated_gpus_train_as_one_cpu(devices, rng):
    """The CUDA path end to end (the simulator here, a GPU where there is one): the input slices,
    the outputs' join and the model call's slices launch the same math as on the CPU."""
    x, y = data(rng, 3)                                # 2 + 1 rows over the two GPUs
    results, weights = [], None
    for kind in ("cpu", "gpu"):
        if kind == "cpu":
            strategy = strategy_on(devices, 1)
        else:
            devices(cpus=1, gpus=2)
            strategy = tf.distribute.MirroredStrategy(["GPU:0", "GPU:1"])
        model = two_by_two(strategy)
        weights = weights or model.get_weights()
        model.set_weights(weights)
        model.compile(optimizer="sgd", loss=["mse", "mae"], loss_weights=[W1, W2])
        logs = model.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0).history
        results.append((model.get_weights(), logs, model.predict(x, verbose=0)))
        if kind == "gpu":
            check_replicas_equal(model)
    (w_cpu, logs_cpu, p_cpu), (w_gpu, logs_gpu, p_gpu) = results
    for a, b in zip(w_gpu, w_cpu):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(p_gpu, p_cpu):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert sorted(logs_gpu) == sorted(logs_cpu) == ["loss", "o1_loss", "o2_loss"]


def test_two_inputs_into_one_softmax_output_report_keras_loss_and_accuracy(devices, rng):
    strategy = strategy_on(devices, 2)
    with strategy.scope():
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        h = L.Concatenate()([L.Dense(5, activation="relu")(a), b])
        model = keras.Model([a, b], L.Dense(4, activation="softmax", name="cls")(h))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, _ = data(rng, 9)
    y = rng.integers(0, 4, 9)
    model.fit(x, y, batch_size=4, verbose=0)
    p = model.predict(x, verbose=0).astype(np.float64)                           # (9, 4) probabilities
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-6)
    loss, accuracy = model.evaluate(x, y, batch_size=4, verbose=0)
    np.testing.assert_allclose(loss, -np.log(p[np.arange(9), y]).mean(), rtol=1e-5)
    assert accuracy == pytest.approx(np.mean(p.argmax(axis=1) == y))


KERAS_FIT = """
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np, keras
d = dict(np.load(sys.argv[1]))
a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
h = keras.layers.Concatenate(name="join")([keras.layers.Dense(4, activation="relu", name="da")(a),
                                           keras.layers.Dense(4, activation="relu", name="db")(b)])
model = keras.Model([a, b], [keras.layers.Dense(2, name="o1")(h), keras.layers.Dense(1, name="o2")(h)])
model.set_weights([d[f"w{i}"] for i in range(8)])
model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"o1": "mse", "o2": "mae"}, loss_weights=[1.0, 0.5],
              metrics={"o1": ["mae"], "o2": "mse"})
logs = model.fit([d["xa"], d["xb"]], [d["y1"], d["y2"]], batch_size=5, shuffle=False, verbose=0).history
np.savez(sys.argv[2], *model.get_weights(), **{"log_" + k: v[0] for k, v in logs.items()})
"""


def test_keras_3_trains_the_same_model_to_the_same_weights_and_logs(devices, rng, tmp_path):
    """Where Keras 3 and JAX are installed (not dependencies: skipped otherwise), Keras 3 itself is
    the oracle of the losses, weights, metrics and their names: the same model, weights and
    batches on its JAX backend (a process of its own), against ours on 2 replicas."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("keras") is None or importlib.util.find_spec("jax") is None:
        pytest.skip("needs keras and jax installed (Keras 3's own fit)")
    model = two_by_two(strategy_on(devices, 2))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss={"o1": "mse", "o2": "mae"}, loss_weights=[W1, W2],
                  metrics={"o1": ["mae"], "o2": "mse"})
    x, y = data(rng, 13)
    start = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    np.savez(tmp_path / "in.npz", xa=x[0], xb=x[1], y1=y[0], y2=y[1], **start)
    ours = model.fit(x, y, batch_size=5, shuffle=False, verbose=0).history
    done = subprocess.run([sys.executable, "-c", KERAS_FIT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = dict(np.load(tmp_path / "out.npz"))
    for i, got in enumerate(model.get_weights()):
        np.testing.assert_allclose(got, theirs[f"arr_{i}"], rtol=RTOL, atol=ATOL)
    assert sorted(ours) == sorted(k[4:] for k in theirs if k.startswith("log_"))
    for key, value in ours.items():
        np.testing.assert_allclose(value[0], theirs["log_" + key], rtol=1e-4, err_msg=key)


def test_a_custom_loop_and_its_tf_function_train_the_model_alike(devices, rng):
    """TF's custom training loop on a model of two inputs and outputs: ``strategy.run`` over a
    distributed data set of dicts, a loss per output, ``apply_gradients``; the ``@tf.function``
    replay gives the eager loop's weights bitwise (the same launches), both the oracle's."""
    strategy = strategy_on(devices, 2)
    model = two_by_two(strategy)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(LR)
    x, y = data(rng, 6)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(({"a": x[0], "b": x[1]}, {"o1": y[0], "o2": y[1]})).batch(6))
    mse = keras.losses.MeanSquaredError(reduction="none")

    def step(batch):
        xs, ys = batch
        with tf.GradientTape() as tape:
            o1, o2 = model(xs, training=True)
            loss = W1 * tf.nn.compute_average_loss(mse(ys["o1"], o1), global_batch_size=6) + \
                W2 * tf.nn.compute_average_loss(mse(ys["o2"], o2), global_batch_size=6)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    traced = tf.function(lambda batch: strategy.run(step, args=(batch,)))
    start = model.get_weights()
    results = []
    for run in (lambda batch: strategy.run(step, args=(batch,)), traced, traced):     # eager; trace; replay
        model.set_weights(start)
        for batch in dist:
            run(batch)
        results.append(model.get_weights())
        check_replicas_equal(model)
    for eager, replayed in zip(results[0], results[2]):
        assert np.array_equal(eager, replayed)
    wa, ba, wb, bb, k1, c1, k2, c2 = [w.astype(np.float64) for w in start]
    h = np.concatenate([np.maximum(x[0] @ wa + ba, 0), np.maximum(x[1] @ wb + bb, 0)], axis=1)
    d1, d2 = W1 * 2 * (h @ k1 + c1 - y[0]) / 12, W2 * 2 * (h @ k2 + c2 - y[1]) / 6
    np.testing.assert_allclose(results[0][5], c1 - LR * d1.sum(0), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(results[0][7], c2 - LR * d2.sum(0), rtol=RTOL, atol=ATOL)
