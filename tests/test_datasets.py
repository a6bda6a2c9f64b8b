"""Tests for mirrored.datasets.load('mnist'): the bundled subset, downloads, failures.

No test touches the network: `_fetch` is replaced by fakes, and a small synthetic
"full" set (random digits in real IDX files) stands in for MNIST by monkeypatching
`MNIST_FILES` with its sizes and SHA-256s.

    /tmp/venv/bin/python -m pytest tests/test_datasets.py
"""
import gzip
import hashlib
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from mirrored import datasets
from mirrored.datasets import BundledSubsetWarning, DownloadError

N_TRAIN, N_TEST = 37, 11               # the synthetic "full" set: small, odd sizes


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Every test: no network, a fresh warn-once memory, no environment overrides."""
    def no_network(url, timeout):
        raise OSError(f"network disabled in tests ({url})")
        yield  # noqa: unreachable — makes this a generator like the real _fetch

    monkeypatch.setattr(datasets, "_fetch", no_network)
    monkeypatch.setattr(datasets, "_warned", set())
    monkeypatch.delenv("MIRRORED_OFFLINE", raising=False)
    monkeypatch.delenv("MIRRORED_DATA_DIR", raising=False)


def idx_bytes(array, magic):
    """A gzip-compressed IDX file holding a uint8 array."""
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0)


class FakeMirror:
    """Serves a synthetic full set; records every URL asked for."""

    def __init__(self, files):
        self.files, self.urls = files, []

    def __call__(self, url, timeout):
        self.urls.append(url)
        blob = self.files[url.rsplit("/", 1)[1]]
        for start in range(0, len(blob), 1000):   # in chunks, like a real response
            yield blob[start:start + 1000]


@pytest.fixture
def full_set(monkeypatch, rng):
    """Synthetic 'full' MNIST: its files' bytes, arrays, and MNIST_FILES pointing at them."""
    arrays = {
        "train": (rng.integers(0, 256, (N_TRAIN, 28, 28)), rng.integers(0, 10, N_TRAIN)),
        "test": (rng.integers(0, 256, (N_TEST, 28, 28)), rng.integers(0, 10, N_TEST)),
    }
    files = {}
    for split, (images_file, labels_file) in datasets.SPLIT_FILES.items():
        files[images_file] = idx_bytes(arrays[split][0], datasets.IMAGES_MAGIC)
        files[labels_file] = idx_bytes(arrays[split][1], datasets.LABELS_MAGIC)
    table = {name: (len(blob), hashlib.sha256(blob).hexdigest()) for name, blob in files.items()}
    monkeypatch.setattr(datasets, "MNIST_FILES", table)
    return files, arrays


def cache_dir(tmp_path):
    return tmp_path / "mnist"


def put_cached(tmp_path, files):
    cache_dir(tmp_path).mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        (cache_dir(tmp_path) / name).write_bytes(blob)


# --- the bundled subset -----------------------------------------------------------------

