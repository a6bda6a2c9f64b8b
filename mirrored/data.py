"""mirrored.data — a small tf.data: input pipelines over NumPy values.

What: `Dataset` with TensorFlow's names and semantics, so the course's MNIST lab
pipeline runs unchanged with `tf` replaced by `mirrored`:

    ds = ds_train.map(scale).cache().shuffle(10000).batch(64).prefetch(mirrored.data.AUTOTUNE)
    for images, labels in ds: ...            # every iter() is a fresh epoch

Elements are NumPy values: arrays, scalars, and tuples or dicts of them ("structures").
`for x in ds` hands them out as `tensor.HostTensor`s (NumPy arrays that answer `.numpy()`
and print as TF's eager tensors); `map` functions and `as_numpy_iterator` get plain NumPy.
`from_tensor_slices` slices along axis 0 (`from_tensors` keeps one whole element,
`from_generator` calls a generator), `map` calls a Python function per element,
`shuffle` is TF's *buffer* shuffle, `batch` stacks components along a new axis 0.
`element_spec` describes an element (`TensorSpec`s); `Options`/`with_options` are
accepted and recorded (see `Options` for what each changes here).

Why it is shaped like this — two ways to run one pipeline:

1. Element by element (`_generate`): each dataset pulls elements from its input,
   exactly as tf.data's iterators do. Always correct, but in Python every element
   costs microseconds, and a 60,000-image epoch pays that 60,000 times.
2. By index (`_index_plan`): when the elements are rows of arrays we already hold
   (`from_tensor_slices`, or a `cache()` that has been filled), a dataset can describe
   its epoch as a stream of *row numbers* instead of elements. `shuffle` permutes the
   row numbers (the same buffer algorithm, the same random draws, on ints),
   `repeat`/`take` cut and join the stream, and `batch` turns each run of 64 row
   numbers into one NumPy gather. A cached MNIST epoch is then a few tens of ms.

Both ways give the same elements in the same order (tests check it); the second is
only a faster schedule for the first.

Neighbours: mirrored/datasets.py loads MNIST into a `Dataset`;
`strategy.experimental_distribute_dataset` (mirrored/distribute) iterates our batches
and splits each global batch across the replicas.
"""
import enum
import itertools
import types

import numpy as np

from kernels.launch import ceil_div
from mirrored import random as _random
from mirrored.tensor import HostTensor, TensorSpec

AUTOTUNE = -1              # tf.data.AUTOTUNE: "let the runtime choose" (prefetch accepts it)
INFINITE_CARDINALITY = -1  # tf.data.INFINITE_CARDINALITY
UNKNOWN_CARDINALITY = -2   # tf.data.UNKNOWN_CARDINALITY

# TF keeps these under tf.data.experimental too; old course notebooks use that spelling.
experimental = types.SimpleNamespace(AUTOTUNE=AUTOTUNE,
                                     INFINITE_CARDINALITY=INFINITE_CARDINALITY,
                                     UNKNOWN_CARDINALITY=UNKNOWN_CARDINALITY)

_CHUNK = 4096  # row numbers handed along per step of an index plan: big enough to be cheap


# ---------------------------------------------------------------------------------------
# Structures: an element is a leaf (array/scalar) or a tuple/dict of structures.
# ---------------------------------------------------------------------------------------

def _map_structure(fn, *structures):
    """Apply fn leaf-wise to structures of the same shape (tf.nest.map_structure)."""
    first = structures[0]
    if isinstance(first, tuple):
        if not all(isinstance(s, tuple) and len(s) == len(first) for s in structures):
            raise ValueError(f"elements differ in structure: {_describe(structures)}")
        parts = [_map_structure(fn, *group) for group in zip(*structures)]
        return type(first)(*parts) if hasattr(first, "_fields") else tuple(parts)  # namedtuple
    if isinstance(first, dict):
        if not all(isinstance(s, dict) and s.keys() == first.keys() for s in structures):
            raise ValueError(f"elements differ in structure: {_describe(structures)}")
        return {key: _map_structure(fn, *(s[key] for s in structures)) for key in first}
    return fn(*structures)


def _leaves(structure):
    """The leaves of a structure, in _map_structure's order."""
    out = []
    _map_structure(out.append, structure)
    return out


def _describe(structures):
    shown = ", ".join(repr(type(s).__name__) for s in structures[:4])
    return f"[{shown}{', ...' if len(structures) > 4 else ''}]"


# The types _to_numpy hands back unchanged: NumPy's own arrays and scalars (np.float32(1.),
# what indexing a 1-D array gives). An exact type test: a subclass may answer .numpy().
_NUMPY_LEAF_TYPES = frozenset({np.ndarray, *np.sctypeDict.values()})


def _is_numpy_tuple(element):
    """True for a plain tuple of NumPy leaves, the usual (image, label): the fast paths below
    (``_numpy_element``, ``_stack_elements``, ``_StackedRows.play``) take it whole, with no
    ``_map_structure`` recursion (~4 µs an element in Python) and the same result."""
    if type(element) is not tuple:
        return False
    for leaf in element:
        if type(leaf) not in _NUMPY_LEAF_TYPES:
            return False
    return True


