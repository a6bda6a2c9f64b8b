"""Keras 3's file layout for models used as layers, and the new layers, both ways (issue 49;
keras/saving.py).

Keras 3 (keras/src/saving/saving_lib.py, ``_save_state`` / ``_walk_saveable``) walks a
Sequential or functional model's ``layers`` and writes each layer's variables at the path it
reached it by; a model used as a layer is walked into, so its layers' weights sit under its
own group::

    layers/sequential/vars                     (the nested model's own: empty, name attribute)
    layers/sequential/layers/dense/vars/0      (its first Dense's kernel)
    layers/functional/layers/input_layer/vars  (a nested functional model's input layer)

and a nested model's config is its own full config (class_name "Sequential" with its
InputLayer entry first, or "Functional" with its layers, input_layers and output_layers) as
an entry of the outer model's ``layers``. The expected paths below were read off files Keras
3.15.1 wrote for the same models; the test that needs no Keras holds our files to them. Where
Keras 3 is installed (``pytest.importorskip``; run with /work/kvenv's python, NumPy backend),
the files go both ways, ``.keras`` and ``.weights.h5``, made live by Keras in the test, and the
two libraries predict the same numbers (float32 tolerance: different kernels, the same math).
The new layers (BatchNormalization with non-trivial moving statistics, LayerNormalization,
AveragePooling2D, UpSampling2D, Conv2DTranspose, GlobalAverage/MaxPooling2D, LeakyReLU,
Softmax, Embedding) go the same two ways.

    python -m pytest -n 0 -q tests/test_nested_saving.py
    KERAS_BACKEND=numpy /work/kvenv/bin/python -m pytest -n 0 -q tests/test_nested_saving.py
"""
import io
import json
import os
import zipfile

import h5py
import numpy as np
import pytest

import mirrored as tf

TOL = dict(rtol=1e-5, atol=1e-6)


# -- the models, written once for either library (K: keras or mirrored.keras) ----------------------
def seq_in_seq(K):
    L = K.layers
    inner = K.Sequential([K.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3)])
    return K.Sequential([inner, L.Dense(2), L.Softmax()])


def fun_in_fun(K):
    L = K.layers
    inner = K.Sequential([K.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3)])
    i2 = K.Input((5,))
    middle = K.Model(i2, inner(i2))
    inp = K.Input((5,))
    return K.Model(inp, L.Dense(2)(middle(inp)))


def two_side_by_side(K):
    L = K.layers
    a = K.Sequential([K.Input((5,)), L.Dense(4)])
    b = K.Sequential([K.Input((5,)), L.Dense(4), L.Dropout(0.5)])
    inp = K.Input((5,))
    return K.Model(inp, L.Dense(2)(L.Add()([a(inp), b(inp)])))


def fun_in_seq(K):
    L = K.layers
    i = K.Input((5,))
    feature = K.Model(i, L.Dense(3, activation="relu")(i))
    return K.Sequential([K.Input((5,)), feature, L.Dense(2)])


def new_layers(K):
    L = K.layers
    inp = K.Input((6, 6, 2))
    h = L.Conv2D(3, 3, padding="same")(inp)
    h = L.BatchNormalization()(h)
    h = L.LeakyReLU(negative_slope=0.1)(h)
    h = L.AveragePooling2D(2)(h)
    h = L.UpSampling2D(2)(h)
    h = L.Conv2DTranspose(2, 3, strides=2, padding="same")(h)
    h = L.LayerNormalization()(h)
    h = L.Concatenate()([L.GlobalAveragePooling2D()(h), L.GlobalMaxPooling2D()(h)])
    return K.Model(inp, L.Softmax()(L.Dense(3)(h)))


def embedding(K):
    L = K.layers
    return K.Sequential([K.Input((4,), dtype="int32"), L.Embedding(10, 3), L.Flatten(), L.Dense(2)])


