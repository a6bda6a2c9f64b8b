"""benchmarks/multiworker.py launches mpiexec itself and writes valid JSON (``--smoke``).

    python -m benchmarks.multiworker --smoke --out /tmp/multiworker.json
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_smoke
from mirrored.launcher import find_mpiexec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpiexec and mpi4py (python -m pip install mpi4py mpich)")
def test_smoke_run_writes_valid_json(tmp_path):
    out = tmp_path / "multiworker.json"
    proc = run_smoke("multiworker", "--out", str(out))        # the workers' CPU counted too
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "multiworker" and doc["mode"] == "smoke"
    assert doc["device"]["cpus"] >= 1 and doc["device"]["mpi4py"]
    assert [r["bytes"] for r in doc["results"]] == [1 << 10, 1 << 14]
    for row in doc["results"]:
        assert row["n"] == 2
        for alg in ("ring", "mpi"):
            assert row[alg]["samples"] == 3
            for key in (f"{alg}_us", f"{alg}_algbw", f"{alg}_busbw"):
                assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert math.isclose(row["ring_busbw"], row["ring_algbw"])          # 2(N-1)/N = 1 for N = 2
        assert math.isclose(row["ratio"], row["ring_busbw"] / row["mpi_busbw"])
    assert "ring/MPI" in proc.stdout
