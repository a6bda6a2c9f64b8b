"""Bad input and faults, round four (issue 42, items 5-10): weights files and checkpoints.
Each test here failed before its fix (before it, the save under a file-size limit died of
SIGSEGV, and a .keras file holding a virtual dataset did too), except the one over every
damaged file type, which keeps what already held for most of them.

* A save under a file-size limit (a full disk acts alike) fails with an ``OSError`` that
  names the file, the process lives on, and the earlier file stays (item 5).
* ``tf.train.Checkpoint`` files take ``0666 & ~umask`` (item 6).
* A damaged checkpoint raises ``DataLossError`` naming the file (item 7); a damaged
  compressed member of a ``.keras`` file names the file and the member; every damaged file
  type gets a named error, and the model is unchanged (item 8).
* A weights file (``.weights.h5``, or the one inside a ``.keras``) that points outside itself
  (external storage, an external link, a soft link, a virtual dataset) is refused by name
  before anything is read (item 9), and one that declares a dataset far larger than the
  model's variable is refused before anything is allocated (item 10).

The files are made with h5py and zipfile as a hostile or unlucky user would make them;
the model is a small Dense model on 2 logical CPUs (the file code is the same for GPUs).
Neighbours: mirrored/keras/file_safety.py (the checks), tests/test_saving.py (the formats).
"""
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

import mirrored as tf
from mirrored.errors import DataLossError
from mirrored.keras import saving

from test_faults import assert_same_state, state_of

ROOT = Path(__file__).resolve().parent.parent
L = tf.keras.layers
#: The files' first Dense kernel, in Keras's layout (saving.py's docstring).
KERNEL = "layers/dense/vars/0"
#: 74.5 GiB of float64, the size the issue's 20 KB file declared.
HUGE = (100_000, 100_000)


def square_model(strategy, seed_rng):
    """Dense(4) -> Dense(4) on 4 features: both kernels (4, 4), so a soft link from one to
    the other has the right shape and would load. Trained one step (Adam has slots)."""
    with strategy.scope():
        model = tf.keras.Sequential([L.Dense(4, activation="relu", input_shape=(4,)), L.Dense(4)])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = seed_rng.random((4, 4)).astype(np.float32)
    model.fit(x, seed_rng.integers(0, 4, 4), batch_size=4, verbose=0)
    return model


@pytest.fixture
def two(devices, rng):
    """Two trained models of one architecture with different weights: ``a`` writes the
    files, ``b`` must stay as it was whenever a load is refused."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    return square_model(strategy, rng), square_model(strategy, rng)


def same_weights(model, arrays):
    return all(np.array_equal(a, b) for a, b in zip(model.get_weights(), arrays))


def rewrite_h5_member(keras_path, edit, libver=None):
    """Apply ``edit(h5file)`` to the weights inside the ``.keras`` archive at ``keras_path``."""
    with zipfile.ZipFile(keras_path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    inner = keras_path.parent / "inner.h5"
    inner.write_bytes(members[saving.ARCHIVE_WEIGHTS])
    with h5py.File(inner, "r+", libver=libver) as f:
        edit(f)
    members[saving.ARCHIVE_WEIGHTS] = inner.read_bytes()
    with zipfile.ZipFile(keras_path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


# --- item 5: a save that cannot write -------------------------------------------------------

_LIMITED_SAVE = r"""
import hashlib, json, os, resource, signal, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import mirrored as tf
folder, limit = sys.argv[2], int(sys.argv[3])
L = tf.keras.layers
model = tf.keras.Sequential([L.Dense(64, input_shape=(32,)), L.Dense(10)])
model.compile(optimizer="adam", loss="mse")       # not fitted: compiling the step takes seconds
ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
saves = {"w.weights.h5": model.save_weights, "m.keras": model.save, "c.npz": lambda p: ckpt.write(p[:-4])}
for name, save in saves.items():
    save(os.path.join(folder, name))
digests = {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest() for n in saves}
model.set_weights([w + 1 for w in model.get_weights()])          # the next saves differ
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)                   # EFBIG instead of a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
result = {}
for name, save in saves.items():
    try:
        save(os.path.join(folder, name))
        result[name] = ["saved"]
    except OSError as err:
        result[name] = ["OSError", err.errno, str(err)]
    except BaseException as err:
        result[name] = [type(err).__name__, None, str(err)]