def _numpy_element(element):
    """``_map_structure(_to_numpy, element)``: what a map() function returned, as NumPy."""
    if _is_numpy_tuple(element):         # every leaf would come back unchanged
        return element
    return _map_structure(_to_numpy, element)


def _to_numpy(value):
    """A leaf as a NumPy value; Python numbers get TF's default dtypes (float32, int32)."""
    if hasattr(value, "numpy"):          # a mirrored.Tensor (or anything Tensor-like)
        value = value.numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        return value
    array = np.asarray(value)
    if array.dtype == np.float64:        # tf.constant(0.5).dtype is float32
        return array.astype(np.float32)
    if array.dtype == np.int64 and array.size and np.abs(array).max() < 2**31:
        return array.astype(np.int32)    # tf.constant(3).dtype is int32
    return array


def _stack_arrays(arrays):
    """np.stack(arrays) for many small same-shape arrays, checked like TF's batch.

    Leaves are NumPy values (arrays or NumPy scalars), so .shape and .dtype are there.
    Fast path: when every leaf has the first one's dtype (the very object: one cheap test
    each), ``np.array`` stacks the list in C, and refuses ragged shapes itself. The cache's
    stack of 60,000 MNIST images: ~1.4 µs an image against the loop's ~1.6 (~1.65 against
    ~2.6 with nothing else running); a batch of 64 images fresh from a 10,000-element shuffle
    buffer costs ~2 µs an image either way (reading them from memory is most of it).
    Anything else (mixed dtypes, ragged shapes, object arrays) goes to the loop, which says
    what differs.
    """
    shape, dtype = arrays[0].shape, arrays[0].dtype
    if not dtype.hasobject and all([getattr(array, "dtype", None) is dtype for array in arrays]):
        try:
            out = np.array(arrays)                        # out: (n, *shape)
        except ValueError:                                # ragged: the loop names the shapes
            out = None
        if out is not None and out.shape == (len(arrays),) + shape and out.dtype == dtype:
            return out
    out = np.empty((len(arrays),) + shape, dtype)        # out: (n, *shape)
    for i, array in enumerate(arrays):
        if not isinstance(array, (np.ndarray, np.generic)):  # a later element nests deeper
            raise ValueError(f"cannot stack a {type(array).__name__} where the first element has "
                             f"a {dtype}{list(shape)} value (the elements differ in structure)")
        if array.shape != shape or array.dtype != dtype:
            raise ValueError(f"cannot stack a {array.dtype}{list(array.shape)} element "
                             f"onto {dtype}{list(shape)} elements")
        out[i] = array
    return out


def _stack_elements(elements):
    """``_map_structure(lambda *xs: _stack_arrays(xs), *elements)``: one stacked array per
    leaf. Plain tuples of NumPy leaves, all of one length, go column by column directly
    (what the recursion would do, without checking 64 structures at every level)."""
    first = elements[0]
    if _is_numpy_tuple(first) and all([type(e) is tuple and len(e) == len(first) for e in elements]):
        return tuple([_stack_arrays(column) for column in zip(*elements)])
    return _map_structure(lambda *xs: _stack_arrays(xs), *elements)


def _stack(elements):
    """Stack same-structure elements into one batch element (what batch() emits)."""
    try:
        return _stack_elements(elements)
    except ValueError as error:
        raise ValueError(
            f"batch() stacks elements, so they must share structure, shape and dtype: "
            f"{error}. Resize, pad or cast the elements in a map() first "
            f"(padded_batch is not implemented here).") from error


# ---------------------------------------------------------------------------------------
# Rows: elements we hold in memory, addressed by row number (the index plans' source).
# ---------------------------------------------------------------------------------------

class _StackedRows:
    """Elements that are the rows of stacked arrays: element i is `columns[...][i]`.

    The arrays are read-only, so a map function that writes into its input in place
    (`image /= 255` on an array it did not create) fails loudly instead of silently
    changing the data for every later epoch.
    """

    def __init__(self, columns):
        self.columns = columns          # a structure of arrays sharing axis 0
        for array in _leaves(columns):
            array.flags.writeable = False
        self.count = len(_leaves(columns)[0])

    def row(self, i):
        return _map_structure(lambda array: array[i], self.columns)

    def play(self, chunks):
        """The elements at an index plan's row numbers, one by one: ``self.row(i)`` for each.

        Columns that are a plain tuple of arrays (the usual (images, labels)) are read by
        ``zip`` over one ``map(column.__getitem__, ...)`` per column: the indexing, the tuple
        and the loop all run in C, ~0.3 µs an element where ``row`` takes ~4."""
        columns = self.columns
        if isinstance(columns, np.ndarray):                   # one array: element i is its row i
            return map(columns.__getitem__, _row_numbers(chunks))
        if type(columns) is not tuple or not all(isinstance(c, np.ndarray) for c in columns):
            return (self.row(i) for i in _row_numbers(chunks))  # namedtuples, dicts, nesting
        return itertools.chain.from_iterable(
            zip(*[map(column.__getitem__, numbers) for column in columns])
            for numbers in (chunk.tolist() for chunk in chunks))

    def gather(self, rows):             # rows: (k,) int64 → structure of (k, ...) arrays
        return _map_structure(lambda array: array.take(rows, axis=0), self.columns)


