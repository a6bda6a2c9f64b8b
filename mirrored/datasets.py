"""mirrored.datasets — `tfds.load` for MNIST and Fashion-MNIST, verified and offline-friendly.

What: `load('mnist', ...)` returns `mirrored.data.Dataset`s the way
`tensorflow_datasets.load` does, so the course lab's first cell runs unchanged:

    datasets, info = mirrored.datasets.load('mnist', with_info=True, as_supervised=True)
    train, test = datasets['train'], datasets['test']
    info.splits['train'].num_examples          # 60000 (or 8000 from the bundled subset)

Where the data comes from, in order:
1. Files the user already has, in `<data_dir>/mnist/` or `<data_dir>/` itself: the four
   original IDX files (gzip) with the published SHA-256s, or any copy, gzip-compressed or
   not (`train-images-idx3-ubyte`, `train-images-idx3-ubyte.gz`, Kaggle's
   `train-images.idx3-ubyte`), whose UNCOMPRESSED contents have MNIST's SHA-256
   (`MNIST_RAW_SHA256`): a copy recompressed with other gzip settings has other .gz
   bytes but the same digits. Used with no network and no warning. data_dir: the
   argument, else the env var MIRRORED_DATA_DIR, else ~/tensorflow_datasets (where tfds
   keeps its data).
2. The network: each missing or damaged file is fetched from MIRRORS in order, checked
   against its SHA-256 while it streams, and written atomically (temporary file in the
   same folder, fsync, os.replace): a failed or corrupt download never leaves a file
   under the real name, and never touches a file already there.
3. The bundled subset `mirrored/_data/mnist-10k` — 8,000 train / 2,000 test real MNIST
   digits, so a lab runs on a laptop with no network. Using it warns once per process.

`download=True` (default) tries 1, 2, 3. `download=False` (or env MIRRORED_OFFLINE=1,
set by the test suite and CI) never touches the network: 1, then 3.
`download='force'` insists on the full set: 1, 2, else an error that says which file
was wrong and what to do (the subset is never substituted silently).

`disable_progress_bar()` / `enable_progress_bar()`, as in tfds: whether a download
prints a line per file (to stderr) while it runs. The course lab calls
`tfds.disable_progress_bar()` first; with `import mirrored.datasets as tfds` it runs.

Why IDX: it is MNIST's own format — a big-endian header (magic number, dimensions)
then raw uint8 bytes — so a dozen lines of NumPy read it (see `read_idx`).

Fashion-MNIST (`load('fashion_mnist')`): the same files, splits and features (with tfds's
class names in `info.features['label'].names`), kept in `<data_dir>/fashion_mnist/`; it is not
bundled, so with no copy and no network `load` raises `DownloadError` naming that folder
(`fetch_files`, also what `keras.datasets` downloads through).

Neighbours: mirrored/data.py (the Dataset returned here); mirrored/keras/datasets.py
(`keras.datasets`, Keras's arrays, through `fetch_files`); tests/test_datasets.py replaces
`_fetch` and `MNIST_FILES` so no test touches the network; tests/test_keras_datasets.py
serves generated files from a `file://` mirror.
"""
import contextlib
import gzip
import hashlib
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
import zlib
from pathlib import Path

import numpy as np

from mirrored.data import Dataset

