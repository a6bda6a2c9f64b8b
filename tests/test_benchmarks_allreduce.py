"""benchmarks/allreduce.py runs and writes valid JSON (``--smoke``: logical CPUs, tiny sizes).

The benchmark configures logical devices, which a process may do only once, so it
runs in a child process, as a user would run it:

    python -m benchmarks.allreduce --smoke --out /tmp/allreduce.json
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import REPEAT
from conftest import run_smoke

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.allreduce", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


def test_smoke_run_writes_valid_json(tmp_path):
    out = tmp_path / "allreduce.json"
    proc = run_smoke("allreduce", "--out", str(out))          # the README's form, in SMOKE_LIMIT_S
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "allreduce" and doc["mode"] == "smoke"
    assert {"numba", "numba_cuda", "numpy", "date_utc", "device"} <= set(doc["device"])
    assert doc["copy"]["GBps"] > 0
    assert sorted({r["n"] for r in doc["results"]}) == [2, 4, 8]
    for row in doc["results"]:
        for alg in ("ring", "reduce_to_one"):
            assert row[alg]["samples"] == REPEAT                # --repeat's default
            for key in (f"{alg}_us", f"{alg}_algbw", f"{alg}_busbw"):
                assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert math.isclose(row["ring_busbw"], row["ring_algbw"] * 2 * (row["n"] - 1) / row["n"])
    assert "ring µs" in proc.stdout                           # the table was printed


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":     # conftest.py decided: real GPU
        pytest.skip("a real GPU is present: the no-GPU message does not apply")
    results = ROOT / "benchmarks" / "results"
    before = set(results.iterdir()) if results.exists() else set()
    proc = _run("--out", str(tmp_path / "never.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no real GPU" in proc.stdout
    assert not (tmp_path / "never.json").exists()
    assert (set(results.iterdir()) if results.exists() else set()) == before
