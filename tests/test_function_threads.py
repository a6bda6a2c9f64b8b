"""``@tf.function`` with more than one thread, and TensorFlow's other function rules (issue 50).

Each test is one row of the issue's table, the TensorFlow column as the expectation:

* a trace records its own thread's device calls (and its ``strategy.run`` replica
  threads'), never another thread's: a data loader's or a notebook timer's work is not
  part of the function (mirrored/program/recording.py: the recorder is a per-thread slot the
  boundary's wrappers consult, ``backends.BOUNDARY``);
* concurrent calls of one function are safe, each with its own results, and the first
  call traces once (a lock per function, traced_function.py);
* a trace that raises leaves no effect (its changes rolled back), a Ctrl-C during a
  replay of a 2-replica step stops between two steps with the replicas bitwise equal;
* a returned variable is its value at that call; ``input_signature`` is checked for every
  kind of argument (TypeError); five traces in a row warn as TensorFlow does; NumPy arrays
  and a data set's batches are tensors (traced by shape and dtype, no eager fallback); a
  variable may be made on the first call only (TensorFlow's ValueError).

Thread tests make thousands of calls on CPU devices, a few seconds each.

    python -m pytest -n 0 -q tests/test_function_threads.py
"""
import signal
import sys
import threading
import warnings

import numpy as np
import pytest
from conftest import tutorial_train_step
from test_one_step import make_model

import mirrored as tf
from mirrored import traced_function

#: Calls per thread in the replay test: 2 threads x 2,500 = the issue's 5,000 calls.
CALLS_PER_THREAD = 2500
#: How long a thread waits for the other at a hand-off before the test fails (not hangs).
HANDOFF_S = 20


def _no_fallback():
    """A block where any warning (an EagerFallbackWarning above all) fails the test."""
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("error")
    return context