def subclassed(K):
    """keras.io's patterns at once: a subclassed model holding a Sequential and a layer as
    attributes, and a layer of its own holding two Dense layers ("layers inside layers").
    Keras 3 saves a subclassed model's layers by ATTRIBUTE, in order of name; its ``layers``
    property is one of those names, so ``zblock`` (after "layers") is saved as layers/block."""
    L = K.layers

    class Block(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense_a = L.Dense(3)
            self.out = L.Dense(2)

        def call(self, x):
            return self.out(self.dense_a(x))

    class Outer(K.Model):
        def __init__(self):
            super().__init__()
            self.inner = K.Sequential([K.Input((5,)), L.Dense(4, activation="relu"), L.Dense(3)])
            self.head = L.Dense(2)
            self.zblock = Block()

        def call(self, inputs, training=None):
            return self.zblock(self.head(self.inner(inputs)))
    model = Outer()
    model.build((None, 5))
    model(np.zeros((2, 5), np.float32))            # Keras builds the sublayers on a call
    return model


NESTED = [seq_in_seq, fun_in_fun, two_side_by_side, fun_in_seq]

#: What Keras 3.15.1's saving_lib writes for each model: {vars group: number of arrays}.
KERAS_LAYOUT = {
    "seq_in_seq": {"vars": 0, "layers/sequential/vars": 0, "layers/sequential/layers/dense/vars": 2,
                   "layers/sequential/layers/dense_1/vars": 2, "layers/dense/vars": 2, "layers/softmax/vars": 0},
    "fun_in_fun": {"vars": 0, "layers/input_layer/vars": 0, "layers/functional/vars": 0,
                   "layers/functional/layers/input_layer/vars": 0, "layers/functional/layers/sequential/vars": 0,
                   "layers/functional/layers/sequential/layers/dense/vars": 2,
                   "layers/functional/layers/sequential/layers/dense_1/vars": 2, "layers/dense/vars": 2},
    "two_side_by_side": {"vars": 0, "layers/input_layer/vars": 0, "layers/sequential/vars": 0,
                         "layers/sequential/layers/dense/vars": 2, "layers/sequential_1/vars": 0,
                         "layers/sequential_1/layers/dense/vars": 2, "layers/sequential_1/layers/dropout/vars": 0,
                         "layers/add/vars": 0, "layers/dense/vars": 2},
    "fun_in_seq": {"vars": 0, "layers/functional/vars": 0, "layers/functional/layers/input_layer/vars": 0,
                   "layers/functional/layers/dense/vars": 2, "layers/dense/vars": 2},
    "new_layers": {"vars": 0, "layers/input_layer/vars": 0, "layers/conv2d/vars": 2,
                   "layers/batch_normalization/vars": 4, "layers/leaky_re_lu/vars": 0,
                   "layers/average_pooling2d/vars": 0, "layers/up_sampling2d/vars": 0,
                   "layers/conv2d_transpose/vars": 2, "layers/layer_normalization/vars": 2,
                   "layers/global_average_pooling2d/vars": 0, "layers/global_max_pooling2d/vars": 0,
                   "layers/concatenate/vars": 0, "layers/dense/vars": 2, "layers/softmax/vars": 0},
    "embedding": {"vars": 0, "layers/embedding/vars": 1, "layers/flatten/vars": 0, "layers/dense/vars": 2},
    "subclassed": {"vars": 0, "head/vars": 2, "inner/vars": 0, "inner/layers/dense/vars": 2,
                   "inner/layers/dense_1/vars": 2, "layers/block/vars": 0, "layers/block/dense_a/vars": 2,
                   "layers/block/out/vars": 2},
}


def layout(source):
    """{vars group: number of datasets} of a weights file (path or file object)."""
    found = {}
    with h5py.File(source, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, len(obj)) if name.split("/")[-1] == "vars"
                     and isinstance(obj, h5py.Group) and not name.startswith("optimizer") else None)
    return found


