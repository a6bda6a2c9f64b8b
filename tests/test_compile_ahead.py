"""Compiling a step's kernels ahead of its first launch (``kernels/compile_ahead.py``, issue 40).

In the simulator (nothing compiles there, so ``passes._compile_ahead`` is made to answer as on a
GPU, with ``missing`` recording what the plan found instead of loading or compiling it):

* the plan run of each pass's first device part writes down exactly the kernels, with the
  argument kinds, that the real run then launches: a small ConvNet (fused conv + pool, dense,
  Dropout, Adam), trained, evaluated and predicted, one and two replicas, and with
  ``steps_per_execution=2``;
* it changes nothing: the launches, the weights, Adam's slots, the update count and predict's
  outputs are bitwise those of a model without it (the simulated kernels are counted);
* a plan run that raises is left for the real run to raise; only the thread that plans records.

What goes wrong in a child (an exit code, no report, a kernel it cannot make, a hang) costs
time, never the run: reported, this process compiles its own share, one warning; a Ctrl-C
while waiting leaves no child behind. The shares, the signature strings, a factory kernel's
recipe and the ``python -m mirrored info`` line are checked too.

Without the simulator: ``tests/test_kernel_disk_cache.py``'s compile-ahead test (the real
compiler, the driver stubbed: children compile the lab's kernels into the disk cache, and the
run after compiles none); on a real GPU, the ``gpu``-marked test at the end (a fresh process
trains bitwise as one that compiles at launch).
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import mirrored as tf
from kernels import compile_ahead, launch
from mirrored.program import capture, passes
from conftest import ReplayByRerun

L = tf.keras.layers
ROOT = Path(__file__).resolve().parent.parent
#: Tests that count the simulator's kernel runs (on a GPU: ``test_a_gpu_fit_compiled_ahead...``).
simulator_only = pytest.mark.skipif(not launch.SIMULATOR, reason="counts the CUDA simulator's "
                                    "kernel runs; on a GPU the gpu-marked test below checks the same")


def _describe(args):
    return tuple((str(a.dtype), len(a.shape)) if hasattr(a, "shape") else type(a).__name__
                 for a in args)


class Recorder:
    """Stands in for what a GPU would do with the plan: the planned launches, per first run."""

    def __init__(self, monkeypatch):
        self.plans = []
        monkeypatch.setattr(passes, "_compile_ahead", lambda devices, ops=None: compile_ahead)
        monkeypatch.setattr(compile_ahead, "missing", self.missing)

    def missing(self, launches):
        self.plans.append([(k, _describe(a)) for k, a in launches])
        return []


class LaunchLog:
    """Every simulated kernel run, as (kernel, argument kinds)."""

    def __init__(self, monkeypatch):
        from numba.cuda.simulator.kernel import FakeCUDAKernel
        self.runs = []
        call = FakeCUDAKernel.__call__

        def run(kernel, *args):
            if not kernel._device:                   # a kernel, not a device function it calls
                self.runs.append((kernel, _describe(args)))
            return call(kernel, *args)
        monkeypatch.setattr(FakeCUDAKernel, "__call__", run)


def convnet(n_replicas, seed, steps_per_execution=1):
    strategy = tf.distribute.MirroredStrategy([f"GPU:{i}" for i in range(n_replicas)])
    tf.random.set_seed(seed)
    with strategy.scope():
        model = tf.keras.Sequential([
            L.Conv2D(4, 3, activation="relu", input_shape=(8, 8, 1)), L.MaxPooling2D(),
            L.Flatten(), L.Dense(6, activation="relu"), L.Dropout(0.3), L.Dense(3)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    return model


def _fit(n_replicas, x, y, seed, steps_per_execution):
    model = convnet(n_replicas, seed, steps_per_execution)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    model.evaluate(x, y, batch_size=4, verbose=0)
    model.predicted = model.predict(x, batch_size=4, verbose=0)
    return model


@simulator_only
@pytest.mark.parametrize("n_replicas, steps_per_execution", [(1, 1), (2, 1), (1, 2)])
def test_the_plan_finds_what_the_first_run_launches_and_changes_nothing(
        devices, rng, monkeypatch, n_replicas, steps_per_execution):
    devices(gpus=n_replicas)
    monkeypatch.setattr(capture, "why_not_capturable", lambda devs, ops=None: None)  # as on a GPU
    monkeypatch.setattr(capture, "_Graph", ReplayByRerun)
    x = rng.standard_normal((10, 8, 8, 1)).astype(np.float32)   # batches of 4, 4 and 2
    y = rng.integers(0, 3, 10)
    seed = int(rng.integers(1 << 30))
    log = LaunchLog(monkeypatch)
    plain = _fit(n_replicas, x, y, seed, steps_per_execution)
    plain_runs, log.runs = log.runs, []

    recorder = Recorder(monkeypatch)
    original = compile_ahead.before_first_run
    firsts = []

    def before_first_run(plan, device_id=0, children=None):
        result = original(plan, device_id, children=0)
        firsts.append(len(log.runs))                  # the real run's launches start here
        return result
    monkeypatch.setattr(compile_ahead, "before_first_run", before_first_run)
    planned = _fit(n_replicas, x, y, seed, steps_per_execution)

    # a plan per first run of a pass: training's batch sizes 4 and 2, evaluate's, predict's
    assert len(recorder.plans) == len(firsts) == 6, len(recorder.plans)
    for plan, start in zip(recorder.plans, firsts):
        assert plan, "a plan run wrote down no launch"
        assert [(id(k), d) for k, d in plan] == [(id(k), d) for k, d in log.runs[start:start + len(plan)]]
    names = {k.__name__ for plan in recorder.plans for k, _ in plan}
    assert {"conv2d_relu_pool", "max_pool_backward_v2", "adam_kernel", "fill_kernel"} <= names, names
    assert any("dropout" in name for name in names), names
    # nothing of the plans ran, and nothing changed: the launches, weights and slots of a plain fit
    assert [(id(k), d) for k, d in log.runs] != [] and len(log.runs) == len(plain_runs)
    assert [(k.__name__, d) for k, d in log.runs] == [(k.__name__, d) for k, d in plain_runs]
    assert int(plain.optimizer.iterations) == int(planned.optimizer.iterations) == 3
    assert plain.optimizer.updates_done == planned.optimizer.updates_done
    for a, b in zip(plain.get_weights(), planned.get_weights()):
        np.testing.assert_array_equal(a, b)
    slots = [m.optimizer.keras_variables(m.step.pack) for m in (plain, planned)]
    assert len(slots[0]) == len(slots[1]) > len(plain.get_weights())
    for a, b in zip(*slots):
        np.testing.assert_array_equal(a, b)                 # Adam's m and v too
    np.testing.assert_array_equal(plain.predicted, planned.predicted)


def test_a_plan_run_that_raises_leaves_the_raise_to_the_real_run():
    def device_part(what):
        raise ValueError(what)
    report = compile_ahead.before_first_run(lambda: device_part("bad buffers"))
    assert report["planned"] is None and "ValueError: bad buffers" in report["error"]


def test_only_the_planning_thread_writes_its_launches_down():
    """Another thread's launch, made while this one plans, runs; the plan stays this thread's."""
    from numba import cuda
    from kernels import elementwise
    out = cuda.to_device(np.zeros(5, np.float32))

    def other():
        elementwise.fill(out, np.float32(2.5))
    with launch.planned() as launches:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        elementwise.fill(out, np.float32(7.0))     # written down, not run
        with launch.planned() as inner:               # a nested plan: its own list
            elementwise.fill(out, np.float32(9.0))
    assert np.array_equal(out.copy_to_host(), np.full(5, 2.5, np.float32))
    assert len(launches) == 1 and len(inner) == 1
    assert launches[0][0] is inner[0][0] and float(launches[0][1][1]) == 7.0


def test_a_dry_run_writes_launches_down_and_runs_no_host_call_even_inside_a_trace(rng):
    """``recording.dry_run`` (the plan): each kernel launch written down and none made, a
    host call (the update count, a metric) written down and not run, what the block made
    dropped by its ``undo``; called inside a trace, the trace records on afterwards."""
    import contextlib
    from numba import cuda
    from kernels import elementwise
    from mirrored.program import recording
    start = rng.standard_normal(5).astype(np.float32)
    out = cuda.to_device(start)
    ran, undone = [], []
    host = recording.host_work(lambda: ran.append(1))

    def part():
        elementwise.fill(out, np.float32(rng.standard_normal()))
        host()

    @contextlib.contextmanager
    def undo():
        try:
            yield
        except BaseException:
            undone.append(1)
            raise
    with recording.Recording() as trace:
        launches = recording.dry_run(part, (), undo)
        assert recording.active() is trace
    assert len(launches) == 1 and launches[0][0].__name__ == "fill_kernel"
    assert not ran and undone == [1] and trace.entries == []
    np.testing.assert_array_equal(out.copy_to_host(), start)     # nothing launched


class FakeKernel:
    class stats:
        cache_path = "/cache"

    def __init__(self, line):
        self.line = line


def test_shares_keep_an_index_file_in_one_process_and_balance_the_rest(monkeypatch):
    monkeypatch.setattr(compile_ahead.disk_cache, "file_prefix", lambda k: f"f-{k.line}.")
    kernels = [FakeKernel(line) for line in (1, 1, 1, 2, 3, 3, 4, 5)]
    jobs = [(k, (i,)) for i, k in enumerate(kernels)]
    shares = compile_ahead._shares(jobs, 3)
    assert sorted(len(s) for s in shares) == [2, 3, 3]
    for share in shares:
        lines = {k.line for k, _ in share}
        for line in lines:                # every job of an index file is in this share
            assert sum(1 for k, _ in jobs if k.line == line) == sum(1 for k, _ in share
                                                                     if k.line == line)
    assert sorted(t for s in shares for _, t in s) == sorted(t for _, t in jobs)


def test_signature_strings_give_back_the_launch_types():
    from numba.core import types as nt
    cases = [(nt.Array(nt.float32, 1, "C"), nt.uint32),
             (nt.Array(nt.int8, 1, "C"), nt.Array(nt.float32, 2, "C"), nt.int64, nt.float32),
             (nt.Array(nt.float32, 4, "C"), nt.Array(nt.int32, 3, "A"), nt.boolean)]
    for types in cases:
        text = compile_ahead.signature_of(types)
        assert text.startswith("void(") and compile_ahead.parse(text) == types, text
    # a type it does not spell: None (that kernel compiles at its launch)
    assert compile_ahead.signature_of((nt.Array(nt.float32, 1, "C", readonly=True),)) is None
    assert compile_ahead.signature_of((nt.unicode_type,)) is None


def test_a_factory_kernel_names_how_to_make_it_again():
    from kernels import conv2d_v3, registry
    geo = conv2d_v3.geometry((4, 8, 8, 1), (3, 3, 1, 4), (1, 1), "valid")
    kernel = conv2d_v3.forward_kernel(geo, True, 2)
    recipe = compile_ahead.recipe(kernel)
    assert recipe[:2] == ["kernels.conv2d_v3", "forward_kernel"]
    request = {"label": registry.spec_of(kernel).label, "module": "kernels.conv2d_v3",
               "made_by": recipe, "signature": "void()"}
    assert compile_ahead.make(request) is kernel           # made again: the same kernel
    assert compile_ahead.recipe(registry.by_label("max_pool_v1").kernel) == []


# --- what goes wrong in a child costs time, never the run ------------------------------------

class CompilingHere(FakeKernel):
    """A kernel this process compiles (its share): the compile is written down."""

    def __init__(self, line, compiled):
        super().__init__(line)
        self.compiled = compiled

    def compile(self, types):
        self.compiled.append((self.line, types))


def _jobs(monkeypatch, n):
    monkeypatch.setattr(compile_ahead.disk_cache, "file_prefix", lambda k: f"f-{k.line}.")
    monkeypatch.setattr(compile_ahead, "job", lambda kernel, types: {"label": f"k{kernel.line}",
                                                                     "signature": "void()"})
    compiled = []
    return [(CompilingHere(line, compiled), (line,)) for line in range(n)], compiled


@pytest.mark.parametrize("child, words", [
    ("import sys; sys.exit(3)", "a child exited with code 3"),
    ("import sys; print('not JSON'); sys.stderr.write('it broke\\n'); sys.exit(1)", "it broke"),
    ("import json; print(json.dumps([{'label': 'k1', 'signature': 'void()', 'seconds': 0.1, "
     "'error': 'LookupError: gone'}]))", "k1 void(): LookupError: gone"),
])
def test_a_failing_child_is_reported_and_this_process_still_compiles_its_share(monkeypatch, child,
                                                                              words):
    import sys
    jobs, compiled = _jobs(monkeypatch, 4)
    report = compile_ahead.compile_all(jobs, 0, 1, command=[sys.executable, "-c", child])
    assert report["children"] == 1 and report["here"] == len(compiled) == 2
    assert len(report["errors"]) == 1 and words in report["errors"][0], report["errors"]


def test_a_child_that_hangs_is_stopped_at_the_time_limit(monkeypatch):
    import sys
    import time
    jobs, compiled = _jobs(monkeypatch, 3)
    monkeypatch.setattr(compile_ahead, "CHILD_TIMEOUT_S", 1)
    start = time.monotonic()
    report = compile_ahead.compile_all(jobs, 0, 1, command=[sys.executable, "-c",
                                                            "import time; time.sleep(60)"])
    assert time.monotonic() - start < 30
    assert report["errors"] == ["a child was still compiling after 1 s and was stopped"]


class Failing(CompilingHere):
    def __init__(self, line, compiled, error):
        super().__init__(line, compiled)
        self.error = error

    def compile(self, types):
        raise self.error


def test_a_compile_error_here_is_reported_and_a_ctrl_c_leaves_no_child_behind(monkeypatch):
    import subprocess as sp
    import sys
    started = []

    class Popen(sp.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
    monkeypatch.setattr(compile_ahead.subprocess, "Popen", Popen)
    jobs, compiled = _jobs(monkeypatch, 2)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    # this process's share fails to compile: reported (its launch raises it), the rest goes on
    jobs[0] = (Failing(0, compiled, TypeError("no such overload")), (0,))
    report = compile_ahead.compile_all(jobs, 0, 1, command=[sys.executable, "-c", "print('[]')"])
    assert len(report["errors"]) == 1 and report["errors"][0].endswith(": TypeError: no such overload")
    assert report["children"] == 1 and report["here"] == 1
    # a Ctrl-C while this process compiles its share: it propagates, and the child is stopped
    jobs[0] = (Failing(0, compiled, KeyboardInterrupt()), (0,))
    with pytest.raises(KeyboardInterrupt):
        compile_ahead.compile_all(jobs, 0, 1, command=sleeper)
    assert len(started) == 2 and started[-1].poll() is not None


def test_before_first_run_warns_once_with_what_failed_and_how_to_turn_it_off(monkeypatch):
    jobs, _ = _jobs(monkeypatch, 5)
    monkeypatch.setattr(compile_ahead, "missing", lambda launches: jobs)
    monkeypatch.setattr(compile_ahead, "compile_all", lambda jobs, device, children: {
        "children": 2, "here": 2, "errors": ["a child exited with code 1: boom"]})
    with pytest.warns(RuntimeWarning) as caught:
        report = compile_ahead.before_first_run(lambda: [], children=2)
    assert report["missing"] == 5 and report["children"] == 2 and compile_ahead.log[-1] is report
    message = str(caught[0].message)
    assert "boom" in message and "MIRRORED_COMPILE_AHEAD=0" in message and "first launch" in message


def test_children_are_as_many_as_free_cores_and_gpu_memory_allow(monkeypatch):
    jobs, _ = _jobs(monkeypatch, 12)
    asked = []
    monkeypatch.setattr(compile_ahead, "missing", lambda launches: jobs)
    monkeypatch.setattr(compile_ahead, "compile_all", lambda jobs, device, children: asked.append(
        children) or {"children": children, "here": 1, "errors": []})
    gib = 2**30
    for cores, free, want in [(16, 80 * gib, compile_ahead.MAX_CHILDREN), (4, 80 * gib, 3),
                              (16, 2 * gib, 2), (16, 0.9 * gib, 0), (1, 80 * gib, 0)]:
        monkeypatch.setattr(compile_ahead, "_free_cores", lambda: cores)
        monkeypatch.setattr(compile_ahead, "_fit_in_memory",
                            lambda: int(free // 2 // compile_ahead.CHILD_CONTEXT_BYTES))
        report = compile_ahead.before_first_run(lambda: [])
        assert report["children"] == want, (cores, free, report)
    assert asked == [compile_ahead.MAX_CHILDREN, 3, 2]


def test_a_run_with_nothing_missing_asks_nothing_of_the_device_and_an_odd_answer_is_no_limit(
        monkeypatch):
    monkeypatch.setattr(compile_ahead, "missing", lambda launches: [])
    monkeypatch.setattr(compile_ahead, "_fit_in_memory", lambda: pytest.fail("asked the device"))
    assert compile_ahead.before_first_run(lambda: [])["children"] == 0
    monkeypatch.undo()
    # the simulator's context answers NaN for its free memory: no limit from it, no error
    assert compile_ahead._fit_in_memory() == compile_ahead.MAX_CHILDREN


def test_too_few_kernels_or_cores_start_no_child(monkeypatch):
    jobs, _ = _jobs(monkeypatch, compile_ahead.MIN_KERNELS)
    started = []
    monkeypatch.setattr(compile_ahead, "compile_all", lambda *a: started.append(a) or
                        {"children": 1, "here": 1, "errors": []})
    monkeypatch.setattr(compile_ahead, "missing", lambda launches: jobs[:-1])
    assert compile_ahead.before_first_run(lambda: [], children=4)["children"] == 0
    monkeypatch.setattr(compile_ahead, "missing", lambda launches: jobs)
    assert compile_ahead.before_first_run(lambda: [], children=0)["children"] == 0
    assert started == []
    assert compile_ahead.before_first_run(lambda: [], children=4)["children"] == 1


def test_a_child_reports_a_kernel_it_cannot_make_and_goes_on():
    import io
    import json
    request = {"device": 0, "jobs": [
        {"label": "no_such_kernel", "module": "kernels.elementwise", "made_by": [],
         "signature": "void(float32[::1])"},
        {"label": "max_pool_backward_v2[made up]", "module": "kernels.pooling",
         "made_by": ["kernels.pooling", "backward_v2_kernel",
                     repr(((4, 4, 1, 2, 2, 0, 0, 2, 2), True, "int8"))],
         "signature": "void(float32[::1])"}]}
    out, selected = io.StringIO(), []
    compile_ahead.child_main(json.dumps(request), out, select_device=selected.append)
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert selected == [0] and [r["label"] for r in report] == ["no_such_kernel",
                                                               "max_pool_backward_v2[made up]"]
    assert report[0]["error"].startswith("LookupError: no kernel labelled no_such_kernel")
    assert report[1]["error"].startswith("LookupError: made max_pool_backward_v2[4x4x1")


@simulator_only
def test_info_says_whether_a_first_run_compiles_ahead(monkeypatch):
    from mirrored import info
    assert "compile      off: the CUDA simulator compiles nothing" in info.report()
    monkeypatch.setattr(launch, "SIMULATOR", False)         # as on a GPU host
    monkeypatch.setattr(compile_ahead, "_free_cores", lambda: 16)
    assert compile_ahead.note().startswith(f"on: a pass's first run on GPUs compiles "
                                           f"{compile_ahead.MIN_KERNELS} or more missing kernels "
                                           f"in up to {compile_ahead.MAX_CHILDREN} child")
    monkeypatch.setattr(compile_ahead, "_free_cores", lambda: 1)
    assert compile_ahead.note().startswith("off here: one free core")
    monkeypatch.setenv("MIRRORED_KERNEL_CACHE", "0")
    assert "nothing is kept on disk" in compile_ahead.note()
    monkeypatch.setenv("MIRRORED_COMPILE_AHEAD", "0")
    assert compile_ahead.note().startswith("off (MIRRORED_COMPILE_AHEAD=0)")


GPU_FIT = """
    import json, os
    import numpy as np
    import mirrored as tf
    from kernels import compile_ahead
    L = tf.keras.layers
    tf.random.set_seed(7)
    rng = np.random.default_rng(7)
    x, y = rng.random((96, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 96)
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([L.Conv2D(8, 3, activation="relu", input_shape=(28, 28, 1)),
                                     L.MaxPooling2D(), L.Flatten(), L.Dense(16, activation="relu"),
                                     L.Dense(10)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01), metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    loss, accuracy = model.evaluate(x, y, batch_size=32, verbose=0)
    print(json.dumps({"log": compile_ahead.log, "loss": loss,
                      "weights": [w.tolist() for w in model.get_weights()]}))
"""


def _gpu_fit(**env):
    environ = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **env,
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(GPU_FIT)], cwd=ROOT, env=environ,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_a_gpu_fit_compiled_ahead_trains_as_one_compiled_at_launch(tmp_path):
    """On a real GPU, a fresh process with an empty kernel cache: fit's first step compiles its
    kernels in child processes (no error), and trains bitwise as a process that compiles each
    kernel at its launch (MIRRORED_COMPILE_AHEAD=0, a cache of its own); a second process
    finds nothing missing."""
    ahead = _gpu_fit(NUMBA_CACHE_DIR=str(tmp_path / "ahead"))
    serial = _gpu_fit(NUMBA_CACHE_DIR=str(tmp_path / "serial"), MIRRORED_COMPILE_AHEAD="0")
    first = ahead["log"][0]
    assert first["errors"] == [] and first["missing"] >= compile_ahead.MIN_KERNELS, first
    assert first["children"] >= 1 or os.cpu_count() < 3, first
    assert serial["log"] == []
    assert ahead["weights"] == serial["weights"] and ahead["loss"] == serial["loss"]
    again = _gpu_fit(NUMBA_CACHE_DIR=str(tmp_path / "ahead"))
    assert all(entry["missing"] == 0 and entry["children"] == 0 for entry in again["log"]), again["log"]
    assert again["weights"] == ahead["weights"]
