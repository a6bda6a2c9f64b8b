"""Keras 3's file formats: ``*.weights.h5`` (save_weights/load_weights) and ``*.keras``
(model.save / models.load_model), atomic writes, and what a damaged file says.

TensorFlow is not a dependency, so Keras's side is a fixture written here with h5py from
Keras 3's documented layout (keras/src/saving/saving_lib.py, H5IOStore; mirrored/keras/
saving.py's docstring): what ``model.save_weights("w.weights.h5")`` writes for the course's
dense model and for the lab's ConvNet. Our writer must produce that layout, and our reader
must take it (with and without the empty groups, which newer Keras versions leave out).
"""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

import mirrored as tf
from mirrored.keras import saving

ROOT = Path(__file__).resolve().parent.parent
L = tf.keras.layers


def dense_model(strategy=None):
    with (strategy or tf.distribute.get_strategy()).scope():
        return tf.keras.Sequential([L.Flatten(input_shape=(28, 28)), L.Dense(64, activation="relu"),
                                    L.Dense(10)])


def convnet(strategy=None):
    with (strategy or tf.distribute.get_strategy()).scope():
        return tf.keras.Sequential([L.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
                                    L.MaxPooling2D(), L.Flatten(), L.Dense(64, activation="relu"),
                                    L.Dense(10)])


#: Keras 3's layout for the two lab models: layer path -> (class, shapes of vars/0, vars/1...).
DENSE_LAYOUT = {"flatten": [], "dense": [(784, 64), (64,)], "dense_1": [(64, 10), (10,)]}
CONVNET_LAYOUT = {"conv2d": [(3, 3, 1, 32), (32,)], "max_pooling2d": [], "flatten": [],
                  "dense": [(5408, 64), (64,)], "dense_1": [(64, 10), (10,)]}


def keras_file(path, layout, rng, empty_groups=True, optimizer_slots=0, names=None):
    """A weights file as Keras 3 writes it: /vars (the model's own, none), /layers/<path>/vars/<i>
    (attrs name), /optimizer/vars: iteration, learning_rate, then each variable's slots.
    Returns the layer arrays in model order and the optimizer's arrays."""
    arrays, opt = [], []
    with h5py.File(path, "w") as f:
        if empty_groups:
            f.create_group("vars").attrs["name"] = "sequential"
        for i, (key, shapes) in enumerate(layout.items()):
            if not shapes and not empty_groups:
                continue                                   # newer Keras: no group for no variables
            g = f.create_group(f"layers/{key}/vars")
            g.attrs["name"] = (names or {}).get(key, f"{key}_from_keras")
            for j, shape in enumerate(shapes):
                a = rng.standard_normal(shape).astype(np.float32)
                g.create_dataset(str(j), data=a)
                arrays.append(a)
        if optimizer_slots is not None:
            g = f.create_group("optimizer/vars")
            g.attrs["name"] = "adam"
            opt = [np.int64(7), np.float32(0.003)]
            for a in arrays:
                opt += [rng.standard_normal(a.shape).astype(np.float32) for _ in range(optimizer_slots)]
            for j, a in enumerate(opt):
                g.create_dataset(str(j), data=a)
    return arrays, opt


