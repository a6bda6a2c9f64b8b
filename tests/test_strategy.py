"""The Strategy API against TensorFlow's documented behaviour (MirroredStrategy's API page).

Every example runs on 2 and 4 logical CPU devices and on 2 logical GPUs (simulated where
there is no GPU). A replica that misbehaves must never hang the test: the calls that
could hang run under a watchdog.
"""
import threading

import numpy as np
import pytest

import mirrored as tf
from mirrored.values import MirroredVariable, PerReplica

LONG = "/job:localhost/replica:0/task:0/device:"
WATCHDOG_S = 300         # generous for the simulator on a busy machine; a hang would wait forever


@pytest.fixture(params=["2cpu", "4cpu", "2gpu"])
def strategy(request, devices):
    n, kind = int(request.param[0]), request.param[1:].upper()
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    return tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)])


def no_hang(fn, *args):
    """Run fn in a thread; fail (instead of hanging) if it does not return in time."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001
            box["error"] = err
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(WATCHDOG_S)
    assert not t.is_alive(), f"{fn.__name__} hung for {WATCHDOG_S} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_prints_tensorflow_line_and_counts_replicas(devices, capsys):
    devices(cpus=2)
    s = tf.distribute.MirroredStrategy(["cpu:0", "/device:CPU:1"])
    assert capsys.readouterr().err.strip() == (        # TF's INFO log goes to stderr
        f"INFO:mirrored:Using MirroredStrategy with devices ('{LONG}CPU:0', '{LONG}CPU:1')")
    assert s.num_replicas_in_sync == 2
    assert s.cluster_resolver is None
    assert s.extended.worker_devices == (f"{LONG}CPU:0", f"{LONG}CPU:1")


def test_default_devices_every_gpu_else_the_cpu(devices):
    devices(cpus=3)
    gpus = tf.config.list_logical_devices("GPU")
    expected = tuple(g.name for g in gpus) or tuple(f"{LONG}CPU:{i}" for i in range(3))   # every logical CPU, as TF
    assert tf.distribute.MirroredStrategy().extended.worker_devices == expected
    devices(cpus=1, gpus=2)
    assert tf.distribute.MirroredStrategy().extended.worker_devices == (f"{LONG}GPU:0", f"{LONG}GPU:1")


def test_bad_device_lists(devices):
    devices(cpus=2)
    with pytest.raises(ValueError, match="No duplicates"):
        tf.distribute.MirroredStrategy(["CPU:0", "/cpu:0"])
    with pytest.raises(ValueError, match="at least one device"):
        tf.distribute.MirroredStrategy([])
    with pytest.raises(ValueError, match="Devices here"):
        tf.distribute.MirroredStrategy(["GPU:7"])
    with pytest.raises(NotImplementedError, match="RingAllReduce"):
        tf.distribute.NcclAllReduce()


# --- variables --------------------------------------------------------------------------

def test_variable_in_scope_is_mirrored_with_tf_repr(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        x = tf.Variable(1.)
    assert isinstance(x, MirroredVariable) and isinstance(x, tf.Variable)
    kind = strategy.extended.devices[0].device_type
    lines = ["MirroredVariable:{",
             "  0: <tf.Variable 'Variable:0' shape=() dtype=float32, numpy=1.0>,"]
    lines += [f"  {i}: <tf.Variable 'Variable/replica_{i}:0' shape=() dtype=float32, numpy=1.0>,"
              for i in range(1, n)]
    lines[-1] = lines[-1].rstrip(",")
    assert repr(x) == "\n".join(lines + ["}"])
    assert [v.device for v in x.values] == [f"{LONG}{kind}:{i}" for i in range(n)]
    assert x.numpy() == 1.0 and x.shape == () and x.dtype == tf.float32


def test_variable_created_in_a_function_under_scope(strategy):
    created = []

    @tf.function
    def create_variable():
        if not created:
            created.append(tf.Variable(1.))
        return created[0]

    with strategy.scope():
        value = create_variable()
    v, = created
    assert isinstance(v, MirroredVariable) and len(v.values) == strategy.num_replicas_in_sync
    # what the call returns is the variable's value at that call (issue 50, as TensorFlow 2.21)
    assert not isinstance(value, tf.Variable) and float(value) == 1.0


def test_variable_outside_scope_is_plain(strategy):
    x = tf.Variable(1.)
    assert type(x) is tf.Variable
    assert repr(x) == "<tf.Variable 'Variable:0' shape=() dtype=float32, numpy=1.0>"


def test_copies_start_equal_from_one_random_initialiser(strategy, rng):
    calls = []

    def init():
        calls.append(1)
        return rng.standard_normal((3, 4)).astype(np.float32)

    with strategy.scope():
        w = tf.Variable(init)
    assert len(calls) == 1
    first = w.values[0].numpy()
    for c in w.values[1:]:
        np.testing.assert_array_equal(c.numpy(), first)


def test_cross_replica_assign_updates_every_copy(strategy):
    with strategy.scope():
        v = tf.Variable([1., 2.])
        v.assign([5., 6.])
        v.assign_add([1., 1.])
        v.assign_sub([0.5, 0.5])
    for c in v.values:
        np.testing.assert_array_equal(c.numpy(), [5.5, 6.5])
    with pytest.raises(ValueError, match="shape"):
        v.assign([1., 2., 3.])


def test_replica_context_update_without_aggregation_is_an_error(strategy):
    with strategy.scope():
        v = tf.Variable(0.)
    with pytest.raises(ValueError, match="aggregation"):
        no_hang(strategy.run, lambda: v.assign_add(1.))


@pytest.mark.parametrize("aggregation,expected", [
    ("SUM", lambda n: sum(range(1, n + 1))),
    ("MEAN", lambda n: sum(range(1, n + 1)) / n),
    ("ONLY_FIRST_REPLICA", lambda n: 1.0)])
def test_replica_context_update_with_aggregation(strategy, aggregation, expected):
    with strategy.scope():
        v = tf.Variable(10., aggregation=getattr(tf.VariableAggregation, aggregation))

    def step():
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        v.assign_add(tf.cast(rid, tf.float32) + 1.)
    no_hang(strategy.run, step)
    n = strategy.num_replicas_in_sync
    for c in v.values:
        assert c.numpy() == pytest.approx(10. + expected(n))


def test_replica_reads_its_own_copy(strategy):
    with strategy.scope():
        v = tf.Variable(0.)
    for i, c in enumerate(v.values):
        c.assign(float(i))               # deliberately make the copies differ
    out = no_hang(strategy.run, lambda: v.read_value())
    assert [t.numpy() for t in strategy.experimental_local_results(out)] == \
        [float(i) for i in range(strategy.num_replicas_in_sync)]


# --- run, reduce, contexts ----------------------------------------------------------------

def test_run_replica_ids_and_reduce(strategy):
    n = strategy.num_replicas_in_sync

    @tf.function
    def step_fn():
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    result = no_hang(strategy.run, step_fn)
    assert isinstance(result, PerReplica)
    assert [t.numpy() for t in result.values] == list(range(n))
    assert [t.device for t in result.values] == list(strategy.extended.worker_devices)
    assert repr(result).startswith("PerReplica:{\n  0: <tf.Tensor: shape=(), dtype=int32, numpy=0>,")
    assert strategy.reduce("SUM", result, axis=None) == sum(range(n))
    # MEAN divides as `/`, as TensorFlow (issue 15 item 7): 0.5 for ids 0 and 1
    assert strategy.reduce(tf.distribute.ReduceOp.MEAN, result, axis=None).numpy() == sum(range(n)) / n


def test_run_with_a_constant_returns_the_value(strategy):
    out = no_hang(strategy.run, lambda: tf.constant(1.))
    comps = strategy.experimental_local_results(out)
    assert len(comps) == strategy.num_replicas_in_sync
    assert all(c.numpy() == 1.0 for c in comps)
    assert [c.device for c in comps] == list(strategy.extended.worker_devices)
    same = object()
    assert strategy.run(lambda: same) is same          # TF's regroup keeps identical objects


def test_distributed_values_are_unpacked_per_replica(strategy):
    def value_fn(ctx):
        return tf.constant([float(ctx.replica_id_in_sync_group)])
    distributed = strategy.experimental_distribute_values_from_function(value_fn)
    assert isinstance(distributed, PerReplica)
    result = no_hang(strategy.run, lambda x: x * 2, (distributed,))
    assert [t.numpy().tolist() for t in result.values] == \
        [[2.0 * i] for i in range(strategy.num_replicas_in_sync)]


def test_all_reduce_inside_the_replica_function(strategy):
    n = strategy.num_replicas_in_sync

    @tf.function
    def step_fn():
        ctx = tf.distribute.get_replica_context()
        value = tf.identity(tf.constant(1.))
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)

    result = no_hang(strategy.run, step_fn)
    assert type(result).__name__ == "PerReplica"                # as TensorFlow returns it
    local = strategy.experimental_local_results(result)
    assert [t.numpy() for t in local] == [float(n)] * n
    assert [t.device for t in local] == list(strategy.extended.worker_devices)


def test_all_reduce_of_a_structure_with_mean(strategy, rng):
    n = strategy.num_replicas_in_sync
    data = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(n)]
    ints = [rng.integers(0, 100, size=4).astype(np.int32) for _ in range(n)]

    def step_fn():
        rid = int(tf.distribute.get_replica_context().replica_id_in_sync_group)
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("mean", {"w": tf.constant(data[rid]), "i": tf.constant(ints[rid])})

    out = no_hang(strategy.run, step_fn)
    for comp in strategy.experimental_local_results(out["w"]):
        np.testing.assert_allclose(comp.numpy(), np.mean(np.array(data, np.float64), axis=0), rtol=1e-5, atol=1e-6)
    for comp in strategy.experimental_local_results(out["i"]):     # MEAN divides as `/`: float64
        assert comp.numpy().dtype == np.float64
        np.testing.assert_array_equal(comp.numpy(), np.sum(ints, axis=0) / n)


def test_reduce_axis_none_versus_axis_zero(strategy):
    n = strategy.num_replicas_in_sync
    x = strategy.experimental_distribute_values_from_function(lambda _: tf.ones([4, 5]))
    np.testing.assert_array_equal(strategy.reduce("SUM", x, axis=None), np.full((4, 5), float(n)))
    np.testing.assert_array_equal(strategy.reduce("SUM", x, axis=0), np.full((5,), 4.0 * n))
    np.testing.assert_array_equal(strategy.reduce("MEAN", x, axis=0), np.ones(5))
    assert strategy.reduce("MEAN", x, axis=None).numpy().shape == (4, 5)


def test_mean_over_axis_zero_counts_an_uneven_last_batch(strategy, rng):
    n = strategy.num_replicas_in_sync
    # a last batch of 3 rows: replica r gets rows per TF's rebatching rule (some empty)
    from mirrored.input_lib import rebatch_bounds
    rows = rng.standard_normal(3).astype(np.float32)
    bounds = rebatch_bounds(3, n)
    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(rows[slice(*bounds[ctx.replica_id_in_sync_group])]))
    # float32 additions: each rounds by at most 2**-24 of a partial sum, bounded by sum |rows|
    # (a relative bound alone fails when the rows nearly cancel: a mean of 0.008 was off by 1.3e-6)
    bound = 1e-6 * np.abs(rows.astype(np.float64)).sum()
    assert strategy.reduce("MEAN", pr, axis=0).numpy() == pytest.approx(rows.astype(np.float64).mean(),
                                                                        rel=1e-6, abs=bound / 3)
    assert strategy.reduce("SUM", pr, axis=0).numpy() == pytest.approx(rows.astype(np.float64).sum(),
                                                                       rel=1e-6, abs=bound)


def test_gather_and_local_results(strategy):
    n = strategy.num_replicas_in_sync
    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([[ctx.replica_id_in_sync_group] * 2]))
    np.testing.assert_array_equal(strategy.gather(pr, axis=0), np.repeat(np.arange(n), 2).reshape(n, 2))
    assert strategy.experimental_local_results(5) == (5,)
    assert len(strategy.experimental_local_results(pr)) == n


def test_reduce_to_and_batch_reduce_to(strategy):
    n = strategy.num_replicas_in_sync
    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group + 1)))
    total = strategy.extended.reduce_to("SUM", pr, destinations="CPU:0")
    assert total.device == f"{LONG}CPU:0" and total.numpy() == n * (n + 1) / 2
    with strategy.scope():
        v = tf.Variable(0.)
    mirrored, mean = strategy.extended.batch_reduce_to("SUM", [(pr, v), (pr, "CPU:0")])
    assert [c.numpy() for c in mirrored.values] == [n * (n + 1) / 2] * n
    assert [c.device for c in mirrored.values] == [c.device for c in v.values]
    with pytest.raises(ValueError, match="non-DistributedValues"):
        strategy.extended.reduce_to("SUM", tf.constant(1.), destinations="CPU:0")
    assert strategy.extended.reduce_to("MEAN", tf.constant(3.), destinations="CPU:0").numpy() == 3.0


def test_contexts_inside_and_outside_scope_and_run(strategy):
    n = strategy.num_replicas_in_sync
    assert tf.distribute.get_strategy() is not strategy
    assert tf.distribute.get_replica_context() is not None          # the default one
    assert not tf.distribute.in_cross_replica_context()

    def merge_fn(s, replica_ids):
        return {"cross": tf.distribute.in_cross_replica_context(), "strategy": s,
                "ids": strategy.experimental_local_results(replica_ids)}

    def step():
        ctx = tf.distribute.get_replica_context()
        merged = ctx.merge_call(merge_fn, args=(int(ctx.replica_id_in_sync_group),))
        return {"num": ctx.num_replicas_in_sync, "cross": tf.distribute.in_cross_replica_context(),
                "same": tf.distribute.get_strategy() is strategy, "merged": merged}

    with strategy.scope():
        assert tf.distribute.get_strategy() is strategy
        assert tf.distribute.get_replica_context() is None
        assert tf.distribute.in_cross_replica_context()
        out = no_hang(strategy.run, step)
    # every replica got the same plain answers, so TF's regroup keeps them plain
    assert out["num"] == n and out["cross"] is False and out["same"] is True
    merged = out["merged"]
    assert merged["cross"] is True and merged["strategy"] is strategy
    assert merged["ids"] == tuple(range(n))


def test_nested_scopes(strategy, devices):
    with strategy.scope():
        with strategy.scope():                        # the same strategy again: fine
            assert tf.distribute.get_strategy() is strategy
        other = tf.distribute.OneDeviceStrategy("CPU:0")
        with pytest.raises(RuntimeError, match="Mixing different"):
            with other.scope():
                pass


def test_reduce_errors(strategy):
    pr = PerReplica(["a"] * strategy.num_replicas_in_sync)
    with pytest.raises(TypeError, match="only numbers"):
        strategy.reduce("SUM", pr, axis=None)
    with pytest.raises(ValueError, match="not a reduce op"):
        strategy.reduce("MAX", pr, axis=None)
    with pytest.raises(ValueError, match="not a reduce op"):
        tf.distribute.ReduceOp.validate("average")
    with pytest.raises(ValueError, match="non-DistributedValues"):
        strategy.reduce("SUM", 1.0, axis=None)
    assert strategy.reduce("MEAN", 1.0, axis=None) == 1.0


def test_an_exception_in_one_replica_reaches_the_caller_and_nothing_hangs(strategy):
    n = strategy.num_replicas_in_sync

    def step():
        ctx = tf.distribute.get_replica_context()
        if int(ctx.replica_id_in_sync_group) == n - 1:
            raise KeyError("boom")
        ctx.all_reduce("SUM", 1.0)        # the others wait here: they must be released
        return 1

    with pytest.raises(KeyError, match="boom") as err:
        no_hang(strategy.run, step)
    assert any(f"replica {n - 1}" in note for note in getattr(err.value, "__notes__", []))
    # the strategy still works afterwards
    out = no_hang(strategy.run, lambda: tf.distribute.get_replica_context().all_reduce("SUM", 2.0))
    assert all(t.numpy() == 2.0 * n for t in strategy.experimental_local_results(out))


def test_replicas_making_different_merge_calls_fail_instead_of_hanging(strategy):
    def step():
        ctx = tf.distribute.get_replica_context()
        if int(ctx.replica_id_in_sync_group) == 0:
            ctx.all_reduce("SUM", 1.0)
        return 0

    with pytest.raises(RuntimeError, match="same merge calls"):
        no_hang(strategy.run, step)


def test_run_accepts_kwargs_and_nested_per_replica(strategy):
    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group)))
    out = no_hang(lambda: strategy.run(lambda a, b=None: {"sum": a + b["x"]},
                                       args=(pr,), kwargs={"b": {"x": 10.0}}))
    assert [t.numpy() for t in out["sum"].values] == [10.0 + i for i in range(strategy.num_replicas_in_sync)]


# --- one device, the default strategy, distributed datasets ------------------------------

def test_one_device_strategy(devices):
    devices(cpus=2)
    s = tf.distribute.OneDeviceStrategy("/cpu:1")
    assert s.num_replicas_in_sync == 1
    with s.scope():
        v = tf.Variable(2.0)
        t = tf.constant(1.0)
    assert type(v) is tf.Variable and v.device == f"{LONG}CPU:1" and t.device == f"{LONG}CPU:1"
    out = s.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(3.0)))
    assert isinstance(out, tf.Tensor) and out.numpy() == 3.0
    assert s.reduce("SUM", out, axis=None) == 3.0


def test_default_strategy_outside_every_scope(devices):
    devices(cpus=1)
    s = tf.distribute.get_strategy()
    assert s.num_replicas_in_sync == 1
    assert s.run(lambda x: x + 1, args=(1,)) == 2
    ctx = tf.distribute.get_replica_context()
    assert ctx.num_replicas_in_sync == 1 and int(ctx.replica_id_in_sync_group) == 0
    assert ctx.all_reduce("SUM", 5.0) == 5.0


@pytest.mark.parametrize("n,b,expected", [(2, 6, [3, 3]), (4, 6, [2, 2, 2, 0]), (4, 5, [2, 2, 1, 0]),
                                          (2, 1, [1, 0]), (4, 8, [2, 2, 2, 2])])
def test_distributed_dataset_rebatching(devices, n, b, expected, rng):
    devices(cpus=n)
    s = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    x = rng.standard_normal((b, 3)).astype(np.float32)
    y = np.arange(b)
    (batch,) = list(s.experimental_distribute_dataset([(x, y)]))
    xs, ys = batch
    assert [t.shape[0] for t in xs.values] == expected
    assert [t.device for t in ys.values] == list(s.extended.worker_devices)
    np.testing.assert_array_equal(np.concatenate([t.numpy() for t in xs.values]), x)
    np.testing.assert_array_equal(np.concatenate([t.numpy() for t in ys.values]), y)


def test_distribute_datasets_from_function(devices):
    devices(cpus=2)
    s = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    seen = []

    def dataset_fn(ctx):
        seen.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(8)
        return [np.full((per_replica,), k) for k in range(5)]

    steps = list(s.distribute_datasets_from_function(dataset_fn))
    assert len(seen) == 1 and seen[0].num_replicas_in_sync == 2
    assert len(steps) == 2        # 5 batches: two full steps, the odd one left over
    assert [t.numpy().tolist() for t in steps[1].values] == [[2] * 4, [3] * 4]
    with pytest.raises(ValueError, match="not divisible"):
        seen[0].get_per_replica_batch_size(7)


def test_experimental_make_numpy_dataset(devices, rng):
    devices(cpus=2)
    s = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((10, 3)).astype(np.float32)
    ds = s.experimental_make_numpy_dataset(x).batch(4)
    batches = list(s.experimental_distribute_dataset(ds))
    assert len(batches) == 3
    assert [t.shape[0] for t in batches[-1].values] == [1, 1]          # the last batch of 2
    np.testing.assert_array_equal(np.concatenate([t.numpy() for b in batches for t in b.values]), x)
