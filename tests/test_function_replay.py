"""``@tf.function`` traces once per input signature, then replays (mirrored/traced_function.py).

The custom loop's step under ``@tf.function`` must train exactly as the eager loop and as
``fit``: the same weights and optimizer slots, bit for bit, after the same steps (a replay
that re-zeroed Adam's moments, or froze Adam's alpha or a batch, changes the last bits at
once). And TensorFlow's semantics of what a trace does once: Python ``print`` while tracing
only, ``tf.print`` every call; a new shape traces again; what it returns stays valid after
the next call; what cannot be recorded runs eagerly with one warning naming the line.
"""
import warnings

import numpy as np
import pytest
from conftest import tutorial_train_step
from test_one_step import OPTIMIZERS, custom_loop, make_model

import mirrored as tf
from mirrored import traced_function
from mirrored.program import recording, replay
from mirrored.backends import CpuOps
from mirrored.mirrored_run import ReplicaWorkers


@pytest.mark.parametrize("kind,replicas,opt", [("CPU", 2, "adam"), ("CPU", 1, "sgd-momentum"),
                                               ("GPU", 2, "adam")])
def test_replayed_eager_and_fit_give_bitwise_equal_weights(devices, rng, kind, replicas, opt, monkeypatch):
    devices(cpus=replicas if kind == "CPU" else 1, gpus=replicas if kind == "GPU" else 0)
    features, hidden, classes, batch, steps = (5, 4, 3, 4, 3) if kind == "GPU" else (13, 9, 5, 33, 5)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(replicas)])
    l2 = float(rng.uniform(0.001, 0.01)) if opt == "adam" else 0.0
    x = rng.standard_normal((steps * batch - 3, features)).astype(np.float32)   # a short last batch
    y = rng.integers(0, classes, x.shape[0])
    models = [make_model(strategy, features, hidden, classes, OPTIMIZERS[opt](), l2) for _ in range(3)]
    by_fit, by_eager, by_replay = models
    for m in models[1:]:
        m.set_weights(by_fit.get_weights())
    start = by_fit.get_weights()

    by_fit.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    if kind == "GPU":                  # the simulator is slow: fit == eager is test_one_step's
        by_eager.set_weights(by_fit.get_weights())
        slots_of_eager = by_fit
    else:
        slots_of_eager = by_eager
    _, eager_losses = custom_loop(strategy, by_eager, by_eager.optimizer, x, y, batch) if kind != "GPU" \
        else (None, None)
    threads = []                       # a replay must not hand the step to the replica threads
    original = ReplicaWorkers.run
    monkeypatch.setattr(ReplicaWorkers, "run", lambda self, *a: threads.append(1) or original(self, *a))
    step, losses = custom_loop(strategy, by_replay, by_replay.optimizer, x, y, batch, compiled=True)

    assert step.experimental_get_tracing_count() == 2           # the full batch, then the short one
    assert len(threads) == (2 if replicas > 1 else 0)           # the two traces only
    assert int(by_replay.optimizer.iterations) == int(by_fit.optimizer.iterations) == steps
    for w0, a, b, c in zip(start, by_fit.get_weights(), by_eager.get_weights(), by_replay.get_weights()):
        assert not np.array_equal(w0, a), "fit did not train"
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    slots = [m.optimizer.keras_variables(m.step.pack) for m in (by_fit, slots_of_eager, by_replay)]
    for a, b, c in zip(*slots):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    # every loss the replay returned is still its own step's (not overwritten by the next)
    assert all(isinstance(v, tf.Tensor) for v in losses)
    if eager_losses is not None:
        np.testing.assert_array_equal([float(v) for v in losses], [float(v) for v in eager_losses])
    for v in by_replay.trainable_variables:                     # every replica's copy alike
        copies = strategy.experimental_local_results(v)
        for c in copies[1:]:
            np.testing.assert_array_equal(c.numpy(), copies[0].numpy())


def _setup(devices, rng, replicas=2, batch=8, steps=3):
    devices(cpus=replicas)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    model = make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0)
    x = rng.standard_normal((batch * steps, 6)).astype(np.float32)
    y = rng.integers(0, 4, len(x))
    batches = list(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)))
    return strategy, model, batches, tutorial_train_step(model, batch)


