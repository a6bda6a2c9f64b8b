"""Tests for mirrored.data: tf.data semantics on NumPy values.

Most pipelines are checked twice: over `from_tensor_slices` (the fast, index-plan
schedule) and behind an identity `map` (the element-by-element schedule); both must
give the same elements in the same order.

    /tmp/venv/bin/python -m pytest tests/test_data.py
"""

import numpy as np
import pytest

from mirrored import data
from mirrored.data import Dataset

SCHEDULES = ["by_index", "by_element"]


def make(values, schedule):
    """A dataset of `values`, on the chosen schedule."""
    ds = Dataset.from_tensor_slices(values)
    return ds if schedule == "by_index" else ds.map(lambda x: x)


def ints(ds):
    return [int(x) for x in ds]


# --- sources ------------------------------------------------------------------------

def test_from_tensor_slices_array(rng):
    x = rng.standard_normal((7, 3)).astype(np.float32)
    elements = list(Dataset.from_tensor_slices(x))
    assert len(elements) == 7
    for i, e in enumerate(elements):
        np.testing.assert_array_equal(e, x[i])
        assert e.dtype == np.float32


def test_from_tensor_slices_tuple_and_dict(rng):
    images = rng.integers(0, 256, (5, 4, 4, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, 5)
    for i, (image, label) in enumerate(Dataset.from_tensor_slices((images, labels))):
        np.testing.assert_array_equal(image, images[i])
        assert label == labels[i]
    elements = list(Dataset.from_tensor_slices({"image": images, "label": labels}))
    assert [sorted(e) for e in elements] == [["image", "label"]] * 5
    assert [int(e["label"]) for e in elements] == labels.tolist()


def test_from_tensor_slices_copies_its_input():
    x = np.arange(4)
    ds = Dataset.from_tensor_slices(x)
    x[0] = 100                        # TF copies into a constant: later edits don't leak in
    assert ints(ds) == [0, 1, 2, 3]


def test_from_tensor_slices_length_mismatch_names_lengths():
    with pytest.raises(ValueError, match=r"\[5, 4\]"):
        Dataset.from_tensor_slices((np.zeros(5), np.zeros(4)))


def test_from_tensor_slices_scalar_is_an_error():
    with pytest.raises(ValueError, match="at least one dimension"):
        Dataset.from_tensor_slices(np.float32(1.0))


def test_range():
    assert ints(Dataset.range(5)) == [0, 1, 2, 3, 4]
    assert ints(Dataset.range(2, 11, 3)) == [2, 5, 8]
    assert ints(Dataset.range(5, 0, -2)) == [5, 3, 1]
    assert all(x.dtype == np.int64 and x.shape == () for x in Dataset.range(3))     # int64 scalar tensors, as TF
    assert len(Dataset.range(2, 11, 3)) == 3


# --- map / filter ---------------------------------------------------------------------

def test_map_unpacks_tuples_and_passes_dicts_whole(rng):
    a, b = rng.integers(0, 100, 6), rng.integers(0, 100, 6)
    sums = Dataset.from_tensor_slices((a, b)).map(lambda x, y: x + y)
    assert ints(sums) == (a + b).tolist()
    from_dict = Dataset.from_tensor_slices({"x": a, "y": b}).map(lambda d: d["x"] - d["y"])
    assert ints(from_dict) == (a - b).tolist()


def test_map_lab_scale_function(rng):
    """The course lab's scale(): cast to float32, divide by 255, keep the label."""
    images = rng.integers(0, 256, (10, 28, 28, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, 10)

    def scale(image, label):
        image = image.astype(np.float32)
        image /= 255
        return image, label

    for i, (image, label) in enumerate(Dataset.from_tensor_slices((images, labels)).map(scale)):
        assert image.dtype == np.float32 and image.shape == (28, 28, 1)
        np.testing.assert_allclose(image, images[i] / 255, rtol=1e-6)
        assert label == labels[i]


def test_map_python_numbers_get_tf_dtypes():
    (x, y), = list(Dataset.range(1).map(lambda i: (0.5, 3)))
    assert x.dtype == np.float32 and y.dtype == np.int32


def test_elements_are_read_only():
    """In-place edits of an element must fail, not corrupt the next epoch."""
    ds = Dataset.from_tensor_slices(np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="read-only"):
        next(iter(ds))[0] += 1


def test_filter():
    ds = Dataset.range(10).filter(lambda x: x % 3 == 0)
    assert ints(ds) == [0, 3, 6, 9]
    assert ds.cardinality() == data.UNKNOWN_CARDINALITY
    with pytest.raises(TypeError, match="length is unknown"):
        len(ds)


# --- batch ----------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_batch_partial_last_and_drop_remainder(schedule, rng):
    n, b = 33, 8                      # 4 full batches and a remainder of 1
    x = rng.standard_normal((n, 3)).astype(np.float32)
    batches = list(make(x, schedule).batch(b))
    assert [len(batch) for batch in batches] == [8, 8, 8, 8, 1]
    np.testing.assert_array_equal(np.concatenate(batches), x)
    dropped = list(make(x, schedule).batch(b, drop_remainder=True))
    assert [len(batch) for batch in dropped] == [8, 8, 8, 8]
    assert len(make(x, schedule).batch(b)) == 5
    assert len(make(x, schedule).batch(b, drop_remainder=True)) == 4


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_batch_stacks_tuple_components(schedule, rng):
    images = rng.integers(0, 256, (10, 28, 28, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, 10)
    ds = Dataset.from_tensor_slices((images, labels))
    if schedule == "by_element":
        ds = ds.map(lambda image, label: (image, label))
    first_images, first_labels = next(iter(ds.batch(4)))
    assert first_images.shape == (4, 28, 28, 1) and first_images.dtype == np.uint8
    assert first_labels.shape == (4,)
    np.testing.assert_array_equal(first_labels, labels[:4])


def test_batch_of_ragged_elements_is_a_clear_error():
    ds = Dataset.range(3).map(lambda i: np.zeros(int(i) + 1))
    with pytest.raises(ValueError, match="batch\\(\\) stacks elements"):
        list(ds.batch(3))


# --- shuffle ----------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shuffle_buffer_of_one_is_identity(schedule):
    assert ints(make(np.arange(50), schedule).shuffle(1)) == list(range(50))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shuffle_full_buffer_is_a_permutation(schedule, rng):
    n = int(rng.integers(20, 200))
    order = ints(make(np.arange(n), schedule).shuffle(n))
    assert sorted(order) == list(range(n))
    assert order != list(range(n))    # a fixed point over all n! orders: ~1/n! chance


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shuffle_small_buffer_respects_input_order(schedule, rng):
    """TF's property: element i is read only after i - buffer_size + 1 have been emitted,
    so it cannot be emitted before position i - (buffer_size - 1)."""
    n, buffer_size = 500, int(rng.integers(2, 20))
    order = ints(make(np.arange(n), schedule).shuffle(buffer_size))
    assert sorted(order) == list(range(n))
    position = {element: pos for pos, element in enumerate(order)}
    earliest = [position[i] - (i - (buffer_size - 1)) for i in range(n)]
    assert min(earliest) >= 0, f"buffer_size={buffer_size}: an element came out too early"
    assert order != list(range(n))


def test_shuffle_is_uniform_over_the_buffer():
    """With buffer_size=2 over [0, 1, 2], the first element is 0 or 1, each half the time."""
    firsts = [int(next(iter(Dataset.range(3).shuffle(2, seed=s)))) for s in range(400)]
    assert set(firsts) == {0, 1}
    assert 150 < firsts.count(0) < 250


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shuffle_seed_reproducible_and_reshuffles_each_epoch(schedule):
    x = np.arange(100)
    a = make(x, schedule).shuffle(30, seed=7)
    b = make(x, schedule).shuffle(30, seed=7)
    epochs_a = [ints(a) for _ in range(3)]
    epochs_b = [ints(b) for _ in range(3)]
    assert epochs_a == epochs_b                      # same seed → same sequence of epochs
    assert epochs_a[0] != epochs_a[1] != epochs_a[2]  # a new order every epoch
    assert ints(make(x, schedule).shuffle(30, seed=8)) != epochs_a[0]


@pytest.mark.parametrize("seed", [None, 3])
def test_shuffle_without_reshuffle_repeats_one_order(seed):
    ds = Dataset.range(100).shuffle(100, seed=seed, reshuffle_each_iteration=False)
    assert ints(ds) == ints(ds) != list(range(100))


def test_both_schedules_give_the_same_order():
    x = np.arange(300)
    fast = Dataset.from_tensor_slices(x).shuffle(40, seed=11).batch(7)
    slow = Dataset.from_tensor_slices(x).map(lambda v: v).shuffle(40, seed=11).batch(7)
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a, b)


def test_shuffle_rejects_bad_buffer_size():
    with pytest.raises(ValueError, match="buffer_size"):
        Dataset.range(3).shuffle(0)


# --- repeat / take ----------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_repeat_and_take(schedule):
    ds = make(np.arange(5), schedule)
    assert ints(ds.repeat(3)) == list(range(5)) * 3
    assert ints(ds.repeat(0)) == []
    assert ints(ds.repeat().take(12)) == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert ints(ds.take(3)) == [0, 1, 2]
    assert ints(ds.take(99)) == list(range(5))
    assert ints(ds.take(0)) == []
    assert ints(ds.take(-1)) == list(range(5))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_batch_spans_repeat_epochs(schedule):
    batches = list(make(np.arange(5), schedule).repeat(2).batch(4))
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 0, 1, 2], [3, 4]]


