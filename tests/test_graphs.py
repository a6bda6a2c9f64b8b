"""CUDA graphs of fit, evaluate and predict (mirrored/program/capture.py; compile(run_eagerly=False)).

A graph cannot be captured on CPU devices or in Numba's simulator, so most of these tests
put a stand-in in ``capture._Graph``: ``RecordedGraph`` records the calls a pass makes on
the devices' ops and copies without running them, and replays them with the arguments
they were captured with (buffers by reference, numbers frozen, Python not re-run), which
is what a CUDA graph holds. Through it, a model compiled with the default
(``run_eagerly=False``) must train, evaluate and predict bitwise like ``run_eagerly=True``,
dropout included (each replay a new mask); a Dropout that passed its key from the host
(the old layer) is shown to fail that test. Also: the first-run rule (a recorded program over StepGraphs), why a step
cannot be captured, the default's silence where nothing can be, ``cuda_graph=`` as a
deprecated alias. On a real GPU: the same comparison with real graphs.

    python -m pytest -q tests/test_graphs.py
"""
import warnings

import numpy as np
import pytest

from kernels import dropout as dropout_kernels
import mirrored as tf
from mirrored.program import capture, recording
from mirrored.keras import layers as layers_mod

L = tf.keras.layers


def make_model(strategy, din, dropout=False, optimizer="adam", **compile_kwargs):
    with strategy.scope():
        model = tf.keras.Sequential([L.Dense(7, activation="relu", input_shape=(din,))]
                                    + ([L.Dropout(0.5, seed=3)] if dropout else []) + [L.Dense(3)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01) if optimizer == "adam" else
                  tf.keras.optimizers.SGD(0.1, momentum=0.9),
                  metrics=["accuracy"], **compile_kwargs)
    return model


def passes(model, x, y, batch, epochs):
    """fit (with validation), then evaluate and predict twice each: what the model gives."""
    history = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False,
                        validation_data=(x[:11], y[:11]))
    evals = [model.evaluate(x, y, batch_size=batch, verbose=0) for _ in range(2)]
    preds = [model.predict(x, batch_size=batch, verbose=0) for _ in range(2)]
    return model.get_weights(), history.history, evals, preds


def assert_same(eager, graphed):
    (w_e, h_e, ev_e, p_e), (w_g, h_g, ev_g, p_g) = eager, graphed
    for a, b in zip(w_e, w_g):
        assert np.array_equal(a, b), "a replayed step must train bitwise like an eager one"
    assert h_e == h_g and ev_e == ev_g
    for a, b in zip(p_e, p_g):
        assert np.array_equal(a, b)


def pair(names, rng, dropout=False, n=29, din=5, batch=8, epochs=2, optimizer="adam"):
    """The same model, data and weights with run_eagerly=True and with the default."""
    x = rng.standard_normal((n, din)).astype(np.float32)
    y = rng.integers(0, 3, n)
    strategy = tf.distribute.MirroredStrategy(names)
    eager = make_model(strategy, din, dropout, optimizer, run_eagerly=True)
    graphed = make_model(strategy, din, dropout, optimizer)
    graphed.set_weights(eager.get_weights())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = passes(eager, x, y, batch, epochs), passes(graphed, x, y, batch, epochs)
    return eager, graphed, results, [str(w.message) for w in caught]


class RecordedGraph:
    """A stand-in for ``capture._Graph`` where CUDA has no graphs (see the module docstring)."""

    captures = 0

    def __init__(self, calls):
        self.calls = calls

    @classmethod
    def capture(cls, devices, fn, args):
        calls, undo = [], []

        def recorder(original):
            return lambda *a, **k: calls.append((original, a, k))   # recorded, not run
        for dev in devices:
            names = [(dev.ops, m) for m in dir(dev.ops) if not m.startswith("_")]
            names += [(dev, "copy_into"), (dev, "copy_peer_into")]
            for obj, name in names:
                original = getattr(obj, name)
                if callable(original):
                    setattr(obj, name, recorder(original))
                    undo.append((obj, name))
        try:
            fn(*args)
        finally:
            for obj, name in undo:
                delattr(obj, name)                                  # back to the class's method
        cls.captures += 1
        return cls(calls)

    def launch(self):
        for original, a, k in self.calls:
            original(*a, **k)

    def close(self):
        self.calls = None


