"""Functional models in Keras 3's files: ``model.save('m.keras')`` writes the "Functional"
config (layers with their ``inbound_nodes``, ``input_layers``, ``output_layers``:
``mirrored/keras/functional_config.py``) and ``load_model`` reads it back, ours and Keras's.

* Our config is checked field by field against the layout Keras 3's ``Functional.get_config``
  writes (keras/src/models/functional.py), a shared layer's calls numbered as Keras numbers them.
* A round trip gives the same predictions bit for bit, and training resumes where it stopped
  (weights and Adam's slots restored: the next steps give the bits an uninterrupted run gives).
* A config written by hand as Keras 3 writes it (with a .weights.h5 in Keras's layout) loads,
  and the model computes what a float64 NumPy forward of those weights computes.

    python -m pytest -q tests/test_functional_saving.py
"""
import io
import json
import zipfile

import numpy as np
import pytest

import mirrored as tf
from mirrored import keras

L = keras.layers
F32 = np.float32


@pytest.fixture(autouse=True)
def one_cpu(devices):
    """Every model here on one CPU device (the default strategy would take the simulated GPU)."""
    with tf.distribute.OneDeviceStrategy("CPU:0").scope():
        yield


def shared_model(din=4, hidden=5, classes=3, dropout=True):
    inputs = keras.Input((din,), name="features")
    h = L.Dense(hidden, activation="relu", name="hidden")(inputs)
    shared = L.Dense(hidden, activation="relu", name="shared")
    h = shared(shared(h))
    if dropout:
        h = L.Dropout(0.25, seed=5, name="drop")(h)
    return keras.Model(inputs, L.Dense(classes, name="logits")(h), name="mini")


def tensor_ref(shape, history):
    return {"class_name": "__keras_tensor__",
            "config": {"shape": shape, "dtype": "float32", "keras_history": history}}


def test_our_functional_config_is_kerass_layout(devices):
    config = shared_model().get_config()
    assert config["name"] == "mini" and config["trainable"] is True
    assert config["input_layers"] == ["features", 0, 0] and config["output_layers"] == ["logits", 0, 0]
    layers = config["layers"]
    assert [(l["class_name"], l["name"]) for l in layers] == [
        ("InputLayer", "features"), ("Dense", "hidden"), ("Dense", "shared"), ("Dropout", "drop"),
        ("Dense", "logits")]
    first = layers[0]
    assert first["inbound_nodes"] == [] and first["config"]["batch_shape"] == [None, 4]
    assert first["module"] == "keras.layers" and first["registered_name"] is None
    for entry in layers[1:]:
        assert set(entry) >= {"module", "class_name", "config", "registered_name", "build_config", "name",
                              "inbound_nodes"}
        assert entry["config"]["name"] == entry["name"]
    hidden, shared, drop, logits = layers[1:]
    assert hidden["inbound_nodes"] == [{"args": [tensor_ref([None, 4], ["features", 0, 0])], "kwargs": {}}]
    assert hidden["build_config"] == {"input_shape": [None, 4]}
    assert shared["inbound_nodes"] == [{"args": [tensor_ref([None, 5], ["hidden", 0, 0])], "kwargs": {}},
                                       {"args": [tensor_ref([None, 5], ["shared", 0, 0])], "kwargs": {}}]
    assert drop["inbound_nodes"][0]["args"][0]["config"]["keras_history"] == ["shared", 1, 0]
    assert logits["inbound_nodes"][0]["args"][0]["config"]["keras_history"] == ["drop", 0, 0]