def test_print_runs_while_tracing_and_tf_print_every_call(devices, rng, capsys):
    strategy, model, batches, train_step = _setup(devices, rng)
    printed = []

    @tf.function
    def step(batch):
        losses = strategy.run(train_step, args=(batch,))
        printed.append(str(losses))                  # Python: while tracing only
        print("per-replica losses:", losses)
        total = strategy.reduce("SUM", losses, axis=None)
        tf.print("total:", total)                    # every call, this call's value
        return total

    totals = [step(b) for b in batches]
    err = capsys.readouterr()
    assert len(printed) == 1 and 'Tensor("traced", shape=(), dtype=float32)' in printed[0]
    assert err.out.count("per-replica losses:") == 1
    shown = [line for line in err.err.splitlines() if line.startswith("total:")]
    assert shown == ["total: " + str(t.numpy()) for t in totals]
    assert len(set(float(t) for t in totals)) == 3         # three different steps' losses


def test_returned_tensors_accumulate_on_the_device(devices, rng):
    strategy, model, batches, train_step = _setup(devices, rng)

    @tf.function
    def step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)

    total = 0.0
    kept = []
    for b in batches:
        loss = step(b)
        kept.append(loss)
        total += loss                              # a device add, no host read
    assert isinstance(total, tf.Tensor)
    assert float(total) == pytest.approx(sum(float(v) for v in kept), rel=1e-6)
    assert len({float(v) for v in kept}) == len(kept)      # each call's own value