def test_shuffle_then_repeat_reshuffles_each_repetition():
    ds = Dataset.from_tensor_slices(np.arange(50)).shuffle(50, seed=1).repeat(2)
    order = ints(ds)
    assert sorted(order[:50]) == sorted(order[50:]) == list(range(50))
    assert order[:50] != order[50:]


def test_repeat_forever_of_nothing_ends():
    assert ints(Dataset.range(0).repeat()) == []
    assert ints(Dataset.from_tensor_slices(np.arange(0)).repeat()) == []


# --- cache ------------------------------------------------------------------------------

def test_cache_runs_map_once_then_replays():
    calls = []

    def traced(x):
        calls.append(int(x))
        return x * 2

    ds = Dataset.range(6).map(traced).cache()
    assert ints(ds) == [0, 2, 4, 6, 8, 10]
    assert ints(ds) == [0, 2, 4, 6, 8, 10]
    assert calls == list(range(6))    # the second epoch came from the cache


def test_cache_discards_a_partial_epoch():
    calls = []
    ds = Dataset.range(6).map(lambda x: calls.append(1) or x).cache()
    assert ints(ds.take(2)) == [0, 1]
    assert ints(ds) == list(range(6))  # refilled from the start
    assert ints(ds) == list(range(6))
    assert len(calls) == 2 + 6