def layout_of(path):
    """Every group and dataset of an HDF5 file: {path: (shape, dtype) or 'group'}, and attrs."""
    items, attrs = {}, {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            items[name] = (obj.shape, obj.dtype.str) if isinstance(obj, h5py.Dataset) else "group"
            attrs.update({f"{name}@{k}": str(v) for k, v in obj.attrs.items()})
        f.visititems(visit)
    return items, attrs


@pytest.mark.parametrize("make,layout", [(dense_model, DENSE_LAYOUT), (convnet, CONVNET_LAYOUT)],
                         ids=["dense", "convnet"])
@pytest.mark.parametrize("empty_groups", [True, False], ids=["keras3.0", "keras3.9"])
def test_reads_kerass_weights_file_and_writes_the_same_layout(devices, rng, tmp_path, make, layout,
                                                              empty_groups):
    devices(cpus=1)
    path = tmp_path / "keras.weights.h5"
    arrays, _ = keras_file(path, layout, rng, empty_groups=empty_groups, optimizer_slots=None)
    model = make()
    model.load_weights(path)
    got = model.get_weights()
    assert [a.shape for a in got] == [a.shape for a in arrays]
    for a, b in zip(got, arrays):
        np.testing.assert_array_equal(a, b)
    # ours: the same paths, shapes and dtypes as Keras 3.0's (with the empty groups), each vars
    # group named after its layer; and it reads back
    ours = tmp_path / "ours.weights.h5"
    model.save_weights(ours)
    keras_ref = tmp_path / "ref.weights.h5"
    keras_file(keras_ref, layout, rng, empty_groups=True, optimizer_slots=None)
    items, attrs = layout_of(ours)
    assert items == layout_of(keras_ref)[0]
    assert attrs["vars@name"] == model.name
    for key, layer in zip(layout, model.layers):
        assert attrs[f"layers/{key}/vars@name"] == layer.name
        assert items[f"layers/{key}/vars"] == "group"
    model.set_weights([np.zeros_like(a) for a in arrays])
    model.load_weights(ours)
    for a, b in zip(model.get_weights(), arrays):
        np.testing.assert_array_equal(a, b)


def test_optimizer_state_in_weights_files_follows_kerass_rule(devices, rng, tmp_path):
    """Keras restores an optimizer's variables only when it has as many (a built optimizer);
    a fresh one warns and keeps its own. Ours writes iteration, learning_rate, then each
    variable's (m, v) in turn, as Keras's Adam does."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((8, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    model = dense_model(strategy)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)                     # 2 steps
    path = tmp_path / "w.weights.h5"
    model.save_weights(path)
    with h5py.File(path, "r") as f:
        opt = f["optimizer/vars"]
        assert len(opt) == 2 + 2 * 4 and int(opt["0"][()]) == 2 and opt["0"].dtype == np.int64
        assert float(opt["1"][()]) == pytest.approx(0.01)
        for k, w in enumerate(model.get_weights()):
            assert opt[str(2 + 2 * k)].shape == w.shape == opt[str(3 + 2 * k)].shape
        v = np.asarray(opt["3"])                                          # Adam's v of the first kernel
        assert (v >= 0).all() and v.any()
    # a fresh compiled model: weights load, the optimizer is skipped with Keras's warning
    fresh = dense_model(strategy)
    fresh.compile(loss="sparse_categorical_crossentropy", optimizer="adam")
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        fresh.load_weights(path)
    assert int(fresh.optimizer.iterations) == 0
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # a built one (it has trained) takes them: a Keras file's iteration and slots
    arrays, opt = keras_file(tmp_path / "k.weights.h5", DENSE_LAYOUT, rng, optimizer_slots=2)
    model.load_weights(tmp_path / "k.weights.h5")
    assert int(model.optimizer.iterations) == 7 and model.optimizer.learning_rate == pytest.approx(0.003)
    got = model.optimizer.keras_variables(model.step.pack)
    for a, b in zip(got[2:], opt[2:]):
        np.testing.assert_array_equal(a, b)
    second = model.step.pack.devices[1]                                   # every replica got them
    key = ("pack", id(model.step.pack), 1)
    m1 = second.to_numpy(model.optimizer._slots[key][0])[:784 * 64].reshape(784, 64)
    np.testing.assert_array_equal(m1, opt[2])


def test_layer_mismatch_and_wrong_names_are_refused_before_anything_changes(devices, rng, tmp_path):
    devices(cpus=1)
    path = tmp_path / "conv.weights.h5"
    keras_file(path, CONVNET_LAYOUT, rng, optimizer_slots=None)
    model = dense_model()
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"conv\.weights\.h5.*layer 'dense'.*\(784, 64\).*\(5408, 64\)"):
        model.load_weights(path)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"must end in \.weights\.h5"):
        model.save_weights(tmp_path / "w.h5")
    with pytest.raises(ValueError, match=r"must end in \.keras"):
        model.save(tmp_path / "m.h5")
    with h5py.File(tmp_path / "other.weights.h5", "w") as f:
        f["data"] = np.zeros(3)
    with pytest.raises(ValueError, match="not a Keras 3 weights file"):
        model.load_weights(tmp_path / "other.weights.h5")


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_truncated_or_empty_files_say_so_and_name_the_file(devices, rng, tmp_path, suffix):
    devices(cpus=1)
    model = dense_model()
    model.compile(loss="sparse_categorical_crossentropy", optimizer="adam")
    path = tmp_path / f"m{suffix}"
    save = model.save_weights if suffix == ".weights.h5" else model.save
    load = model.load_weights if suffix == ".weights.h5" else tf.keras.models.load_model
    save(path)
    data = path.read_bytes()
    half = tmp_path / f"half{suffix}"
    half.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=rf"half{suffix}.*truncated"):
        load(half)
    empty = tmp_path / f"empty{suffix}"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"empty{suffix}.*empty \(0 bytes\)"):
        load(empty)
    text = tmp_path / f"text{suffix}"
    text.write_text("not a model")
    with pytest.raises(ValueError, match=rf"text{suffix} is not a Keras"):
        load(text)


_KILLED_SAVE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from mirrored.keras import saving
class Model:
    name, built, layers, optimizer = "m", True, [], None
def slow(model, target):
    with open(target, "wb") as f:
        f.write(b"x" * 4096)
    print("writing", flush=True)
    time.sleep(120)
saving._write_h5 = slow
saving.save_weights(Model(), sys.argv[1])
"""


def test_a_killed_saves_temporary_is_removed_by_the_next_save(devices, tmp_path):
    devices(cpus=1)
    target = tmp_path / "w.weights.h5"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(target), str(ROOT)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()                                              # kill -9 in the middle of the save
        proc.wait()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(f".weights-{proc.pid}-"), left
    # a temporary of a live writer (this test's parent process) must stay
    live = tmp_path / f".weights-{os.getppid()}-live.tmp"
    live.write_bytes(b"in progress")
    other = tmp_path / ".weightsmith.txt"                         # not ours: never touched
    other.write_text("keep")
    # older versions named them .weights-<8 random chars>: removed once an hour old
    old, recent = tmp_path / ".weights-k3x9_q0z", tmp_path / ".weights-a1b2c3d4"
    old.write_bytes(b"x")
    recent.write_bytes(b"x")
    hours_ago = os.path.getmtime(old) - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    model = dense_model()
    model.save_weights(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, recent.name,
                                                                  target.name])