# The full MNIST set (LeCun, Cortes, Burges; CC BY-SA 3.0): file name → (bytes, SHA-256).
MNIST_FILES = {
    "train-images-idx3-ubyte.gz":
        (9912422, "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
    "train-labels-idx1-ubyte.gz":
        (28881, "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
    "t10k-images-idx3-ubyte.gz":
        (1648877, "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
    "t10k-labels-idx1-ubyte.gz":
        (4542, "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
}
# SHA-256 of each file's UNCOMPRESSED contents (the same for every copy of MNIST, however
# it was compressed): what a local copy is checked against when its .gz bytes differ.
MNIST_RAW_SHA256 = {
    "train-images-idx3-ubyte.gz": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte.gz": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte.gz": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte.gz": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
SPLIT_FILES = {  # split → (images file, labels file)
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
MIRRORS = (  # tried in order; every file is SHA-256 checked, so plain http is safe
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
FETCH_TIMEOUT_S = 20       # per connect/read: a dead mirror costs at most this, not forever
# A temporary download file untouched this long belongs to a download that died (killed,
# power cut): a live one writes at least every FETCH_TIMEOUT_S. Removed on the next download.
STALE_PART_S = 15 * 60
BUNDLED_DIR = Path(__file__).parent / "_data" / "mnist-10k"
BUNDLED_NAME = "mnist-10k"
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049   # IDX: 0x0000 08 (uint8) 03/01 (dimensions)

# Fashion-MNIST (Zalando Research, MIT licence): MNIST's format, file names and sizes of
# image, 10 classes of clothing. Not bundled: offline with no copy is an error naming the
# folder (``fetch_files``). SHA-256s as Keras's datasets/fashion_mnist.py lists them.
FASHION_MNIST_FILES = {
    "train-images-idx3-ubyte.gz":
        (26421880, "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
    "train-labels-idx1-ubyte.gz":
        (29515, "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
    "t10k-images-idx3-ubyte.gz":
        (4422102, "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
    "t10k-labels-idx1-ubyte.gz":
        (5148, "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
}
FASHION_MNIST_MIRRORS = (   # Keras's, then tfds's
    "https://storage.googleapis.com/tensorflow/tf-keras-datasets/",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)
#: tfds's ``info.features["label"].names`` for Fashion-MNIST, label 0 to 9.
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot")
#: What ``DatasetInfo`` says of each data set: (full name, description, homepage, class names).
_ABOUT = {
    "mnist": ("mnist/3.0.1", "The MNIST database of handwritten digits.",
              "http://yann.lecun.com/exdb/mnist/", None),
    "fashion_mnist": ("fashion_mnist/3.0.1", "Fashion-MNIST: 28x28 grayscale images of Zalando's "
                      "articles of clothing, 10 classes (a drop-in replacement for MNIST).",
                      "https://github.com/zalandoresearch/fashion-mnist", FASHION_MNIST_CLASSES),
}
AVAILABLE = tuple(_ABOUT)

_warned = set()            # messages already shown in this process (warn once each)
_progress_bar = [True]     # whether downloads print progress (disable_progress_bar)


class BundledSubsetWarning(UserWarning):
    """load() fell back to the bundled 10k subset (filter it with warnings.filterwarnings)."""


class DownloadError(OSError):
    """Files were required (MNIST with download='force', or a data set with no bundled copy)
    but could not be had. ``problems``: {file name: what is wrong with it} (from
    ``fetch_files``; empty where not known)."""

    def __init__(self, *args, problems=None):
        super().__init__(*args)
        self.problems = dict(problems or {})


class DamagedFileWarning(UserWarning):
    """A cached data file failed its size or SHA-256 check and was not used (the warning
    names it, with both hashes, and what to do)."""


# ---------------------------------------------------------------------------------------
# Progress output, as tfds
# ---------------------------------------------------------------------------------------

def disable_progress_bar():
    """No progress output from downloads (tfds.disable_progress_bar)."""
    _progress_bar[0] = False


def enable_progress_bar():
    """Downloads print one line per file to stderr (the default; tfds.enable_progress_bar)."""
    _progress_bar[0] = True


def _progress(message):
    if _progress_bar[0]:
        print(f"mirrored.datasets: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------

def load(name, split=None, with_info=False, as_supervised=False, data_dir=None,
         download=True, shuffle_files=False, batch_size=None):
    """Load MNIST or Fashion-MNIST ('fashion_mnist': the same splits, features and files,
    not bundled: downloaded, or an error naming the folder) as tfds.load does.

    split: None → {'train': ds, 'test': ds}; 'train', 'test', slices 'train[:10%]',
      'train[1000:2000]', joins 'train+test'; or a list of these → a list of datasets.
    as_supervised: elements `(image, label)` instead of `{'image': ..., 'label': ...}`.
      image: (28, 28, 1) uint8; label: int64 scalar.
    with_info: return `(datasets, info)`; `info.source` says 'full' or the bundled subset.
    download: True (fetch if needed, else fall back to the subset), False (never use
      the network), or 'force' (the full set or an error).
    shuffle_files: accepted; MNIST is one file per split, so there is nothing to shuffle.
    batch_size: batch the datasets; -1 returns whole splits as NumPy arrays, as tfds does.
    """
    builder = _builder_name(name)
    directory = _data_dir(data_dir) / builder
    if builder == "mnist":                       # the bundled subset is the last resort
        paths, source, problems = _locate_files(directory, _download_mode(download))
    else:                                        # no bundled copy: the files or an error
        paths, source, problems = (fetch_files(f"load({builder!r})", directory, FASHION_MNIST_FILES,
                                               FASHION_MNIST_MIRRORS, download), "full", {})
    arrays = {split_name: _read_split(paths, split_name) for split_name in SPLIT_FILES}
    info = _make_info(arrays, source, paths, problems, directory, builder)

    def build(spec):
        images, labels = _slice_split(arrays, spec)     # (n, 28, 28, 1) uint8, (n,) int64
        elements = (images, labels) if as_supervised else {"image": images, "label": labels}
        if batch_size == -1:                            # tfds: the whole split as arrays
            return elements
        dataset = Dataset.from_tensor_slices(elements)
        return dataset.batch(batch_size) if batch_size else dataset

    if split is None:
        result = {split_name: build(split_name) for split_name in SPLIT_FILES}
    elif isinstance(split, (list, tuple)):
        result = [build(spec) for spec in split]
    else:
        result = build(split)
    return (result, info) if with_info else result


def _builder_name(name):
    """'mnist' or 'mnist:3.0.1' → 'mnist'; anything else is a clear error."""
    base = str(name).split(":")[0].strip().lower()
    if base not in AVAILABLE:
        raise ValueError(f"Dataset {name!r} is not available in mirrored.datasets; "
                         f"available: {list(AVAILABLE)}.")
    return base


def _data_dir(data_dir):
    chosen = data_dir or os.environ.get("MIRRORED_DATA_DIR") or "~/tensorflow_datasets"
    return Path(chosen).expanduser()


def _download_mode(download):
    """'never', 'try' or 'force', from the argument and MIRRORED_OFFLINE."""
    if download not in (True, False, "force"):
        raise ValueError(f"download must be True, False or 'force'; got {download!r}.")
    offline = os.environ.get("MIRRORED_OFFLINE", "").strip().lower() in ("1", "true", "yes")
    if download == "force":
        return "force-offline" if offline else "force"
    return "try" if download and not offline else "never"


# ---------------------------------------------------------------------------------------
# Finding valid files: cache, then network, then the bundled subset
# ---------------------------------------------------------------------------------------

def _locate_files(directory, mode):
    """Return ({file name: path}, source, {file name: problem}) for the files to read."""
    paths, problems, not_writable = _verify_or_download(directory, MNIST_FILES, MIRRORS, mode,
                                                        local_copy=_find_local_copy)
    if not problems:
        return paths, "full", {}
    if mode.startswith("force"):
        raise DownloadError(_force_failure_message(directory, problems, mode))
    _warn_once(_fallback_message(directory, problems, mode, not_writable))
    return _bundled_files(), f"bundled subset {BUNDLED_NAME}", problems


def _verify_or_download(directory, files, mirrors, mode, local_copy=None):
    """Every file of ``files`` ({name: (bytes, SHA-256)}) in ``directory``, checked; a missing
    or damaged one downloaded from ``mirrors`` (verified, atomic) unless ``mode`` forbids the
    network. ``local_copy(directory, name)``: another copy the user may have, (path, rejected).
    Returns ({name: path}, {name: what is still wrong}, why the folder is not writable or None).
    The one loop behind every data set here: MNIST, Fashion-MNIST, CIFAR-10, keras.datasets."""
    problems, paths = {}, {}
    network_down = mode not in ("try", "force")
    not_writable = None                  # why the folder cannot take a download, once known
    for name, (size, sha256) in files.items():
        path = directory / name
        problem = check_file(path, size, sha256)
        if problem and local_copy is not None:     # another copy the user has, checked by its contents?
            copy, rejected = local_copy(directory, name)
            if copy is not None:
                path, problem = copy, None
            elif rejected and is_missing(problem):
                problem = rejected[0]    # say what is wrong with the copy that IS there
        paths[name] = path
        if problem and not network_down and not_writable is None:
            not_writable = _not_writable(directory)
            if not_writable:
                network_down = True      # nothing to gain from asking the mirrors
                problem += f"; it was not downloaded because {not_writable}"
        if problem and not network_down:
            try:
                _download(name, path, sha256, size, mirrors)
                problem = None
            except _AllMirrorsFailed as failure:
                problem += f"; downloading it failed: {failure}"
                network_down = failure.unreachable   # don't wait on dead mirrors again
        if problem:
            problems[name] = problem
    return paths, problems, not_writable


def fetch_files(what, directory, files, mirrors, download=True):
    """``{name: path}`` of every file of ``files`` ({name: (bytes, SHA-256)}) in ``directory``,
    each verified, the missing or damaged ones downloaded from ``mirrors`` (verified, atomic),
    unless ``download`` is False or MIRRORED_OFFLINE=1. For the data sets with no bundled
    copy (Fashion-MNIST, CIFAR-10): when a file cannot be had, a ``DownloadError`` names each
    problem and the folder to put the files in; nothing else is ever substituted."""
    directory = Path(directory).expanduser()
    mode = _download_mode(download)
    paths, problems, _ = _verify_or_download(directory, files, mirrors, mode)
    if problems:
        lines = "\n".join(f"  - {problem}" for problem in problems.values())
        why = ("no download was tried (download=False or MIRRORED_OFFLINE=1)"
               if mode in ("never", "force-offline") else "the download did not succeed")
        raise DownloadError(
            f"{what} needs {len(files)} file(s) in {directory}, and {why}:\n{lines}\n"
            f"What to do: load with network access, or copy the original files "
            f"({', '.join(files)}) from {mirrors[0]} into {directory}; a damaged file named "
            f"above can be deleted. (This data set has no bundled copy, and no other is used.)",
            problems=problems)
    return paths


def check_file(path, size, sha256):
    """None if the file at path is the expected one (``size`` bytes, ``sha256``), else what
    is wrong with it."""
    if not path.exists():
        return f"{path} is missing"
    actual_size = path.stat().st_size
    if actual_size != size:       # both hashes too: the one a user compares with the origin's
        return (f"{path} has {actual_size} bytes, expected {size}, and SHA-256 {_sha256(path)}, "
                f"expected {sha256} (truncated or another file)")
    actual = _sha256(path)
    if actual != sha256:
        return f"{path} has SHA-256 {actual}, expected {sha256} (corrupt)"
    return None


def is_missing(problem):
    """True if ``problem`` (from ``check_file``) says the file is not there at all (rather
    than there and wrong: a file worth naming to the user)."""
    return problem.endswith(" is missing")


def _local_names(name):
    """The names a local copy of ``name`` may have: 'train-images-idx3-ubyte.gz', the same
    uncompressed, and Kaggle's 'train-images.idx3-ubyte' (either way)."""
    stem = name[:-len(".gz")]
    kaggle = stem.replace("-idx", ".idx")           # train-images-idx3-ubyte → .idx3-ubyte
    return (name, stem, kaggle, kaggle + ".gz")


def _find_local_copy(directory, name):
    """(path, rejected): a file in ``directory`` or its parent (data_dir itself) whose
    uncompressed contents have MNIST's SHA-256 for ``name``, or None; and what is wrong
    with each candidate file passed over (unreadable, or other contents)."""
    rejected = []
    for folder in (directory, directory.parent):
        for candidate in _local_names(name):
            path = folder / candidate
            if not path.is_file():
                continue
            try:
                actual = hashlib.sha256(_raw_bytes(path)).hexdigest()
            except ValueError as error:
                rejected.append(str(error))
                continue
            if actual == MNIST_RAW_SHA256.get(name):
                return path, rejected
            rejected.append(f"{path} is not MNIST's {name}: its uncompressed contents have "
                            f"SHA-256 {actual}, expected {MNIST_RAW_SHA256.get(name)}")
    return None, rejected


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _not_writable(directory):
    """None if a download can be written into ``directory``, else why not (the OSError of
    creating the folder or a temporary file in it: read-only, no permission, a file there).
    Asked before any download, so that the warning blames the folder, not the network."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".mirrored-write-test.")
        os.close(fd)
        os.unlink(probe)
        return None
    except OSError as error:
        return (f"the data folder {directory} is not writable ({type(error).__name__}: "
                f"{error.strerror or error})")


def _fallback_message(directory, problems, mode, not_writable=None):
    counts = {split: _idx_count(BUNDLED_DIR / files[1]) for split, files in SPLIT_FILES.items()}
    if mode == "never":
        why = "download=False or MIRRORED_OFFLINE=1, so no download was tried"
    elif not_writable:
        why = (f"{not_writable}: pass data_dir= (or set MIRRORED_DATA_DIR to) a folder you can "
               f"write, or make this one writable")
    else:
        why = "the full set could not be downloaded (no network?)"
    bad = [p for p in problems.values() if not is_missing(p.split("; ")[0])]
    details = (f" Bad cached file(s), not used: {'; '.join(bad)}; delete them (a download "
               f"replaces them)." if bad else "")
    # Short: a notebook shows it in every run that has no full set (the classroom's usual
    # case). The ways to get the full set are in load()'s docstring and the README.
    return (f"load('mnist'): the bundled subset {BUNDLED_NAME}, {counts['train']:,} train / "
            f"{counts['test']:,} test real MNIST images (the full set: 60,000 / 10,000), because "
            f"{why}.{details} For the full set, load with network access or put MNIST's four "
            f"files in {directory}.")


def _force_failure_message(directory, problems, mode):
    lines = "\n".join(f"  - {problem}" for problem in problems.values())
    hint = ("MIRRORED_OFFLINE=1 is set, so no download was tried: unset it"
            if mode == "force-offline" else "check the network connection")
    return (f"load('mnist', download='force') needs the full MNIST set in {directory}, "
            f"but:\n{lines}\nWhat to do: delete any corrupt file named above, {hint}, "
            f"and load again; or copy the original files from {MIRRORS[0]} into "
            f"{directory}; or pass download=True to accept the bundled subset.")


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, BundledSubsetWarning, stacklevel=4)


def _bundled_files():
    """Paths of the bundled subset, checked against its SHA256SUMS."""
    expected = {}
    for line in (BUNDLED_DIR / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            sha256, name = line.split()
            expected[name] = sha256
    for name, sha256 in expected.items():
        if _sha256(BUNDLED_DIR / name) != sha256:
            raise RuntimeError(f"The bundled subset file {BUNDLED_DIR / name} does not match "
                               f"its SHA256SUMS: the installation is damaged; reinstall "
                               f"mirrored.")
    return {name: BUNDLED_DIR / name for name in MNIST_FILES}


# ---------------------------------------------------------------------------------------
# Downloading: mirrors in order, streamed, verified, written atomically
# ---------------------------------------------------------------------------------------

class _AllMirrorsFailed(Exception):
    def __init__(self, errors, unreachable):
        super().__init__("; ".join(errors))
        self.unreachable = unreachable   # True when no mirror could even be reached


def _fetch(url, timeout):
    """Yield the bytes at url in chunks. Tests replace this to stay off the network."""
    request = urllib.request.Request(url, headers={"User-Agent": "mirrored-datasets"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        while chunk := response.read(1 << 16):
            yield chunk


def _download(name, path, sha256, size, mirrors=None):
    """Fetch `name` into `path` from the first of `mirrors` (MNIST's by default) that
    delivers the right bytes (`size` of them: a mirror that sends more is cut off, not
    followed to a full disk)."""
    errors, unreachable = [], True
    for mirror in MIRRORS if mirrors is None else mirrors:
        url = mirror + name
        try:
            _progress(f"downloading {url} ...")
            _write_atomically(_fetch(url, FETCH_TIMEOUT_S), path, sha256, max_bytes=size)
            _progress(f"{name}: done, SHA-256 verified, saved as {path}")
            return
        except Exception as error:       # any failure here just means: try the next mirror
            errors.append(f"{url}: {type(error).__name__}: {error}")
            # An HTTP status or a checksum mismatch means the mirror answered.
            if isinstance(error, (urllib.error.HTTPError, ValueError)):
                unreachable = False
    raise _AllMirrorsFailed(errors, unreachable)


def _write_atomically(chunks, path, sha256, max_bytes=None):
    """Write the byte chunks to path only if their SHA-256 matches; never a half file.

    The bytes go to a temporary file in the same folder (so os.replace is a rename on
    one file system, atomic), are flushed to disk, checked, and only then renamed onto
    the final name. On any failure the temporary file is removed and whatever was at
    `path` before is untouched; more than ``max_bytes`` is a failure (a stream that never
    ends would fill the disk). Temporary files that a killed download left in the folder
    are removed first (``_remove_stale_parts``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_parts(path.parent, set(MNIST_FILES) | {path.name})
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                written += len(chunk)
                if max_bytes is not None and written > max_bytes:
                    raise ValueError(f"the mirror sent more than the expected {max_bytes:,} "
                                     f"bytes of {path.name}; stopped there")
                f.write(chunk)
                digest.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        if digest.hexdigest() != sha256:
            raise ValueError(f"downloaded bytes have SHA-256 {digest.hexdigest()}, "
                             f"expected {sha256}")
        os.chmod(temp, 0o644)            # mkstemp makes 0600; data files are world-readable
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    _fsync_dir(path.parent)              # make the rename itself durable


def _remove_stale_parts(directory, names=None):
    """Delete the temporary files of our own naming (``.<file name>.*.part``, for the
    ``names`` given, MNIST's by default) in ``directory`` that no write has touched for
    ``STALE_PART_S``: left by a download that was killed. Recent ones may belong to a
    download running now, and stay."""
    now = time.time()
    for name in MNIST_FILES if names is None else names:
        for part in directory.glob(f".{name}.*.part"):
            with contextlib.suppress(OSError):   # gone already, or not ours to delete
                if now - part.stat().st_mtime > STALE_PART_S:
                    part.unlink()


def _fsync_dir(directory):
    with contextlib.suppress(OSError):   # not possible on every platform (Windows)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------
# Reading IDX files
# ---------------------------------------------------------------------------------------

def _raw_bytes(path):
    """The uncompressed contents of an IDX file: gunzipped when its name ends in .gz,
    else as it is. A ValueError naming the file when a .gz does not decompress: not gzip
    at all, cut short (EOFError), a bad CRC, or bytes damaged inside the compressed
    stream (``zlib.error``, which is not an OSError) — so a damaged file is passed over
    and named, like a truncated one, and the offline path falls back to the subset."""
    path = Path(path)
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: not a readable gzip file ({type(error).__name__}: {error}). "
                         f"Delete it and load again.") from error


def read_idx(path, expected_magic=None):
    """Read an IDX file (gzip-compressed when its name ends in .gz) into a uint8 array.

    Layout: 4-byte big-endian magic 0x000008NN (08 = unsigned byte data, NN = number of
    dimensions), then NN big-endian uint32 sizes, then the bytes in C order.
    Any mismatch raises ValueError naming the file.
    """
    path = Path(path)
    raw = _raw_bytes(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes is too short for an IDX header.")
    magic = int.from_bytes(raw[:4], "big")
    if magic >> 8 != 0x08 or (expected_magic is not None and magic != expected_magic):
        wanted = f"{expected_magic} ({expected_magic:#010x})" if expected_magic else "0x000008NN"
        raise ValueError(f"{path}: bad IDX magic number {magic} ({magic:#010x}); expected "
                         f"{wanted}. Is it the right MNIST file? Delete it and load again.")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header}).")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    expected = int(np.prod(dims))
    if len(raw) - header != expected:
        raise ValueError(f"{path}: the IDX header says {' x '.join(map(str, dims))} = "
                         f"{expected} bytes of data, but the file holds {len(raw) - header}. "
                         f"It is truncated or damaged: delete it and load again.")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _idx_count(path):
    """The first dimension from an IDX header (cheap: reads 8 bytes)."""
    with (gzip.open(path, "rb") if Path(path).suffix == ".gz" else open(path, "rb")) as f:
        return int.from_bytes(f.read(8)[4:8], "big")


def _read_split(paths, split):
    images_file, labels_file = SPLIT_FILES[split]
    images = read_idx(paths[images_file], IMAGES_MAGIC)   # images: (n, 28, 28) uint8
    labels = read_idx(paths[labels_file], LABELS_MAGIC)   # labels: (n,) uint8
    if len(images) != len(labels):
        raise ValueError(f"{paths[images_file]} holds {len(images)} images but "
                         f"{paths[labels_file]} holds {len(labels)} labels.")
    return images[..., np.newaxis], labels.astype(np.int64)  # (n, 28, 28, 1), (n,) int64


# ---------------------------------------------------------------------------------------
# Split specs: 'train', 'test[:10%]', 'train[1000:2000]', 'train+test'
# ---------------------------------------------------------------------------------------

_SPEC = re.compile(r"^(?P<name>\w+)(?:\[(?P<start>-?\d*%?):(?P<stop>-?\d*%?)\])?$")


def _slice_split(arrays, spec):
    """(images, labels) for a split spec; '+' joins parts."""
    parts = [_slice_one(arrays, part.strip()) for part in str(spec).split("+")]
    if len(parts) == 1:
        return parts[0]
    return (np.concatenate([images for images, _ in parts]),
            np.concatenate([labels for _, labels in parts]))


def _slice_one(arrays, spec):
    match = _SPEC.match(spec)
    if not match or match["name"] not in arrays:
        raise ValueError(f"Unknown split {spec!r}. Splits: {list(arrays)}; slices like "
                         f"'train[:10%]', 'train[1000:2000]', 'train[-10%:]'; joins 'train+test'.")
    images, labels = arrays[match["name"]]
    n = len(images)
    rows = slice(_bound(match["start"], n, spec), _bound(match["stop"], n, spec))
    return images[rows], labels[rows]


def _bound(text, n, spec):
    """A slice bound: '' → None, '1000' → 1000, '10%' → 10% of n (rounded, as tfds)."""
    if not text:
        return None
    if text.endswith("%"):
        percent = int(text[:-1])
        if not -100 <= percent <= 100:
            raise ValueError(f"Split {spec!r}: percentages must be within -100%..100%.")
        return int(round(percent * n / 100))
    return int(text)


# ---------------------------------------------------------------------------------------
# info: what tfds's DatasetInfo offers that labs use
# ---------------------------------------------------------------------------------------

class SplitInfo:
    def __init__(self, name, num_examples):
        self.name, self.num_examples = name, num_examples

    def __repr__(self):
        return f"<SplitInfo num_examples={self.num_examples}>"


class _SplitDict(dict):
    """{'train': SplitInfo, 'test': SplitInfo}; also answers slices: splits['train[:10%]']."""

    def __init__(self, arrays):
        super().__init__({name: SplitInfo(name, len(images))
                          for name, (images, _) in arrays.items()})
        self._arrays = arrays

    def __missing__(self, spec):
        return SplitInfo(spec, len(_slice_split(self._arrays, spec)[0]))

    @property
    def total_num_examples(self):
        return sum(split.num_examples for split in self.values())


class ClassLabel:
    def __init__(self, num_classes, names=None):
        self.num_classes = num_classes
        self.names = list(names) if names is not None else [str(i) for i in range(num_classes)]
        self.shape, self.dtype = (), np.int64

    def int2str(self, value):
        return self.names[int(value)]

    def str2int(self, name):
        return self.names.index(str(name))

    def __repr__(self):
        return f"ClassLabel(shape=(), dtype=int64, num_classes={self.num_classes})"


class Image:
    def __init__(self, shape):
        self.shape, self.dtype = shape, np.uint8

    def __repr__(self):
        return f"Image(shape={self.shape}, dtype=uint8)"


class DatasetInfo:
    """name, version, features, splits, supervised_keys, plus `source` and `files`."""

    def __init__(self, splits, source, files, problems, data_dir=None, name="mnist"):
        self.full_name, self.description, self.homepage, names = _ABOUT[name]
        self.name, self.version = name, self.full_name.split("/")[1]
        self.features = {"image": Image((28, 28, 1)), "label": ClassLabel(10, names)}
        self.supervised_keys = ("image", "label")
        self.splits = splits
        self.source = source             # 'full' or 'bundled subset mnist-10k'
        self.files = files               # {file name: path read}
        self.problems = problems         # {file name: why the full file was not used}
        self.data_dir = data_dir         # tfds's too: the folder this data set is kept in

    def __repr__(self):
        splits = ", ".join(f"'{k}': {v.num_examples}" for k, v in self.splits.items())
        return (f"DatasetInfo(name='{self.name}', version={self.version}, source='{self.source}',\n"
                f"    features={self.features},\n    splits={{{splits}}})")


def _make_info(arrays, source, paths, problems, directory=None, name="mnist"):
    return DatasetInfo(_SplitDict(arrays), source, dict(paths), problems,
                       None if directory is None else str(directory), name)
