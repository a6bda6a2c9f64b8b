"""benchmarks/training.py's --modes: eager rows (run_eagerly=True) and graph rows
(run_eagerly=False, CUDA graphs: GPU only). Without a GPU the graph rows are skipped with
the reason, and a mode that does not exist is refused.

    python -m pytest -q tests/test_benchmarks_training_modes.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}   # the program decides
    env["MIRRORED_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "benchmarks.training", "--smoke", "--models", "lab",
                           "--no-peers", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)


def test_graph_rows_are_skipped_with_the_reason_without_a_gpu(tmp_path):
    out = tmp_path / "training.json"
    proc = run("--modes", "eager,graph", "--no-resident", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["method"]["modes"] == ["eager", "graph"] and doc["method"]["resident_rows"] is False
    rows = {(r["strategy"], r["replicas"]) for r in doc["results"] if r["framework"] == "ours"}
    assert rows == {("no strategy", 1), ("OneDeviceStrategy", 1), ("MirroredStrategy", 1),
                    ("MirroredStrategy", 2), ("MirroredStrategy", 4),        # no resident, no graph
                    ("MirroredStrategy custom loop eager", 1),               # issue 41's rows
                    ("MirroredStrategy custom loop @function", 1)}, rows
    skipped = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert "no GPU" in skipped["graph rows"]


def test_an_unknown_mode_is_refused():
    proc = run("--modes", "eager,jit")
    assert proc.returncode == 2 and "--modes takes a comma-separated subset of eager, graph" in proc.stderr
