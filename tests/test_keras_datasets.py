"""``keras.datasets`` (mnist, fashion_mnist, cifar10) and ``mirrored.datasets.load('fashion_mnist')``.

No test touches the network: small IDX and tar files are generated here, with fresh random
pixels, and served from a ``file://`` mirror (the real urllib path, one ``_fetch`` as in
production), their sizes and SHA-256s patched into the tables. Claims:
* the arrays are Keras's shapes and dtypes and hold exactly the generated pixels and labels
  (CIFAR-10's planes turned channels-last);
* files land in Keras's cache folder (``KERAS_HOME``) and are then used offline;
* a mirror that sends a wrong checksum or a truncated file is passed over, or, the last
  one, gives a DownloadError naming the file, with nothing half-written in the folder;
* offline with no copy, fashion_mnist and cifar10 fail naming the folder; mnist gives the
  bundled subset with its one warning; never another data set.
"""
import gzip
import hashlib
import io
import tarfile
import warnings

import numpy as np
import pytest

import mirrored as tf
from mirrored import datasets
from mirrored.keras import datasets as kd


@pytest.fixture
def keras_home(tmp_path, monkeypatch):
    home = tmp_path / "keras-home"
    monkeypatch.setenv("KERAS_HOME", str(home))
    monkeypatch.setattr(datasets, "_warned", set())
    datasets.disable_progress_bar()
    yield home / "datasets"
    datasets.enable_progress_bar()


def _idx(array):
    """IDX bytes (gzip) of a uint8 array: magic 0x000008NN, big-endian dims, the bytes."""
    header = (0x0800 | array.ndim).to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.tobytes())