@pytest.fixture
def stand_in(monkeypatch):
    """Graphs 'enabled' on any device, captured and replayed by RecordedGraph."""
    monkeypatch.setattr(capture, "why_not_capturable", lambda devices, ops=None: None)
    monkeypatch.setattr(capture, "_Graph", RecordedGraph)
    RecordedGraph.captures = 0
    return RecordedGraph


# --- the passes, captured and replayed (by the stand-in) ---------------------------------------

@pytest.mark.parametrize("kind,n,dropout", [("CPU", 1, False), ("CPU", 2, True), ("CPU", 3, True),
                                            ("GPU", 1, True)])
def test_fit_evaluate_and_predict_replayed_match_eager(devices, rng, stand_in, kind, n, dropout):
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    rows, batch = (11, 4) if kind == "GPU" else (29, 8)            # the simulator: fewer rows
    eager, graphed, (a, b), said = pair([f"{kind}:{i}" for i in range(n)], rng, dropout, n=rows, batch=batch)
    assert_same(a, b)
    assert not said, said
    sg = graphed._step_graphs
    assert eager._step_graphs is None and eager._trainer() is eager.step
    # two batch shapes in each pass (a full one and the last): CPU 8 and 5, GPU 4 and 3
    assert sorted({k[0] for k in sg._graphs}) == ["evaluate", "predict", "train"]
    assert len(sg._graphs) == stand_in.captures >= 6
    assert sg.counts["replayed"] > sg.counts["eager"] and sg.last == "replayed"
    if dropout:
        steps = 2 * -(-rows // batch)                                # 2 epochs of training forwards
        assert graphed.layers[1]._steps == eager.layers[1]._steps == {r: steps for r in range(n)}


def test_a_dropout_key_from_the_host_would_freeze_the_mask(devices, rng, stand_in, monkeypatch):
    """The test above can fail: the old layer passed each step's key as a launch argument,
    and a replay then repeats the captured step's mask."""
    def host_key_forward(self, state, x, training=False):
        if not training:
            return x
        steps = self.__dict__.setdefault("host_steps", {})     # this layer's own count
        step = steps.get(state.replica_id, 0)
        steps[state.replica_id] = step + 1
        self._key = dropout_kernels.dropout_key(self._seed, step, state.global_replica_id)
        y = state.buffers(x.shape[0])
        state.ops.dropout(x, y, self.rate, self._key)
        return y

    def host_key_backward(self, state, dy):
        state.ops.dropout(dy, dy, self.rate, self._key)
        return dy
    monkeypatch.setattr(layers_mod.Dropout, "forward", host_key_forward)
    monkeypatch.setattr(layers_mod.Dropout, "backward", host_key_backward)
    devices(cpus=1)
    _, _, (a, b), _ = pair(["CPU:0"], rng, dropout=True)
    assert not all(np.array_equal(u, v) for u, v in zip(a[0], b[0])), \
        "the stand-in replayed a frozen key like a fresh one: it could not catch the bug"


def test_run_eagerly_true_never_captures_and_the_attribute_switches(devices, rng, stand_in):
    devices(cpus=1)
    model = make_model(tf.distribute.OneDeviceStrategy("CPU:0"), 4, run_eagerly=True)
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6)
    assert model.run_eagerly is True
    for _ in range(3):
        model.fit(x, y, verbose=0)
        model.predict(x, verbose=0)
    assert model._trainer() is model.step and stand_in.captures == 0
    model.run_eagerly = False                        # Keras's attribute, settable
    for _ in range(2):
        model.fit(x, y, verbose=0)
    assert stand_in.captures == 1 and model._step_graphs.counts["replayed"] == 1
    graphs_before = model._step_graphs
    model.run_eagerly = True
    assert model._step_graphs is None and graphs_before._graphs == {}   # closed


