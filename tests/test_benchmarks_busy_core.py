"""benchmarks.training's issue-25 additions, in a smoke run: the two-conv model, the
``--rows x1`` subset and ``--busy-core`` (a spinning process pinned to one core, paused
between the busy rows' epochs), with the load average and the BLAS policy recorded."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks import training

ROOT = Path(__file__).resolve().parents[1]


def test_two_conv_geometry_and_weights_follow_the_tutorials_model():
    spec = training.MODELS["two-conv"]
    geo = training.conv_geometry(spec)
    assert geo == [(1, 32, 3, 26, 13), (32, 64, 3, 11, 5)]
    assert training.dense_dims(spec) == (5 * 5 * 64, 64, 10)
    shapes = [w.shape for w in training.initial_weights(spec, seed=np.random.default_rng().integers(99))]
    assert shapes == [(3, 3, 1, 32), (32,), (3, 3, 32, 64), (64,), (1600, 64), (64,), (64, 10), (10,)]
    # the second conv's dX is a GEMM of the step (dcols = dz W^T), the first conv's is not
    gemms = training.step_gemm_shapes(spec, 64)
    assert (64 * 11 * 11, 3 * 3 * 32, 64, False, True) in gemms
    assert not any(g[1] == 9 and g[4] for g in gemms)


def test_busy_core_smoke_run_times_quiet_and_busy_rows(tmp_path):
    out = tmp_path / "busy.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["MIRRORED_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.training", "--smoke", "--models", "convnet",
                           "--rows", "x1", "--busy-core", "--no-peers", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = {(r["strategy"], r["replicas"]) for r in doc["results"]}
    assert rows == {("no strategy", 1), ("MirroredStrategy", 1), ("no strategy +busy core", 1),
                    ("MirroredStrategy +busy core", 1),
                    ("MirroredStrategy custom loop eager", 1),           # issue 41's rows (x1)
                    ("MirroredStrategy custom loop @function", 1)}, rows
    busy = [t for t in doc["targets"] if "busy core" in t["target"]]
    assert len(busy) == 1 and busy[0]["measured"] > 0
    info = doc["device"]
    assert len(info["loadavg_start"]) == 3 and len(info["loadavg_end"]) == 3
    assert info["busy_core"]["loop"] == training.BUSY_LOOP
    assert "thread" in info["threads"]["blas_policy"]


def test_breakdown_covers_the_two_conv_model(tmp_path):
    out = tmp_path / "breakdown.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["MIRRORED_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.breakdown", "--model", "two-conv", "--steps", "2",
                           "--rounds", "1", "--no-peers", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    parts = {r["part"] for r in doc["rows"]}
    for layer in ("conv2d", "conv2d_1", "max_pooling2d", "max_pooling2d_1"):
        assert {f"{layer} fwd", f"{layer} bwd"} <= parts, parts
    rows = {r["part"]: r for r in doc["rows"]}
    assert rows["conv2d_1 bwd"]["ms_per_step"] > 0            # the second conv's dX runs