def _serve(folder, files):
    """Write ``{name: bytes}`` into ``folder``; returns (its file:// prefix, {name: (size, sha256)})."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    table = {name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items()}
    return folder.as_uri() + "/", table


def _fashion_files(rng, train=7, test=3):
    arrays = {"train": (rng.integers(0, 256, (train, 28, 28), dtype=np.uint8), rng.integers(0, 10, train, dtype=np.uint8)),
              "test": (rng.integers(0, 256, (test, 28, 28), dtype=np.uint8), rng.integers(0, 10, test, dtype=np.uint8))}
    files = {}
    for split, (images_file, labels_file) in datasets.SPLIT_FILES.items():
        files[images_file], files[labels_file] = _idx(arrays[split][0]), _idx(arrays[split][1])
    return arrays, files


@pytest.fixture
def fashion_mirror(tmp_path, monkeypatch, rng):
    arrays, files = _fashion_files(rng)
    good, table = _serve(tmp_path / "mirror", files)
    monkeypatch.setattr(datasets, "FASHION_MNIST_FILES", table)
    monkeypatch.setattr(datasets, "FASHION_MNIST_MIRRORS", ((tmp_path / "no-such-mirror").as_uri() + "/", good))
    monkeypatch.delenv("MIRRORED_OFFLINE", raising=False)
    return arrays, files, tmp_path


def test_fashion_mnist_downloads_into_keras_cache_then_works_offline(keras_home, fashion_mirror, monkeypatch):
    arrays, _, _ = fashion_mirror
    (x, y), (xt, yt) = tf.keras.datasets.fashion_mnist.load_data()
    for got, want in ((x, arrays["train"][0]), (y, arrays["train"][1]), (xt, arrays["test"][0]), (yt, arrays["test"][1])):
        assert got.dtype == np.uint8 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert sorted(p.name for p in (keras_home / "fashion-mnist").iterdir()) == sorted(datasets.FASHION_MNIST_FILES)
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    monkeypatch.setattr(datasets, "FASHION_MNIST_MIRRORS", ("file:///nowhere/",))
    (x2, _), _ = tf.keras.datasets.fashion_mnist.load_data()
    np.testing.assert_array_equal(x2, arrays["train"][0])


@pytest.mark.parametrize("damage", ["wrong checksum", "truncated"])
def test_a_bad_download_is_a_clear_error_and_leaves_nothing(keras_home, fashion_mirror, monkeypatch, damage):
    _, files, tmp = fashion_mirror
    name = "train-labels-idx1-ubyte.gz"
    data = files[name]
    bad = data[:-3] if damage == "truncated" else bytes([data[0] ^ 1]) + data[1:]
    liar, _ = _serve(tmp / "liar", dict(files, **{name: bad}))
    monkeypatch.setattr(datasets, "FASHION_MNIST_MIRRORS", (liar,))
    with pytest.raises(datasets.DownloadError) as error:
        tf.keras.datasets.fashion_mnist.load_data()
    message = str(error.value)
    assert name in message and "SHA-256" in message and str(keras_home / "fashion-mnist") in message
    folder = keras_home / "fashion-mnist"
    assert not (folder / name).exists()
    assert not list(folder.glob(".*.part")), "a temporary file was left behind"
    # a good mirror after the liar: the file is had, verified
    good = fashion_mirror[2] / "mirror"
    monkeypatch.setattr(datasets, "FASHION_MNIST_MIRRORS", (liar, good.as_uri() + "/"))
    tf.keras.datasets.fashion_mnist.load_data()
    assert (folder / name).read_bytes() == data


def test_a_truncated_cached_file_is_named_offline(keras_home, fashion_mirror, monkeypatch):
    _, files, _ = fashion_mirror
    folder = keras_home / "fashion-mnist"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data[:-1] if name.startswith("t10k-images") else data)
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    with pytest.raises(datasets.DownloadError, match=r"t10k-images-idx3-ubyte.gz has \d+ bytes, expected"):
        tf.keras.datasets.fashion_mnist.load_data()


def test_offline_without_files_names_the_folder_and_substitutes_nothing(keras_home):
    for loader, folder in ((tf.keras.datasets.fashion_mnist, keras_home / "fashion-mnist"),
                           (tf.keras.datasets.cifar10, keras_home)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")           # no bundled-subset warning: no other data set
            with pytest.raises(datasets.DownloadError, match="no bundled copy") as error:
                loader.load_data()
        assert f"in {folder}," in str(error.value)


def test_mnist_offline_is_the_bundled_subset_with_its_warning(keras_home):
    with pytest.warns(datasets.BundledSubsetWarning, match="bundled subset"):
        (x, y), (xt, yt) = tf.keras.datasets.mnist.load_data()
    assert x.shape == (8000, 28, 28) and xt.shape == (2000, 28, 28)
    assert x.dtype == y.dtype == xt.dtype == yt.dtype == np.uint8 and y.shape == (8000,)
    images, labels = datasets.load("mnist", split="test", as_supervised=True, batch_size=-1)
    np.testing.assert_array_equal(xt, images[..., 0])
    np.testing.assert_array_equal(yt, labels)


def test_mnist_npz_in_the_cache_or_at_path_is_used(keras_home, tmp_path, monkeypatch, rng):
    arrays = {"x_train": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), "y_train": rng.integers(0, 10, 5, dtype=np.uint8),
              "x_test": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8), "y_test": rng.integers(0, 10, 2, dtype=np.uint8)}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    monkeypatch.setattr(kd, "MNIST_NPZ", ("mnist.npz", len(data), hashlib.sha256(data).hexdigest()))
    keras_home.mkdir(parents=True)
    (keras_home / "mnist.npz").write_bytes(data)
    elsewhere = tmp_path / "my_mnist.npz"
    elsewhere.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path in ("mnist.npz", str(elsewhere)):
            (x, y), (xt, yt) = tf.keras.datasets.mnist.load_data(path=path)
            np.testing.assert_array_equal(x, arrays["x_train"])
            np.testing.assert_array_equal(yt, arrays["y_test"])


@pytest.mark.parametrize("damage,where", [("one byte changed", "mnist.npz"), ("truncated", "mnist.npz"),
                                          ("one byte changed", "elsewhere")])
def test_a_tampered_mnist_npz_is_named_with_both_hashes_and_not_used(keras_home, tmp_path, monkeypatch, rng,
                                                                       damage, where):
    """Issue 51: offline, a tampered ``mnist.npz`` was (rightly) not used, but the only message
    was the bundled subset's, which never named the file. Keras names the file whose hash
    does not match: so do we, with its SHA-256 and the expected one, and what to do; the file
    itself is left as it was (it is the user's), and the subset is what comes back."""
    arrays = {k: rng.integers(0, 256, (3, 28, 28) if k[0] == "x" else 3, dtype=np.uint8)
              for k in ("x_train", "y_train", "x_test", "y_test")}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    good = buffer.getvalue()
    expected = hashlib.sha256(good).hexdigest()
    monkeypatch.setattr(kd, "MNIST_NPZ", ("mnist.npz", len(good), expected))
    at = int(rng.integers(0, len(good)))
    bad = good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1:] if damage == "one byte changed" else good[:at]
    actual = hashlib.sha256(bad).hexdigest()
    path = keras_home / "mnist.npz" if where == "mnist.npz" else tmp_path / "my-mnist.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bad)
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    monkeypatch.setenv("MIRRORED_DATA_DIR", str(tmp_path / "tfds"))    # no full IDX set to fall back on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (x, _), _ = tf.keras.datasets.mnist.load_data(path="mnist.npz" if where == "mnist.npz" else str(path))
    named = [str(w.message) for w in caught if issubclass(w.category, datasets.DamagedFileWarning)]
    assert len(named) == 1, [str(w.message) for w in caught]
    message = named[0]
    assert str(path) in message and f"SHA-256 {actual}, expected {expected}" in message, message
    assert "not used" in message and "delete it" in message and "network access" in message, message
    if damage == "truncated":
        assert f"has {at} bytes, expected {len(good)}" in message, message
    assert any(issubclass(w.category, datasets.BundledSubsetWarning) for w in caught)
    assert x.shape == (8000, 28, 28)                                # the bundled subset, not the file
    assert path.read_bytes() == bad                                 # left as it was