class _ListRows:
    """Elements kept as a Python list (when they cannot be stacked, e.g. ragged shapes)."""

    def __init__(self, elements):
        self.elements = elements
        self.count = len(elements)

    def row(self, i):
        return self.elements[i]

    def play(self, chunks):
        return map(self.elements.__getitem__, _row_numbers(chunks))

    def gather(self, rows):
        return _stack([self.elements[i] for i in rows.tolist()])


def _rows_from_elements(elements):
    """Store a finished cache: stacked when every element has one structure and shape."""
    if elements:
        try:
            return _StackedRows(_stack_elements(elements))
        except ValueError:               # ragged shapes or mixed structures
            pass
    return _ListRows(elements)


# Index plans are (rows, chunks): `chunks` yields int64 arrays of row numbers that,
# concatenated, are this epoch's elements in order. These helpers reshape the stream.

def _in_order(count):
    """Rows 0 .. count-1, chunked: the plan of a dataset that plays what it holds."""
    return (np.arange(start, min(start + _CHUNK, count), dtype=np.int64)
            for start in range(0, count, _CHUNK))


def _row_numbers(chunks):
    """The plan's row numbers one by one, as Python ints."""
    return itertools.chain.from_iterable(chunk.tolist() for chunk in chunks)


def _rechunk(chunks, size):
    """Regroup a stream of index arrays into arrays of exactly `size` (last may be short)."""
    pending, pending_count = [], 0
    for chunk in chunks:
        while len(chunk):
            piece = chunk[:size - pending_count]
            chunk = chunk[len(piece):]
            pending.append(piece)
            pending_count += len(piece)
            if pending_count == size:
                yield np.concatenate(pending)
                pending, pending_count = [], 0
    if pending_count:
        yield np.concatenate(pending)


# ---------------------------------------------------------------------------------------
# The buffer shuffle (shared by both schedules, so both give the same order).
# ---------------------------------------------------------------------------------------

_END = object()  # marks the end of an input iterator


def _uniforms(rng):
    """Uniform floats in [0, 1), drawn in blocks: the same sequence however it is consumed."""
    while True:
        yield from rng.random(_CHUNK).tolist()


def _buffer_shuffle(items, buffer_size, rng):
    """Yield `items` in tf.data's shuffle order.

    Fill a buffer with the first buffer_size items; then repeatedly emit a uniformly
    chosen buffer slot and refill that slot with the next input item. When the input
    runs out, keep emitting random slots until the buffer is empty.

    Consequences students should know: buffer_size=1 changes nothing; a buffer at
    least as large as the data gives a uniform random permutation; with a small buffer
    item i cannot come out before position i - (buffer_size - 1) (it is not read yet),
    so shuffling sorted data with a small buffer leaves it nearly sorted.
    """
    items = iter(items)
    buffer = list(itertools.islice(items, buffer_size))
    uniforms = _uniforms(rng)
    while buffer:
        slot = int(next(uniforms) * len(buffer))   # uniform over the buffer
        yield buffer[slot]
        refill = next(items, _END)       # read the next input only now, as TF does
        if refill is not _END:
            buffer[slot] = refill
        else:                            # input done: move the last item into the hole
            buffer[slot] = buffer[-1]
            buffer.pop()


def _buffer_shuffle_rows(chunks, buffer_size, rng):
    """``_buffer_shuffle`` of an index plan's row numbers, as chunks: the same order (the same
    uniforms, drawn in the same blocks), with no Python loop over the refill phase
    (``_shuffle_refill``, NumPy) and a loop over plain ints for the drain (``_shuffle_drain``).
    The lab's ``shuffle(10000).batch(64)`` spent ~1.5 µs of Python per image in the element
    loop: a quarter of a captured GPU step's host time (benchmarks/host_profile.py).

    Why not ``numba.njit``, which did this before: the first compiled call of a process
    sets up numba's CPU compiler (its typing registries, LLVM), 0.2-0.9 s even with the
    compiled code on disk, and it landed in the lab's *second* epoch (the first to shuffle
    by row number). That alone made epoch 2 0.2 s longer than the others on the H200, and
    made ``fit(verbose=0)``, measured first in benchmarks/host_profile.py, look twice as
    slow as ``verbose=1`` (issue 40). NumPy costs ~0.1 µs per row instead, every epoch."""
    buffer = np.empty(buffer_size, np.int64)
    filled = 0
    uniforms = np.empty(0)
    for chunk in chunks:
        take = min(buffer_size - filled, len(chunk))          # 1. fill the buffer
        buffer[filled:filled + take] = chunk[:take]
        filled += take
        rest = chunk[take:]
        if len(rest):                                          # 2. one out per one in
            while len(uniforms) < len(rest):
                uniforms = np.concatenate([uniforms, rng.random(_CHUNK)])
            yield _shuffle_refill(buffer, np.asarray(rest, np.int64), uniforms[:len(rest)])
            uniforms = uniforms[len(rest):]
    while len(uniforms) < filled:                              # 3. the input ran out: drain
        uniforms = np.concatenate([uniforms, rng.random(_CHUNK)])
    if filled:
        yield _shuffle_drain(buffer[:filled], uniforms[:filled])