def test_a_recorded_program_is_captured_at_its_first_replay_then_replayed(devices, monkeypatch):
    """The one first-run rule (``recording.record``, then ``replay.Program.run`` over
    ``capture.StepGraphs``), the CUDA part replaced by a recorder: a key's first run is eager
    and recorded, its first replay captures the recorded launches, later ones replay the
    graph; the Python runs once per key. (Before, the graphs ran a key eagerly once, captured
    it from its Python the second time and replayed it after: the same calls, one rule less.)"""
    dev = devices(cpus=1)[0]
    calls, captured = [], []

    class FakeGraph:
        def __init__(self, key):
            self.key = key

        def launch(self):
            calls.append(("replay", self.key))

        @classmethod
        def capture(cls, devs, fn, args):
            captured.append([entry.name for entry in args[0]])
            return cls(len(captured))

        def close(self):
            pass

    monkeypatch.setattr(capture, "_Graph", FakeGraph)
    sg = capture.StepGraphs([dev])
    sg.reason = None                                   # pretend the devices allow graphs
    buf = dev.from_numpy(np.zeros(3, np.float32))

    def step(tag):
        calls.append(("eager", tag))                   # the Python: a key's first run only
        dev.ops.binary_scalar("add", buf, 1.0, buf)
        return f"buffers of {tag}"
    known, got, how = {}, [], []
    for key in ["a", "a", "a", "b", "a", "b"]:
        if key not in known:                           # what passes.CapturedStep._run does
            result, program = recording.record(lambda: step(key), sg, (key,))
            known[key] = program, result
            sg.ran_eagerly()
        else:
            program, result = known[key]
            program.run()
        got.append(result)
        how.append(sg.last)
    assert how == ["eager", "replayed", "replayed", "eager", "replayed", "replayed"]
    assert got == ["buffers of a"] * 3 + ["buffers of b", "buffers of a", "buffers of b"]
    assert captured == [["binary_scalar"], ["binary_scalar"]]   # each key captured exactly once
    assert calls == [("eager", "a"), ("replay", 1), ("replay", 1), ("eager", "b"),
                     ("replay", 1), ("replay", 2)]
    assert sg.counts == {"eager": 2, "captured": 2, "replayed": 4} and sorted(sg._graphs) == [("a",), ("b",)]


def test_a_failed_capture_warns_and_runs_eagerly_from_then_on(monkeypatch):
    class Refused:
        @classmethod
        def capture(cls, devices, fn, args):
            raise capture.CaptureError("cuStreamEndCapture failed: stand-in")

    monkeypatch.setattr(capture, "_Graph", Refused)
    sg = capture.StepGraphs([])
    sg.reason = None
    ran = []
    with pytest.warns(RuntimeWarning, match="stand-in.*runs eagerly"):
        sg.run("k", ran.append, 1)                     # the capture fails: run it eagerly now
    sg.run("k", ran.append, 2)
    assert ran == [1, 2] and not sg.enabled and "failed" in sg.reason


# --- where there is nothing to capture ----------------------------------------------------------

@pytest.mark.parametrize("kind,n", [("CPU", 1), ("CPU", 2), ("GPU", 2)])
def test_the_default_is_silent_and_trains_like_eager_where_nothing_is_captured(devices, rng, kind, n):
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    from mirrored.devices import cuda_mode
    if kind == "GPU" and cuda_mode() == "real":
        pytest.skip("on a real GPU the step is captured: test_graph_replay_matches_eager_on_a_gpu")
    sizes = {"n": 7, "batch": 4, "epochs": 1} if kind == "GPU" else {"n": 13}   # simulator: less
    eager, graphed, (a, b), said = pair([f"{kind}:{i}" for i in range(n)], rng, **sizes)
    assert_same(a, b)
    assert not said, said                              # the default does not warn
    # nothing captured: each pass's recorded program replayed as a list (program/replay.py)
    captured = graphed._trainer()
    assert graphed.run_eagerly is False and captured is not graphed.step
    assert captured.known and all(program.graphs is None for program, _ in captured.known.values())
    assert captured.graphs.counts["captured"] == 0
    want = "CPU devices" if kind == "CPU" else "simulator"
    assert want in graphed._step_graphs.reason


