"""``keras.datasets``: ``mnist``, ``fashion_mnist``, ``cifar10``, as Keras 3 returns them.

    (x_train, y_train), (x_test, y_test) = keras.datasets.fashion_mnist.load_data()
    # x_train (60000, 28, 28) uint8, y_train (60000,) uint8; cifar10: (50000, 32, 32, 3), (50000, 1)

NumPy arrays, Keras's shapes and dtypes (uint8 images, uint8 labels), ready for
``keras.utils.to_categorical`` and ``fit``. (The labels are uint8, as Keras's: ``fit`` and the
custom loop convert any integer labels once per batch, ``keras/data_adapters.py``.)

Where the files are kept: Keras's cache folder, ``$KERAS_HOME/datasets`` (default
``~/.keras/datasets``): ``mnist.npz``; ``fashion-mnist/`` with the four IDX files;
``cifar-10-binary.tar.gz`` (the binary version, which tfds reads too: fixed-size records, no
pickle to unpickle, unlike the python version Keras downloads). Every file is checked
against its SHA-256 and downloaded, when missing or damaged, through ``mirrored.datasets``'s
one verified, atomic path (``fetch_files``): several mirrors, a temporary file renamed
only when its digest matches, a clear error naming the file and the fix.

Offline (no network, or ``MIRRORED_OFFLINE=1``):
* ``mnist``: ``mnist.npz`` if it is there, else what ``mirrored.datasets.load('mnist')``
  finds (MNIST's IDX files in ``~/tensorflow_datasets``) or its bundled 8,000 / 2,000
  subset, with its one warning. An ``mnist.npz`` that is there but fails its check (size,
  SHA-256) is never read: a ``DamagedFileWarning`` names it, with its SHA-256 and the
  expected one, and says what to do (as Keras names the file whose hash does not match).
* ``fashion_mnist``, ``cifar10``: not bundled. With no cached copy, ``load_data()`` raises
  ``DownloadError`` naming the folder to put the files in; another data set is never
  substituted.

Neighbours: ``mirrored/datasets.py`` (the tfds-style loader and the download machinery),
``utils.py`` (``to_categorical``), tests/test_keras_datasets.py (every path, through a
``file://`` mirror of generated files).
"""
import os
import tarfile
import warnings
import zlib
from pathlib import Path

import numpy as np

from mirrored import datasets as _datasets

#: Keras's own copy of MNIST: (file name, bytes, SHA-256), from its origin folder.
MNIST_NPZ = ("mnist.npz", 11490434, "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1")
KERAS_ORIGINS = ("https://storage.googleapis.com/tensorflow/tf-keras-datasets/",)
#: CIFAR-10's binary version (Krizhevsky 2009): {file name: (bytes, SHA-256)}.
CIFAR10_FILES = {"cifar-10-binary.tar.gz":
                 (170052171, "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd")}
CIFAR10_MIRRORS = ("https://www.cs.toronto.edu/~kriz/",)
#: One CIFAR-10 record: a label byte, then the image as 3 planes of 32 x 32 (R, G, B).
CIFAR10_SHAPE = (3, 32, 32)
CIFAR10_RECORD = 1 + int(np.prod(CIFAR10_SHAPE))
#: The archive's members of each split, in Keras's order.
CIFAR10_MEMBERS = {"train": [f"cifar-10-batches-bin/data_batch_{i}.bin" for i in range(1, 6)],
                   "test": ["cifar-10-batches-bin/test_batch.bin"]}

DownloadError = _datasets.DownloadError


def cache_dir():
    """Keras's cache folder for data sets: ``$KERAS_HOME/datasets``, else ``~/.keras/datasets``."""
    home = os.environ.get("KERAS_HOME") or os.path.join("~", ".keras")
    return Path(home).expanduser() / "datasets"


# --- mnist -----------------------------------------------------------------------------------

def _mnist_load_data(path="mnist.npz"):
    """``(x_train, y_train), (x_test, y_test)``: (n, 28, 28) uint8 images, (n,) uint8 labels.

    ``path``: where Keras's ``mnist.npz`` is kept, relative to the cache folder (or absolute).
    It is downloaded there when its name is ``mnist.npz``; another name must already hold
    the file. Without it: ``mirrored.datasets.load('mnist')`` (full IDX files, or offline
    the bundled subset, with its warning)."""
    name, size, sha256 = MNIST_NPZ
    target = cache_dir() / Path(path).expanduser()
    found = problem = None
    try:
        if target.name == name:
            found = _datasets.fetch_files("keras.datasets.mnist.load_data()", target.parent,
                                          {name: (size, sha256)}, KERAS_ORIGINS)[name]
        else:
            problem = _datasets.check_file(target, size, sha256)
            found = None if problem else target
    except DownloadError as error:
        problem = error.problems.get(name)
    if found is not None:
        return _read_mnist_npz(found)
    if problem and not _datasets.is_missing(problem.split("; ")[0]):   # there, and not Keras's file
        warnings.warn(f"keras.datasets.mnist.load_data(): {problem}, so it is not used. What to do: "
                      f"delete it and load with network access (Keras's copy, {KERAS_ORIGINS[0]}{name}, "
                      f"is downloaded and checked), or put that file there. Loading "
                      f"mirrored.datasets.load('mnist') instead.", _datasets.DamagedFileWarning, stacklevel=2)
    splits = _datasets.load("mnist", split=["train", "test"], as_supervised=True, batch_size=-1)
    return tuple((images[..., 0], labels.astype(np.uint8)) for images, labels in splits)