def _shuffle_refill(buffer, inputs, uniforms):
    """For each input i: emit slot ``int(u_i * size)`` of the (full) buffer, refill it with
    input i. Updates ``buffer``; returns what came out, (len(inputs),) int64.

    No loop: the slots do not depend on what is in them (the buffer stays full), so what
    step i emits is known in advance: the input written into its slot by the last earlier
    step that chose the same slot, or the slot's first occupant if none did. Sorting the
    steps by slot (stably, so in time order within a slot) puts each step right after that
    last earlier one."""
    size, m = len(buffer), len(inputs)
    slots = (uniforms * size).astype(np.int64)               # int(u * size): u >= 0 truncates alike
    key = slots * m + np.arange(m)                            # unique: slot first, then time
    key.sort()                                                # (a plain sort: 5x a stable argsort's speed)
    order, by_slot = key % m, key // m                        # steps by slot, in time order per slot
    first = np.ones(m, bool)                                  # the first step to choose its slot
    first[1:] = by_slot[1:] != by_slot[:-1]
    before = inputs[order[np.maximum(np.arange(m) - 1, 0)]]   # input of the previous step in order
    out = np.empty(m, np.int64)
    out[order] = np.where(first, buffer[by_slot], before)
    last = np.ones(m, bool)                                   # the last step to choose its slot
    last[:-1] = by_slot[1:] != by_slot[:-1]
    buffer[by_slot[last]] = inputs[order[last]]               # what each slot holds now
    return out


def _shuffle_drain(buffer, uniforms):
    """No input left: emit slot ``int(u_k * n_left)``, move the last item into it, shrink.
    Returns what came out, (len(buffer),) int64. Each step depends on the last one's move,
    so this one is a loop, over Python ints (~0.2 µs a row)."""
    items = buffer.tolist()
    slots = (uniforms * np.arange(len(items), 0, -1)).astype(np.int64).tolist()
    out = []
    for slot in slots:
        out.append(items[slot])
        items[slot] = items[-1]
        items.pop()
    return np.array(out, np.int64)


# ---------------------------------------------------------------------------------------
# Dataset: the public API (TF's names).
# ---------------------------------------------------------------------------------------