def test_keras_model_round_trip_resumes_training_exactly(devices, rng, tmp_path):
    """Train, save, load, train on: the loaded model ends bitwise where the original does,
    because the architecture, the weights AND Adam's state (step, m, v) came back."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([L.Conv2D(4, 3, activation="relu", input_shape=(8, 8, 1)),
                                     L.MaxPooling2D(), L.Flatten(), L.Dense(6, activation="relu"),
                                     L.Dense(3)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01, beta_1=0.8), metrics=["accuracy"])
    x = rng.standard_normal((24, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 3, 24)
    model.fit(x[:12], y[:12], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["config.json", "metadata.json", "model.weights.h5"]
    with strategy.scope():
        loaded = tf.keras.models.load_model(path)
        cold = tf.keras.models.load_model(path, compile=False)
    assert [type(l).__name__ for l in loaded.layers] == ["Conv2D", "MaxPooling2D", "Flatten", "Dense", "Dense"]
    assert [l.name for l in loaded.layers] == [l.name for l in model.layers]
    assert loaded.optimizer.beta_1 == 0.8 and int(loaded.optimizer.iterations) == 3
    assert loaded.metrics_names == model.metrics_names
    assert loaded.distribute_strategy is strategy
    cold.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 optimizer=tf.keras.optimizers.Adam(0.01, beta_1=0.8))
    for m in (model, loaded, cold):
        m.fit(x[12:], y[12:], batch_size=4, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), cold.get_weights())), \
        "a fresh optimizer trains differently: the optimizer state is what made them agree"
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    # a failed save leaves the previous archive whole, and no temporaries
    good = path.read_bytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(saving, "model_config", lambda m: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(OSError, match="disk full"):
            model.save(path)
    assert path.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["m.keras"]


def dropout_model(strategy):
    """Two Dropout layers: one seeded, one drawing its seed at build (so both the seed and
    the counters must come back for the masks to)."""
    with strategy.scope():
        model = tf.keras.Sequential([L.Dense(8, activation="relu", input_shape=(5,)), L.Dropout(0.5),
                                     L.Dense(8, activation="relu"), L.Dropout(0.3, seed=11), L.Dense(3)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.05))
    return model


def test_dropout_masks_resume_bitwise_through_a_keras_file(devices, rng, tmp_path):
    """Train 3 steps, save, load, train 6 more == 9 steps uninterrupted, bit for bit, on 2
    replicas: the archive carries each Dropout's seed and per-replica step counts (as
    attributes Keras ignores); save_weights/load_weights leave them alone, as Keras's do.
    (CPU replicas: the simulated GPU takes 35 s here, and its masks are the CPU's for the
    same counters, tests/test_dropout_layer.py.)"""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((24, 5)).astype(np.float32)
    y = rng.integers(0, 3, 24)
    model = dropout_model(strategy)
    model.fit(x[:12], y[:12], batch_size=4, epochs=1, shuffle=False, verbose=0)     # 3 steps
    path = tmp_path / "m.keras"
    model.save(path)
    with zipfile.ZipFile(path) as zf:
        zf.extract(saving.ARCHIVE_WEIGHTS, tmp_path)
    _, attrs = layout_of(tmp_path / saving.ARCHIVE_WEIGHTS)
    for key, layer in [("dropout", model.layers[1]), ("dropout_1", model.layers[3])]:
        assert attrs[f"layers/{key}/vars@mirrored_seed"] == str(layer._seed)
        assert attrs[f"layers/{key}/vars@mirrored_steps"] == "[3 3]"      # one count per replica
    with strategy.scope():
        loaded = tf.keras.models.load_model(path)
    assert loaded.layers[1]._seed == model.layers[1]._seed and loaded.layers[3]._seed == 11
    for m in (model, loaded):
        m.fit(x[12:], y[12:], batch_size=4, epochs=2, shuffle=False, verbose=0)     # 6 more
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    for v in loaded.trainable_variables:                      # and the replicas agree bitwise
        assert all(np.array_equal(v.values[0].numpy(), c.numpy()) for c in v.values[1:])
    # Keras's save_weights keeps no SeedGenerator state, its load_weights leaves it as it was
    model.save_weights(tmp_path / "w.weights.h5")
    assert not any("mirrored_" in k for k in layout_of(tmp_path / "w.weights.h5")[1])
    model.load_weights(path)
    assert model.layers[1]._steps == {0: 9, 1: 9}
    # a damaged state is refused, naming the file
    with h5py.File(tmp_path / saving.ARCHIVE_WEIGHTS, "r+") as f:
        f["layers/dropout/vars"].attrs["mirrored_steps"] = np.array([-1.5, 2.0])
    bad = tmp_path / "bad.keras"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bad, "w") as dst:
        for name in src.namelist():
            data = (tmp_path / name).read_bytes() if name == saving.ARCHIVE_WEIGHTS else src.read(name)
            dst.writestr(name, data)
    with strategy.scope(), pytest.raises(ValueError, match=r"bad\.keras.*'dropout'.*damaged"):
        tf.keras.models.load_model(bad)


def test_model_checkpoint_writes_kerass_formats(devices, rng, tmp_path):
    devices(cpus=1)
    model = dense_model(tf.distribute.OneDeviceStrategy("CPU:0"))   # not the simulated GPU: fast
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd")
    x = rng.standard_normal((8, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    cbs = [tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "w{epoch}.weights.h5"), save_weights_only=True),
           tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "m{epoch}.keras"))]
    model.fit(x, y, epochs=2, callbacks=cbs, verbose=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m1.keras", "m2.keras", "w1.weights.h5",
                                                          "w2.weights.h5"]
    with pytest.raises(ValueError, match=r"\.weights\.h5"):
        tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "w.h5"), save_weights_only=True)


def test_real_keras_reads_our_files_and_we_read_its(devices, rng, tmp_path):
    """Where Keras 3 is installed (not a dependency: skipped otherwise), the real thing, on its
    NumPy backend: the lab's ConvNet goes both ways through .weights.h5 and .keras, and both
    libraries then predict the same numbers."""
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    keras = pytest.importorskip("keras")
    devices(cpus=1)

    def keras_convnet():
        return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
                                 keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                                 keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    x = rng.random((3, 28, 28, 1)).astype(np.float32)
    theirs = keras_convnet()
    theirs.set_weights([0.1 * rng.standard_normal(w.shape).astype(np.float32) for w in theirs.get_weights()])
    theirs.save_weights(tmp_path / "k.weights.h5")
    ours = convnet(tf.distribute.OneDeviceStrategy("CPU:0"))
    ours.load_weights(tmp_path / "k.weights.h5")
    np.testing.assert_allclose(ours.predict(x, verbose=0), theirs.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    ours.set_weights([w * 0.5 for w in ours.get_weights()])
    ours.save_weights(tmp_path / "m.weights.h5")
    ours.save(tmp_path / "m.keras")
    back = keras_convnet()
    back.load_weights(tmp_path / "m.weights.h5")
    whole = keras.models.load_model(tmp_path / "m.keras")
    for model in (back, whole):
        np.testing.assert_allclose(model.predict(x, verbose=0), ours.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_real_keras_and_we_read_each_others_dropout_models(devices, rng, tmp_path):
    """Where Keras 3 is installed: our trained Dropout model's .keras (with its mask state)
    loads in Keras; Keras's (no such state: 3.15 saves none) loads here with fresh counters.
    Both predict alike (dropout is the identity there)."""
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    keras = pytest.importorskip("keras")
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((8, 5)).astype(np.float32)
    ours = dropout_model(strategy)
    ours.fit(x, rng.integers(0, 3, 8), batch_size=4, verbose=0)
    ours.save(tmp_path / "ours.keras")
    theirs = keras.models.load_model(tmp_path / "ours.keras")
    assert [type(l).__name__ for l in theirs.layers] == ["Dense", "Dropout", "Dense", "Dropout", "Dense"]
    np.testing.assert_allclose(theirs.predict(x, verbose=0), ours.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    theirs.save(tmp_path / "theirs.keras")
    with strategy.scope():
        back = tf.keras.models.load_model(tmp_path / "theirs.keras")
    assert back.layers[3]._seed == 11 and back.layers[3]._steps == {}
    np.testing.assert_allclose(back.predict(x, verbose=0), theirs.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
