"""``python -m benchmarks.kernels``: the smoke mode runs and writes valid JSON.

The real benchmark needs a GPU; here we only prove the program works end to end, in
the CUDA simulator, in a child process (it picks its own CUDA mode at import).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import run_smoke

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_benchmark_smoke_writes_valid_json(tmp_path):
    out = tmp_path / "kernels.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # --smoke must choose the simulator itself
    proc = run_smoke("kernels", "--out", str(out), env=env)       # within SMOKE_LIMIT_S
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "kernels"
    assert doc["device"]["simulator"] is True
    assert doc["method"]["smoke"] is True
    impls = {r["impl"] for r in doc["results"]}
    assert {"gemm v1", "gemm v2", "gemm v3"} <= impls, impls
    # The copy ceiling is the fastest of the copies measured, each one recorded.
    (copy,) = [r for r in doc["results"] if r["name"] == "device-to-device copy"]
    methods = copy["copy_methods"]
    assert {"our copy kernel (elementwise.cast)", "numba copy_to_device"} <= set(methods), methods
    assert copy["impl"] == max(methods, key=methods.get) and copy["gbps"] == max(methods.values())
    names = {r["name"] for r in doc["results"]}
    assert {"elementwise add", "softmax_xent (10 classes)", "sgd momentum", "adam"} <= names
    # The lab's conv and pooling layers, each checked before it was timed.
    for prefix in ("conv2d v1 forward", "conv2d v2 forward", "conv2d backward dW+db",
                   "conv2d backward dX+dW+db", "max_pool 2x2 forward", "max_pool 2x2 backward"):
        assert [n for n in names if n.startswith(prefix)], (prefix, names)
    for r in doc["results"]:  # every number written was measured
        assert r["median_s"] > 0 and r["samples"] >= 1
    assert not [s for s in doc["skipped"] if "wrong result" in s["reason"]], doc["skipped"]
    # Simulator numbers must never land in benchmarks/results/.
    assert not list((ROOT / "benchmarks" / "results").glob("kernels-numba-cuda-simulator-*"))


def test_kernels_benchmark_gemm_runs_the_named_gemms_only(tmp_path):
    """``--gemm`` (lab 04's timing cell): the GEMMs named and nothing else; a name that
    matches none is refused with the names there are."""
    out = tmp_path / "gemm.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--smoke", "--gemm", "smoke",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["method"]["gemm_only"] == "smoke"
    assert {r["kind"] for r in doc["results"]} == {"gemm"}, {r["kind"] for r in doc["results"]}
    assert {r["impl"] for r in doc["results"]} >= {"gemm v1", "gemm v2", "gemm v3"}
    bad = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--smoke", "--gemm", "no such gemm"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "smoke transposed" in bad.stderr, bad.stdout + bad.stderr

