"""CUDA-graph capture of a training step (mirrored/graphs.py, compile(cuda_graph=True)).

Everywhere: what StepGraphs does with keys (eager once, captured once, replayed after),
why a step cannot be captured (CPU devices, the simulator, ReductionToOneDevice, a traced
ring), and that compile(cuda_graph=True) trains exactly like an eager fit where it falls
back. On a real GPU: fit with graphs gives bitwise the weights and logs of an eager fit.
"""
import warnings

import numpy as np
import pytest

import mirrored as tf
from mirrored import graphs


def make_model(strategy, din, cuda_graph, optimizer="adam"):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(7, activation="relu", input_shape=(din,)),
                                     tf.keras.layers.Dense(3)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01) if optimizer == "adam" else
                  tf.keras.optimizers.SGD(0.1, momentum=0.9),
                  metrics=["accuracy"], cuda_graph=cuda_graph)
    return model


def fit_pair(names, rng, n=29, din=5, batch=8, epochs=2, optimizer="adam"):
    """Fit the same model, data and initial weights eagerly and with cuda_graph=True."""
    x = rng.standard_normal((n, din)).astype(np.float32)
    y = rng.integers(0, 3, n)
    strategy = tf.distribute.MirroredStrategy(names)
    eager = make_model(strategy, din, False, optimizer)
    graphed = make_model(strategy, din, True, optimizer)
    graphed.set_weights(eager.get_weights())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h_eager = eager.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False)
        h_graph = graphed.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False)
    return eager, graphed, h_eager, h_graph, [str(w.message) for w in caught if "cuda_graph" in str(w.message)]


def assert_same_training(eager, graphed, h_eager, h_graph):
    for a, b in zip(eager.get_weights(), graphed.get_weights()):
        assert np.array_equal(a, b), "a captured step must train bitwise like an eager one"
    assert h_eager.history == h_graph.history


# --- where there is nothing to capture --------------------------------------------------------

@pytest.mark.parametrize("kind,n", [("CPU", 1), ("CPU", 2), ("GPU", 2)])
def test_fallback_trains_exactly_like_eager_and_says_why(devices, rng, kind, n):
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    from mirrored.devices import cuda_mode
    if kind == "GPU" and cuda_mode() == "real":
        pytest.skip("on a real GPU the step is captured: test_graph_replay_matches_eager_on_a_gpu")
    eager, graphed, h_eager, h_graph, said = fit_pair([f"{kind}:{i}" for i in range(n)], rng)
    assert_same_training(eager, graphed, h_eager, h_graph)
    want = "CPU devices" if kind == "CPU" else "simulator"
    assert len(said) == 1 and want in said[0], said          # once, with the reason
    assert graphed._step_graphs.counts["replayed"] == 0


def test_reasons_a_step_cannot_be_captured(devices):
    devs = devices(cpus=1, gpus=2)
    cpu, two = devs[:1], devs[1:]
    assert [d.device_type for d in two] == ["GPU", "GPU"]
    assert "CPU devices" in graphs.why_not_capturable(cpu)
    reason = graphs.why_not_capturable(two, tf.distribute.ReductionToOneDevice())
    assert "ReductionToOneDevice" in reason
    reason = graphs.why_not_capturable(two, tf.distribute.RingAllReduce(trace=True))
    assert "trace" in reason
    from mirrored.devices import cuda_mode
    if cuda_mode() != "real":
        assert "simulator" in graphs.why_not_capturable(two, tf.distribute.RingAllReduce())
    else:
        assert graphs.why_not_capturable(two, tf.distribute.RingAllReduce()) is None


def test_step_graphs_run_each_key_eagerly_once_then_capture_once_then_replay(monkeypatch):
    """The bookkeeping of StepGraphs.run, with the CUDA part replaced by a recorder."""
    calls, captured = [], []

    class FakeGraph:
        def __init__(self, fn, args):
            self.fn, self.args = fn, args

        def launch(self):
            calls.append(("replay",) + self.args)

        @classmethod
        def capture(cls, devices, fn, args):
            captured.append(args)
            return cls(fn, args)

        def close(self):
            pass

    monkeypatch.setattr(graphs, "_Graph", FakeGraph)
    sg = graphs.StepGraphs([])
    sg.reason = None                                   # pretend the devices allow graphs
    step = lambda tag: calls.append(("eager", tag))    # noqa: E731
    got = [sg.run(key, step, key) for key in ["a", "a", "a", "b", "a", "b"]]
    assert got == ["eager", "replayed", "replayed", "eager", "replayed", "replayed"]
    assert captured == [("a",), ("b",)]                # each key captured exactly once
    assert calls == [("eager", "a"), ("replay", "a"), ("replay", "a"), ("eager", "b"),
                     ("replay", "a"), ("replay", "b")]
    assert sg.counts == {"eager": 2, "captured": 2, "replayed": 4}


def test_recompiling_drops_the_graphs(devices, rng):
    devices(cpus=1)
    model = make_model(tf.distribute.MirroredStrategy(["CPU:0"]), 4, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6), verbose=0)
    first = model._step_graphs
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model._step_graphs is None                  # cuda_graph not asked for this time
    assert first is not None


# --- on a real GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,optimizer", [(1, "adam"), (2, "adam"), (2, "sgd"), (4, "adam")])
def test_graph_replay_matches_eager_on_a_gpu(devices, rng, n, optimizer):
    devices(cpus=1, gpus=n)
    eager, graphed, h_eager, h_graph, said = fit_pair([f"GPU:{i}" for i in range(n)], rng,
                                                      n=61, batch=8 * n, epochs=3, optimizer=optimizer)
    assert not said, said
    counts = graphed._step_graphs.counts
    # 2 batch sizes (full and last): each runs once eagerly, is captured once, then replays.
    assert counts["captured"] == 2 and counts["eager"] == 2 and counts["replayed"] > counts["eager"]
    assert_same_training(eager, graphed, h_eager, h_graph)