class Dataset:
    """A sequence of elements, re-iterable: each `iter(ds)` is a fresh epoch.

    Build one with `Dataset.from_tensor_slices` or `Dataset.range`, then chain
    transformations; each returns a new Dataset that reads from this one.
    Subclasses implement `_generate` (element by element), `_cardinality`, and may
    implement `_index_plan` (the fast schedule described in the module docstring).
    """

    # --- sources -------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors):
        """One element per index along axis 0 of every array in `tensors`.

        `tensors` is an array, or a tuple/dict (nested allowed) of arrays that all have
        the same length: `from_tensor_slices((images, labels))` → `(image, label)` elements.
        """
        return _TensorSliceDataset(tensors)

    @staticmethod
    def from_tensors(tensors, name=None):
        """One element: ``tensors`` whole (an array, or a tuple/dict of them), as TF's
        ``from_tensors``; ``from_tensors(([1.], [1.])).repeat(100).batch(10)`` gives ten
        (10, 1) batches. Held as a row, so it shuffles, batches and stays resident as fast
        as ``from_tensor_slices``."""
        return _TensorSliceDataset(_map_structure(lambda leaf: np.asarray(_to_numpy(leaf))[np.newaxis],
                                                  tensors))

    @staticmethod
    def from_generator(generator, output_types=None, output_shapes=None, args=None,
                       output_signature=None, name=None):
        """Elements from ``generator()`` (called afresh for each epoch, with ``args``), each
        checked against ``output_signature`` (a structure of ``TensorSpec``; ``None`` in a
        shape accepts any size) and converted to its dtype, as TF's ``from_generator``.
        ``output_types``/``output_shapes`` (TF's older spelling) work too."""
        if not callable(generator):
            raise TypeError(f"from_generator needs a callable that returns an iterator (the "
                            f"generator function itself, not a generator), got {generator!r}.")
        if output_signature is None:
            if output_types is None:
                raise TypeError("from_generator needs output_signature=(a structure of "
                                "mirrored.TensorSpec) (or output_types).")
            shapes = output_shapes if output_shapes is not None else \
                _map_structure(lambda _: None, output_types)
            output_signature = _map_structure(lambda t, s: TensorSpec(s, t), output_types, shapes)
        return _GeneratorDataset(generator, tuple(args or ()), output_signature)

    @staticmethod
    def range(*args, output_type=np.int64):
        """Like Python's range(stop) / range(start, stop[, step]); int64 scalar elements."""
        return _RangeDataset(range(*args), np.dtype(output_type))

    # --- transformations -------------------------------------------------------------
    def map(self, map_func, num_parallel_calls=None, deterministic=None, name=None):
        """Apply map_func to each element; a tuple element is unpacked into arguments.

        `ds.map(lambda image, label: ...)` works on `(image, label)` elements, as in TF;
        a dict element is passed as one argument. Runs in this thread, in order
        (num_parallel_calls and deterministic are accepted for compatibility).
        """
        return _MapDataset(self, map_func)

    def filter(self, predicate, name=None):
        """Keep the elements for which predicate (unpacked like map) is true."""
        return _FilterDataset(self, predicate)

    def cache(self, filename="", name=None):
        """Remember the elements of the first complete epoch; later epochs replay them."""
        if filename:
            raise NotImplementedError(
                "cache(filename) (a cache on disk) is not implemented; use cache() to "
                "keep the elements in memory.")
        return _CacheDataset(self)

    def shuffle(self, buffer_size, seed=None, reshuffle_each_iteration=True, name=None):
        """TF's buffer shuffle (see _buffer_shuffle). Use buffer_size >= len(ds) for a
        full shuffle. The same seed gives the same sequence of epochs; each epoch is
        reshuffled unless reshuffle_each_iteration=False."""
        return _ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def batch(self, batch_size, drop_remainder=False, num_parallel_calls=None,
              deterministic=None, name=None):
        """Stack runs of batch_size elements; the last batch may be short unless
        drop_remainder=True drops it."""
        return _BatchDataset(self, batch_size, drop_remainder)

    def repeat(self, count=None, name=None):
        """Play the dataset count times (None or -1: forever), a fresh epoch each time."""
        return _RepeatDataset(self, count)

    def take(self, count, name=None):
        """The first count elements (-1: all)."""
        return _TakeDataset(self, count)

    def enumerate(self, start=0, name=None):
        """``(i, element)`` pairs, ``i`` an int64 counting from ``start`` (TF's ``enumerate``)."""
        return _EnumerateDataset(self, int(start))

    def with_options(self, options, name=None):
        """This dataset with ``options`` (a ``mirrored.data.Options``) merged into its own.

        Every option is accepted; what each changes here is on ``Options``."""
        if not isinstance(options, Options):
            raise TypeError(f"with_options takes a mirrored.data.Options(), got {options!r}.")
        return _OptionsDataset(self, options)

    def options(self):
        """The ``Options`` in force (TF's ``Dataset.options()``)."""
        return Options()

    @property
    def element_spec(self):
        """The structure of ``TensorSpec`` of one element (TF's ``element_spec``)."""
        return self._element_spec()

    def shard(self, num_shards, index, name=None):
        """Every num_shards-th element, starting at element ``index`` (TF's ``shard``): the
        usual way to give each worker its own part of the input
        (``ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)`` in
        ``distribute_datasets_from_function``)."""
        num_shards, index = int(num_shards), int(index)
        if num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(f"shard(num_shards={num_shards}, index={index}): need num_shards >= 1 "
                             f"and 0 <= index < num_shards.")
        return _ShardDataset(self, num_shards, index)

    def prefetch(self, buffer_size, name=None):
        """Accepted for compatibility (AUTOTUNE too); a pass-through here.

        tf.data prefetches on background threads. Here a cached epoch costs one NumPy
        gather per batch, so a thread would have nothing worth overlapping, and Python's
        GIL would serialise a map() anyway.
        """
        return _PrefetchDataset(self, buffer_size)

    # --- inspection ------------------------------------------------------------------
    def cardinality(self):
        """Number of elements; INFINITE_CARDINALITY (-1) or UNKNOWN_CARDINALITY (-2)."""
        return self._cardinality()

    def __len__(self):
        n = self._cardinality()
        if n == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if n == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown.")
        return n

    def __bool__(self):
        return True   # as TF: truth must not call __len__ (which fails on infinite data)

    def __iter__(self):
        """A fresh epoch. Each element's arrays come as ``HostTensor``s: NumPy arrays that
        also answer ``.numpy()`` and print as TensorFlow's eager tensors do."""
        return (_as_tensors(e) for e in self._elements())

    def _elements(self):
        """A fresh epoch of plain NumPy elements: what the transformations pass along."""
        plan = self._index_plan()
        if plan is None:
            return iter(self._generate())
        rows, chunks = plan
        return rows.play(chunks)

    def as_numpy_iterator(self):
        """As TF: the elements as plain NumPy values."""
        return self._elements()

    def __repr__(self):
        n = self._cardinality()
        shown = {INFINITE_CARDINALITY: "infinite", UNKNOWN_CARDINALITY: "unknown"}.get(n, n)
        return f"<{type(self).__name__} cardinality={shown}>"

    # --- what subclasses provide --------------------------------------------------------
    def _generate(self):
        """A generator over this epoch's elements (the element-by-element schedule)."""
        raise NotImplementedError

    def _cardinality(self):
        raise NotImplementedError

    def _element_spec(self):
        """Default: this dataset's input's spec (pass-through transformations)."""
        return self._input._element_spec()

    def _index_plan(self):
        """(rows, chunks) if this epoch is a stream of rows we hold, else None.

        Must have no side effects when it returns None, so callers can ask first and
        fall back to `_generate`.
        """
        return None


def _as_tensors(element):
    """An element's arrays as HostTensors (a flat tuple, the usual (image, label), directly)."""
    if type(element) is tuple and all(isinstance(leaf, (np.ndarray, np.generic)) for leaf in element):
        return tuple(np.asarray(leaf).view(HostTensor) for leaf in element)
    return _map_structure(HostTensor.wrap, element)


def _call_unpacked(fn, element):
    """TF's calling convention for map/filter: a tuple element is spread into arguments."""
    return fn(*element) if isinstance(element, tuple) else fn(element)


def _positive_int(value, what):
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{what} must be a positive integer; got {value!r}.")
    return int(value)