def _read_mnist_npz(path):
    """The four arrays of Keras's ``mnist.npz`` (no pickles: ``allow_pickle=False``)."""
    with np.load(path, allow_pickle=False) as f:
        arrays = [f[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    for k in (0, 2):
        x, y = arrays[k], arrays[k + 1]
        if x.dtype != np.uint8 or x.shape[1:] != (28, 28) or y.shape != x.shape[:1]:
            raise ValueError(f"{path}: not Keras's mnist.npz (images {x.shape} {x.dtype}, labels "
                             f"{y.shape}); delete it and load again.")
    return (arrays[0], arrays[1].astype(np.uint8)), (arrays[2], arrays[3].astype(np.uint8))


# --- fashion_mnist -----------------------------------------------------------------------------

def _fashion_mnist_load_data():
    """``(x_train, y_train), (x_test, y_test)``: (60000, 28, 28) and (10000, 28, 28) uint8
    images, (n,) uint8 labels (``mirrored.datasets.FASHION_MNIST_CLASSES`` names them), from
    ``<cache>/fashion-mnist/``; downloaded there if need be, else ``DownloadError``."""
    paths = _datasets.fetch_files("keras.datasets.fashion_mnist.load_data()", cache_dir() / "fashion-mnist",
                                  _datasets.FASHION_MNIST_FILES, _datasets.FASHION_MNIST_MIRRORS)
    result = []
    for images_file, labels_file in _datasets.SPLIT_FILES.values():          # train, then test
        images = _datasets.read_idx(paths[images_file], _datasets.IMAGES_MAGIC)   # (n, 28, 28) uint8
        labels = _datasets.read_idx(paths[labels_file], _datasets.LABELS_MAGIC)   # (n,) uint8
        if len(images) != len(labels):
            raise ValueError(f"{paths[images_file]} holds {len(images)} images but "
                             f"{paths[labels_file]} holds {len(labels)} labels.")
        result.append((images, labels))
    return tuple(result)


# --- cifar10 -----------------------------------------------------------------------------------

def _cifar10_load_data():
    """``(x_train, y_train), (x_test, y_test)``: (50000, 32, 32, 3) and (10000, 32, 32, 3) uint8
    images (channels last), (n, 1) uint8 labels, as Keras; from ``<cache>/cifar-10-binary.tar.gz``,
    downloaded there if need be, else ``DownloadError``."""
    name = next(iter(CIFAR10_FILES))
    path = _datasets.fetch_files("keras.datasets.cifar10.load_data()", cache_dir(), CIFAR10_FILES,
                                 CIFAR10_MIRRORS)[name]
    try:
        with tarfile.open(path, "r:gz") as tar:
            return tuple(_cifar10_split(tar, path, CIFAR10_MEMBERS[split]) for split in ("train", "test"))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        raise ValueError(f"{path}: not a readable CIFAR-10 archive ({type(error).__name__}: {error}). "
                         f"Delete it and load again.") from error


def _cifar10_split(tar, path, members):
    """One split's records, read from the archive's members in memory (nothing is extracted
    to disk, so no member name can write outside the cache)."""
    records = []
    for member_name in members:
        try:
            member = tar.getmember(member_name)
        except KeyError:
            raise ValueError(f"{path}: no member {member_name}; is it CIFAR-10's binary version? "
                             f"Delete it and load again.") from None
        if not member.isfile() or member.size % CIFAR10_RECORD:
            raise ValueError(f"{path}: {member_name} is not a whole number of {CIFAR10_RECORD}-byte "
                             f"records ({member.size} bytes). Delete the archive and load again.")
        data = tar.extractfile(member).read(member.size)
        records.append(np.frombuffer(data, np.uint8).reshape(-1, CIFAR10_RECORD))   # (n, 3073)
    rows = np.concatenate(records)
    images = rows[:, 1:].reshape((-1,) + CIFAR10_SHAPE).transpose(0, 2, 3, 1)       # (n, 32, 32, 3)
    return np.ascontiguousarray(images), rows[:, :1].copy()                          # labels (n, 1)


class mnist:  # noqa: N801 (Keras's module names)
    """``keras.datasets.mnist``: ``load_data(path='mnist.npz')``."""
    load_data = staticmethod(_mnist_load_data)


class fashion_mnist:  # noqa: N801
    """``keras.datasets.fashion_mnist``: ``load_data()``."""
    load_data = staticmethod(_fashion_mnist_load_data)


class cifar10:  # noqa: N801
    """``keras.datasets.cifar10``: ``load_data()``."""
    load_data = staticmethod(_cifar10_load_data)