def randomised(model, rng):
    """The model with fresh random weights (a variance positive), and those weights."""
    weights = [0.5 * rng.standard_normal(w.shape).astype(np.float32) for w in model.get_weights()]
    names = [getattr(v, "path", None) or v.name for v in model.weights]
    weights = [np.abs(w) + 0.5 if "variance" in n else w for w, n in zip(weights, names)]
    model.set_weights(weights)
    return weights


# -- no Keras needed: our files against Keras's layout ------------------------------------------------
@pytest.mark.parametrize("make", NESTED, ids=lambda f: f.__name__)
def test_our_files_have_keras_3s_paths_for_models_inside_models(devices, rng, tmp_path, make):
    devices(cpus=1)
    with tf.device("CPU:0"):
        model = make(tf.keras)
        weights = randomised(model, rng)
        model.save_weights(tmp_path / "m.weights.h5")
        model.save(tmp_path / "m.keras")
    want = KERAS_LAYOUT[make.__name__]
    assert layout(tmp_path / "m.weights.h5") == want
    with zipfile.ZipFile(tmp_path / "m.keras") as zf:
        assert layout(io.BytesIO(zf.read("model.weights.h5"))) == want
        config = json.loads(zf.read("config.json"))
    # the nested models' entries: their own configs, as Keras serialises them
    entries = [e for e in config["config"]["layers"] if e["class_name"] in ("Sequential", "Functional")]
    assert entries, config
    for entry in entries:
        inner = entry["config"]
        assert isinstance(inner["layers"], list) and inner["name"]
        if entry["class_name"] == "Sequential":
            assert entry["module"] == "keras" and inner["layers"][0]["class_name"] == "InputLayer"
        else:
            assert entry["module"] == "keras.src.models.functional" and entry["registered_name"] == "Functional"
            assert inner["input_layers"] and inner["output_layers"]
        if config["class_name"] == "Functional":          # called in a functional model: its calls
            assert entry["name"] == inner["name"] and entry["inbound_nodes"]
    names = [e["config"]["name"] for e in entries]
    assert len(set(names)) == len(names), f"two nested models share a name: {names}"
    # and back: the same weights, whichever file
    with tf.device("CPU:0"):
        loaded = tf.keras.models.load_model(tmp_path / "m.keras")
        again = make(tf.keras)
        again.load_weights(tmp_path / "m.weights.h5")
    for model_back in (loaded, again):
        for got, w in zip(model_back.get_weights(), weights):
            np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("make", [new_layers, embedding], ids=lambda f: f.__name__)