# --- sources -------------------------------------------------------------------------

class _TensorSliceDataset(Dataset):
    def __init__(self, tensors):
        # Copy, as TF does when it makes a constant: later edits to the caller's arrays
        # must not change the dataset.
        columns = _map_structure(lambda leaf: np.array(_to_numpy(leaf)), tensors)
        leaves = _leaves(columns)
        if not leaves:
            raise ValueError("from_tensor_slices needs at least one array.")
        if any(leaf.ndim == 0 for leaf in leaves):
            raise ValueError("from_tensor_slices slices along axis 0, so every component "
                             "needs at least one dimension; got a scalar. Use an array.")
        lengths = [len(leaf) for leaf in leaves]
        if len(set(lengths)) > 1:
            raise ValueError(f"from_tensor_slices: all components must have the same "
                             f"length along axis 0 (one element per index); got lengths "
                             f"{lengths}.")
        self._rows = _StackedRows(columns)

    def _cardinality(self):
        return self._rows.count

    def _element_spec(self):
        return _map_structure(lambda a: TensorSpec(a.shape[1:], a.dtype), self._rows.columns)

    def _index_plan(self):               # always there: our elements are rows we hold
        return self._rows, _in_order(self._rows.count)


class _RangeDataset(Dataset):
    def __init__(self, values, dtype):
        self._values, self._dtype = values, dtype

    def _cardinality(self):
        return len(self._values)

    def _generate(self):
        return (self._dtype.type(v) for v in self._values)

    def _element_spec(self):
        return TensorSpec((), self._dtype)


# --- element-wise transformations ----------------------------------------------------

class _MapDataset(Dataset):
    def __init__(self, input_dataset, map_func):
        self._input, self._fn = input_dataset, map_func

    def _cardinality(self):
        return self._input._cardinality()

    def _generate(self):
        for element in self._input._elements():
            yield _numpy_element(_call_unpacked(self._fn, element))

    def _element_spec(self):             # TF traces the function; we look at its first result
        first = next(self._elements(), None)
        if first is None:
            raise ValueError("element_spec of an empty mapped dataset is not known here.")
        specs = _map_structure(TensorSpec.from_value, first)
        batched = all(len(s.shape) and s.shape[0] is None for s in _leaves(self._input._element_spec()))
        if batched:                      # a batch's size varies: keep its axis unknown, as TF
            specs = _map_structure(lambda s: TensorSpec((None,) + tuple(s.shape)[1:], s.dtype)
                                   if len(s.shape) else s, specs)
        return specs


class _FilterDataset(Dataset):
    def __init__(self, input_dataset, predicate):
        self._input, self._predicate = input_dataset, predicate

    def _cardinality(self):
        n = self._input._cardinality()
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    def _generate(self):
        return (e for e in self._input._elements() if bool(_call_unpacked(self._predicate, e)))


class _ShardDataset(Dataset):
    def __init__(self, input_dataset, num_shards, index):
        self._input, self._num_shards, self._index = input_dataset, num_shards, index

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n                    # infinite or unknown stays so
        return n // self._num_shards + (1 if self._index < n % self._num_shards else 0)

    def _generate(self):
        return itertools.islice(self._input._elements(), self._index, None, self._num_shards)


class _CacheDataset(Dataset):
    """First complete epoch: pass elements through and keep them. After: replay rows.

    An epoch abandoned half way keeps nothing (TF also discards a partial cache), so
    `ds.cache().take(5)` never caches more than it has seen.
    """

    def __init__(self, input_dataset):
        self._input = input_dataset
        self._rows = None                # set once a full epoch has been seen

    def _cardinality(self):
        return self._input._cardinality()

    def _index_plan(self):
        if self._rows is None:
            return None
        return self._rows, _in_order(self._rows.count)

    def _generate(self):
        elements = []
        for element in self._input._elements():
            elements.append(element)
            yield element
        if self._rows is None:           # the input ran to its end: the cache is complete
            self._rows = _rows_from_elements(elements)


class _ShuffleDataset(Dataset):
    def __init__(self, input_dataset, buffer_size, seed, reshuffle_each_iteration):
        self._input = input_dataset
        self._buffer_size = _positive_int(buffer_size, "shuffle buffer_size")
        # Seeds as TensorFlow's: from the global seed (mirrored.random.set_seed) and the op
        # seed, so a seeded program shuffles alike in every run; with neither, fresh
        # entropy, drawn once, so reshuffle_each_iteration=False still repeats one order
        # across epochs (as TF does).
        self._seed = _random.get_seed(seed) or [np.random.SeedSequence().entropy]
        self._reshuffle = bool(reshuffle_each_iteration)
        self._epochs = itertools.count()  # next() on a count is atomic under the GIL

    def _cardinality(self):
        return self._input._cardinality()

    def _epoch_rng(self):
        """The generator for the epoch now starting: seed + epoch number."""
        epoch = next(self._epochs) if self._reshuffle else 0
        return np.random.default_rng([*self._seed, epoch])

    def _index_plan(self):
        plan = self._input._index_plan()
        if plan is None:
            return None
        rows, chunks = plan
        return rows, _buffer_shuffle_rows(chunks, self._buffer_size, self._epoch_rng())

    def _generate(self):
        return _buffer_shuffle(self._input._elements(), self._buffer_size, self._epoch_rng())