def test_a_functional_model_round_trips_and_resumes_training(devices, rng, tmp_path):
    x = rng.standard_normal((12, 4)).astype(F32)
    y = rng.integers(0, 3, 12)

    def compiled(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = compiled(shared_model())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with zipfile.ZipFile(path) as zf:
        written = json.loads(zf.read("config.json"))
        weights = io.BytesIO(zf.read("model.weights.h5"))
    import h5py
    with h5py.File(weights, "r") as f:                  # Keras's keys: model.layers, InputLayer first
        assert sorted(f["layers"]) == ["dense", "dense_1", "dense_2", "dropout", "input_layer"]
        assert len(f["layers/input_layer/vars"]) == 0 and len(f["layers/dense_1/vars"]) == 2
        assert f["layers/dense_1/vars"].attrs["name"] == "shared"
    assert written["class_name"] == "Functional" and written["registered_name"] == "Functional"
    assert written["module"] == "keras.src.models.functional"
    assert written["compile_config"]["optimizer"]["class_name"] == "Adam"
    back = keras.models.load_model(path)
    assert type(back).__name__ == "Functional" and back.name == "mini"
    assert [l.name for l in back.layers] == [l.name for l in model.layers]
    assert back.get_config() == model.get_config()
    assert np.array_equal(back.predict(x, verbose=0), model.predict(x, verbose=0))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)        # both resume
    back.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), back.get_weights()):
        assert np.array_equal(a, b)


def kerass_config(w):
    """What Keras 3 writes to config.json for shared_model(dropout=False) (hand-written from
    keras/src/models/functional.py's get_config and Keras's layer configs)."""
    policy = {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "float32"},
              "registered_name": None}

    def dense(name, units, activation, din, calls):
        return {"module": "keras.layers", "class_name": "Dense", "registered_name": None,
                "config": {"name": name, "trainable": True, "dtype": policy, "units": units,
                           "activation": activation, "use_bias": True,
                           "kernel_initializer": {"module": "keras.initializers", "class_name": "GlorotUniform",
                                                  "config": {"seed": None}, "registered_name": None},
                           "bias_initializer": {"module": "keras.initializers", "class_name": "Zeros",
                                                "config": {}, "registered_name": None},
                           "kernel_regularizer": None, "bias_regularizer": None, "kernel_constraint": None,
                           "bias_constraint": None},
                "build_config": {"input_shape": [None, din]}, "name": name,
                "inbound_nodes": [{"args": [tensor_ref([None, din], h)], "kwargs": {}} for h in calls]}

    # listed in an order that makes the loader wait: 'logits' reads shared's SECOND call
    layers = [{"module": "keras.layers", "class_name": "InputLayer", "registered_name": None,
               "config": {"batch_shape": [None, 4], "dtype": "float32", "sparse": False, "ragged": False,
                          "name": "features", "optional": False},
               "name": "features", "inbound_nodes": []},
              dense("hidden", 5, "relu", 4, [["features", 0, 0]]),
              dense("logits", 3, "linear", 5, [["shared", 1, 0]]),
              dense("shared", 5, "relu", 5, [["hidden", 0, 0], ["shared", 0, 0]])]
    return {"module": "keras.src.models.functional", "class_name": "Functional", "registered_name": "Functional",
            "config": {"name": "theirs", "trainable": True, "layers": layers,
                       "input_layers": [["features", 0, 0]], "output_layers": [["logits", 0, 0]]},
            "build_config": {"input_shape": None}}


