"""benchmarks/step_path.py: the counts it reports are the counts of the calls it saw.

The program's counting is checked on made-up call sequences against a second, plainer
count (``itertools.groupby`` for the jumps), and its spans on made-up nested events;
then it follows the lab ConvNet's step on 2 logical CPUs, and every number it reports must agree
with the others (sums, subsets, the scopes nested). No number is a target here: the
program reports them (``python -m benchmarks.step_path``).

    python -m pytest -q tests/test_step_path.py
"""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import step_path

ROOT = Path(__file__).resolve().parents[1]

FILES = ["mirrored/a.py", "mirrored/keras/b.py", "kernels/c.py", "kernels/d.py"]


def random_calls(rng, n):
    return [(FILES[i], f"f{j}") for i, j in zip(rng.integers(0, len(FILES), n), rng.integers(0, 5, n))]


@pytest.mark.parametrize("n", [0, 1, 2, 31, 200])
def test_summarise_counts_calls_files_functions_and_jumps(rng, n):
    calls = random_calls(rng, n)
    for prefix in ("", "mirrored/", "kernels/"):
        mine = [c for c in calls if c[0].startswith(prefix)]
        got = step_path.summarise(calls, prefix)
        assert got["calls"] == len(mine)
        assert got["functions"] == len(set(mine))
        assert got["per_file"] == {f: sum(1 for c in mine if c[0] == f) for f in FILES
                                   if any(c[0] == f for c in mine)}
        assert got["files"] == len(got["per_file"])
        assert got["jumps"] == max(len(list(itertools.groupby(f for f, _ in mine))) - 1, 0)


def test_span_runs_from_the_start_call_to_the_end_return_on_the_start_thread():
    A, B, C = ("m/s.py", "Step.train"), ("m/o.py", "Opt.update"), ("k/x.py", "f")
    ev = [("call", *C, 1), ("return", *C, 1),
          ("call", *A, 1), ("call", *C, 1), ("return", *C, 1),
          ("call", *B, 2), ("return", *B, 2),                   # another thread's update: not the end
          ("call", *B, 1), ("call", *B, 1), ("return", *B, 1),  # a nested update: not yet the end
          ("call", *C, 1), ("return", *C, 1), ("return", *B, 1),
          ("call", *C, 1), ("return", *A, 1)]
    assert step_path.span(ev, A, B) == [A, C, B, B, B, C]
    assert step_path.span(ev, A) == [A, C, B, B, B, C, C]
    with pytest.raises(ValueError, match="never called"):
        step_path.span(ev, ("m/s.py", "nothing"))
    with pytest.raises(ValueError, match="never returned"):
        step_path.span(ev[:-1], A)


def test_the_lab_convnet_step_path_is_consistent(tmp_path):
    # In a process of its own, as the README runs it: a test before it in the same worker
    # (a strategy's scope or a replica context left behind) must not put files on the path.
    out = tmp_path / "step_path.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}   # CPU devices
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_path", "--replicas", "2", "--batch", "33",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())["scopes"]
    assert list(result) == ["fit", "batch", "step"]
    for scope, counts in result.items():
        for which, prefix in (("all", ""), ("mirrored", "mirrored/")):
            c = counts[which]
            assert sum(c["per_file"].values()) == c["calls"] > 0
            assert c["files"] == len(c["per_file"])
            assert all(f.startswith(prefix) and f.endswith(".py") for f in c["per_file"])
            assert c["files"] <= c["functions"] <= c["calls"]
            assert c["files"] - 1 <= c["jumps"] <= c["calls"] - 1
        everything, mine = counts["all"], counts["mirrored"]
        assert mine["per_file"] == {f: n for f, n in everything["per_file"].items()
                                    if f.startswith("mirrored/")}
        assert mine["jumps"] <= everything["jumps"]
    for inner, outer in (("step", "batch"), ("batch", "fit")):      # the scopes nest
        for f, n in result[inner]["all"]["per_file"].items():
            assert n <= result[outer]["all"]["per_file"][f], (inner, outer, f)
    step = result["step"]["all"]["per_file"]
    for f in ("mirrored/keras/step.py", "mirrored/keras/engine.py", "mirrored/keras/optimizers.py",
              "mirrored/ring.py"):                                    # 2 replicas: the ring runs
        assert f in step, f
    assert "mirrored/keras/callbacks.py" in result["fit"]["all"]["per_file"]
    # Issue 29: the files of mirrored/ one step crosses may not grow back. Moving code out of
    # the reading order's files put new files on this path before (a LearningRate module).
    most = {"fit": 15, "batch": 11, "step": 8}
    grown = {s: sorted(result[s]["mirrored"]["per_file"]) for s in most
             if result[s]["mirrored"]["files"] > most[s]}
    assert not grown, f"more mirrored/ files on one step's path than {most}: {grown}"
    assert "mirrored/keras/callbacks.py" not in step


def test_the_default_fit_replays_the_step_through_no_more_files(tmp_path):
    """``--replayed``: fit's default (``run_eagerly=False``) replays the recorded step after the
    warm-up, so the layers' Python is off the path and the program's replay is on it; the
    reading order's bound holds there too (issue 50: one device program, on CPU devices too)."""
    out = tmp_path / "replayed.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_path", "--replicas", "2", "--batch", "33",
                           "--replayed", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())["scopes"]
    assert list(result) == ["fit", "batch"]
    batch = result["batch"]["all"]["per_file"]
    assert "mirrored/program/replay.py" in batch and "mirrored/program/passes.py" in batch
    for f in ("mirrored/ring.py", "mirrored/keras/layers.py", "mirrored/program/recording.py"):
        assert f not in batch, f                     # the layers', the ring's Python: not run again
    most = {"fit": 15, "batch": 11}
    grown = {s: sorted(result[s]["mirrored"]["per_file"]) for s in most
             if result[s]["mirrored"]["files"] > most[s]}
    assert not grown, f"more mirrored/ files on the replayed step's path than {most}: {grown}"