class _BatchDataset(Dataset):
    def __init__(self, input_dataset, batch_size, drop_remainder):
        self._input = input_dataset
        self._batch_size = _positive_int(batch_size, "batch_size")
        self._drop_remainder = bool(drop_remainder)

    def _cardinality(self):
        n, b = self._input._cardinality(), self._batch_size
        if n < 0:
            return n
        return n // b if self._drop_remainder else ceil_div(n, b)

    def _element_spec(self):
        lead = self._batch_size if self._drop_remainder else None
        return _map_structure(lambda spec: TensorSpec((lead,) + tuple(spec.shape), spec.dtype),
                              self._input._element_spec())

    def _generate(self):
        plan = self._input._index_plan()
        if plan is not None:            # fast: one gather per batch
            rows, chunks = plan
            for batch_rows in _rechunk(chunks, self._batch_size):
                if len(batch_rows) < self._batch_size and self._drop_remainder:
                    return
                yield rows.gather(batch_rows)
            return
        elements = self._input._elements()    # element by element: collect, then stack
        while batch := list(itertools.islice(elements, self._batch_size)):
            if len(batch) < self._batch_size and self._drop_remainder:
                return
            yield _stack(batch)


class _RepeatDataset(Dataset):
    def __init__(self, input_dataset, count):
        self._input = input_dataset
        self._count = None if count is None or count == -1 else int(count)
        if self._count is not None and self._count < 0:
            raise ValueError(f"repeat count must be >= 0, or None/-1 for forever; got {count}.")

    def _cardinality(self):
        n = self._input._cardinality()
        if self._count == 0 or n == 0:
            return 0
        if self._count is None:
            return INFINITE_CARDINALITY if n != UNKNOWN_CARDINALITY else UNKNOWN_CARDINALITY
        return n * self._count if n >= 0 else n

    def _epochs(self):
        return itertools.count() if self._count is None else range(self._count)

    def _index_plan(self):
        if self._count == 0:
            return None
        first = self._input._index_plan()
        if first is None:
            return None
        rows = first[0]

        def chunks():
            plan = first
            for epoch in self._epochs():
                if epoch:                   # a fresh epoch of the input (reshuffled)
                    plan = self._input._index_plan()
                    assert plan[0] is rows, "a held dataset changed its rows between epochs"
                empty = True
                for chunk in plan[1]:
                    empty = empty and not len(chunk)
                    yield chunk
                if empty:                   # repeating nothing forever is nothing
                    return
        return rows, chunks()

    def _generate(self):
        for _ in self._epochs():
            empty = True
            for element in self._input._elements():
                empty = False
                yield element
            if empty:
                return


class _TakeDataset(Dataset):
    def __init__(self, input_dataset, count):
        self._input, self._count = input_dataset, int(count)

    def _cardinality(self):
        n = self._input._cardinality()
        if self._count < 0:
            return n
        if n == INFINITE_CARDINALITY:
            return self._count
        return n if n == UNKNOWN_CARDINALITY else min(n, self._count)

    def _index_plan(self):
        plan = self._input._index_plan()
        if plan is None or self._count < 0:
            return plan
        rows, chunks = plan[0], iter(plan[1])

        def first_rows():
            left = self._count
            while left:                 # never pull past what we need: the input may be infinite
                chunk = next(chunks, None)
                if chunk is None:
                    return
                yield chunk[:left]
                left -= len(chunk[:left])
        return rows, first_rows()

    def _generate(self):
        elements = self._input._elements()
        return elements if self._count < 0 else itertools.islice(elements, self._count)


class _PassThroughDataset(Dataset):
    """A dataset that yields its input's elements unchanged (prefetch, with_options)."""

    def _cardinality(self):
        return self._input._cardinality()

    def _index_plan(self):
        return self._input._index_plan()

    def _generate(self):
        return self._input._elements()


class _PrefetchDataset(_PassThroughDataset):
    def __init__(self, input_dataset, buffer_size):
        if buffer_size != AUTOTUNE and not (isinstance(buffer_size, int) and buffer_size >= 0):
            raise ValueError(f"prefetch buffer_size must be >= 0 or AUTOTUNE (-1); "
                             f"got {buffer_size!r}.")
        self._input = input_dataset


class _GeneratorDataset(Dataset):
    def __init__(self, generator, args, signature):
        self._generator, self._args = generator, args
        self._signature = _map_structure(lambda spec: spec if isinstance(spec, TensorSpec)
                                         else TensorSpec(None, spec), signature)

    def _cardinality(self):
        return UNKNOWN_CARDINALITY

    def _element_spec(self):
        return self._signature

    def _generate(self):
        for element in self._generator(*self._args):
            yield _map_structure(_conform, self._signature, element)


def _conform(spec, value):
    """``value`` as ``spec.dtype``, its shape checked against ``spec.shape`` (None: any)."""
    arr = np.asarray(_to_numpy(value))
    if arr.dtype != spec.dtype:
        converted = arr.astype(spec.dtype)
        if arr.dtype.kind in "fc" and spec.dtype.kind in "iub" and not np.array_equal(converted, arr):
            raise TypeError(f"from_generator: the generator yielded {arr.dtype} values, but the "
                            f"output_signature says {spec.dtype}; yield {spec.dtype} values.")
        arr = converted
    if not spec.shape.is_compatible_with(arr.shape):
        raise TypeError(f"from_generator: the generator yielded an element of shape {arr.shape}, "
                        f"which is not compatible with the output_signature's {spec.shape}.")
    return arr


