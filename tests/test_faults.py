"""Bad input and faults (issue 15): each contract here is what a user probing the library
found broken — a silent wrong result, a hang, an unclear error or a leaked resource.

Runs on logical CPUs and on simulated logical GPUs (the ``strategy`` fixture); calls
that could hang run under ``no_hang``'s watchdog.
"""
import ast
import queue
import sys
import threading
import time

import numpy as np
import pytest

import mirrored as tf
from mirrored.values import PerReplica

from test_strategy import no_hang


@pytest.fixture(params=["2cpu", "2gpu"])
def strategy(request, devices):
    n, kind = int(request.param[0]), request.param[1:].upper()
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    return tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)])


def replica_id():
    return tf.distribute.get_replica_context().replica_id_in_sync_group


# --- item 7: MEAN divides as `/` ---------------------------------------------------------

def test_reduce_mean_of_integers_divides_as_true_division(strategy):
    ids = no_hang(strategy.run, replica_id)             # int32 0 and 1
    assert float(strategy.reduce("MEAN", ids, axis=None)) == 0.5
    assert float(strategy.reduce("SUM", ids, axis=None)) == 1
    floats = PerReplica([np.float32(1.0), np.float32(2.0)])
    mean = strategy.reduce("MEAN", floats, axis=None)
    assert mean.dtype == np.float32 and float(mean) == 1.5


# --- unclear errors -------------------------------------------------------------------------

def test_reduce_axis_errors_name_the_axis_and_what_to_do(strategy):
    vectors = PerReplica([np.arange(3.0), np.arange(3.0)])
    with pytest.raises(ValueError, match=r"axis=1.*shape \(3,\).*axis=None"):
        strategy.reduce("SUM", vectors, axis=1)
    scalars = PerReplica([np.float32(1.0), np.float32(2.0)])
    with pytest.raises(ValueError, match=r"axis=0.*scalar"):
        strategy.reduce("SUM", scalars, axis=0)
    with pytest.raises(ValueError, match="non-DistributedValues"):
        strategy.reduce("SUM", 1.0, axis=0)            # returned 1.0 before
    with pytest.raises(ValueError, match=r"axis=0.*scalar"):
        strategy.reduce("MEAN", 1.0, axis=0)


def test_reduce_of_a_nest_reduces_each_leaf(strategy):
    out = no_hang(strategy.run, lambda: (replica_id(), {"x": tf.constant(2.0)}))
    total = strategy.reduce("SUM", out, axis=None)
    assert isinstance(total, tuple) and float(total[0]) == 1 and float(total[1]["x"]) == 4.0


def test_all_reduce_with_different_structures_names_the_replicas(strategy):
    def step():
        rid = int(replica_id())
        value = (1.0, 2.0) if rid == 0 else (1.0,)
        return tf.distribute.get_replica_context().all_reduce("SUM", value)

    with pytest.raises(ValueError, match=r"replicas \[0\] passed .*replicas \[1\] passed"):
        no_hang(strategy.run, step)


def test_all_reduce_with_different_ops_is_refused_naming_both(strategy):
    def step():
        op = "sum" if int(replica_id()) == 0 else "mean"
        return tf.distribute.get_replica_context().all_reduce(op, 1.0)

    with pytest.raises(ValueError, match="replica 0: SUM, replica 1: MEAN"):
        no_hang(strategy.run, step)


def test_memory_limit_must_be_mib_as_a_number():
    with pytest.raises(TypeError, match="MiB.*memory_limit=1024"):
        tf.config.LogicalDeviceConfiguration(memory_limit="1GB")


def test_listing_tpus_finds_none():
    assert tf.config.list_physical_devices("TPU") == []
    assert tf.config.list_logical_devices("TPU") == []
    with pytest.raises(ValueError, match="device_type"):
        tf.config.list_physical_devices("QPU")


def test_run_of_one_strategy_inside_another_scope_is_refused(devices):
    devices(cpus=2)
    a = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    b = tf.distribute.OneDeviceStrategy("CPU:0")
    with b.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            a.run(lambda: 1)
    with a.scope():                                  # its own scope: fine
        assert no_hang(a.run, lambda: 1) == 1


# --- item 5: no deadlock, no wait for ever ----------------------------------------------------