def test_kept_results_stay_their_own_and_a_loop_keeping_none_allocates_none(devices, rng, monkeypatch):
    """Returned tensors come from a pool of buffers per output (replay.OutputPool):
    a result the caller keeps (a list of losses, a view of one) is never rewritten by a later
    replay; where the caller keeps nothing, a replay allocates nothing on the devices."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    features, rows, batch = 6, 48, 4
    models = [make_model(strategy, features, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    x = rng.standard_normal((rows, features)).astype(np.float32)
    batches = list(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 4, rows))).batch(batch)))

    def distributed(model):
        def step(b):
            per_replica = strategy.run(tutorial_train_step(model, batch), args=(b,))
            return strategy.reduce("SUM", per_replica, axis=None), per_replica
        return step
    eager, replayed = distributed(models[0]), tf.function(distributed(models[1]))
    expected = [eager(b) for b in batches + batches]
    expected = [(float(total), [c.numpy() for c in per.values]) for total, per in expected]
    kept = [replayed(b) for b in batches]                       # every step's results, kept
    views = [tf.reshape(per.values[1], (1,)) for _, per in kept]   # views outlive their tensor
    kept = [(total, per.values[0]) for total, per in kept]
    made = _count_allocations(monkeypatch, strategy.extended.devices)
    for i, b in enumerate(batches):                             # a loop that keeps nothing
        total, per = replayed(b)
        if i == 1:
            made_by_first_two = len(made)
    assert made_by_first_two > 0 and len(made) == made_by_first_two, made   # none after two calls
    assert float(total) == expected[-1][0]
    for (total, first), view, (want_total, want) in zip(kept, views, expected):
        assert float(total) == want_total
        np.testing.assert_array_equal(first.numpy(), want[0])
        np.testing.assert_array_equal(view.numpy(), want[1].reshape(1))
    assert len({float(t) for t, _ in kept}) == len(kept)
    trace, = traced_function_traces(replayed)
    assert all(len(pool.entries) <= replay.POOL_SIZE for pool in trace.pools.values())


def _count_allocations(monkeypatch, devs):
    """A list that gets one item per buffer allocated on ``devs`` from now on."""
    made = []
    for cls in {type(d) for d in devs}:
        original = cls.empty
        monkeypatch.setattr(cls, "empty", lambda self, *a, _o=original: made.append(a) or _o(self, *a))
    return made


def test_kept_results_on_a_gpu_stay_their_own(devices, rng, monkeypatch):
    """The pool on (simulated) GPU arrays: a Tensor holds the array, not its memory's owner,
    and a slice holds the owner, not the array; either keeps the buffer from reuse."""
    dev, = devices(cpus=1, gpus=1)[1:]
    with tf.device("GPU:0"):
        x = tf.constant(rng.standard_normal((3, 2)).astype(np.float32))
        ks = [tf.constant(np.full((3, 2), k, np.float32)) for k in range(7)]
    scaled = tf.function(lambda x, k: x * k + 1.0)
    kept = [scaled(x, k) for k in ks[:4]] + [tf.reshape(scaled(x, k), (6,)) for k in ks[4:6]]
    made = _count_allocations(monkeypatch, [dev])
    for _ in range(5):
        out = scaled(x, ks[6])                             # keeps nothing but the last
    assert scaled.experimental_get_tracing_count() == 1
    assert len(made) <= 2, made                            # then two buffers take turns
    want = x.numpy()
    for k, got in enumerate(kept):
        np.testing.assert_array_equal(got.numpy().reshape(3, 2), want * np.float32(k) + np.float32(1))
    np.testing.assert_array_equal(out.numpy(), want * np.float32(6) + np.float32(1))


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_float_target_losses_replay_bitwise_as_eagerly(devices, rng, loss, replicas):
    """MeanSquaredError and BinaryCrossentropy take float targets (keras/tape.py
    ``_targets_on``): kept on the device (BCE's integer labels cast there), not read on
    the host, so their custom loops trace and replay instead of running eagerly."""
    devices(cpus=replicas)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    rows, batch, outputs = 22, 8, 2                            # a short last batch
    x = rng.standard_normal((rows, 5)).astype(np.float32)
    if loss == "mse":
        y, loss_object = rng.standard_normal((rows, outputs)).astype(np.float32), \
            tf.keras.losses.MeanSquaredError(reduction="none")
    else:
        y, loss_object = rng.integers(0, 2, (rows, outputs)).astype(np.int32), \
            tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")
    models = []
    for _ in range(2):
        with strategy.scope():
            models.append(tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(4, activation="relu"),
                                               tf.keras.layers.Dense(outputs)]))
            models[-1].compile(optimizer=tf.keras.optimizers.Adam(0.01), loss=loss_object)
    models[1].set_weights(models[0].get_weights())
    start = models[0].get_weights()
    batches = list(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)))

    def distributed(model):
        train_step = tutorial_train_step(model, batch, loss_object)
        return lambda b: strategy.reduce("SUM", strategy.run(train_step, args=(b,)), axis=None)
    eager, replayed = distributed(models[0]), tf.function(distributed(models[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", traced_function.EagerFallbackWarning)
        for _ in range(2):
            for b in batches:
                np.testing.assert_array_equal(eager(b).numpy(), replayed(b).numpy())
    assert replayed.experimental_get_tracing_count() == 2      # the full batch, the short one
    for w0, a, b in zip(start, models[0].get_weights(), models[1].get_weights()):
        assert not np.array_equal(w0, a), "the loop did not train"
        np.testing.assert_array_equal(a, b)


def test_a_host_read_runs_the_function_eagerly_with_one_warning(devices, rng):
    strategy, model, batches, train_step = _setup(devices, rng, replicas=1)
    twin = make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0)
    twin.set_weights(model.get_weights())
    seen = []

    @tf.function
    def step(batch):
        loss = strategy.run(train_step, args=(batch,))
        if float(loss) > 0:                        # Python control flow on a value: not recordable
            seen.append(1)
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in batches:
            step(b)
    fallbacks = [w for w in caught if issubclass(w.category, traced_function.EagerFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert fallbacks[0].filename == __file__ and "if float(loss) > 0" in str(fallbacks[0].message)
    assert "reads a device value on the host" in str(fallbacks[0].message)
    assert len(seen) == len(batches)               # eager every call: its Python ran each time
    assert int(model.optimizer.iterations) == len(batches)   # no step twice, none skipped
    # the same steps, eagerly, on the twin: the same weights
    twin_step = tutorial_train_step(twin, 8)
    for b in batches:
        twin_step(b)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_next_on_an_iterator_inside_the_function_runs_it_eagerly(devices, rng):
    strategy, model, batches, train_step = _setup(devices, rng)
    x = rng.standard_normal((24, 6)).astype(np.float32)
    it = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 4, 24))).batch(8)))

    @tf.function
    def step(iterator):
        return strategy.run(train_step, args=(next(iterator),))

    with pytest.warns(traced_function.EagerFallbackWarning, match="distributed iterator"):
        for _ in range(3):
            step(it)
    assert int(model.optimizer.iterations) == 3
    with pytest.raises(StopIteration):
        next(it)                                   # every batch was taken, none frozen


def test_a_failing_trace_or_replay_leaves_no_trace(devices, rng, monkeypatch):
    strategy, model, batches, train_step = _setup(devices, rng)
    twin = make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0)
    twin.set_weights(model.get_weights())
    start = model.get_weights()

    @tf.function
    def step(batch):
        return strategy.run(train_step, args=(batch,))

    with monkeypatch.context() as patch:             # the trace fails in the all-reduce
        patch.setattr(strategy.extended.cross_device_ops, "all_reduce_flat",
                      lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected in the trace")))
        with pytest.raises(RuntimeError, match="injected in the trace"):
            step(batches[0])
    assert step.experimental_get_tracing_count() == 1 and int(model.optimizer.iterations) == 0
    for a, b in zip(start, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    step(batches[0])                                 # traces again, trains
    assert step.experimental_get_tracing_count() == 2
    calls = []
    with monkeypatch.context() as patch:             # the replay fails in the update
        patch.setattr(CpuOps, "adam", lambda *a: calls.append(1) or (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            step(batches[1])
    assert calls and int(model.optimizer.iterations) == 1      # the failed step is not counted
    step(batches[1])
    step(batches[2])
    assert step.experimental_get_tracing_count() == 2
    custom = lambda b: strategy.run(tutorial_train_step(twin, 8), args=(b,))      # noqa: E731 (eagerly)
    for b in batches:
        custom(b)
    assert int(twin.optimizer.iterations) == int(model.optimizer.iterations) == 3
    # the failed replay's forward and backward had run; the update had not: weights as eager
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_the_step_reorders_into_one_run_of_launches_with_the_same_result(devices, rng):
    """What a GPU captures: host work moved out of the launches (begin_step to the front, a
    metric's update to the back) leaves ONE run of launches per step, one CUDA graph; replayed
    in that order on CPU devices it trains bitwise as the recorded order."""
    strategy, model, batches, train_step = _setup(devices, rng)
    twin = make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0)
    twin.set_weights(model.get_weights())
    accuracy = [tf.keras.metrics.SparseCategoricalAccuracy() for _ in range(2)]

    def make(m, acc):
        inner = tutorial_train_step(m, 8)

        def step_fn(inputs):
            loss = inner(inputs)
            acc.update_state(inputs[1], m(inputs[0], training=False))
            return loss
        return tf.function(lambda b: strategy.run(step_fn, args=(b,)))

    plain, moved = make(model, accuracy[0]), make(twin, accuracy[1])
    plain(batches[0])
    moved(batches[0])
    trace = next(iter(traced_function_traces(moved)))
    parts = replay.segments(replay.reorder(trace.entries))
    runs = [p for p in parts if isinstance(p, list)]
    assert len(runs) == 1, parts
    # begin_step, the update count (Optimizer.count_update) and where each replica's two
    # forwards left their output (ReplicaProgram.ran_forward): host entries at the front; the
    # metric's two host calls at the back
    names = [p.fn.__name__ if isinstance(p, replay.HostCall) else "launches" for p in parts]
    front, back = names[:names.index("launches")], names[names.index("launches") + 1:]
    assert sorted(front) == ["begin_step", "count_update"] + ["ran_forward"] * 4, names
    assert len(back) == 2 and "ran_forward" not in back, names
    trace.segments = parts
    for b in batches[1:]:
        plain(b)
        moved(b)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert float(accuracy[0].result()) == float(accuracy[1].result())


def traced_function_traces(fn):
    return fn._traces.values()


def test_recording_catches_launches_made_by_code_holding_ops_from_before(devices):
    """The boundary's methods are wrapped once, on the classes, and consult the calling
    thread's recorder, so an ``ops`` object taken before the trace (a layer program keeps
    one) is recorded too."""
    dev = devices(cpus=1)[0]
    ops = dev.ops
    a = dev.from_numpy(np.arange(4, dtype=np.float32))
    out = dev.empty((4,), np.float32)
    with recording.Recording() as rec:
        ops.binary_scalar("mul", a, 2.0, out)
    assert [e.name for e in rec.entries] == ["binary_scalar"]
    assert "binary_scalar" not in vars(type(ops)) or type(ops).binary_scalar.__qualname__.startswith("CpuOps")
    out[...] = 0
    rec.entries[0].run()
    np.testing.assert_array_equal(out, [0, 2, 4, 6])


@pytest.mark.parametrize("kind,replicas", [("CPU", 2), ("GPU", 1)])
def test_the_replay_captured_as_graphs_trains_as_eagerly(devices, rng, monkeypatch, kind, replicas):
    """Where graphs can be captured (here: ``test_graphs``'s stand-in, which records the
    launches a capture sees and replays them), a replay runs its one run of launches through
    ``capture.StepGraphs``: the trace is its first run, the first replay captures, later ones
    replay (one first-run rule with fit's: no eager run between the trace and the capture). The
    weights match the eager loop's bitwise."""
    from test_graphs import RecordedGraph

    from mirrored.program import capture
    monkeypatch.setattr(capture, "why_not_capturable", lambda devices, ops=None: None)
    monkeypatch.setattr(capture, "_Graph", RecordedGraph)
    RecordedGraph.captures = 0
    devices(cpus=replicas if kind == "CPU" else 1, gpus=replicas if kind == "GPU" else 0)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(replicas)])
    features, rows, batch = (4, 9, 3) if kind == "GPU" else (6, 40, 8)
    models = [make_model(strategy, features, 5, 3, tf.keras.optimizers.Adam(0.01), 0.0) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    x = rng.standard_normal((rows, features)).astype(np.float32)
    y = rng.integers(0, 3, rows)
    batches = list(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)))
    eager, replayed = (lambda b: strategy.run(tutorial_train_step(models[0], batch), args=(b,))), \
        tf.function(lambda b: strategy.run(tutorial_train_step(models[1], batch), args=(b,)))
    for b in batches:
        eager(b)
        replayed(b)
    trace, = traced_function_traces(replayed)
    assert trace.graphs is not None and RecordedGraph.captures == 1
    # the trace is the first run (counted eager); the first replay captures: no eager rerun
    assert trace.graphs.counts == {"eager": 1, "captured": 1, "replayed": len(batches) - 1}
    assert sum(isinstance(p, list) for p in trace.segments) == 1       # one graph per step
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_metric_result_read_inside_runs_eagerly_and_stays_live(devices, rng):
    strategy, model, batches, train_step = _setup(devices, rng, replicas=1)
    accuracy = tf.keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def step(batch):
        images, labels = batch
        accuracy.update_state(labels, model(images, training=False))
        return accuracy.result()                   # a host value: frozen if it were traced

    with pytest.warns(traced_function.EagerFallbackWarning, match="result"):
        results = [float(step(b)) for b in batches]
    expected = []
    hits = seen = 0
    for images, labels in batches:
        predictions = np.argmax(model(images, training=False).numpy(), axis=1)
        hits, seen = hits + int((predictions == labels.numpy()).sum()), seen + len(predictions)
        expected.append(float(np.float32(hits / seen)))
    assert results == expected


