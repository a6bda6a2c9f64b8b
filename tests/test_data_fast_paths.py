"""mirrored/data.py's element-by-element fast paths give what the generic path gives.

A cache's first epoch runs element by element (issue 40: the lab's epoch 1). Plain tuples of
NumPy leaves, the usual (image, label), skip ``_map_structure``'s recursion in three places:
reading rows (``_StackedRows.play``), taking a map()'s result (``_numpy_element``) and
stacking (``_stack_elements``, ``_stack_arrays``). Each test runs the same pipeline twice,
with the fast paths and with them switched off (``generic``), and asserts the same elements:
the same structure types, dtypes, shapes and bits (bitwise: both only copy values, neither
computes), the same calls of the map function, the same errors word for word; and, where
there is one, against a NumPy oracle. Inputs are fresh random values of awkward shapes.
"""
import collections

import numpy as np
import pytest

import mirrored as tf
from mirrored import data
from mirrored.data import Dataset
from mirrored.tensor import HostTensor

Pair = collections.namedtuple("Pair", "image label")


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.fixture
def generic(monkeypatch):
    """Switch every fast path off: what the pipelines did before them."""
    def switch_off():
        monkeypatch.setattr(data, "_is_numpy_tuple", lambda element: False)
        monkeypatch.setattr(data._StackedRows, "play",
                            lambda self, chunks: (self.row(i) for i in data._row_numbers(chunks)))
        monkeypatch.setattr(data, "_stack_arrays", _stack_arrays_loop)
    return switch_off


def _stack_arrays_loop(arrays):
    """_stack_arrays as it was: one checked copy per element."""
    shape, dtype = arrays[0].shape, arrays[0].dtype
    out = np.empty((len(arrays),) + shape, dtype)
    for i, array in enumerate(arrays):
        if array.shape != shape or array.dtype != dtype:
            raise ValueError(f"cannot stack a {array.dtype}{list(array.shape)} element "
                             f"onto {dtype}{list(shape)} elements")
        out[i] = array
    return out


def _flat(structure, path=()):
    """[(path, type name, leaf)] in order: the structure's shape and leaves, comparable."""
    if isinstance(structure, tuple):
        out = [(path, type(structure).__name__, None)]
        for i, part in enumerate(structure):
            out += _flat(part, path + (i,))
        return out
    if isinstance(structure, dict):
        out = [(path, "dict", tuple(structure))]
        for key in structure:
            out += _flat(structure[key], path + (key,))
        return out
    return [(path, type(structure).__name__, structure)]


def assert_same_elements(got, want):
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        fg, fw = _flat(g), _flat(w)
        assert [(p, t) for p, t, _ in fg] == [(p, t) for p, t, _ in fw], f"element {k}: structure"
        for (path, _, a), (_, _, b) in zip(fg, fw):
            if isinstance(b, (np.ndarray, np.generic)):
                assert a.dtype == b.dtype and np.shape(a) == np.shape(b), (k, path, a, b)
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (k, path)
            else:
                assert a == b, (k, path)


def both_ways(make, generic, epochs=2):
    """[epoch elements] of make()'s pipeline with the fast paths, then with them off."""
    fast = make()
    fast_epochs = [list(fast.as_numpy_iterator()) for _ in range(epochs)]
    generic()
    slow = make()
    return fast_epochs, [list(slow.as_numpy_iterator()) for _ in range(epochs)]


def _columns(rng, n):
    images = rng.integers(0, 256, (n, 5, 3, 1), dtype=np.uint8)     # (n, 5, 3, 1) uint8
    labels = rng.integers(0, 10, n)                                  # (n,) int64
    return images, labels


def scale(image, label):                                            # the lab's
    image = tf.cast(image, tf.float32)
    image /= 255
    return image, label


@pytest.mark.parametrize("n, buffer, batch", [(1, 1, 1), (31, 7, 4), (65, 100, 64)])
def test_the_labs_pipeline_matches_the_generic_path_and_a_numpy_oracle(rng, generic, n, buffer, batch):
    images, labels = _columns(rng, n)
    seed = int(rng.integers(2**31))
    make = lambda: Dataset.from_tensor_slices((images, labels)).map(scale).cache() \
        .shuffle(buffer, seed=seed).batch(batch)
    fast, slow = both_ways(make, generic)
    assert_same_elements(fast[0], slow[0])
    assert_same_elements(fast[1], slow[1])
    # The oracle: scale in NumPy; the order: the same shuffle of the row numbers, which runs
    # by index plan (_buffer_shuffle_rows, in NumPy), not element by element.
    order = list(Dataset.from_tensor_slices(np.arange(n)).shuffle(buffer, seed=seed).as_numpy_iterator())
    x = images.astype(np.float32) / np.float32(255)                 # (n, 5, 3, 1) float32
    want = [(x[order[i:i + batch]], labels[order[i:i + batch]]) for i in range(0, n, batch)]
    assert_same_elements(fast[0], want)


@pytest.mark.parametrize("columns", [
    "flat3", "one array", "namedtuple", "dict", "nested"])
def test_reading_rows_gives_row_i_for_every_structure(rng, columns):
    n = 33
    a, b = _columns(rng, n)
    c = rng.standard_normal((n, 2)).astype(np.float16)               # (n, 2) float16
    structure = {"flat3": (a, b, c), "one array": c, "namedtuple": Pair(a, b),
                 "dict": {"x": a, "y": (b, c)}, "nested": ((a, b), c)}[columns]
    rows = data._StackedRows(structure)
    numbers = rng.permutation(n)
    chunks = [numbers[:5], numbers[5:5], numbers[5:]]                 # an empty chunk too
    got = list(rows.play(iter(chunks)))
    assert_same_elements(got, [rows.row(int(i)) for i in numbers])
    for leaf in data._leaves(got[0]):                                 # views of the held arrays
        assert not getattr(leaf, "flags", np.ones(1).flags).writeable or leaf.ndim == 0