def test_bundled_subset_loads_like_tfds(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    with pytest.warns(BundledSubsetWarning, match="mnist-10k.*8,000 train / 2,000 test"):
        splits, info = datasets.load("mnist", with_info=True, as_supervised=True,
                                     data_dir=tmp_path)
    assert set(splits) == {"train", "test"}
    assert len(splits["train"]) == info.splits["train"].num_examples == 8000
    assert len(splits["test"]) == info.splits["test"].num_examples == 2000
    assert info.name == "mnist" and info.features["label"].num_classes == 10
    assert "bundled" in info.source and "mnist-10k" in info.source
    images, labels = next(iter(splits["train"].batch(8000)))
    assert images.shape == (8000, 28, 28, 1) and images.dtype == np.uint8
    assert labels.dtype == np.int64 and set(labels.tolist()) == set(range(10))
    image, label = next(iter(splits["test"]))
    assert image.shape == (28, 28, 1) and image.dtype == np.uint8
    assert label.dtype == np.int64 and 0 <= label <= 9


def test_dict_elements_without_as_supervised(tmp_path):
    with pytest.warns(BundledSubsetWarning):
        test = datasets.load("mnist", split="test", data_dir=tmp_path, download=False)
    element = next(iter(test))
    assert sorted(element) == ["image", "label"]
    assert element["image"].shape == (28, 28, 1)


def test_warns_once_per_process(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        datasets.load("mnist", data_dir=tmp_path, download=False)
        datasets.load("mnist", data_dir=tmp_path, download=False)
    subset = [w for w in caught if issubclass(w.category, BundledSubsetWarning)]
    assert len(subset) == 1
    assert "full set" in str(subset[0].message)   # and it says how to get the full set


def test_split_specs(tmp_path):
    with pytest.warns(BundledSubsetWarning):
        parts, info = datasets.load(
            "mnist", split=["train[:10%]", "train[:1000]", "test[-10%:]", "train+test",
                            "train[100:250]"],
            data_dir=tmp_path, download=False, with_info=True)
    assert [len(p) for p in parts] == [800, 1000, 200, 10000, 150]
    assert info.splits["train[:10%]"].num_examples == 800
    with pytest.raises(ValueError, match="Unknown split"):
        datasets.load("mnist", split="validation", data_dir=tmp_path, download=False)


def test_batch_size_option(tmp_path):
    with pytest.warns(BundledSubsetWarning):
        images, labels = datasets.load("mnist", split="test", batch_size=-1, as_supervised=True,
                                       data_dir=tmp_path, download=False)
    assert images.shape == (2000, 28, 28, 1) and labels.shape == (2000,)
    batched = datasets.load("mnist", split="test", batch_size=64, data_dir=tmp_path,
                            download=False)
    assert len(batched) == 32


def test_unknown_dataset_lists_what_exists(tmp_path):
    with pytest.raises(ValueError, match=r"'cifar10'.*\['mnist', 'fashion_mnist'\]"):
        datasets.load("cifar10", data_dir=tmp_path)


# --- no network ---------------------------------------------------------------------------

def test_no_network_falls_back_after_one_round_of_mirrors(tmp_path, monkeypatch):
    asked = []

    def unreachable(url, timeout):
        asked.append(url)
        raise OSError("Name or service not known")
        yield  # noqa: unreachable

    monkeypatch.setattr(datasets, "_fetch", unreachable)
    with pytest.warns(BundledSubsetWarning, match="could not be downloaded"):
        _, info = datasets.load("mnist", data_dir=tmp_path, with_info=True)
    assert "bundled" in info.source
    assert len(asked) == len(datasets.MIRRORS)   # every mirror once, then no more waiting
    assert not list(cache_dir(tmp_path).glob("*"))  # nothing half-written left behind


def test_forced_download_without_network_is_a_clear_error(tmp_path):
    with pytest.raises(DownloadError) as error:
        datasets.load("mnist", data_dir=tmp_path, download="force")
    message = str(error.value)
    assert "train-images-idx3-ubyte.gz is missing" in message
    assert "network" in message and str(cache_dir(tmp_path)) in message


def test_forced_download_while_offline_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    with pytest.raises(DownloadError, match="MIRRORED_OFFLINE=1"):
        datasets.load("mnist", data_dir=tmp_path, download="force")


def test_download_false_never_fetches(tmp_path, monkeypatch, full_set):
    def forbidden(url, timeout):
        raise AssertionError("download=False must not touch the network")

    monkeypatch.setattr(datasets, "_fetch", forbidden)
    with pytest.warns(BundledSubsetWarning, match="download=False"):
        datasets.load("mnist", data_dir=tmp_path, download=False)
    put_cached(tmp_path, full_set[0])             # valid full files present → used
    _, info = datasets.load("mnist", data_dir=tmp_path, download=False, with_info=True)
    assert info.source == "full" and info.splits["train"].num_examples == N_TRAIN


# --- downloading the (synthetic) full set ---------------------------------------------

def test_downloads_verifies_and_uses_the_full_set(tmp_path, monkeypatch, full_set):
    files, arrays = full_set
    mirror = FakeMirror(files)
    monkeypatch.setattr(datasets, "_fetch", mirror)
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # no subset warning on this path
        splits, info = datasets.load("mnist", data_dir=tmp_path, with_info=True,
                                     as_supervised=True)
    assert info.source == "full"
    assert sorted(mirror.urls) == sorted(datasets.MIRRORS[0] + name for name in files)
    for name, blob in files.items():
        assert (cache_dir(tmp_path) / name).read_bytes() == blob
    images, labels = next(iter(splits["train"].batch(N_TRAIN)))
    np.testing.assert_array_equal(images[..., 0], arrays["train"][0])
    np.testing.assert_array_equal(labels, arrays["train"][1])
    assert len(splits["test"]) == N_TEST
    datasets.load("mnist", data_dir=tmp_path)      # cached now: no second download
    assert len(mirror.urls) == len(files)


def test_data_dir_from_environment(tmp_path, monkeypatch, full_set):
    monkeypatch.setenv("MIRRORED_DATA_DIR", str(tmp_path))
    put_cached(tmp_path, full_set[0])
    _, info = datasets.load("mnist", with_info=True, download=False)
    assert info.source == "full"
    name = "t10k-labels-idx1-ubyte.gz"
    assert info.files[name] == cache_dir(tmp_path) / name


def test_a_mirror_with_wrong_bytes_is_skipped(tmp_path, monkeypatch, full_set):
    files, _ = full_set
    good = FakeMirror(files)

    def first_mirror_lies(url, timeout):
        if url.startswith(datasets.MIRRORS[0]):
            yield b"<html>not the file</html>"
        else:
            yield from good(url, timeout)

    monkeypatch.setattr(datasets, "_fetch", first_mirror_lies)
    _, info = datasets.load("mnist", data_dir=tmp_path, with_info=True)
    assert info.source == "full"
    assert all(url.startswith(datasets.MIRRORS[1]) for url in good.urls)


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_damaged_cached_file_is_refetched(tmp_path, monkeypatch, full_set, damage):
    files, _ = full_set
    put_cached(tmp_path, files)
    name = "train-images-idx3-ubyte.gz"
    blob = bytearray(files[name])
    if damage == "flipped_byte":
        blob[len(blob) // 2] ^= 0xFF              # same size, wrong checksum
    else:
        del blob[len(blob) // 2:]
    (cache_dir(tmp_path) / name).write_bytes(bytes(blob))
    mirror = FakeMirror(files)
    monkeypatch.setattr(datasets, "_fetch", mirror)
    _, info = datasets.load("mnist", data_dir=tmp_path, with_info=True)
    assert info.source == "full"
    assert mirror.urls == [datasets.MIRRORS[0] + name]   # only the bad file was fetched
    assert (cache_dir(tmp_path) / name).read_bytes() == files[name]


def test_damaged_file_without_network_falls_back_naming_it(tmp_path, full_set):
    files, _ = full_set
    put_cached(tmp_path, files)
    bad = cache_dir(tmp_path) / "t10k-labels-idx1-ubyte.gz"
    bad.write_bytes(files["t10k-labels-idx1-ubyte.gz"][:-5])
    with pytest.warns(BundledSubsetWarning, match=r"t10k-labels-idx1-ubyte\.gz has \d+ bytes"):
        _, info = datasets.load("mnist", data_dir=tmp_path, with_info=True)
    assert "bundled" in info.source
    with pytest.raises(DownloadError, match=r"(?s)t10k-labels.*truncated.*delete"):
        datasets.load("mnist", data_dir=tmp_path, download="force")


# --- atomic writes ----------------------------------------------------------------------

def failing_midway(blob):
    def fetch(url, timeout):
        yield blob[:len(blob) // 2]
        raise ConnectionResetError("connection reset midway")
    return fetch


def test_a_fetch_failing_midway_leaves_no_file(tmp_path, monkeypatch, full_set):
    files, _ = full_set
    monkeypatch.setattr(datasets, "_fetch", failing_midway(files["train-images-idx3-ubyte.gz"]))
    with pytest.warns(BundledSubsetWarning):
        datasets.load("mnist", data_dir=tmp_path)
    assert list(cache_dir(tmp_path).iterdir()) == []   # no final file, no temporary file


def test_a_fetch_failing_midway_keeps_the_old_file(tmp_path, monkeypatch, full_set):
    files, _ = full_set
    name = "train-labels-idx1-ubyte.gz"
    put_cached(tmp_path, {name: b"old and corrupt"})
    monkeypatch.setattr(datasets, "_fetch", failing_midway(files[name]))
    with pytest.warns(BundledSubsetWarning, match="old|bytes"):
        datasets.load("mnist", data_dir=tmp_path)
    assert (cache_dir(tmp_path) / name).read_bytes() == b"old and corrupt"
    assert [p.name for p in cache_dir(tmp_path).iterdir()] == [name]


def test_write_atomically_never_replaces_a_valid_file_with_a_partial_one(tmp_path, rng):
    good = rng.bytes(5000)
    target = tmp_path / "file.gz"
    target.write_bytes(good)
    sha = hashlib.sha256(good).hexdigest()

    def broken_stream():
        yield good[:2500]
        raise TimeoutError("read timed out")

    with pytest.raises(TimeoutError):
        datasets._write_atomically(broken_stream(), target, sha)
    with pytest.raises(ValueError, match="SHA-256"):
        datasets._write_atomically(iter([good[:2500]]), target, sha)
    assert target.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["file.gz"]


# --- IDX parsing ------------------------------------------------------------------------

def test_read_idx_round_trip(tmp_path, rng):
    array = rng.integers(0, 256, (3, 5, 7)).astype(np.uint8)
    path = tmp_path / "x.gz"
    path.write_bytes(idx_bytes(array, 0x0803))
    np.testing.assert_array_equal(datasets.read_idx(path, 0x0803), array)


def test_bad_idx_magic_names_the_file(tmp_path):
    path = tmp_path / "labels.gz"
    path.write_bytes(idx_bytes(np.zeros((4, 28, 28)), datasets.IMAGES_MAGIC))
    with pytest.raises(ValueError, match=r"labels\.gz: bad IDX magic number 2051.*2049"):
        datasets.read_idx(path, datasets.LABELS_MAGIC)


def test_idx_size_not_matching_header_names_the_file(tmp_path):
    header = datasets.IMAGES_MAGIC.to_bytes(4, "big") + b"".join(
        d.to_bytes(4, "big") for d in (10, 28, 28))
    path = tmp_path / "short.gz"
    path.write_bytes(gzip.compress(header + bytes(28 * 28 * 9)))   # 9 images, header says 10
    with pytest.raises(ValueError, match=r"short\.gz: the IDX header says 10 x 28 x 28 = 7840"):
        datasets.read_idx(path, datasets.IMAGES_MAGIC)


def test_not_gzip_names_the_file(tmp_path):
    path = tmp_path / "plain.gz"
    path.write_bytes(b"definitely not gzip data")
    with pytest.raises(ValueError, match=r"plain\.gz: not a readable gzip file"):
        datasets.read_idx(path)


def test_load_reports_a_bad_magic_file_that_passed_its_checksum(tmp_path, monkeypatch, full_set):
    """If the checksum table itself is wrong (here: a swapped file), parsing still catches it."""
    files, _ = full_set
    files = dict(files, **{"train-labels-idx1-ubyte.gz": files["t10k-images-idx3-ubyte.gz"]})
    monkeypatch.setattr(datasets, "MNIST_FILES", {
        name: (len(blob), hashlib.sha256(blob).hexdigest()) for name, blob in files.items()})
    put_cached(tmp_path, files)
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz: bad IDX magic"):
        datasets.load("mnist", data_dir=tmp_path, download=False)


# --- copies the user already has ---------------------------------------------------------

#: The whole MNIST set, recompressed (gzip -n -9: other .gz bytes than the originals), kept
#: beside the repository for tests and benchmarks (see its README.md); elsewhere, a folder
#: holding MNIST's four .gz files named by MIRRORED_TEST_MNIST_DIR.
SHARED_FULL = Path(os.environ.get("MIRRORED_TEST_MNIST_DIR")
                   or Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-full")
#: MNIST's class counts (from SHARED_FULL's README): what the full test split must hold.
TEST_CLASS_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def raw_table(arrays):
    """MNIST_RAW_SHA256 for a synthetic set: the SHA-256 of each file's uncompressed bytes."""
    table = {}
    for split, (images_file, labels_file) in datasets.SPLIT_FILES.items():
        for name, array, magic in ((images_file, arrays[split][0], datasets.IMAGES_MAGIC),
                                   (labels_file, arrays[split][1], datasets.LABELS_MAGIC)):
            table[name] = hashlib.sha256(gzip.decompress(idx_bytes(array, magic))).hexdigest()
    return table


def no_fetch_allowed(monkeypatch):
    def forbidden(url, timeout):
        raise AssertionError(f"a local copy was there: no download expected ({url})")
        yield  # noqa: unreachable
    monkeypatch.setattr(datasets, "_fetch", forbidden)


@pytest.mark.skipif(not SHARED_FULL.is_dir(),
                    reason=f"the full MNIST set is not at {SHARED_FULL}: to run this test, set "
                           f"MIRRORED_TEST_MNIST_DIR to a folder holding MNIST's four .gz files "
                           f"({', '.join(datasets.MNIST_FILES)})")
def test_full_mnist_recompressed_in_data_dir_is_used_offline_without_warning(tmp_path,
                                                                             monkeypatch):
    cache_dir(tmp_path).mkdir()
    for name in datasets.MNIST_FILES:
        (cache_dir(tmp_path) / name).symlink_to(SHARED_FULL / name)
    no_fetch_allowed(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # no subset warning, no other warning
        (train, test), info = datasets.load("mnist", split=["train", "test"], with_info=True,
                                            as_supervised=True, data_dir=tmp_path,
                                            batch_size=-1)
    assert info.source == "full" and not info.problems
    assert train[0].shape == (60000, 28, 28, 1) and test[0].shape == (10000, 28, 28, 1)
    assert np.bincount(test[1], minlength=10).tolist() == TEST_CLASS_COUNTS


def test_uncompressed_and_renamed_copies_in_data_dir_itself(tmp_path, monkeypatch, full_set):
    files, arrays = full_set
    monkeypatch.setattr(datasets, "MNIST_RAW_SHA256", raw_table(arrays))
    raw = {name: gzip.decompress(blob) for name, blob in files.items()}
    (tmp_path / "train-images-idx3-ubyte").write_bytes(raw["train-images-idx3-ubyte.gz"])
    (tmp_path / "train-labels.idx1-ubyte").write_bytes(raw["train-labels-idx1-ubyte.gz"])
    (tmp_path / "t10k-images.idx3-ubyte.gz").write_bytes(
        gzip.compress(raw["t10k-images-idx3-ubyte.gz"], compresslevel=1, mtime=7))
    cache_dir(tmp_path).mkdir()                   # the original name, other .gz bytes
    (cache_dir(tmp_path) / "t10k-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(raw["t10k-labels-idx1-ubyte.gz"], compresslevel=9, mtime=12345))
    no_fetch_allowed(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        splits, info = datasets.load("mnist", as_supervised=True, data_dir=tmp_path,
                                     with_info=True, batch_size=-1)
    assert info.source == "full"
    assert info.files["train-labels-idx1-ubyte.gz"] == tmp_path / "train-labels.idx1-ubyte"
    for split in ("train", "test"):
        np.testing.assert_array_equal(splits[split][0][..., 0], arrays[split][0])
        np.testing.assert_array_equal(splits[split][1], arrays[split][1])


def test_a_copy_with_other_contents_is_not_used(tmp_path, monkeypatch, full_set):
    files, arrays = full_set
    monkeypatch.setattr(datasets, "MNIST_RAW_SHA256", raw_table(arrays))
    put_cached(tmp_path, {n: b for n, b in files.items() if n != "train-labels-idx1-ubyte.gz"})
    raw = gzip.decompress(files["train-labels-idx1-ubyte.gz"])
    wrong = raw[:-1] + bytes([(raw[-1] + 1) % 10])                 # the last label changed
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(wrong)      # (always: not set to 9)
    with pytest.warns(BundledSubsetWarning,
                      match=r"train-labels-idx1-ubyte is not MNIST's train-labels-idx1-ubyte\.gz"):
        _, info = datasets.load("mnist", data_dir=tmp_path, download=False, with_info=True)
    assert "bundled" in info.source


def test_read_idx_reads_uncompressed_files(tmp_path, rng):
    array = rng.integers(0, 256, (4, 3)).astype(np.uint8)
    path = tmp_path / "x-idx2-ubyte"
    path.write_bytes(gzip.decompress(idx_bytes(array, 0x0802)))
    np.testing.assert_array_equal(datasets.read_idx(path, 0x0802), array)


# --- progress output, as tfds -------------------------------------------------------------------

def test_progress_bar_switches(tmp_path, monkeypatch, full_set, capsys):
    monkeypatch.setattr(datasets, "_progress_bar", [True])
    monkeypatch.setattr(datasets, "_fetch", FakeMirror(full_set[0]))
    datasets.disable_progress_bar()
    datasets.load("mnist", data_dir=tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    datasets.enable_progress_bar()
    datasets.load("mnist", data_dir=tmp_path / "loud")
    err = capsys.readouterr().err
    assert err.count("downloading") == len(full_set[0]) and "SHA-256 verified" in err


def test_the_labs_first_cell_runs_with_mirrored_datasets_as_tfds():
    import mirrored.datasets as tfds
    tfds.disable_progress_bar()                   # line 3 of "Mirrored Strategy: Basic"
    tfds.enable_progress_bar()


# --- files and resources (issue 15) ------------------------------------------------------

def test_stale_temp_files_of_a_killed_download_are_removed_on_the_next(tmp_path, monkeypatch,
                                                                       full_set):
    files, _ = full_set
    folder = cache_dir(tmp_path)
    folder.mkdir(parents=True)
    stale = folder / ".train-images-idx3-ubyte.gz.k1ll3d.part"    # kill -9 left it
    live = folder / ".t10k-labels-idx1-ubyte.gz.runn1ng.part"     # another download, now
    not_ours = folder / ".notes.txt.abc.part"
    for part in (stale, live, not_ours):
        part.write_bytes(b"partial")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(not_ours, (hour_ago, hour_ago))
    monkeypatch.setattr(datasets, "_fetch", FakeMirror(files))
    datasets.load("mnist", data_dir=tmp_path)
    assert not stale.exists(), "a temp file left by a killed download must be cleaned"
    assert live.exists() and not_ours.exists()


def test_a_download_stops_at_its_expected_size(tmp_path, monkeypatch, full_set):
    files, _ = full_set
    sent = {}                                     # url -> bytes the mirror was asked for

    def endless(url, timeout):
        """A mirror that streams for ever (stops at 50 times the size so a bug cannot hang)."""
        size = len(files[url.rsplit("/", 1)[1]])
        sent[url] = 0
        while sent[url] < 50 * size:
            sent[url] += 1000
            yield b"x" * 1000

    monkeypatch.setattr(datasets, "_fetch", endless)
    with pytest.warns(BundledSubsetWarning):       # every mirror cut off: the subset
        datasets.load("mnist", data_dir=tmp_path)
    for url, count in sent.items():
        size = len(files[url.rsplit("/", 1)[1]])
        assert count <= size + 1000, f"read {count:,} bytes of a {size:,}-byte file from {url}"
    assert list(cache_dir(tmp_path).iterdir()) == []


def test_a_read_only_data_dir_is_blamed_not_the_network(tmp_path, monkeypatch, full_set):
    files, _ = full_set
    mirror = FakeMirror(files)
    monkeypatch.setattr(datasets, "_fetch", mirror)           # online

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")      # what a read-only folder gives

    monkeypatch.setattr(datasets.tempfile, "mkstemp", read_only)
    with pytest.warns(BundledSubsetWarning, match=r"(?s)not writable.*data_dir") as caught:
        datasets.load("mnist", data_dir=tmp_path)
    assert "no network" not in str(caught[0].message)
    assert mirror.urls == []                                  # no pointless download


def test_write_atomically_refuses_more_than_max_bytes(tmp_path):
    target = tmp_path / "file.gz"
    with pytest.raises(ValueError, match="more than the expected 10 bytes of file.gz"):
        datasets._write_atomically(iter([b"x" * 8, b"x" * 8]), target, "0" * 64, max_bytes=10)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into read-only folders; the PermissionError is faked above")
def test_a_really_read_only_data_dir_is_named(tmp_path, monkeypatch, full_set):
    monkeypatch.setattr(datasets, "_fetch", FakeMirror(full_set[0]))
    cache_dir(tmp_path).mkdir()
    cache_dir(tmp_path).chmod(0o555)
    try:
        with pytest.warns(BundledSubsetWarning, match="not writable"):
            datasets.load("mnist", data_dir=tmp_path)
    finally:
        cache_dir(tmp_path).chmod(0o755)


@pytest.mark.parametrize("where", ["images", "labels"])
def test_a_corrupt_compressed_stream_names_the_file_and_falls_back(tmp_path, full_set, where):
    """Bytes flipped inside the deflate stream (not a short file, not a bad magic):
    gunzip fails with zlib.error. Read directly: a ValueError naming the file; through
    load: the offline path falls back to the bundled subset with a warning naming the
    file, and download='force' refuses, naming it."""
    import zlib
    files, _ = full_set
    put_cached(tmp_path, files)
    name = "train-images-idx3-ubyte.gz" if where == "images" else "t10k-labels-idx1-ubyte.gz"
    blob = bytearray(files[name])
    blob[12:16] = b"\xff\xff\xff\xff"            # just past the 10-byte gzip header
    with pytest.raises(zlib.error):              # the damage this test is about
        gzip.decompress(bytes(blob))
    bad = cache_dir(tmp_path) / name
    bad.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=rf"{name}: not a readable gzip file .*Error -3.*[Dd]elete it"):
        datasets.read_idx(bad)
    with pytest.warns(BundledSubsetWarning, match=rf"{name} has SHA-256 \w+, expected \w+ \(corrupt\); delete"):
        _, info = datasets.load("mnist", data_dir=tmp_path, with_info=True, download=False)
    assert "bundled" in info.source and list(info.problems) == [name]
    with pytest.raises(DownloadError, match=rf"(?s){name} has SHA-256 .*corrupt.*[Dd]elete"):
        datasets.load("mnist", data_dir=tmp_path, download="force")
