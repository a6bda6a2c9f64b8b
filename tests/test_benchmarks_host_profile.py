"""benchmarks/host_profile.py: a CPU run writes a profile that names the step's functions
(as text files, and as one JSON file with both ms/step and their ratio)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*args, tmp_path):
    env = dict(os.environ, MIRRORED_OFFLINE="1", NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.host_profile", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_cpu_run_profiles_fit_and_names_the_step(tmp_path):
    proc = run("--model", "dense", "--modes", "graph", "--epochs", "1", "--out", str(tmp_path / "p"),
               "--json", str(tmp_path / "host_profile.json"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("dense graph: verbose=0 ")]
    fast, slow = [float(w) for w in line.replace(",", " ").split() if w.replace(".", "").isdigit()]
    assert 0 < fast < 1000 and 0 < slow < 1000                # ms per step, both measured
    text = (tmp_path / "p" / "prof-dense-graph.txt").read_text()
    assert text.startswith(line)
    assert "=== sorted by tottime" in text and "=== sorted by cumulative" in text
    assert "keras/trainer.py" in text and "(fit)" in text     # the profile covers fit's step
    # --json (gpu_session.sh's plan 40): the same figures and profile in one file
    doc = json.loads((tmp_path / "host_profile.json").read_text())
    assert doc["benchmark"] == "host_profile" and doc["model"] == "dense" and list(doc["modes"]) == ["graph"]
    graph = doc["modes"]["graph"]
    assert (graph["summary"], "\n" + graph["profile"]) == (line, text[len(line):])
    assert [round(graph[f"verbose{v}_ms_per_step"], 3) for v in (0, 1)] == [fast, slow]
    assert graph["quiet_over_loud"] == pytest.approx(graph["verbose0_ms_per_step"] / graph["verbose1_ms_per_step"])
    assert doc["target"] == {"quiet_over_loud": 1.0} and "date_utc" in doc["device"]


def test_an_unknown_mode_is_refused(tmp_path):
    proc = run("--modes", "graph,fast", tmp_path=tmp_path)
    assert proc.returncode == 2 and "unknown mode 'fast'" in proc.stderr
