"""Keras's ``compile(steps_per_execution=N)``: N batches per execution (``trainer.py``'s fit
loop, ``model_api.py``'s evaluate, ``program/passes.py``'s ``CapturedStep.train_steps``).

What must hold, and how it is checked:

* The weights, the optimizer's slots and the History are bitwise those of N single
  steps: fit with N=1 against N=3 and N=4 on 10 batches (a multiple of neither), on 1 and
  2 CPU replicas, and on a simulated GPU (N=2, Dropout drawing a new mask each step). There,
  graphs are captured by the
  stand-in of ``tests/test_graphs.py`` (``RecordedGraph``: the calls a capture makes on
  the devices' ops and copies, replayed with the arguments they were captured with), and
  the test counts what the capture path did: ceil(steps / N) replays an epoch once every
  execution's shape is captured, one graph per shape, one optimizer launch per step in an
  execution's graph. (On a real GPU, the same comparison with real graphs: marked gpu.)
* The callbacks see what Keras 3 gives (``keras/src/trainers/epoch_iterator.py`` and the
  TensorFlow trainer's fit loop): one ``on_train_batch_begin(begin)`` and one
  ``on_train_batch_end(begin + N - 1)`` per execution, ``begin`` in
  ``range(0, steps, N)`` -- the expected sequence is derived here from that rule --
  ``stop_training`` looked at once per execution, an execution truncated at the epoch's end.
* ``get_compile_config``, ``model.save`` and ``load_model`` keep N; a bad N is refused
  before anything changes.
* A step that fails inside an execution: on CPU devices the steps before it stay done
  (counted, replicas bitwise equal) and it leaves nothing; on the capture path a failed
  host part leaves the whole execution undone.

    python -m pytest -q tests/test_steps_per_execution.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.values import components
from test_faults import assert_same_state, state_of
from test_graphs import RecordedGraph, stand_in  # noqa: F401  (stand_in: a fixture)

L = tf.keras.layers
ROWS, BATCH, DIN = 38, 4, 5          # 10 batches (9 of 4 rows, one of 2): a multiple of neither 3 nor 4


def make_model(names, n, weights=None, tiny=False):
    """Dense-ReLU-Dense; ``tiny`` (for the simulator, where each launch costs 0.1 s):
    Dropout then one Dense layer, which still draws a new mask every step."""
    strategy = tf.distribute.MirroredStrategy(names)
    with strategy.scope():
        model = tf.keras.Sequential([L.Dropout(0.3, seed=5, input_shape=(DIN,)), L.Dense(3)] if tiny else
                                    [L.Dense(6, activation="relu", input_shape=(DIN,)), L.Dense(3)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=n)
    if weights is not None:
        model.set_weights(weights)
    return model


def data(rng, rows=ROWS):
    return rng.standard_normal((rows, DIN)).astype(np.float32), rng.integers(0, 3, rows)


def train(model, x, y, epochs=2, batch_size=BATCH, **kwargs):
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False, **kwargs)
    return state_of(model), history.history


def assert_same_model_state(a, b):
    """Two models' ``state_of``: the same step count, weights and slots, bitwise (the slots'
    keys name each model's own parameter pack, so they are compared in order)."""
    assert b["iterations"] == a["iterations"]
    assert len(a["weights"]) == len(b["weights"])
    for u, v in zip(a["weights"], b["weights"]):
        assert np.array_equal(u, v), "N steps per execution must train bitwise like N single steps"
    slots_a, slots_b = list(a["slots"].values()), list(b["slots"].values())
    assert len(slots_a) == len(slots_b) and slots_a
    for u, v in zip(slots_a, slots_b):
        assert len(u) == len(v) and all(np.array_equal(p, q) for p, q in zip(u, v)), "the slots differ"


def assert_same_training(single, grouped):
    (state_1, history_1), (state_n, history_n) = single, grouped
    assert_same_model_state(state_1, state_n)
    assert history_n == history_1


def replicas_equal(model):
    for v in model.trainable_variables:
        first, *others = [c.numpy() for c in components(v)]
        assert all(np.array_equal(first, o) for o in others), "the replicas' copies differ"


# --- the weights: bitwise those of single steps ---------------------------------------------

@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("n", [3, 4])
def test_n_steps_per_execution_train_like_single_steps_on_cpus(devices, rng, cpus, n):
    devices(cpus=cpus)
    names = [f"CPU:{i}" for i in range(cpus)]
    x, y = data(rng)
    single = make_model(names, 1)
    grouped = make_model(names, n, single.get_weights())
    assert_same_training(train(single, x, y), train(grouped, x, y))
    # CPU devices: nothing to capture, the steps run in a row, each replaying its own recording
    assert not grouped._trainer().graphs.enabled and not grouped._trainer().executions
    replicas_equal(grouped)
    assert grouped.evaluate(x, y, batch_size=BATCH, verbose=0) == single.evaluate(x, y, batch_size=BATCH,
                                                                                  verbose=0)