def test_run_from_two_threads_takes_turns_instead_of_deadlocking(strategy, monkeypatch):
    """Two callers whose jobs interleave on the replica queues would send replica 0 to one
    call's merge point and replica 1 to the other's, for ever; runs must take turns.
    The replica queues here pause a random time after each put, so that unserialised
    callers interleave (before the lock: hung every time)."""
    pauses = np.random.default_rng(0)

    class SlowQueue(queue.Queue):
        def put(self, item):
            super().put(item)
            time.sleep(pauses.uniform(0, 0.01))  # the other caller may put both its jobs now

    with monkeypatch.context() as patch:
        patch.setattr(queue, "SimpleQueue", SlowQueue)
        strategy.extended.worker_pool()      # the pool's queues are made now

    def step():
        return tf.distribute.get_replica_context().all_reduce("SUM", 1.0)

    start = threading.Barrier(CALLERS)

    def many():
        start.wait()
        return [strategy.run(step) for _ in range(RUNS_PER_CALLER)]

    callers = [threading.Thread(target=many, daemon=True) for _ in range(CALLERS)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(WATCHDOG_S)
        assert not t.is_alive(), f"threads calling strategy.run deadlocked ({WATCHDOG_S} s)"


def test_run_from_a_merge_function_is_refused_not_hung(strategy):
    def step():
        return tf.distribute.get_replica_context().merge_call(lambda s: s.run(lambda: 1))

    with pytest.raises(RuntimeError, match="from a merge function"):
        no_hang(strategy.run, step)


CALLERS, RUNS_PER_CALLER = 2, 20
WATCHDOG_S = 30


def test_a_merge_point_wait_times_out_naming_who_did_not_come(strategy, monkeypatch):
    from mirrored import mirrored_run
    monkeypatch.setattr(mirrored_run, "MERGE_TIMEOUT_S", 0.5)
    late = threading.Event()

    def step():
        ctx = tf.distribute.get_replica_context()
        if int(ctx.replica_id_in_sync_group) == 1:
            late.wait(WATCHDOG_S)          # stuck in its own code, past the deadline
        return ctx.all_reduce("SUM", 1.0)

    def run_then_release():
        try:
            return strategy.run(step)
        finally:
            late.set()

    timer = threading.Timer(3.0, late.set)  # releases replica 1 once replica 0 gave up
    timer.start()
    try:
        with pytest.raises(tf.errors.DeadlineExceededError,
                           match=r"replicas \[0\] arrived, replicas \[1\] did not"):
            no_hang(run_then_release)
    finally:
        timer.cancel()
    out = no_hang(strategy.run, lambda: tf.distribute.get_replica_context().all_reduce("SUM", 2.0))
    assert all(float(t.numpy()) == 4.0 for t in strategy.experimental_local_results(out))


# --- item 6: reproducible shuffles ---------------------------------------------------------

SHUFFLE_TWO_EPOCHS = """
import sys
import numpy as np
import mirrored as tf
if sys.argv[1] != "none":
    tf.random.set_seed(int(sys.argv[1]))
ds = tf.data.Dataset.from_tensor_slices(np.arange(40)).cache().shuffle(10000)
other = tf.data.Dataset.range(40).shuffle(10000)        # a second unseeded shuffle
print(([int(x) for x in ds], [int(x) for x in ds], [int(x) for x in other]))
"""


def shuffled_in_a_new_process(seed):
    import os
    import subprocess
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", SHUFFLE_TWO_EPOCHS, str(seed)], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_set_seed_makes_unseeded_shuffles_repeat_across_processes_and_reshuffle_per_epoch():
    first, second = shuffled_in_a_new_process(42), shuffled_in_a_new_process(42)
    assert first == second, "set_seed(42): two runs of one program shuffled differently"
    epoch1, epoch2, other = ast.literal_eval(first)     # three lists of ints
    assert sorted(epoch1) == list(range(40)) and epoch1 != epoch2, "must reshuffle each epoch"
    assert other != epoch1, "two shuffles in one program must not share a seed"
    assert shuffled_in_a_new_process(7) != first
    assert shuffled_in_a_new_process("none") != shuffled_in_a_new_process("none")


# --- files and resources ----------------------------------------------------------------------

def replica_threads():
    return [t for t in threading.enumerate() if t.name.startswith("mirrored-replica-")]


def test_strategies_are_freed_and_their_threads_end(devices):
    import gc
    import time
    devices(cpus=2)
    gc.collect()
    before = len(replica_threads())
    for _ in range(50):
        s = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
        s.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", 1.0))
        del s
    gc.collect()
    deadline = time.monotonic() + 10
    while len(replica_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(replica_threads()) <= before, \
        f"{len(replica_threads()) - before} replica threads still alive after 50 strategies were deleted"


# --- bad labels and data: a clear error before any step, on every backend ----------------------

def small_model(strategy, hidden=8, features=12, classes=10, optimizer="adam"):
    from mirrored.keras import layers, models
    with strategy.scope():
        model = models.Sequential([layers.Dense(hidden, activation="relu", input_shape=(features,)),
                                   layers.Dense(classes)])
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def state_of(model):
    """Everything a step may change: every replica's weights, the optimizer's step count
    and slots, and each device's bytes in use (host copies)."""
    import gc
    from mirrored.values import components
    gc.collect()
    step = model.step
    return {
        "weights": [c.numpy().copy() for v in model.trainable_variables for c in components(v)],
        "iterations": int(model.optimizer.iterations),
        "slots": {k: [step.devices[k[2]].to_numpy(s).copy() for s in slots]
                  for k, slots in model.optimizer._slots.items()},
        "bytes": [dev.bytes_in_use for dev in step.devices],
    }


def assert_same_state(before, after):
    assert after["iterations"] == before["iterations"]
    assert after["bytes"] == before["bytes"], "device memory accounting changed"
    assert len(after["weights"]) == len(before["weights"])
    for a, b in zip(before["weights"], after["weights"]):
        assert np.array_equal(a, b)
    assert after["slots"].keys() == before["slots"].keys()
    for k in before["slots"]:
        for a, b in zip(before["slots"][k], after["slots"][k]):
            assert np.array_equal(a, b)


def labelled(rng, n=16, features=12, classes=10):
    return rng.random((n, features)).astype(np.float32), rng.integers(0, classes, n)


def test_one_hot_labels_with_a_sparse_loss_are_refused_before_any_step(strategy, rng):
    model = small_model(strategy)
    x, y = labelled(rng)
    model.fit(x, y, batch_size=8, verbose=0)
    before = state_of(model)
    one_hot = np.eye(10)[y]
    for call in (lambda: model.fit(x, one_hot, batch_size=8, verbose=0),
                 lambda: model.evaluate(x, one_hot, batch_size=8, verbose=0),
                 lambda: model.fit(tf.data.Dataset.from_tensor_slices((x, one_hot)).batch(8), verbose=0)):
        with pytest.raises(ValueError, match=r"labels of shape \((16|8), 10\).*SparseCategoricalCrossentropy"
                                             r".*class indices.*one-hot.*argmax"):
            call()
    assert_same_state(before, state_of(model))
    model.fit(x, y[:, None], batch_size=8, verbose=0)          # (B, 1) is class indices: fine


@pytest.mark.parametrize("bad", [10, -1])
def test_out_of_range_labels_raise_on_the_host_on_every_backend(strategy, rng, bad):
    """The CUDA path turned every weight into NaN with no error; the CPU path raised but
    had already counted the step."""
    model = small_model(strategy)
    x, y = labelled(rng)
    model.fit(x, y, batch_size=8, verbose=0)
    before = state_of(model)
    y_bad = y.copy()
    y_bad[11] = bad
    for call in (lambda: model.fit(x, y_bad, batch_size=8, shuffle=False, verbose=0),
                 lambda: model.evaluate(x, y_bad, batch_size=8, verbose=0)):
        with pytest.raises(ValueError, match=rf"labels must lie in \[0, 10\).*\[{bad}\]"):
            call()
    assert_same_state(before, state_of(model))


def test_a_resident_data_set_checks_its_labels_once_when_placed(strategy, rng):
    model = small_model(strategy)
    x, y = labelled(rng)
    model.fit(x, y, batch_size=8, verbose=0)
    before = state_of(model)
    y[13] = 12
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
        tf.distribute.InputOptions(experimental_place_dataset_on_device=True))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\).*\[12\]"):
        model.fit(dist, verbose=0)
    after = state_of(model)
    after["bytes"] = before["bytes"]          # the placed copy of the data set is charged
    assert_same_state(before, after)


