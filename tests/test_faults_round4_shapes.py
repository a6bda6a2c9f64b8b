"""Bad input, round four (issue 42's closing note): a file we load builds only the model its
stored bytes justify. Each test of a refusal here failed before the fix: the loaders built
the model a file's shapes describe first and compared weights after.

* ``tf.train.Checkpoint.restore`` into a model not built yet: the file's ``input_shape``
  gives the model its weights. A file recording (1000, 1000, 1) in front of Flatten + Dense
  allocated a 12 MB kernel (any size: it is the file's choice) before the weights were
  compared, and left the model built although restore raised. Now the weights that shape
  implies are worked out with nothing allocated (``mirrored/keras/weight_shapes.py``) and
  compared with the file's first; the model stays unbuilt when they differ.
* ``load_model`` of a ``.keras`` file: the config's units, filters, kernel sizes and input
  shape built the model before its weights file was checked. Now the weights the config
  implies must be the file's datasets (shape, dtype), and the file must store the bytes
  they declare (a never-written chunked dataset declares gigabytes in a few bytes):
  a 20 KB file describing ``Dense(units=2**31)`` is refused before anything is built.
* The files that are fine still load, bit for bit.

Allocations are counted with ``tracemalloc`` (NumPy reports its arrays to it): a refusal
allocates under ``PEAK``, where building the refused model took many times that. Models
are small and live on 2 logical CPUs (the file code is the same for GPUs).
Neighbours: mirrored/keras/weight_shapes.py, mirrored/checkpoint.py, mirrored/keras/saving.py,
mirrored/keras/file_safety.py, tests/test_faults_round4_files.py (the files' other checks).
"""
import io
import json
import tracemalloc
import zipfile

import h5py
import numpy as np
import pytest

import mirrored as tf
from mirrored.keras import weight_shapes

L = tf.keras.layers
#: Most bytes a refusal may allocate (the refused models' weights are 12 MB and more).
PEAK = 2 << 20


@pytest.fixture
def strategy(devices):
    devices(cpus=2)
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])


def peak_of(action):
    """(what ``action()`` raised, the most bytes traced while it ran)."""
    tracemalloc.start()
    try:
        with pytest.raises(Exception) as raised:
            action()
        return raised.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def randomize(model, rng):
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) for w in model.get_weights()])


# --- the shapes worked out are the shapes built ---------------------------------------------------

def test_the_planned_weights_are_the_weights_build_makes(rng):
    """weight_shapes' rules against the layers' own build, on random layers and inputs; a
    layer of the user's own is unknown (None), a weightless one has none."""
    for _ in range(12):
        units, features = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        k = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        image = (int(rng.integers(max(k[0], 2), 9)), int(rng.integers(max(k[1], 2), 9)), int(rng.integers(1, 4)))
        for layer, shape in ((L.Dense(units), (features,)),
                             (L.Conv2D(units, k, use_bias=bool(rng.integers(2))), image),
                             (L.Flatten(), image), (L.MaxPooling2D(), image), (L.Dropout(0.5), image)):
            planned = weight_shapes.of_layer(layer, shape)
            layer.build(shape)
            assert planned == [(w.name, tuple(w.shape)) for w in layer.trainable_weights], layer
    assert weight_shapes.of_layer(Scale(), (3,)) is None
    assert weight_shapes.minimum_count(L.Dense(7)) == 14
    assert weight_shapes.minimum_count(L.Conv2D(5, (3, 2))) == 3 * 2 * 5 + 5
    assert weight_shapes.minimum_count(L.Conv2D(5, (3, 2), use_bias=False)) == 3 * 2 * 5


class Scale(L.Layer):
    """A layer of the user's own with weights (one factor per feature): its build decides
    what it makes, so the loaders cannot know its weights before building it."""

    def build(self, input_shape):
        super().build(input_shape)
        self.factor = tf.Variable(np.ones(input_shape, np.float32), name=f"{self.name}/factor")

    @property
    def weights(self):
        return [self.factor] if self.built else []

    trainable_weights = weights