def launches(graph, name):
    """How many ``name`` launches (e.g. "adam") a RecordedGraph holds."""
    return sum(getattr(call, "__name__", "") == name for call, _, _ in graph.calls)


def test_on_a_simulated_gpu_n_steps_are_one_captured_graph(devices, rng, stand_in):
    devices(gpus=1)
    n, batch, rows = 2, 2, 4               # one execution of 2 batches an epoch (the simulator is slow)
    x, y = data(rng, rows)
    steps = -(-rows // batch)
    single = make_model(["GPU:0"], 1, tiny=True)
    grouped = make_model(["GPU:0"], n, single.get_weights(), tiny=True)
    counts = []

    class Counts(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            counts.append(dict(self.model._step_graphs.counts))

    a = train(single, x, y, batch_size=batch)
    b = train(grouped, x, y, batch_size=batch, callbacks=[Counts()])
    assert_same_training(a, b)
    want = single.evaluate(x, y, batch_size=batch, verbose=0)
    assert [grouped.evaluate(x, y, batch_size=batch, verbose=0) for _ in range(2)] == [want, want]  # 2nd: replayed

    sg = grouped._step_graphs
    sizes = [min(batch, rows - i) for i in range(0, rows, batch)]                  # each batch's rows
    several = {tuple(sizes[s:s + n]) for s in range(0, steps, n)} - {(sizes[-1],)}  # executions of 2 or more
    assert several, "the test must run an execution of several steps"
    train_graphs = {k: g for k, g in sg._graphs.items() if k[0] == "train steps"}
    assert len(train_graphs) == len(several), "one graph per shape of execution"
    assert all(launches(g, "adam") == len(k) - 2 for k, g in train_graphs.items()), \
        "an execution's graph holds one optimizer launch per step"
    assert any(len(k) - 2 == n for k in train_graphs) and any(k[0] == "evaluate steps" for k in sg._graphs)
    # epoch 1 runs each shape of execution eagerly, then captures; epoch 2 replays them all
    assert counts[1]["replayed"] - counts[0]["replayed"] == -(-steps // n)
    assert counts[1]["eager"] == counts[0]["eager"], "no eager step once every execution is captured"


# --- the callbacks, as Keras 3 calls them ------------------------------------------------------

def keras_hooks(steps, n, epochs=1):
    """Keras 3's batch hooks for an epoch of ``steps`` batches with steps_per_execution ``n``
    (epoch_iterator.py: an execution starts at each ``step`` of ``range(0, steps, n)``; the
    trainer calls ``on_train_batch_begin(step)`` and ``on_train_batch_end(step + n - 1)``)."""
    one = [h for begin in range(0, steps, n) for h in (("begin", begin), ("end", begin + n - 1))]
    return one * epochs


class Hooks(tf.keras.callbacks.Callback):
    def __init__(self, stop_after=None):
        super().__init__()
        self.calls, self.iterations, self.stop_after = [], [], stop_after

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("end", batch))
        self.iterations.append(int(self.model.optimizer.iterations))
        if self.stop_after is not None and len(self.iterations) >= self.stop_after:
            self.model.stop_training = True


@pytest.mark.parametrize("n,steps_per_epoch", [(3, None), (4, None), (3, 7), (12, None), (1, None)])
def test_batch_hooks_follow_keras(devices, rng, n, steps_per_epoch):
    devices(cpus=1)
    x, y = data(rng)
    batches = -(-ROWS // BATCH)
    steps = steps_per_epoch or batches
    single = make_model(["CPU:0"], 1)
    grouped = make_model(["CPU:0"], n, single.get_weights())
    hooks = Hooks()
    _, history_n = train(grouped, x, y, epochs=2, callbacks=[hooks], steps_per_epoch=steps_per_epoch)
    _, history_1 = train(single, x, y, epochs=2, steps_per_epoch=steps_per_epoch)
    assert hooks.calls == keras_hooks(steps, n, epochs=2)
    # each execution ends min(n, what is left of the epoch) steps after the one before it
    done = [e * steps + min(b + n, steps) for e in range(2) for b in range(0, steps, n)]
    assert hooks.iterations == done
    assert history_n == history_1 and grouped.history.params["steps"] == steps


def test_stop_training_is_looked_at_once_per_execution(devices, rng):
    devices(cpus=1)
    x, y = data(rng)
    n = 3
    model = make_model(["CPU:0"], n)
    hooks = Hooks(stop_after=1)                  # asks to stop at the end of the first execution
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False, callbacks=[hooks])
    assert hooks.calls == keras_hooks(n, n)[:2] and int(model.optimizer.iterations) == n
    assert len(model.history.history["loss"]) == 1


def test_the_progress_bar_counts_batches(devices, rng, capsys):
    devices(cpus=1)
    x, y = data(rng)
    model = make_model(["CPU:0"], 4)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=1, shuffle=False)
    out = capsys.readouterr().out
    batches = -(-ROWS // BATCH)
    assert f"{batches}/{batches} [" in out and f"{batches + 2}/" not in out


# --- compile, saving ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", [4]])
def test_a_bad_n_is_refused_before_anything_changes(devices, bad):
    devices(cpus=1)
    model = make_model(["CPU:0"], 2)
    optimizer = model.optimizer
    with pytest.raises(ValueError, match="steps_per_execution.*positive whole number"):
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=bad)
    assert model.optimizer is optimizer and model.steps_per_execution == 2


def test_the_compile_config_and_a_keras_file_keep_n(devices, rng, tmp_path):
    devices(cpus=1)
    x, y = data(rng)
    model = make_model(["CPU:0"], 5)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert model.get_compile_config()["steps_per_execution"] == 5
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert loaded.steps_per_execution == 5 and loaded.get_compile_config()["steps_per_execution"] == 5
    other = make_model(["CPU:0"], 1)
    other.compile_from_config(model.get_compile_config())
    assert other.steps_per_execution == 5
    assert make_model(["CPU:0"], None).steps_per_execution == 1      # None: Keras's default, 1


# --- a step that fails inside an execution -------------------------------------------------------

def failing_on(monkeypatch, obj, name, call):
    """Make ``obj.name`` raise on its ``call``-th call (counted from 1)."""
    original, calls = getattr(obj, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise MemoryError("injected: out of device memory")
        return original(*args, **kwargs)
    monkeypatch.setattr(obj, name, wrapped)


def test_a_failed_step_keeps_the_steps_before_it_on_cpus(devices, rng, monkeypatch):
    devices(cpus=2)
    names = ["CPU:0", "CPU:1"]
    x, y = data(rng)
    grouped = make_model(names, 4)
    single = make_model(names, 1, grouped.get_weights())
    grouped.fit(x[:8], y[:8], batch_size=BATCH, verbose=0, shuffle=False)       # builds every buffer
    single.fit(x[:8], y[:8], batch_size=BATCH, verbose=0, shuffle=False)
    failing_on(monkeypatch, grouped.step, "host_part", 3)                       # the 3rd step of 4
    with pytest.raises(MemoryError):
        grouped.fit(x[:16], y[:16], batch_size=BATCH, verbose=0, shuffle=False)
    single.fit(x[:8], y[:8], batch_size=BATCH, verbose=0, shuffle=False)         # the 2 steps done
    after, want = state_of(grouped), state_of(single)
    assert_same_model_state(want, after)
    assert after["bytes"] == want["bytes"], "the failed step left buffers charged"
    replicas_equal(grouped)


def test_a_failed_host_part_leaves_a_captured_execution_undone(devices, rng, stand_in, monkeypatch):
    devices(gpus=1)
    x, y = data(rng, 4)
    model = make_model(["GPU:0"], 2, tiny=True)
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False)           # eager, then captured
    assert model._step_graphs.last == "replayed"
    before = state_of(model)
    failing_on(monkeypatch, model.step, "host_part", 2)                         # mid-execution
    with pytest.raises(MemoryError):
        model.fit(x, y, batch_size=2, verbose=0, shuffle=False)
    assert_same_state(before, state_of(model))


def test_setting_the_attribute_is_checked_too(devices):
    devices(cpus=1)
    model = make_model(["CPU:0"], 3)
    model.steps_per_execution = np.int64(6)                      # Keras's attribute, settable
    assert model.steps_per_execution == 6 and type(model.steps_per_execution) is int
    with pytest.raises(ValueError, match="model.steps_per_execution.*positive whole number"):
        model.steps_per_execution = 0
    assert model.steps_per_execution == 6


# --- on a real GPU: real CUDA graphs -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("gpus,n", [(1, 4), (2, 3)])
def test_real_graphs_of_n_steps_train_like_single_steps(devices, rng, gpus, n):
    devices(cpus=1, gpus=gpus)
    names = [f"GPU:{i}" for i in range(gpus)]
    x, y = data(rng, 61)                                  # 8 batches of 8 (the last of 5)
    single = make_model(names, 1, tiny=True)
    grouped = make_model(names, n, single.get_weights(), tiny=True)
    a, b = train(single, x, y, epochs=3, batch_size=8), train(grouped, x, y, epochs=3, batch_size=8)
    assert_same_training(a, b)
    replicas_equal(grouped)
    assert grouped.evaluate(x, y, batch_size=8, verbose=0) == single.evaluate(x, y, batch_size=8, verbose=0)
    sg = grouped._step_graphs
    assert sg.reason is None and any(k[0] == "train steps" for k in sg._graphs) and sg.last == "replayed"
