"""benchmarks/breakdown.py runs and accounts for the whole step (a tiny run, in a child
process as a user runs it; no test asserts a time):

    MIRRORED_OFFLINE=1 python -m benchmarks.breakdown --steps 3 --rounds 2 --no-peers --out X
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"input copy", "conv2d fwd", "max_pooling2d fwd", "flatten fwd", "dense fwd", "dense_1 fwd",
         "loss", "dense_1 bwd", "dense bwd", "flatten bwd", "max_pooling2d bwd", "conv2d bwd",
         "all-reduce", "optimizer", "step, other", "fit loop", "total (fit)"}


def test_breakdown_names_every_part_of_the_convnet_step_and_they_add_up(tmp_path):
    out = tmp_path / "breakdown.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["MIRRORED_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.breakdown", "--steps", "3", "--rounds", "2",
                           "--no-peers", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "breakdown" and doc["model"] == "convnet" and doc["steps_per_round"] == 3
    rows = {r["part"]: r for r in doc["rows"]}
    assert set(rows) == PARTS, set(rows) ^ PARTS
    for name, per_round in doc["rounds_ms"].items():
        assert len(per_round) == 2 and all(math.isfinite(v) for v in per_round), name
    for r in range(2):                 # every round: the parts add up to the whole epoch per step
        parts = sum(v[r] for k, v in doc["rounds_ms"].items() if k != "total (fit)")
        assert math.isclose(parts, doc["rounds_ms"]["total (fit)"][r], rel_tol=1e-9)
    assert rows["conv2d fwd"]["ms_per_step"] > 0 and rows["optimizer"]["ms_per_step"] > 0
    assert "conv2d bwd" in proc.stdout and "median ms/step" in proc.stdout