def _cifar_archive(rng, per_batch=3, test=2):
    """A CIFAR-10 binary archive of random records; returns (bytes, train (x, y), test (x, y))
    with x in the archive's (n, 3, 32, 32) planes."""
    buffer = io.BytesIO()
    splits = {}
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for split, members in kd.CIFAR10_MEMBERS.items():
            xs, ys = [], []
            for member in members:
                n = per_batch if split == "train" else test
                records = rng.integers(0, 256, (n, kd.CIFAR10_RECORD), dtype=np.uint8)
                records[:, 0] = rng.integers(0, 10, n)
                info = tarfile.TarInfo(member)
                info.size = records.nbytes
                tar.addfile(info, io.BytesIO(records.tobytes()))
                xs.append(records[:, 1:].reshape(n, 3, 32, 32))
                ys.append(records[:, :1])
            splits[split] = (np.concatenate(xs), np.concatenate(ys))
    return buffer.getvalue(), splits["train"], splits["test"]


def test_cifar10_is_keras_arrays_channels_last(keras_home, tmp_path, monkeypatch, rng):
    data, train, test = _cifar_archive(rng)
    mirror, table = _serve(tmp_path / "mirror", {"cifar-10-binary.tar.gz": data})
    monkeypatch.setattr(kd, "CIFAR10_FILES", table)
    monkeypatch.setattr(kd, "CIFAR10_MIRRORS", (mirror,))
    monkeypatch.delenv("MIRRORED_OFFLINE", raising=False)
    (x, y), (xt, yt) = tf.keras.datasets.cifar10.load_data()
    assert x.shape == (15, 32, 32, 3) and y.shape == (15, 1) and xt.shape == (2, 32, 32, 3) and yt.shape == (2, 1)
    assert x.dtype == y.dtype == np.uint8
    np.testing.assert_array_equal(x, train[0].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(x[:, 4, 7, 2], train[0][:, 2, 4, 7])        # pixel (4, 7), blue plane
    np.testing.assert_array_equal(y, train[1])
    np.testing.assert_array_equal(xt, test[0].transpose(0, 2, 3, 1))
    assert (keras_home / "cifar-10-binary.tar.gz").read_bytes() == data


def test_tfds_load_fashion_mnist_records_and_class_names(tmp_path, fashion_mirror):
    arrays, _, _ = fashion_mirror
    data_dir = tmp_path / "tfds"
    train, info = datasets.load("fashion_mnist", split="train", with_info=True, data_dir=str(data_dir))
    first = next(iter(train))
    assert set(first) == {"image", "label"}
    assert first["image"].shape == (28, 28, 1) and first["image"].dtype == np.uint8
    assert first["label"].dtype == np.int64 and int(first["label"]) == arrays["train"][1][0]
    np.testing.assert_array_equal(first["image"][..., 0], arrays["train"][0][0])
    assert info.features["label"].names == list(datasets.FASHION_MNIST_CLASSES)
    assert info.features["label"].names[9] == "Ankle boot" and info.name == "fashion_mnist"
    assert info.splits["train"].num_examples == 7 and info.splits["test"].num_examples == 3
    image, label = next(iter(datasets.load("fashion_mnist", split="test", as_supervised=True, data_dir=str(data_dir))))
    np.testing.assert_array_equal(image[..., 0], arrays["test"][0][0])
    assert int(label) == arrays["test"][1][0]
    assert sorted(p.name for p in (data_dir / "fashion_mnist").iterdir()) == sorted(datasets.FASHION_MNIST_FILES)