def test_cuda_graph_is_a_deprecated_alias_of_run_eagerly(devices, rng):
    devices(cpus=1)
    strategy = tf.distribute.OneDeviceStrategy("CPU:0")
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6)
    with pytest.warns(DeprecationWarning, match="run_eagerly"):
        asked = make_model(strategy, 4, cuda_graph=True)
    assert asked.run_eagerly is False
    with warnings.catch_warnings(record=True) as caught:   # an explicit request warns, once
        warnings.simplefilter("always")
        for _ in range(2):
            asked.fit(x, y, verbose=0)
            asked.evaluate(x, y, verbose=0)
            asked.predict(x, verbose=0)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "cuda_graph=True" in said[0] and "CPU devices" in said[0], said
    with pytest.warns(DeprecationWarning, match="run_eagerly=True"):
        eager = make_model(strategy, 4, cuda_graph=False)
    assert eager.run_eagerly is True and eager._step_graphs is None
    optimizer = eager.optimizer
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pass run_eagerly alone"):
        eager.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", run_eagerly=True,
                      cuda_graph=True)
    assert eager.optimizer is optimizer and eager.run_eagerly is True    # nothing changed


def test_reasons_a_step_cannot_be_captured(devices):
    devs = devices(cpus=1, gpus=2)
    cpu, two = devs[:1], devs[1:]
    assert [d.device_type for d in two] == ["GPU", "GPU"]
    assert "CPU devices" in capture.why_not_capturable(cpu)
    reason = capture.why_not_capturable(two, tf.distribute.ReductionToOneDevice())
    assert "ReductionToOneDevice" in reason
    reason = capture.why_not_capturable(two, tf.distribute.RingAllReduce(keep_steps=True))
    assert "step record" in reason
    from mirrored.devices import cuda_mode
    if cuda_mode() != "real":
        assert "simulator" in capture.why_not_capturable(two, tf.distribute.RingAllReduce())
    else:
        assert capture.why_not_capturable(two, tf.distribute.RingAllReduce()) is None


def test_recompiling_drops_the_graphs(devices, rng, stand_in):
    devices(cpus=1)
    model = make_model(tf.distribute.MirroredStrategy(["CPU:0"]), 4)
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6)
    for _ in range(2):
        model.fit(x, y, verbose=0)
    first = model._step_graphs
    assert first._graphs
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert first._graphs == {}                         # closed: they held the old optimizer's buffers
    assert model._step_graphs is not first and model.run_eagerly is False


# --- on a real GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,optimizer,dropout", [(1, "adam", False), (2, "adam", True), (2, "sgd", False),
                                                 (4, "adam", True)])
def test_graph_replay_matches_eager_on_a_gpu(devices, rng, n, optimizer, dropout):
    devices(cpus=1, gpus=n)
    _, graphed, (a, b), said = pair([f"GPU:{i}" for i in range(n)], rng, dropout, n=61, batch=8 * n,
                                    epochs=3, optimizer=optimizer)
    assert not said, said
    counts = graphed._step_graphs.counts
    assert {k[0] for k in graphed._step_graphs._graphs} == {"train", "evaluate", "predict"}
    assert counts["replayed"] > counts["eager"]
    assert_same(a, b)


def test_run_eagerly_is_saved_and_loaded_with_the_model(devices, rng, tmp_path):
    """Keras 3 keeps run_eagerly in the .keras file's compile_config; load_model compiles with it."""
    devices(cpus=1)
    strategy = tf.distribute.OneDeviceStrategy("CPU:0")
    for eager in (True, False):
        model = make_model(strategy, 4, run_eagerly=eager)
        model.fit(rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6), verbose=0)
        model.save(tmp_path / f"m{eager}.keras")
        with strategy.scope():
            assert tf.keras.models.load_model(tmp_path / f"m{eager}.keras").run_eagerly is eager