def test_a_model_built_inside_the_trace_is_built_once(devices, rng):
    """A Sequential without an input shape is built by its first call, here inside the trace:
    the packed copy of its initial weights (and its zeroed buffers) must not be made again
    at every replay, or every step would start from the initial weights."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((40, 6)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    batches = list(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8)))
    built = []
    for _ in range(2):
        with strategy.scope():
            built.append((tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu"), tf.keras.layers.Dense(3)]),
                          tf.keras.optimizers.SGD(0.1)))
    (traced, opt), (twin, twin_opt) = built
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def stepper(model, optimizer):
        def step_fn(inputs):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(inputs[1], model(inputs[0], training=True)),
                                                  global_batch_size=8)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return lambda b: strategy.run(step_fn, args=(b,))
    step = tf.function(stepper(traced, opt))
    step(batches[0])                                   # builds the model inside the trace
    twin(batches[0][0].values[0])
    twin.set_weights(traced.get_weights())             # SGD: no state but the weights
    eager = stepper(twin, twin_opt)
    for b in batches[1:]:
        step(b)
        eager(b)
    for a, b in zip(traced.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_numpy_arguments_are_tensors_and_python_values_key_the_trace(devices, rng):
    devices(cpus=1)
    calls = []

    @tf.function
    def scaled(x, factor):
        calls.append(factor)                       # Python: once per trace
        return x * factor

    x = tf.constant(rng.standard_normal(5).astype(np.float32))
    got = [scaled(x, 2.0), scaled(x, 2.0), scaled(x, 3.0), scaled(x * 1.0, 3.0)]
    assert calls == [2.0, 3.0] and scaled.experimental_get_tracing_count() == 2
    for out, f in zip(got, (2.0, 2.0, 3.0, 3.0)):
        np.testing.assert_array_equal(out.numpy(), x.numpy() * np.float32(f))
    host = rng.standard_normal(4).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # issue 50: TensorFlow converts NumPy arrays (no fallback)
        first = scaled(host, 2.0)
        np.testing.assert_array_equal(np.asarray(first), host * 2)
        np.testing.assert_array_equal(np.asarray(scaled(host + 1, 2.0)), (host + 1) * 2)   # not frozen
    assert calls == [2.0, 3.0, 2.0] and scaled.experimental_get_tracing_count() == 3    # traced by shape


def test_fit_and_a_replayed_custom_loop_taking_turns_train_as_eagerly(devices, rng, monkeypatch):
    """``fit``'s step sends the optimizer's scalars up WITH its inputs (one copy; its update reads
    them there), a custom loop's ``apply_gradients`` puts them in the optimizer's own buffer: each
    graph must hold the address its own step writes. fit and a replayed custom loop taking turns on
    one model, both captured (``test_graphs``' stand-in records and replays the launches a capture
    sees), train bitwise as the same turns run eagerly."""
    from test_graphs import RecordedGraph

    from mirrored.program import capture
    monkeypatch.setattr(capture, "why_not_capturable", lambda devices, ops=None: None)
    monkeypatch.setattr(capture, "_Graph", RecordedGraph)
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    batch, rows = 8, 40
    models = [make_model(strategy, 6, 5, 3, tf.keras.optimizers.Adam(0.01), 0.0) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    eager, captured = models
    eager.compile(loss=eager.loss, optimizer=eager.optimizer, run_eagerly=True)
    x = rng.standard_normal((rows, 6)).astype(np.float32)
    y = rng.integers(0, 3, rows)
    batches = list(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)))
    loops = [lambda b: strategy.run(tutorial_train_step(eager, batch), args=(b,)),
             tf.function(lambda b: strategy.run(tutorial_train_step(captured, batch), args=(b,)))]
    for _ in range(2):                                   # the custom loop, fit, the loop, fit
        for model, loop in zip(models, loops):
            for b in batches:
                loop(b)
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert captured._step_graphs.counts["replayed"] >= 2 * (rows // batch - 2), captured._step_graphs.counts
    trace, = traced_function_traces(loops[1])
    assert trace.graphs.counts["replayed"] >= 2 * len(batches) - 2, trace.graphs.counts
    assert int(eager.optimizer.iterations) == int(captured.optimizer.iterations) == 4 * len(batches)
    for a, b in zip(eager.get_weights(), captured.get_weights()):
        np.testing.assert_array_equal(a, b)