def test_an_unbatched_dataset_says_to_call_batch(strategy, rng):
    model = small_model(strategy)
    x, y = labelled(rng)
    with pytest.raises(ValueError, match=r"single examples.*\.batch\("):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)), verbose=0)


def test_empty_data_raise_as_keras(strategy, rng):
    model = small_model(strategy)
    x, y = labelled(rng)
    empty = tf.data.Dataset.from_tensor_slices((x, y)).take(0).batch(4)
    with pytest.raises(ValueError, match=r"Unexpected result of `train_function` \(Empty logs\)"):
        model.fit(empty, verbose=0)
    with pytest.raises(ValueError, match=r"Empty logs.*0 examples"):
        model.fit(x[:0], y[:0], verbose=0)
    with pytest.raises(ValueError, match=r"Unexpected result of `test_function` \(Empty logs\)"):
        model.evaluate(empty, verbose=0)


# --- a failed step leaves no trace ----------------------------------------------------------------

@pytest.fixture(params=["2cpu", "2gpu"])
def small_devices(request):
    """2 logical devices of 64 KiB each (memory_limit=0.0625 MiB), CPUs or simulated GPUs."""
    from mirrored import devices as registry
    kind = request.param[1:].upper()
    registry._reset()
    phys = tf.config.list_physical_devices(kind)
    if not phys:
        pytest.skip("needs a CUDA GPU or the CUDA simulator")
    tf.config.set_logical_device_configuration(
        phys[0], [tf.config.LogicalDeviceConfiguration(memory_limit=0.0625) for _ in range(2)])
    yield tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"])
    registry._reset()