# --- Checkpoint.restore into a model not built yet -------------------------------------------------

def flat_model(strategy, input_shape=None):
    with strategy.scope():
        return tf.keras.Sequential([L.Flatten(**({"input_shape": input_shape} if input_shape else {})),
                                    L.Dense(3)])


def rewritten(path, changes):
    """The checkpoint ``path`` (.npz) written again with ``changes`` ({name: array or None to
    drop}) to ``<path>-bad.npz``; returns the prefix to restore."""
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays.update(changes)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    out = path[:-len(".npz")] + "-bad"
    with open(out + ".npz", "wb") as f:
        np.savez(f, **arrays)
    return out


@pytest.fixture
def saved(strategy, rng, tmp_path):
    """A Flatten + Dense(3) model on (2, 2) examples, random weights, checkpointed."""
    model = flat_model(strategy, (2, 2))
    randomize(model, rng)
    return model, tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt")) + ".npz"


def test_a_checkpoint_recording_a_huge_input_shape_builds_nothing(strategy, saved):
    """(1000, 1000, 1) in front of Flatten + Dense(3): a (1000000, 3) kernel (12 MB) was made
    before the weights were compared. Now: refused, nothing allocated, the model unbuilt; the
    good checkpoint then restores into it."""
    model, path = saved
    bad = rewritten(path, {"model:model/input_shape": np.array([1000, 1000, 1], np.int64)})
    fresh = flat_model(strategy)
    err, peak = peak_of(lambda: tf.train.Checkpoint(model=fresh).restore(bad))
    assert isinstance(err, ValueError) and "(1000, 1000, 1)" in str(err) and "(1000000, 3)" in str(err)
    assert "Nothing was built" in str(err), err
    assert peak < PEAK, peak
    assert not fresh.built and not any(layer.built for layer in fresh.layers)
    tf.train.Checkpoint(model=fresh).restore(path[:-len(".npz")])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(fresh.get_weights(), model.get_weights()))


@pytest.mark.parametrize("change", ["other units", "a weight missing", "int weights", "negative shape",
                                    "zero shape", "float shape", "2-D shape", "no layer takes it"])
def test_a_mismatching_checkpoint_leaves_an_unbuilt_model_unbuilt(strategy, saved, rng, change):
    model, path = saved
    kernel, bias = model.get_weights()
    bad = rewritten(path, {
        "other units": {"model:model/0": rng.standard_normal((4, 5)).astype(np.float32),
                        "model:model/1": np.zeros(5, np.float32)},
        "a weight missing": {"model:model/1": None},
        "int weights": {"model:model/0": kernel.astype(np.int32)},
        "negative shape": {"model:model/input_shape": np.array([-2, -2], np.int64)},
        "zero shape": {"model:model/input_shape": np.array([0, 4], np.int64)},
        "float shape": {"model:model/input_shape": np.array([2.0, 2.0])},
        "2-D shape": {"model:model/input_shape": np.array([[2, 2]], np.int64)},
        "no layer takes it": {},
    }[change])
    fresh = flat_model(strategy)
    if change == "no layer takes it":                 # a Conv2D needs images: (2, 2) is not one
        with strategy.scope():
            fresh = tf.keras.Sequential([L.Conv2D(2, 1), L.Flatten(), L.Dense(3)])
    expected = {"negative shape": "positive integers", "zero shape": "positive integers",
                "float shape": "positive integers", "2-D shape": "positive integers",
                "no layer takes it": "which this model's layers do not take",
                "int weights": "dtypes"}.get(change, "another architecture")
    with pytest.raises(ValueError, match=expected):
        tf.train.Checkpoint(model=fresh).restore(bad)
    assert not fresh.built and not any(layer.built for layer in fresh.layers)