def test_we_load_a_functional_model_as_keras_writes_it(devices, rng, tmp_path):
    import h5py
    w = {"hidden": (rng.standard_normal((4, 5)), rng.standard_normal(5)),
         "shared": (rng.standard_normal((5, 5)) * 0.5, rng.standard_normal(5)),
         "logits": (rng.standard_normal((5, 3)), rng.standard_normal(3))}
    weights = io.BytesIO()
    with h5py.File(weights, "w") as f:                          # Keras's layout: model.layers' order
        f.create_group("vars")
        f.create_group("layers/input_layer/vars")
        for key, name in (("dense", "hidden"), ("dense_1", "shared"), ("dense_2", "logits")):
            group = f.create_group(f"layers/{key}/vars")
            for i, a in enumerate(w[name]):
                group.create_dataset(str(i), data=np.asarray(a, F32))
    path = tmp_path / "theirs.keras"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("metadata.json", json.dumps({"keras_version": "3.11.3"}))
        zf.writestr("config.json", json.dumps(kerass_config(w)))
        zf.writestr("model.weights.h5", weights.getvalue())
    model = keras.models.load_model(str(path))
    assert [l.name for l in model.layers] == ["hidden", "shared", "logits"]
    assert [len(l.inbound_nodes) for l in model.layers] == [1, 2, 1]
    x = rng.standard_normal((6, 4)).astype(F32)

    def dense(name, v, relu=True):
        z = v @ np.asarray(w[name][0], F32).astype(np.float64) + np.asarray(w[name][1], F32)
        return np.maximum(z, 0) if relu else z
    want = dense("logits", dense("shared", dense("shared", dense("hidden", x.astype(np.float64)))), relu=False)
    got = model.predict(x, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_damaged_functional_config_says_what_is_wrong(devices, tmp_path):
    config = kerass_config(None)
    config["config"]["layers"][3]["inbound_nodes"][0]["args"][0]["config"]["keras_history"] = ["nowhere", 0, 0]
    model = shared_model(dropout=False)
    path = str(tmp_path / "m.keras")
    model.save(path)
    damaged = tmp_path / "damaged.keras"
    with zipfile.ZipFile(path) as zf, zipfile.ZipFile(damaged, "w") as out:
        for name in zf.namelist():
            out.writestr(name, json.dumps(config) if name == "config.json" else zf.read(name))
    with pytest.raises(ValueError, match="Invalid Functional model configuration"):
        keras.models.load_model(str(damaged))


def test_summary_has_kerass_connected_to_column():
    model = shared_model()
    lines = []
    model.summary(print_fn=lines.append)
    assert "Connected to" in lines[2] and lines[0] == 'Model: "mini"'
    rows = {line.split()[0]: line for line in lines if line.startswith(" ") and "(" in line and line.split()}
    assert rows["features"].split()[-1] == "-" and "(InputLayer)" in rows["features"]
    assert rows["hidden"].split()[-1] == "features[0][0]" and rows["hidden"].split()[-2] == "25"
    after_shared = lines[lines.index(rows["shared"]) + 1]
    assert rows["shared"].split()[-1] == "hidden[0][0]" and after_shared.split() == ["shared[0][0]"]
    assert rows["drop"].split()[-1] == "shared[1][0]" and rows["logits"].split()[-1] == "drop[0][0]"
    assert lines[-4] == f"Total params: {model.count_params():,}" == "Total params: 73"


def test_real_keras_reads_our_functional_file_and_we_read_its(rng, tmp_path):
    """Where Keras 3 is installed (not a dependency: skipped otherwise), on its NumPy backend: our
    functional .keras (a shared layer, a residual Add, a Concatenate) loads in Keras and predicts
    what ours does; Keras's own file of it loads here and predicts what Keras's does."""
    import os
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    real = pytest.importorskip("keras")
    inputs = keras.Input((4,), name="features")
    h = L.Dense(5, activation="relu", name="hidden")(inputs)
    shared = L.Dense(5, activation="relu", name="shared")
    s = L.Add(name="skip")([h, shared(shared(h))])
    c = L.Concatenate(name="join")([s, L.Dense(2, name="side")(inputs)])
    ours = keras.Model(inputs, L.Dense(3, name="logits")(c), name="dag")
    x = rng.standard_normal((6, 4)).astype(F32)
    ours.save(str(tmp_path / "ours.keras"))
    theirs = real.models.load_model(tmp_path / "ours.keras")
    assert [l.name for l in theirs.layers] == ["features"] + [l.name for l in ours.layers]
    np.testing.assert_allclose(theirs.predict(x, verbose=0), ours.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    theirs.set_weights([w * 0.5 for w in theirs.get_weights()])
    theirs.save(tmp_path / "theirs.keras")
    back = keras.models.load_model(str(tmp_path / "theirs.keras"))
    np.testing.assert_allclose(back.predict(x, verbose=0), theirs.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