print(json.dumps({"digests": digests, "result": result}))
"""


def test_a_save_under_a_file_size_limit_fails_cleanly_and_keeps_the_old_file(tmp_path):
    """Under RLIMIT_FSIZE (the file-size limit; a full disk fails the same write), each save
    raises an OSError naming its file; the process lives on (h5py writing the file itself
    raised a RuntimeError from its close, and could crash: SIGSEGV with HDF5 2.0), the
    earlier file is byte for byte what it was, and no temporary is left."""
    limit = 4096                     # every file here is 12-13 KB: each save must fail
    out = subprocess.run([sys.executable, "-c", _LIMITED_SAVE, str(ROOT), str(tmp_path), str(limit)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the process died (rc {out.returncode}): {out.stderr[-2000:]}"
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (kind, errno, message) in report["result"].items():
        assert kind == "OSError" and errno == 27, (name, kind, message)     # EFBIG
        assert str(tmp_path / name) in message, message
        assert "intact" in message, message
        now = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        assert now == report["digests"][name], f"{name} changed under a failed save"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(report["result"]), "a temporary was left"


# --- item 6: checkpoint files follow the umask ---------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_files_get_the_mode_the_umask_allows(two, tmp_path, umask):
    """Always 0600 before (mkstemp's mode): another user's serving job could not read them."""
    a, _ = two
    ckpt = tf.train.Checkpoint(model=a, optimizer=a.optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    old = os.umask(umask)
    try:
        for _ in range(3):                                  # new files, then one deleted
            manager.save()
        ckpt.write(str(tmp_path / "plain"))
    finally:
        os.umask(old)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint", "ckpt-2.npz", "ckpt-3.npz", "plain.npz"], names
    for name in names:
        mode = stat.S_IMODE(os.stat(tmp_path / name).st_mode)
        assert oct(mode) == oct(0o666 & ~umask), name


# --- item 7: a damaged checkpoint -------------------------------------------------------------

def flip_bit(data, position):
    out = bytearray(data)
    out[position // 8] ^= 1 << (position % 8)
    return bytes(out)


def member_span(data, name):
    """(start, end) of member ``name``'s bytes in the stored (uncompressed) zip ``data``."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        info = zf.getinfo(name)
        local = info.header_offset
        start = local + 30 + int.from_bytes(data[local + 26:local + 28], "little") + \
            int.from_bytes(data[local + 28:local + 30], "little")
        return start, start + info.compress_size


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped bit in a member", "flipped bit anywhere"])
def test_a_damaged_checkpoint_is_named_and_restores_nothing(two, rng, tmp_path, damage):
    """A bare BadZipFile, 'Bad CRC-32' or EOFError before; TensorFlow raises DataLossError.
    A bit flipped anywhere: a named error, or (a byte no reader checks, such as a
    timestamp) the exact values saved."""
    a, b = two
    path = tf.train.Checkpoint(model=a, optimizer=a.optimizer).save(str(tmp_path / "ckpt"))
    file = Path(path + ".npz")
    data = file.read_bytes()
    if damage == "empty":
        data = b""
    elif damage == "truncated":
        data = data[:rng.integers(1, len(data))]
    elif damage == "flipped bit in a member":
        with zipfile.ZipFile(file) as zf:
            name = zf.namelist()[rng.integers(len(zf.namelist()))]
        start, end = member_span(data, name)
        data = flip_bit(data, rng.integers(8 * start, 8 * end))
    else:
        data = flip_bit(data, rng.integers(8 * len(data)))
    file.write_bytes(data)
    before = state_of(b)
    ckpt = tf.train.Checkpoint(model=b, optimizer=b.optimizer)
    if damage != "flipped bit anywhere":
        with pytest.raises(DataLossError, match=rf"{file}.* is damaged"):
            ckpt.restore(path)
        assert_same_state(before, state_of(b))
        return
    try:
        ckpt.restore(path)
    except ValueError as err:                               # DataLossError is one
        assert str(file) in str(err), err
        assert_same_state(before, state_of(b))
    else:
        assert same_weights(b, a.get_weights())


# --- item 8: damaged .keras and .weights.h5 files ------------------------------------------------

def deflated(path, out):
    """``path``'s archive with every member compressed, as a zip tool may rewrite it."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    return out


def test_a_damaged_compressed_member_of_a_keras_file_names_file_and_member(two, rng, tmp_path):
    """A bare zlib.error before (or BadZipFile: Bad CRC-32, as the flip falls)."""
    a, b = two
    a.save(tmp_path / "m.keras")
    path = deflated(tmp_path / "m.keras", tmp_path / "deflated.keras")
    data = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(saving.ARCHIVE_WEIGHTS)
    start = info.header_offset + 30 + len(info.filename) + int.from_bytes(
        data[info.header_offset + 28:info.header_offset + 30], "little")
    path.write_bytes(flip_bit(data, rng.integers(8 * start, 8 * (start + info.compress_size))))
    before = state_of(b)
    pattern = rf"{path} is damaged: its member '{saving.ARCHIVE_WEIGHTS}'"
    with pytest.raises(DataLossError, match=pattern):
        b.load_weights(path)
    assert_same_state(before, state_of(b))
    with pytest.raises(DataLossError, match=pattern):
        tf.keras.models.load_model(path)


@pytest.mark.parametrize("suffix, damage", [(".weights.h5", "empty"), (".weights.h5", "truncated"),
                                            (".weights.h5", "garbage"), (".keras", "empty"),
                                            (".keras", "truncated"), (".keras", "garbage"),
                                            (".keras", "flipped bit"), (".keras", "unknown zip version")])
def test_every_damaged_file_gets_an_error_naming_it_and_the_model_is_unchanged(two, rng, tmp_path,
                                                                                suffix, damage):
    """(A .weights.h5 has no checksum over its arrays, in Keras's files as in ours: a flipped
    bit there loads as a changed number. A .keras archive's CRCs catch one.)"""
    a, b = two
    path = tmp_path / f"m{suffix}"
    (a.save_weights if suffix == ".weights.h5" else a.save)(path)
    data = path.read_bytes()
    entry = data.find(b"PK\x01\x02")                  # a .keras's first central directory entry
    data = {"empty": b"", "truncated": data[:rng.integers(1, len(data))],
            "garbage": rng.integers(0, 256, rng.integers(1, 4096), dtype=np.uint8).tobytes(),
            "flipped bit": flip_bit(data, rng.integers(8 * len(data))),
            # its "version needed to extract" byte, 0x14 (2.0) -> 0x94: zipfile raised NotImplementedError
            "unknown zip version": flip_bit(data, 8 * (entry + 6) + 7)}[damage]
    path.write_bytes(data)
    before = state_of(b)
    loads = ([tf.keras.models.load_model] if suffix == ".keras" else []) + [b.load_weights]   # b's last
    for load in loads:
        try:
            loaded = load(path)
        except ValueError as err:
            assert str(path) in str(err), err
            assert_same_state(before, state_of(b))
        else:
            assert damage == "flipped bit", "a damaged file loaded"
            assert same_weights(loaded or b, a.get_weights()), "a flipped bit loaded as other weights"


# --- item 9: links, external storage and virtual datasets ---------------------------------------

def outside_pointer(kind, tmp_path, other):
    """``edit(h5file)`` that puts, at the first kernel (or its layer), a ``kind`` pointing
    outside the file's own datasets, and the text the refusal names it by. ``other``: the
    path of another weights file of the same model."""
    host = tmp_path / "host.bin"                      # a host file with known bytes
    host.write_bytes(np.arange(16, dtype=np.float32).tobytes())

    def edit(f):
        if kind == "external storage":
            del f[KERNEL]
            f.create_dataset(KERNEL, shape=(4, 4), dtype="f4", external=[(str(host), 0, 64)])
        elif kind == "external link":
            del f["layers/dense"]
            f["layers/dense"] = h5py.ExternalLink(str(other), "/layers/dense")
        elif kind == "soft link":                     # the second kernel read from the first
            del f["layers/dense_1/vars/0"]
            f["layers/dense_1/vars/0"] = h5py.SoftLink("/" + KERNEL)
        else:
            layout = h5py.VirtualLayout(shape=(4, 4), dtype="f4")
            layout[:] = h5py.VirtualSource(str(other), KERNEL, shape=(4, 4))
            del f[KERNEL]
            f.create_virtual_dataset(KERNEL, layout)
    named = {"external storage": rf"external Dataset: .*'/{KERNEL}'.*host\.bin",
             "external link": r"ExternalLink: .*'/layers/dense' -> file .*other\.weights\.h5",
             "soft link": rf"SoftLink: .*'/layers/dense_1/vars/0' -> '/{KERNEL}'",
             "virtual dataset": rf"virtual Dataset: .*'/{KERNEL}'"}[kind]
    return edit, named


@pytest.mark.parametrize("kind", ["external storage", "external link", "soft link", "virtual dataset"])
@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_a_weights_file_that_points_outside_itself_is_refused_by_name(two, tmp_path, kind, suffix):
    """Each loaded another file's bytes as the model's weights before (a host file's, or
    another weights file's); Keras 3 refuses them. Refused before any data is read; the
    model is unchanged, and load_model builds nothing."""
    a, b = two
    other = tmp_path / "other.weights.h5"
    b.save_weights(other)                              # what the links would load
    edit, named = outside_pointer(kind, tmp_path, other)
    path = tmp_path / f"evil{suffix}"
    if suffix == ".weights.h5":
        a.save_weights(path)
        with h5py.File(path, "r+") as f:
            edit(f)
    else:
        a.save(path)
        rewrite_h5_member(path, edit)
    b.set_weights([w + 1 for w in b.get_weights()])    # b now differs from the linked file too
    before = state_of(b)
    loads = [b.load_weights] + ([tf.keras.models.load_model] if suffix == ".keras" else [])
    for load in loads:
        with pytest.raises(ValueError, match=rf"Not allowed: H5 file with {named}"):
            load(path)
        assert_same_state(before, state_of(b))


# --- item 10: shapes checked before anything is read ---------------------------------------------

def declared_huge(f, name):
    """Replace dataset ``name`` by a 74.5 GiB one that is chunked, compressed and never written."""
    del f[name]
    f.create_dataset(name, shape=HUGE, dtype="f8", chunks=(1000, 1000), compression="gzip")


@pytest.mark.parametrize("where", [KERNEL, "optimizer/vars/2"])
def test_a_small_file_declaring_a_huge_dataset_is_refused_before_allocating(two, tmp_path, where):
    """A 20 KB file declaring 74.5 GiB made the loader allocate it (MemoryError, or the
    memory). Every dataset's shape is checked against the model's variable (the optimizer's
    slot) first: the refusal names both shapes, comes at once and allocates nothing."""
    a, b = two
    path = tmp_path / "bomb.weights.h5"
    a.save_weights(path)
    with h5py.File(path, "r+") as f:
        declared_huge(f, where)
    assert path.stat().st_size < 64 * 1024
    before = state_of(b)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=rf"{path}: .*\(4, 4\) in this model, the file declares "
                                             rf"\(100000, 100000\) \(80,000,000,000 bytes\): nothing was read"):
            b.load_weights(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 10 and peak < 16 << 20, (time.perf_counter() - start, peak)
    assert_same_state(before, state_of(b))


def test_a_dataset_of_the_right_shape_but_not_numbers_is_refused(two, tmp_path):
    a, b = two
    path = tmp_path / "strings.weights.h5"
    a.save_weights(path)
    with h5py.File(path, "r+") as f:
        del f["layers/dense/vars/1"]
        f["layers/dense/vars/1"] = np.array([b"ab", b"cd", b"ef", b"gh"])
    before = state_of(b)
    with pytest.raises(ValueError, match=r"layer 'dense'.*has dtype \|S2 in the file"):
        b.load_weights(path)
    assert_same_state(before, state_of(b))


def test_a_keras_archive_declaring_huge_members_or_attributes_is_refused(two, tmp_path):
    """A .keras archive's parts declare sizes too: a deflated config.json claiming 80 MiB in
    80 KB (a decompression bomb, Keras's words), and a layer attribute of 800 KB where the
    training state is a few bytes. Each refused by name before it is read."""
    a, _ = two
    path = tmp_path / "m.keras"
    a.save(path)
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    bomb = tmp_path / "bomb.keras"
    with zipfile.ZipFile(bomb, "w") as zf:            # config.json deflated, and huge
        info = zipfile.ZipInfo("config.json")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w", force_zip64=True) as f:
            chunk = b" " * (1 << 20)
            for _ in range(80):
                f.write(chunk)
        for name, data in members.items():
            if name != "config.json":
                zf.writestr(name, data)
    with pytest.raises(ValueError, match=r"Not allowed: ZIP member 'config.json' of .*bomb\.keras declares "
                                         r"83,886,080 bytes .*decompression bomb"):
        tf.keras.models.load_model(bomb)

    def big_attribute(f):          # a group made under libver="latest" holds attributes over 64 KB
        f.create_group("layers/new/vars")
        for name in f["layers/dense/vars"]:
            f.copy(f"layers/dense/vars/{name}", f["layers/new/vars"])
        del f["layers/dense"]
        f.move("layers/new", "layers/dense")
        f["layers/dense/vars"].attrs["mirrored_steps"] = np.zeros(100_000)
    rewrite_h5_member(path, big_attribute, libver="latest")
    with pytest.raises(ValueError, match=r"Not allowed: H5 attribute 'mirrored_steps' of "
                                         r"'/layers/dense/vars' in .*m\.keras declares 800,000 bytes"):
        tf.keras.models.load_model(path)
    json.loads(members["config.json"])                # the archive itself was a good one