def test_a_valid_checkpoint_restores_into_an_unbuilt_convnet_bitwise(strategy, rng, tmp_path):
    """The planned path still restores: a ConvNet (conv, pool, dropout, dense) built from the
    shape the file records, every replica's copy equal to the saved weights' bits."""
    shape = (int(rng.integers(6, 11)), int(rng.integers(6, 11)), int(rng.integers(1, 3)))

    def convnet():
        with strategy.scope():
            return tf.keras.Sequential([L.Conv2D(3, 3, activation="relu"), L.MaxPooling2D(),
                                        L.Conv2D(2, 2, use_bias=False), L.Flatten(), L.Dropout(0.3),
                                        L.Dense(4)])
    model = convnet()
    model.build((None,) + shape)
    randomize(model, rng)
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "conv"))
    fresh = convnet()
    tf.train.Checkpoint(model=fresh).restore(prefix)
    assert fresh.built and fresh.input_shape == (None,) + shape
    for got, want in zip(fresh.trainable_variables, model.get_weights()):
        for copy in got.values:
            assert copy.numpy().tobytes() == want.tobytes()


def test_a_model_with_a_layer_of_its_own_is_held_to_the_files_size(strategy, rng, tmp_path):
    """Scale's weights are unknown until it is built, so the weights of the known layers
    after it must fit in what the file holds. A file recording (1000000,) examples for
    Scale + Dense(3): the Dense alone would be (1000000, 3), the file holds 43 numbers:
    refused, unbuilt. A model with such a layer still restores its own file, bitwise."""
    def scaled():
        with strategy.scope():
            return tf.keras.Sequential([L.Dense(4), Scale(), L.Dense(3)])
    model = scaled()
    model.build((None, 5))
    randomize(model, rng)
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "s"))
    fresh = scaled()
    tf.train.Checkpoint(model=fresh).restore(prefix)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(fresh.get_weights(), model.get_weights()))
    with strategy.scope():
        other = tf.keras.Sequential([Scale(), L.Dense(3)])
    bad = rewritten(prefix + ".npz", {"model:model/input_shape": np.array([1_000_000], np.int64)})
    err, peak = peak_of(lambda: tf.train.Checkpoint(model=other).restore(bad))
    assert isinstance(err, ValueError) and "[] and more" in str(err) and peak < PEAK, (err, peak)
    assert not other.built and not any(layer.built for layer in other.layers)


# --- load_model: the config's shapes ----------------------------------------------------------------

def members(path):
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def write_members(path, parts):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in parts.items():
            zf.writestr(name, data)


def edited(path, out, config_edit, h5_edit=None):
    """The .keras archive ``path`` with its config.json edited in place by ``config_edit``
    and its weights file by ``h5_edit(h5file)``, written to ``out``."""
    parts = members(path)
    config = json.loads(parts["config.json"])
    config_edit(config)
    parts["config.json"] = json.dumps(config).encode()
    if h5_edit is not None:
        buffer = io.BytesIO(parts["model.weights.h5"])
        with h5py.File(buffer, "r+") as f:
            h5_edit(f)
        parts["model.weights.h5"] = buffer.getvalue()
    write_members(out, parts)
    return out


def layer_config(config, index):
    return config["config"]["layers"][index]["config"]