def test_an_out_of_memory_step_leaves_no_trace(small_devices, rng):
    """Dense(64) on 4 features: a replica's input buffers for 128 examples fit in 64 KiB,
    its layers' buffers (128 x 64 floats twice) do not, so the step fails after the
    inputs are on the devices. It stranded those buffers (288,000 bytes measured on a
    1 MiB GPU) and counted the step; now the model, the optimizer and the memory are as
    before, and the run goes on exactly as a clean one."""
    from mirrored.errors import ResourceExhaustedError
    x, y = labelled(rng, n=256, features=4)
    tf.random.set_seed(3)
    model = small_model(small_devices, hidden=64, features=4)
    initial = model.get_weights()
    for first in (True, False):                           # before the slots exist, and after
        before = state_of(model)
        with pytest.raises(ResourceExhaustedError):
            model.fit(x, y, batch_size=256, shuffle=False, verbose=0)
        assert_same_state(before, state_of(model))
        if first:
            model.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    model.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    tf.random.set_seed(3)
    clean = small_model(small_devices, hidden=64, features=4)
    clean.set_weights(initial)
    for _ in range(2):
        clean.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    assert int(clean.optimizer.iterations) == int(model.optimizer.iterations) == 2
    for a, b in zip(clean.get_weights(), model.get_weights()):
        assert np.array_equal(a, b)


def test_an_out_of_memory_predict_or_evaluate_leaves_no_trace(small_devices, rng):
    """predict and evaluate at a batch whose layer buffers do not fit: the error, then the
    devices' memory, weights and optimizer as before, and a small predict that still
    gives what a clean model gives (predict kept the buffers it had made: issue 15)."""
    from mirrored.errors import ResourceExhaustedError
    x, y = labelled(rng, n=256, features=4)
    model = small_model(small_devices, hidden=64, features=4)
    model.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    want = model.predict(x[:8], batch_size=8, verbose=0)
    before = state_of(model)
    with pytest.raises(ResourceExhaustedError):
        model.predict(x, batch_size=256, verbose=0)
    assert_same_state(before, state_of(model))
    with pytest.raises(ResourceExhaustedError):
        model.evaluate(x, y, batch_size=256, verbose=0)
    assert_same_state(before, state_of(model))
    np.testing.assert_array_equal(model.predict(x[:8], batch_size=8, verbose=0), want)


# --- all_reduce MEAN of integers -------------------------------------------------------------------

def test_all_reduce_mean_of_integers_divides_as_true_division(strategy):
    """TensorFlow's cross-device MEAN is the SUM / N with `/`: integers give float64,
    as strategy.reduce. It floor-divided in place (0 and 1 gave 0)."""
    def step():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("MEAN", ctx.replica_id_in_sync_group), ctx.all_reduce("SUM", 3)

    mean, total = no_hang(strategy.run, step)
    for v in strategy.experimental_local_results(mean):
        assert v.dtype == np.float64 and float(v) == 0.5
    for v in strategy.experimental_local_results(total):
        assert int(v) == 6