def _run_threads(targets):
    """Start one thread per target, join them; the first error any of them raised, re-raised."""
    errors = []

    def wrapped(fn):
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 (handed to the test)
            errors.append(err)
    threads = [threading.Thread(target=wrapped, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread did not finish"
    if errors:
        raise errors[0]


def test_two_threads_replaying_one_function_each_get_their_own_results(devices, rng):
    devices(cpus=1)
    with tf.device("CPU:0"):
        @tf.function
        def affine(x, w):
            return (x * w + 1.0) * 0.5 - x           # several launches: room for a race

        w = tf.constant(rng.standard_normal(7).astype(np.float32))
        inputs = [rng.standard_normal(7).astype(np.float32) for _ in range(2)]
        wrong = [0, 0]

        def caller(i):
            def run():
                with tf.device("CPU:0"):
                    x = tf.constant(inputs[i])
                    expected = (inputs[i] * w.numpy() + np.float32(1.0)) * np.float32(0.5) - inputs[i]
                    for _ in range(CALLS_PER_THREAD):
                        got = affine(x, w).numpy()
                        if not np.array_equal(got, expected):
                            wrong[i] += 1
            return run
        affine(tf.constant(inputs[0]), w)            # traced here: the threads replay
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)                  # switch threads often: races show at once
        try:
            _run_threads([caller(0), caller(1)])
        finally:
            sys.setswitchinterval(interval)
    assert wrong == [0, 0], f"calls that returned another call's result: {wrong} of {2 * CALLS_PER_THREAD}"
    assert affine.experimental_get_tracing_count() == 1


def test_another_threads_assign_while_tracing_is_not_part_of_the_function(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        w = tf.Variable(0.0)
        tracing, assigned = threading.Event(), threading.Event()

        @tf.function
        def step(x):
            tracing.set()
            assert assigned.wait(HANDOFF_S)           # the other thread's assign happens now
            return x + 1.0

        def other():
            assert tracing.wait(HANDOFF_S)
            w.assign_add(1.0)                        # a data loader's, a timer's work
            assigned.set()
        helper = threading.Thread(target=other)
        helper.start()
        one = tf.constant(1.0)
        results = [float(step(one)) for _ in range(4)]
        helper.join()
    assert results == [2.0] * 4
    assert float(w) == 1.0, "another thread's assign_add was recorded into the function and replayed"


def test_two_threads_making_the_first_call_trace_once_and_run_twice(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        v = tf.Variable(0.0)
        traced = []
        start = threading.Barrier(2)

        @tf.function
        def bump(x):
            traced.append(1)                         # Python: while tracing only
            threading.Event().wait(0.05)             # a slow trace: the other thread arrives meanwhile
            v.assign_add(x)
            return v.read_value()

        def caller():
            with tf.device("CPU:0"):
                one = tf.constant(1.0)
                start.wait(HANDOFF_S)
                for _ in range(3):
                    bump(one)
        _run_threads([caller, caller])
    assert bump.experimental_get_tracing_count() == 1 and len(traced) == 1
    assert float(v) == 6.0, "the body's effect ran a different number of times than it was called"


def test_a_host_read_on_another_thread_during_a_trace_does_not_make_it_eager(devices, rng):
    devices(cpus=1)
    with tf.device("CPU:0"):
        t = tf.constant(rng.standard_normal(3).astype(np.float32))
        tracing, read = threading.Event(), threading.Event()
        traced = []

        @tf.function
        def double(x):
            traced.append(1)
            tracing.set()
            assert read.wait(HANDOFF_S)
            return x * 2.0

        def reader():
            assert tracing.wait(HANDOFF_S)
            float(t[0])                              # another thread reads a tensor on the host
            read.set()
        helper = threading.Thread(target=reader)
        helper.start()
        context = _no_fallback()
        try:
            got = [double(t).numpy() for _ in range(3)]
        finally:
            context.__exit__(None, None, None)
        helper.join()
    assert len(traced) == 1 and double.experimental_get_tracing_count() == 1
    for g in got:
        np.testing.assert_array_equal(g, t.numpy() * np.float32(2.0))


def _two_replica_setup(devices, rng, batch=8, steps=4):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    models = [make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    x = rng.standard_normal((batch * steps, 6)).astype(np.float32)
    y = rng.integers(0, 4, len(x))
    batches = list(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)))
    return strategy, models, batches


def _replica_weights(model):
    """Every replica's copy of every weight: [[replica 0's, replica 1's], ...]."""
    return [[c.numpy() for c in v.values] for v in model.trainable_variables]


def test_an_error_while_tracing_leaves_no_effect(devices, rng):
    strategy, (model, twin), batches = _two_replica_setup(devices, rng)
    train_step, twin_step = tutorial_train_step(model, 8), tutorial_train_step(twin, 8)
    with strategy.scope():
        counter = tf.Variable(0.0)
    fail = [True]

    @tf.function
    def step(batch):
        losses = strategy.run(train_step, args=(batch,))
        counter.assign_add(1.0)
        if fail[0]:
            raise ValueError("raised after the update, while tracing")
        return losses

    start = model.get_weights()
    with pytest.raises(ValueError, match="after the update"):
        step(batches[0])
    assert int(model.optimizer.iterations) == 0 and float(counter) == 0.0
    for a, b in zip(start, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    fail[0] = False
    for b in batches:                                # then it trains as the eager twin, bit for bit
        step(b)
        strategy.run(twin_step, args=(b,))
    assert int(model.optimizer.iterations) == int(twin.optimizer.iterations) == len(batches)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert float(counter) == len(batches)


def test_ctrl_c_inside_a_replayed_two_replica_step_stops_between_steps(devices, rng):
    """SIGINT at random entries of a replay (a profile hook raises it when the replay runs
    its k-th entry): the KeyboardInterrupt comes after the step, which ran on both
    replicas (copies bitwise equal, the step counted, the weights those of an eager twin
    that took as many steps)."""
    strategy, (model, twin), batches = _two_replica_setup(devices, rng, steps=3)
    train_step, twin_step = tutorial_train_step(model, 8), tutorial_train_step(twin, 8)

    @tf.function
    def step(batch):
        return strategy.run(train_step, args=(batch,))

    step(batches[0])
    strategy.run(twin_step, args=(batches[0],))
    entries = _entries_run(lambda: step(batches[1]), "call")
    strategy.run(twin_step, args=(batches[1],))
    assert entries > 10, entries

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # the handler this test relies on
    try:
        for trial in range(4):
            at = int(rng.integers(1, entries + 1))
            b = batches[2 if trial % 2 == 0 else 1]
            with pytest.raises(KeyboardInterrupt):
                _entries_run(lambda: step(b), "call", sigint_at=at)
            assert _entries_run.seen[0] >= at
            strategy.run(twin_step, args=(b,))
            for copies in _replica_weights(model):
                np.testing.assert_array_equal(copies[0], copies[1], err_msg=f"replicas differ (SIGINT at entry {at})")
            assert int(model.optimizer.iterations) == int(twin.optimizer.iterations) == 3 + trial
            for a, b2 in zip(model.get_weights(), twin.get_weights()):
                np.testing.assert_array_equal(a, b2, err_msg=f"SIGINT at entry {at}")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_inside_every_entry_of_a_two_step_replay_stops_at_a_step_boundary(devices, rng):
    """Deterministic, the issue's second case: a ``@function`` whose body is TWO training
    steps of 2 replicas, SIGINT raised as the replay finishes its k-th entry, for every k of
    the replay. The replay goes on to its end (a Ctrl-C is held until the function's replay
    is done), so both steps ran on both replicas: the copies bitwise equal and the weights
    those of an eager twin that took the same steps."""
    strategy, (model, twin), batches = _two_replica_setup(devices, rng, steps=2)
    train_step, twin_step = tutorial_train_step(model, 8), tutorial_train_step(twin, 8)

    @tf.function
    def two_steps(first, second):
        strategy.run(train_step, args=(first,))
        return strategy.run(train_step, args=(second,))

    def twin_steps(first, second):
        strategy.run(twin_step, args=(first,))
        strategy.run(twin_step, args=(second,))

    two_steps(batches[0], batches[1])                   # traced: the first run
    twin_steps(batches[0], batches[1])
    entries = _entries_run(lambda: two_steps(batches[1], batches[0]), "return")
    twin_steps(batches[1], batches[0])
    assert entries > 20, entries                        # two steps' launches, both replicas

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # the handler this test relies on
    try:
        for at in range(1, entries + 1):
            with pytest.raises(KeyboardInterrupt):
                _entries_run(lambda: two_steps(batches[0], batches[1]), "return", sigint_at=at)
            assert _entries_run.seen[0] == entries, f"SIGINT after entry {at}: the replay stopped midway"
            twin_steps(batches[0], batches[1])
            for copies in _replica_weights(model):
                np.testing.assert_array_equal(copies[0], copies[1], err_msg=f"replicas differ (SIGINT at entry {at})")
            assert int(model.optimizer.iterations) == int(twin.optimizer.iterations)
        for a, b in zip(model.get_weights(), twin.get_weights()):
            np.testing.assert_array_equal(a, b)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_returned_variable_is_its_value_at_that_call(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        v = tf.Variable([1.0, 2.0])

        @tf.function
        def bump():
            v.assign_add([1.0, 1.0])
            return v

        first = bump()                               # traced
        second = bump()                              # replayed
        v.assign([100.0, 200.0])
        third = bump()
        v.assign_add([5.0, 5.0])
    np.testing.assert_array_equal(np.asarray(first), [2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(second), [3.0, 4.0])
    np.testing.assert_array_equal(np.asarray(third), [101.0, 201.0])
    np.testing.assert_array_equal(v.numpy(), [106.0, 206.0])


def test_input_signature_is_enforced_for_every_argument_kind(devices, rng):
    devices(cpus=1)
    traced = []
    with tf.device("CPU:0"):
        @tf.function(input_signature=[tf.TensorSpec((None, 3), tf.float32)])
        def total(x):
            traced.append(1)
            return tf.reduce_sum(x)

        for bad in (rng.standard_normal((2, 4)).astype(np.float32),      # the NumPy (2, 4)
                    rng.standard_normal((2, 3)),                         # float64
                    tf.constant(rng.standard_normal((2, 4)).astype(np.float32)),
                    [[1.0, 2.0]], "text"):
            with pytest.raises(TypeError, match="input_signature"):
                total(bad)
        assert traced == [] and total.experimental_get_tracing_count() == 0      # changed nothing
        good = rng.standard_normal((2, 3)).astype(np.float32)
        want = good.astype(np.float64).sum()                 # float32 sums of 6 values: atol near 0
        np.testing.assert_allclose(float(total(good)), want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(float(total(x=tf.constant(good))), want, rtol=1e-6, atol=1e-6)
        with pytest.raises(TypeError, match="input_signature"):
            total(good, good)


def test_retracing_on_every_call_warns_as_tensorflow(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        @tf.function
        def scaled(x, factor):
            return x * factor

        x = tf.constant([1.0, 2.0])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(20):                          # one trace, then replays: quiet
                scaled(x, 2.0)

        @tf.function
        def fresh(x, factor):
            return x * factor

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for factor in (3.0, 4.0, 5.0, 6.0):         # 4 traces in a row: still quiet
                fresh(x, factor)
        with pytest.warns(traced_function.RetracingWarning, match="5 out of the last 5 calls .* retracing"):
            fresh(x, 7.0)                                # the 5th: TensorFlow's warning


def test_a_data_sets_batches_and_numpy_arrays_are_tensors_traced_once(devices, rng):
    """TensorFlow's advanced quickstart: ``for images, labels in train_ds: train_step(images,
    labels)``: one trace for every full batch, each call's values (no eager fallback)."""
    devices(cpus=1)
    x = rng.standard_normal((24, 5)).astype(np.float32)
    y = rng.integers(0, 3, 24).astype(np.int64)
    train_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    traced = []
    with tf.device("CPU:0"):
        acc = tf.Variable(np.zeros(5, np.float32))
        count = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def train_step(images, labels):
            traced.append(1)
            acc.assign_add(tf.reduce_sum(images, axis=0))
            count.assign_add(tf.reduce_sum(labels))
            return tf.reduce_sum(images)

        context = _no_fallback()
        try:
            sums = [float(train_step(images, labels)) for images, labels in train_ds]
            again = float(train_step(x[:6] * 2, y[:6]))         # a plain NumPy array, same shape
        finally:
            context.__exit__(None, None, None)
    assert len(traced) == 1 and train_step.experimental_get_tracing_count() == 1
    np.testing.assert_allclose(sums, x.reshape(4, 6, 5).astype(np.float64).sum(axis=(1, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(again, 2 * x[:6].astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acc.numpy(), x.astype(np.float64).sum(0) + 2 * x[:6].astype(np.float64).sum(0),
                               rtol=1e-5, atol=1e-5)
    assert int(count.numpy()) == int(y.sum() + y[:6].sum())


def test_a_function_making_a_variable_on_every_call_raises_tensorflows_error(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        kept = tf.Variable(0.0)

        @tf.function
        def fresh(x):
            kept.assign_add(1.0)
            v = tf.Variable(1.0)                     # made on every call
            return v + x

        with pytest.raises(ValueError, match="singleton tf.Variables created on the first call"):
            fresh(tf.constant(1.0))
        assert float(kept) == 0.0                    # the failed call changed nothing

        class Counter:                               # TensorFlow's guide's pattern: made once
            v = None

            @tf.function
            def __call__(self, x):
                if self.v is None:
                    self.v = tf.Variable(0.0)
                self.v.assign_add(x)
                return self.v.read_value()

        counter = Counter()
        got = [float(counter(tf.constant(2.0))) for _ in range(3)]
        assert got == [2.0, 4.0, 6.0]

        @tf.function
        def later(x, make):
            if make:
                tf.Variable(0.0)                     # on a later trace only
            return x * 2.0

        later(tf.constant(1.0), False)
        with pytest.raises(ValueError, match="singleton"):
            later(tf.constant(1.0), True)


#: The entries' ``run`` methods (``mirrored/program/replay.py``): one call per entry replayed.
ENTRY_RUNS = {"Launch.run", "Upload.run", "PeerCopy.run", "HostCall.run"}


def _runs_an_entry(frame):
    return frame.f_code.co_filename.endswith("replay.py") and frame.f_code.co_qualname in ENTRY_RUNS


def _entries_run(fn, event, sigint_at=None):
    """Run ``fn()`` counting the replay entries it runs (their ``run``'s ``event``: "call" as
    an entry starts, "return" as it ends); with ``sigint_at=k``, SIGINT is raised at the k-th.
    Returns the count (``_entries_run.seen[0]``: the count so far, when ``fn`` raised)."""
    seen = _entries_run.seen = [0]

    def profile(frame, what, arg):
        if what == event and _runs_an_entry(frame):
            seen[0] += 1
            if seen[0] == sigint_at:
                signal.raise_signal(signal.SIGINT)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen[0]


def test_a_shape_read_as_python_inside_a_function_is_traced_not_eager(devices, rng):
    """``tf.shape(x)[0]`` used as a Python number inside a ``@function`` (keras.io's GAN:
    ``keras.random.normal(shape=(tf.shape(x)[0], 8))``) is known from the shapes, which key
    the trace: the function traces once per shape and replays, with no eager fallback, and
    each call's values are its own."""
    devices(cpus=1)
    with tf.device("CPU:0"):
        @tf.function
        def pad_rows(x):
            n = tf.shape(x)[0]
            width = [int(d) for d in tf.shape(x)][1]
            return tf.concat([x, tf.zeros((n, 1))], axis=1) * float(width) + float(tf.size(x)) + float(tf.rank(x))

        with warnings.catch_warnings():
            warnings.simplefilter("error", traced_function.EagerFallbackWarning)
            for rows in (3, 3, 5, 3):
                x = rng.standard_normal((rows, 2)).astype(np.float32)
                want = np.concatenate([x, np.zeros((rows, 1), np.float32)], axis=1) * 2.0 + rows * 2 + 2
                np.testing.assert_allclose(pad_rows(x).numpy(), want, rtol=1e-6)
        assert pad_rows.experimental_get_tracing_count() == 2
        assert tf.shape(tf.constant([[1.0, 2.0]])).numpy().tolist() == [1, 2]