@pytest.fixture
def dense_file(strategy, rng, tmp_path):
    """Dense(4, relu) -> Dense(4) on 4 features (Sequential), trained a step, saved whole."""
    with strategy.scope():
        model = tf.keras.Sequential([L.Dense(4, activation="relu", input_shape=(4,)), L.Dense(4)])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(rng.random((4, 4)).astype(np.float32), rng.integers(0, 4, 4), batch_size=4, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    return model, path


def huge_dense(units):
    def edit(f):
        for i, shape in enumerate([(4, units), (units,)]):
            del f[f"layers/dense_1/vars/{i}"]
            f.create_dataset(f"layers/dense_1/vars/{i}", shape=shape, dtype="f4",
                             chunks=tuple(min(d, 1 << 16) for d in shape), compression="gzip")
    return edit


def test_a_keras_file_describing_a_huge_dense_is_refused_before_building(strategy, dense_file, tmp_path):
    """Dense(units=2**31) in config.json, and its datasets declared (4, 2**31) and (2**31,),
    chunked and never written: the shapes agree, the bytes are not there. Refused by
    file_safety.check_stored before any weight exists (building it took 32 GiB)."""
    model, path = dense_file
    units = 2 ** 31
    bomb = edited(path, tmp_path / "bomb.keras", lambda c: layer_config(c, 2).update(units=units),
                  huge_dense(units))
    assert bomb.stat().st_size < 64 * 1024
    err, peak = peak_of(lambda: tf.keras.models.load_model(bomb))
    assert isinstance(err, ValueError), err
    assert f"Not allowed: {bomb} describes a model whose weights take {4 * (4 * units + units + 16 + 4):,} " \
           f"bytes, and stores" in str(err), err
    assert "Nothing was built" in str(err) and peak < PEAK, (err, peak)


@pytest.mark.parametrize("change", ["units", "input shape", "units, functional", "input shape, functional"])
def test_a_keras_config_that_its_weights_do_not_match_is_refused_before_building(strategy, rng, dense_file,
                                                                                tmp_path, change):
    """The config's declared shapes (a Dense of 2**20 units: a 16 MB kernel; an input of
    1000000 features: 16 MB) against the weights file's datasets (4, 4): refused, naming
    both shapes, with nothing allocated. Sequential and functional configs alike."""
    model, path = dense_file
    if "functional" in change:
        with strategy.scope():
            x = tf.keras.Input((4,))
            functional = tf.keras.Model(x, L.Dense(4)(L.Dense(4, activation="relu")(x)))
        functional.set_weights(model.get_weights())
        path = tmp_path / "f.keras"
        functional.save(path)
    if change.startswith("units"):
        index, edit, want = 2, lambda c: layer_config(c, 2).update(units=2 ** 20), (4, 2 ** 20)
    else:
        index, want = 0, (1_000_000, 4)

        def edit(c):
            layer_config(c, 0)["batch_shape"] = [None, 1_000_000]
    bad = edited(path, tmp_path / "bad.keras", edit)
    err, peak = peak_of(lambda: tf.keras.models.load_model(bad))
    assert isinstance(err, ValueError), err
    assert f"has shape {want} in this model, the file declares (4, 4)" in str(err), err
    assert peak < PEAK, peak
    back = tf.keras.models.load_model(path)             # the file that is fine still loads
    assert all(a.tobytes() == b.tobytes() for a, b in zip(back.get_weights(), model.get_weights()))


class Wide(tf.keras.Model):
    """A subclassed model: its layers come from its own from_config, its weights are
    unknown until it is built; each Dense's least size still is units * 2."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = L.Dense(units)

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {"units": self.units, "name": self.name}


def test_a_subclassed_model_is_held_to_the_least_size_of_its_layers(strategy, rng, tmp_path):
    with strategy.scope():
        model = Wide(3)
        model.build((None, 4))
    randomize(model, rng)
    path = tmp_path / "w.keras"
    model.save(path)
    bad = edited(path, tmp_path / "bad.keras", lambda c: c["config"].update(units=2 ** 31))
    err, peak = peak_of(lambda: tf.keras.models.load_model(bad, custom_objects={"Wide": Wide}))
    assert isinstance(err, ValueError) and f"weights take {2 * 2 ** 31 * 4:,} bytes" in str(err), err
    assert peak < PEAK, peak
    back = tf.keras.models.load_model(path, custom_objects={"Wide": Wide})
    assert all(a.tobytes() == b.tobytes() for a, b in zip(back.get_weights(), model.get_weights()))