def test_our_files_of_the_new_layers_have_keras_3s_paths_and_order(devices, rng, tmp_path, make):
    """Each layer's group holds its weights in Keras's order (BatchNormalization: gamma, beta,
    moving_mean, moving_variance), at Keras's paths; the config names Keras's classes."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        model = make(tf.keras)
        weights = randomised(model, rng)
        model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as zf:
        data = io.BytesIO(zf.read("model.weights.h5"))
        config = json.loads(zf.read("config.json"))
    assert layout(data) == KERAS_LAYOUT[make.__name__]
    stored = []
    with h5py.File(data, "r") as f:
        for layer in model.layers:                                 # the model's order of layers
            key = next(k for k in KERAS_LAYOUT[make.__name__] if f[k].attrs["name"] == layer.name)
            stored += [f[key][str(i)][()] for i in range(len(f[key]))]
    for got, want in zip(stored, weights):
        np.testing.assert_array_equal(got, want)
    assert [e["class_name"] for e in config["config"]["layers"]][-2:] == (
        ["Dense", "Softmax"] if make is new_layers else ["Flatten", "Dense"])


def test_a_subclassed_models_weights_are_saved_by_attribute_as_keras_3_does(devices, rng, tmp_path):
    devices(cpus=1)
    with tf.device("CPU:0"):
        model = subclassed(tf.keras)
        weights = randomised(model, rng)
        model.save_weights(tmp_path / "m.weights.h5")
        again = subclassed(tf.keras)
        again.load_weights(tmp_path / "m.weights.h5")
    assert layout(tmp_path / "m.weights.h5") == KERAS_LAYOUT["subclassed"]
    for got, want in zip(again.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


def test_a_trained_nested_model_saves_its_dropout_state_at_the_nested_path(devices, rng, tmp_path):
    """The training state our .keras files keep (a Dropout's counters, as attributes Keras
    ignores) sits at the nested layer's path and comes back there."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = two_side_by_side(tf.keras)
        model.compile(optimizer="adam", loss="mse")
    x = rng.standard_normal((8, 5)).astype(np.float32)
    model.fit(x, rng.standard_normal((8, 2)).astype(np.float32), batch_size=4, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as zf, h5py.File(io.BytesIO(zf.read("model.weights.h5")), "r") as f:
        attrs = dict(f["layers/sequential_1/layers/dropout/vars"].attrs)
    assert "mirrored_seed" in attrs and list(attrs["mirrored_steps"]) == [4, 4], attrs   # 2 epochs x 2 steps
    with strategy.scope():
        loaded = tf.keras.models.load_model(tmp_path / "m.keras")
    dropout = [layer for layer in loaded.layers if hasattr(layer, "layers")][1].layers[-1]   # b's Dropout
    assert type(dropout).__name__ == "Dropout" and dropout.training_state()["steps"].tolist() == [4, 4]
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_nested_model_a_config_makes_huge_is_refused_before_it_is_built(devices, rng, tmp_path, monkeypatch):
    """A model used as a layer is made from its config before the model around it: what its
    config declares is held to the bytes the file stores before it is built (a few bytes of
    config must not make us allocate gigabytes)."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        seq_in_seq(tf.keras).save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    config = json.loads(members["config.json"])
    inner = next(e for e in config["config"]["layers"] if e["class_name"] == "Sequential")
    inner["config"]["layers"][1]["config"]["units"] = 2 ** 24           # a (5, 16M) kernel: 320 MiB
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(tmp_path / "huge.keras", "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    built = []
    monkeypatch.setattr(tf.keras.layers.Dense, "build", lambda self, shape: built.append(self))
    with tf.device("CPU:0"), pytest.raises(ValueError, match="refusing to build it.*Nothing was built"):
        tf.keras.models.load_model(tmp_path / "huge.keras")
    assert not built


def test_a_file_that_fits_neither_layout_names_keras_3s(devices, rng, tmp_path):
    """A nested model's weights in its own group, but a layer's group missing: neither Keras's
    layout nor the earlier one fits; the error names Keras's, and says where earlier files
    kept a nested model's weights."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        model = seq_in_seq(tf.keras)
        weights = randomised(model, rng)
    with h5py.File(tmp_path / "bad.weights.h5", "w") as f:
        f.create_group("vars").attrs["name"] = model.name
        for i, w in enumerate(weights[:4]):
            f.create_dataset(f"layers/sequential/vars/{i}", data=w)
        f.create_group("layers/softmax/vars")                     # layers/dense left out
    with pytest.raises(ValueError, match="earlier version of this library"):
        model.load_weights(tmp_path / "bad.weights.h5")


# -- with Keras 3: both ways ------------------------------------------------------------------------
@pytest.fixture
def keras3():
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    return pytest.importorskip("keras")


def inputs(make, rng):
    if make is embedding:
        return rng.integers(0, 10, size=(3, 4)).astype(np.int32)
    if make is new_layers:
        return rng.standard_normal((3, 6, 6, 2)).astype(np.float32)
    return rng.standard_normal((4, 5)).astype(np.float32)


@pytest.mark.parametrize("make", NESTED + [new_layers, embedding], ids=lambda f: f.__name__)
def test_keras_3s_files_load_here_and_predict_alike(devices, rng, tmp_path, keras3, make):
    devices(cpus=1)
    x = inputs(make, rng)
    theirs = make(keras3)
    randomised(theirs, rng)
    theirs.save(tmp_path / "k.keras")
    theirs.save_weights(tmp_path / "k.weights.h5")
    assert layout(tmp_path / "k.weights.h5") == KERAS_LAYOUT[make.__name__]      # the table is Keras's
    with tf.device("CPU:0"):
        loaded = tf.keras.models.load_model(tmp_path / "k.keras")
        ours = make(tf.keras)
        ours.load_weights(tmp_path / "k.weights.h5")
        for model in (loaded, ours):
            np.testing.assert_allclose(model.predict(x, verbose=0), theirs.predict(x, verbose=0), **TOL)


@pytest.mark.parametrize("make", NESTED + [new_layers, embedding], ids=lambda f: f.__name__)
def test_our_files_load_in_keras_3_and_predict_alike(devices, rng, tmp_path, keras3, make):
    devices(cpus=1)
    x = inputs(make, rng)
    with tf.device("CPU:0"):
        ours = make(tf.keras)
        randomised(ours, rng)
        ours.save(tmp_path / "m.keras")
        ours.save_weights(tmp_path / "m.weights.h5")
        want = ours.predict(x, verbose=0)
    loaded = keras3.models.load_model(tmp_path / "m.keras")
    theirs = make(keras3)
    theirs.load_weights(tmp_path / "m.weights.h5")
    for model in (loaded, theirs):
        np.testing.assert_allclose(model.predict(x, verbose=0), want, **TOL)


def test_a_subclassed_models_weights_go_both_ways(devices, rng, tmp_path, keras3):
    devices(cpus=1)
    x = inputs(subclassed, rng)
    theirs = subclassed(keras3)
    randomised(theirs, rng)
    theirs.save_weights(tmp_path / "k.weights.h5")
    assert layout(tmp_path / "k.weights.h5") == KERAS_LAYOUT["subclassed"]     # the table is Keras's
    with tf.device("CPU:0"):
        ours = subclassed(tf.keras)
        ours.load_weights(tmp_path / "k.weights.h5")
        np.testing.assert_allclose(ours.predict(x, verbose=0), theirs.predict(x, verbose=0), **TOL)
        randomised(ours, rng)
        ours.save_weights(tmp_path / "m.weights.h5")
        want = ours.predict(x, verbose=0)
    back = subclassed(keras3)
    back.load_weights(tmp_path / "m.weights.h5")
    np.testing.assert_allclose(back.predict(x, verbose=0), want, **TOL)


def test_a_nested_model_trained_on_two_replicas_loads_in_keras_3(devices, rng, tmp_path, keras3):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = fun_in_fun(tf.keras)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.standard_normal((13, 5)).astype(np.float32)
    model.fit(x, rng.integers(0, 2, 13), batch_size=4, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    theirs = keras3.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(theirs.predict(x, verbose=0), model.predict(x, verbose=0), **TOL)
    for got, want in zip(theirs.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_weights_files_of_earlier_versions_still_load(devices, rng, tmp_path):
    """The layout this library wrote before it followed Keras 3's walk (every layer of
    ``model.layers`` at ``layers/<class key>`` with all its weights: a subclassed model's and
    a nested model's) is still read, when Keras's layout does not fit the file."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        model = subclassed(tf.keras)
        weights = randomised(model, rng)
    with h5py.File(tmp_path / "old.weights.h5", "w") as f:
        f.create_group("vars").attrs["name"] = model.name
        for key, layer in (("sequential", model.inner), ("dense", model.head), ("block", model.zblock)):
            f.create_group(f"layers/{key}/vars")
            for i, w in enumerate(layer.get_weights()):
                f.create_dataset(f"layers/{key}/vars/{i}", data=w)
    with tf.device("CPU:0"):
        again = subclassed(tf.keras)
        again.load_weights(tmp_path / "old.weights.h5")
    for got, want in zip(again.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