def test_cache_of_ragged_elements_still_replays():
    ds = Dataset.range(4).map(lambda i: np.arange(int(i))).cache()
    first = [e.tolist() for e in ds]
    assert [e.tolist() for e in ds] == first == [[], [0], [0, 1], [0, 1, 2]]
    assert sorted(len(e) for e in ds.shuffle(4, seed=0)) == [0, 1, 2, 3]


def test_cache_to_a_file_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="cache\\(\\)"):
        Dataset.range(3).cache("/tmp/somewhere")


# --- len / cardinality / prefetch ------------------------------------------------------

def test_len_and_cardinality():
    ds = Dataset.range(10)
    assert len(ds) == ds.cardinality() == 10
    assert len(ds.batch(3)) == 4 and len(ds.batch(3, drop_remainder=True)) == 3
    assert len(ds.repeat(2).take(15)) == 15
    assert len(ds.shuffle(4).prefetch(data.AUTOTUNE).map(lambda x: x).cache()) == 10
    assert ds.repeat().cardinality() == data.INFINITE_CARDINALITY == -1
    assert ds.repeat().take(7).cardinality() == 7
    assert bool(ds.repeat())          # truthiness must not call len()
    with pytest.raises(TypeError, match="infinite"):
        len(ds.repeat())


def test_prefetch_accepts_autotune_and_passes_through():
    assert data.AUTOTUNE == data.experimental.AUTOTUNE == -1
    assert ints(Dataset.range(4).prefetch(data.AUTOTUNE)) == [0, 1, 2, 3]
    assert ints(Dataset.range(4).prefetch(2)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="prefetch"):
        Dataset.range(4).prefetch(-5)


def test_each_iter_is_a_fresh_epoch():
    ds = Dataset.range(3)
    it = iter(ds)
    assert int(next(it)) == 0
    assert ints(ds) == [0, 1, 2]      # a second iterator starts over
    assert int(next(it)) == 1         # and the first one carries on


# --- speed: the lab pipeline ------------------------------------------------------------

def test_lab_pipeline_cached_epochs_are_fresh_permutations(rng):
    """The lab's `map(scale).cache().shuffle(10000).batch(64)`: after the first epoch
    fills the cache (stacked arrays, index shuffles), every epoch still yields each
    image exactly once, scaled, in a new order. (Its speed is measured by
    `python -m benchmarks.training`, not asserted here.)"""
    n = 6000
    images = rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8)
    labels = np.arange(n)                       # labels identify the rows

    def scale(image, label):
        image = image.astype(np.float32)
        image /= 255
        return image, label

    ds = (Dataset.from_tensor_slices((images, labels)).map(scale).cache()
          .shuffle(1000).batch(64).prefetch(data.AUTOTUNE))
    orders = []
    for _ in range(3):
        xs, ys = zip(*ds)
        y = np.concatenate(ys)
        assert sorted(y.tolist()) == list(range(n))
        x = np.concatenate(xs)
        assert x.dtype == np.float32
        np.testing.assert_array_equal(x, images[y].astype(np.float32) / 255)
        orders.append(y)
    assert not np.array_equal(orders[1], orders[2]), "reshuffled each epoch"


@pytest.mark.parametrize("n, buffer_size", [(0, 3), (1, 1), (5, 9), (37, 37), (100, 1), (300, 7), (9000, 4100), (12000, 2)])
def test_the_row_shuffle_gives_the_element_shuffles_order(rng, n, buffer_size):
    """The index plan's shuffle (NumPy, a loop over ints) against the element one, on the
    same seed, with the rows handed over in awkward chunks: the same order, row for row."""
    from mirrored import data
    rows = rng.permutation(n + 5)[:n].astype(np.int64)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(4, max(n - 1, 0)), replace=False)) if n > 1 else []
    chunks = [c for c in np.split(rows, cuts)]
    seed = int(rng.integers(1 << 30))
    want = list(data._buffer_shuffle(rows.tolist(), buffer_size, np.random.default_rng(seed)))
    got = list(data._buffer_shuffle_rows(iter(chunks), buffer_size, np.random.default_rng(seed)))
    assert all(g.dtype == np.int64 for g in got)
    assert (np.concatenate(got).tolist() if got else []) == want