def _maps():
    """map() functions whose results need converting, or not: (name, fn)."""
    return [
        ("plain tuple", lambda x, y: (x * 2, y)),
        ("python scalars", lambda x, y: (1.5, 3)),                    # float32, int32 (TF's)
        ("mirrored tensors", lambda x, y: (tf.constant(x), tf.constant(y))),
        ("host tensors", lambda x, y: (HostTensor.wrap(x), HostTensor.wrap(y))),   # .numpy()
        ("namedtuple", lambda x, y: Pair(x, y)),
        ("dict", lambda x, y: {"image": x, "label": (y, y + 1)}),
        ("nested", lambda x, y: ((x, y), x.sum())),
        ("one array", lambda x, y: x),
        ("numpy scalars", lambda x, y: (np.float64(x.sum()), np.uint8(y), np.bool_(y > 4))),
    ]


@pytest.mark.parametrize("name, fn", _maps(), ids=[name for name, _ in _maps()])
def test_map_cache_batch_of_every_result_kind_matches_the_generic_path(rng, generic, name, fn):
    images, labels = _columns(rng, 37)
    calls = {"fast": [], "slow": []}

    def make(record):
        def recorded(x, y):
            record.append((x.tobytes(), int(y)))
            return fn(x, y)
        return Dataset.from_tensor_slices((images, labels)).map(recorded).cache()

    fast_cached = make(calls["fast"])
    fast = [list(fast_cached.as_numpy_iterator()), list(fast_cached.batch(8).as_numpy_iterator())]
    generic()
    slow_cached = make(calls["slow"])
    slow = [list(slow_cached.as_numpy_iterator()), list(slow_cached.batch(8).as_numpy_iterator())]
    assert_same_elements(fast[0], slow[0])                          # epoch 1: map's results
    assert_same_elements(fast[1], slow[1])                          # epoch 2: cached rows, batched
    assert calls["fast"] == calls["slow"]                            # once per element, in order
    assert [y for _, y in calls["fast"]] == labels.tolist()
    for element in fast[0]:                                          # plain NumPy, never a Tensor
        assert all(type(leaf) is np.ndarray or isinstance(leaf, np.generic)
                   for leaf in data._leaves(element))


def test_stacking_matches_np_stack_for_awkward_shapes_and_dtypes(rng):
    for shape in [(), (1,), (3, 1), (2, 0), (5, 3, 2)]:
        for dtype in (np.uint8, np.float16, np.int64, np.bool_, np.complex64):
            n = int(rng.integers(1, 70))
            arrays = [rng.standard_normal(shape).astype(dtype) for _ in range(n)]
            if shape == ():
                arrays = [a[()] for a in arrays]                     # NumPy scalars
            got = data._stack_arrays(arrays)
            want = np.stack([np.asarray(a) for a in arrays])
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()


def _ragged(kind):
    """Elements a batch cannot stack, and where they differ."""
    a = np.zeros((2,), np.float32)
    return {
        "shape": [(a, np.int64(0)), (np.zeros((3,), np.float32), np.int64(1))],
        "dtype": [(a, np.int64(0)), (a.astype(np.float64), np.int64(1))],
        "label dtype": [(a, np.int64(0)), (a, np.int32(1))],
        "rank": [(a, np.int64(0)), (np.zeros((1, 2), np.float32), np.int64(1))],
        "length": [(a, np.int64(0)), (a,)],
        "structure": [(a, np.int64(0)), {"x": a}],
        "namedtuple then tuple": [Pair(a, np.int64(0)), (a, np.int64(1))],
        "nested later": [(a, np.int64(0)), (a, (np.int64(1), np.int64(2)))],
    }[kind]


@pytest.mark.parametrize("kind", ["shape", "dtype", "label dtype", "rank", "length", "structure",
                                  "namedtuple then tuple", "nested later"])
def test_a_batch_that_cannot_stack_fails_with_the_same_words(generic, kind):
    elements = _ragged(kind)

    def outcome():
        ds = Dataset.range(len(elements)).map(lambda i: elements[int(i)]).batch(len(elements))
        try:
            return "ok", list(ds.as_numpy_iterator())
        except Exception as error:                                   # noqa: BLE001 (compared below)
            return type(error).__name__, str(error)

    fast = outcome()
    generic()
    slow = outcome()
    if fast[0] == "ok":
        assert slow[0] == "ok"
        assert_same_elements(fast[1], slow[1])
    elif kind != "nested later":        # the old loop said AttributeError ('tuple' ... 'shape')
        assert fast == slow
    if kind in ("shape", "dtype", "label dtype", "rank", "nested later"):
        assert fast[0] == "ValueError" and "batch() stacks elements" in fast[1]
        assert "cannot stack a" in fast[1]
    if kind == "nested later":                  # said in words, not an AttributeError on .shape
        assert "differ in structure" in fast[1], fast


@pytest.mark.parametrize("kind", ["shape", "dtype", "label dtype", "length"])
def test_a_ragged_cache_keeps_a_list_and_replays_it(generic, kind):
    elements = _ragged(kind) * 3

    def epochs():
        ds = Dataset.range(len(elements)).map(lambda i: elements[int(i)]).cache()
        return [list(ds.as_numpy_iterator()), list(ds.as_numpy_iterator())]

    fast = epochs()
    generic()
    slow = epochs()
    for f, s in zip(fast, slow):
        assert_same_elements(f, s)
    assert_same_elements(fast[1], [tuple(e) for e in elements])
