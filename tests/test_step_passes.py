"""``passes.StepPasses``: the contract ``CapturedStep`` runs a model's step through (issue 50).

``program/passes.py`` sits below ``keras/`` and calls nothing of a step but what ``StepPasses``
names (``tests/test_layering.py`` checks the names). One host effect of a step used to be
patched in twice: ``fit`` through graphs raised ``optimizer.updates_done`` after the device
part, and the device part's Python raised it too whenever it ran (the eager first run of a
key, the capture, and, with the simulator's stand-in, every replay), so one step counted as
two. Now the update count is an entry of the step's recorded program (``Optimizer.count_update``,
a ``HostCall``): each run of the program counts once, however the graphs run its launches.
Checked with two stand-ins for a CUDA graph, on CPU devices: one that records the launches
while capturing and replays them (a real graph), one that reruns them at each replay
(``conftest.ReplayByRerun``). And one first-run rule: an execution of ``steps_per_execution``
steps is one program once its first run, N single steps, completed.

    python -m pytest -q tests/test_step_passes.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.program import capture, passes
from conftest import ReplayByRerun
from test_graphs import RecordedGraph

L = tf.keras.layers


@pytest.mark.parametrize("stand_in", [RecordedGraph, ReplayByRerun])
@pytest.mark.parametrize("per_execution", [1, 2])
def test_a_captured_fit_counts_each_update_once(devices, rng, monkeypatch, stand_in, per_execution):
    devices(cpus=2)
    monkeypatch.setattr(capture, "why_not_capturable", lambda devs, ops=None: None)   # as on a GPU
    monkeypatch.setattr(capture, "_Graph", stand_in)
    rows, batch, epochs = 13, 4, 3                     # batches of 4, 4, 4, 1: eager, captured, replayed
    x = rng.standard_normal((rows, 5)).astype(np.float32)
    y = rng.integers(0, 3, rows)
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        model = tf.keras.Sequential([L.Dense(3, input_shape=(5,))])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01), steps_per_execution=per_execution)
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False)
    steps = epochs * -(-rows // batch)
    sg = model._step_graphs
    assert sg.counts["replayed"] > 0 and model._trainer() is not model.step, "the test must replay"
    assert int(model.optimizer.iterations) == steps
    assert model.optimizer.updates_done == steps, (
        f"{model.optimizer.updates_done} updates counted for {steps} steps ({sg.counts})")


@pytest.mark.parametrize("fit", [True, False])
def test_an_execution_that_failed_midway_is_a_first_execution_again(devices, rng, monkeypatch, fit):
    """One first-run rule: an execution's shape is one program once its first run completed.
    The N-step executions of steps_per_execution once marked their batch sizes done before
    the N single steps ran, so after a failed one the next was captured, its later steps'
    buffers made inside the capture (which a real CUDA graph refuses: eager for good after).
    Now: after a failed execution the next runs as N single steps (no N-step program), and
    the one after it as one program, put together from the steps' recordings."""
    devices(cpus=1)
    monkeypatch.setattr(capture, "why_not_capturable", lambda devs, ops=None: None)
    monkeypatch.setattr(capture, "_Graph", RecordedGraph)
    x = rng.standard_normal((4, 5)).astype(np.float32)                  # one execution: 2 batches of 2
    y = rng.integers(0, 3, 4)
    with tf.distribute.MirroredStrategy(["CPU:0"]).scope():
        model = tf.keras.Sequential([L.Dense(3, input_shape=(5,))])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(0.1), steps_per_execution=2)
    model.predict(x[:1], verbose=0)                                      # built, graphs made
    step, name = model.step, "host_part" if fit else "inputs"
    original, calls = getattr(step, name), []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected: out of device memory")
        return original(*args, **kwargs)
    monkeypatch.setattr(step, name, second_fails)
    run = (lambda: model.fit(x, y, batch_size=2, verbose=0, shuffle=False)) if fit else \
        (lambda: model.evaluate(x, y, batch_size=2, verbose=0))
    with pytest.raises(MemoryError):
        run()
    sg = model._step_graphs

    def executions():
        return sorted(k for k in sg._graphs if k[0] in ("train steps", "evaluate steps"))
    run()                                                                # the 2 steps, one by one
    assert executions() == [], sg._graphs
    run()                                                                # now one program: one capture
    assert len(executions()) == 1, sg._graphs


def test_captured_step_takes_a_step_passes_only():
    with pytest.raises(TypeError, match="StepPasses"):
        passes.CapturedStep(object(), capture.StepGraphs([]))


def test_the_contract_says_what_is_missing():
    """A subclass that leaves a pass out is told which, not an AttributeError deep in a capture."""
    class Partial(passes.StepPasses):
        def host_part(self, batch):
            return [], 1.0
    with pytest.raises(NotImplementedError):
        Partial().device_part([], None, 1.0)
    assert set(vars(passes.StepPasses)) >= {"host_part", "device_part", "evaluate_part", "predict_part",
                                           "written", "rolled_back_on_error", "rows"}