class _EnumerateDataset(Dataset):
    def __init__(self, input_dataset, start):
        self._input, self._start = input_dataset, start

    def _cardinality(self):
        return self._input._cardinality()

    def _element_spec(self):
        return TensorSpec((), np.int64), self._input._element_spec()

    def _generate(self):
        return ((np.int64(i), e) for i, e in enumerate(self._input._elements(), self._start))


class _OptionsDataset(_PassThroughDataset):
    def __init__(self, input_dataset, options):
        self._input, self._options = input_dataset, options

    def options(self):
        return self._input.options().merge(self._options)


class AutoShardPolicy(enum.Enum):
    """``tf.data.experimental.AutoShardPolicy``: how a dataset is split between workers.

    Here every multi-worker dataset is split by DATA (each worker keeps its replicas'
    slices of every global batch: ``input_lib.local_bounds``), whatever the policy; the
    policy is recorded (``OFF``, ``FILE``, ``HINT`` change nothing). One worker: nothing to split."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class DistributeOptions:
    """``options.experimental_distribute``: ``auto_shard_policy`` (see ``AutoShardPolicy``)."""

    def __init__(self):
        self.auto_shard_policy = AutoShardPolicy.AUTO
        self.num_devices = None


class Options:
    """``tf.data.Options``: accepted and recorded; what each changes here:

    ``experimental_distribute.auto_shard_policy``: nothing (see ``AutoShardPolicy``);
    ``deterministic`` / ``experimental_deterministic``: nothing (every pipeline here is
    deterministic: one thread, in order); ``experimental_optimization``, ``threading``:
    nothing (there is no graph to optimise and no thread pool)."""

    _FIELDS = ("experimental_distribute", "deterministic", "experimental_deterministic",
               "experimental_optimization", "threading", "autotune", "experimental_slack",
               "experimental_external_state_policy", "experimental_symbolic_checkpoint",
               "experimental_warm_start")

    def __init__(self):
        self.experimental_distribute = DistributeOptions()
        self.experimental_optimization = types.SimpleNamespace()
        self.threading = types.SimpleNamespace(private_threadpool_size=None, max_intra_op_parallelism=None)
        self.autotune = types.SimpleNamespace(enabled=True)
        self.deterministic = self.experimental_deterministic = None

    def __setattr__(self, name, value):
        if name not in self._FIELDS:
            raise AttributeError(f"tf.data.Options has no option {name!r}; options here: {self._FIELDS}.")
        object.__setattr__(self, name, value)

    def merge(self, other):
        """A new Options: the settings ``other`` changed from the defaults, over this one's
        (TF's ``Options.merge``)."""
        merged, default = Options(), Options()
        for src in (self, other):
            for k in self._FIELDS:
                if k not in src.__dict__:
                    continue
                if k == "experimental_distribute":
                    for field, value in vars(src.experimental_distribute).items():
                        if value != getattr(default.experimental_distribute, field):
                            setattr(merged.experimental_distribute, field, value)
                elif src.__dict__[k] is not default.__dict__.get(k) and \
                        src.__dict__[k] != default.__dict__.get(k):
                    object.__setattr__(merged, k, src.__dict__[k])
        return merged


experimental.AutoShardPolicy = AutoShardPolicy
experimental.DistributeOptions = DistributeOptions


# --- a batched epoch as row numbers (for input_lib's resident data sets) ----------------

def index_batches(dataset):
    """This epoch of a batched ``mirrored.data.Dataset`` as row numbers: ``(rows, batches)``.

    ``rows`` holds the elements (``rows.columns``: a structure of arrays, one row per
    element); ``batches`` yields one int64 array of row numbers per batch, in the
    order the dataset would play them (the same shuffle draws). Returns
    ``(None, why)`` when the epoch is not a stream of held rows; asking has no side
    effect then, so the caller can iterate the dataset as usual instead.
    ``input_lib.DistributedDataset`` asks this to keep a data set on the devices.
    """
    while isinstance(dataset, _PrefetchDataset):
        dataset = dataset._input
    if not isinstance(dataset, _BatchDataset):
        return None, ("the dataset does not end in .batch(GLOBAL_BATCH_SIZE) (optionally "
                      "followed by .prefetch)")
    plan = dataset._input._index_plan()
    if plan is None:
        return None, ("its elements are not rows held in memory yet: start from "
                      "from_tensor_slices, or put .cache() after any map(); a cache is "
                      "filled by the first epoch, and the data is resident from the second")
    rows, chunks = plan
    if not isinstance(rows, _StackedRows):
        return None, "its elements differ in shape, so they cannot be stored as one array per device"
    size, drop = dataset._batch_size, dataset._drop_remainder

    def batches():
        for idx in _rechunk(chunks, size):       # idx: (<= size,) int64 row numbers
            if len(idx) < size and drop:
                return
            yield idx
    return rows, batches()
