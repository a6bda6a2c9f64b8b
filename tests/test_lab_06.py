"""Lab 06 (Beyond one machine) runs top to bottom: it starts 2 workers with mpiexec itself.

Executed by the ``run_lab`` fixture (tests/conftest.py) with MIRRORED_QUICK=1, twice: on
this machine's devices and in the CUDA simulator (the workers inherit it).

    python -m pytest tests/test_lab_06.py
"""
import importlib.util
import re
import sys
from pathlib import Path

import pytest


@pytest.mark.notebook
@pytest.mark.skipif(not (Path(sys.executable).parent / "mpiexec").exists()
                    or importlib.util.find_spec("mpi4py") is None,
                    reason="needs the mpich wheel's mpiexec beside this Python and mpi4py "
                           "(python -m pip install mpi4py mpich)")
def test_lab_06_beyond_one_machine(run_lab):
    text, images = run_lab("06_beyond_one_machine.ipynb")
    assert text.count("Using MultiWorkerMirroredStrategy: worker") == 2        # one line per worker
    assert len(re.findall(r"\d+/\d+ \[=+\] - ", text)) == 1                   # the chief's bar only
    assert "equal on every worker: True" in text
    assert "files the chief kept: ['chief.json', 'model.weights.h5', 'train.py']" in text
    assert "(MPI)" in text and "= 1 + 2 + ... + N = 3" in text              # 2 workers x 1 CPU
    # a quick run times two sizes only: under load the latency may explain both (no bandwidth)
    assert re.search(r"fitted link: latency α = [\d.]+ µs per step, bandwidth β = ([\d.]+ GB/s|too high to tell)", text)
    assert images >= 3, f"sharding, ring diagram, cost model: found {images} figures"


@pytest.mark.notebook
def test_lab_06_without_mpiexec_skips_the_worker_cells_with_a_reason(run_lab, monkeypatch, tmp_path):
    """A plain ``pip install ".[labs]"`` has no mpiexec: the cells that start workers say so
    in one line each and the rest of the lab (the sharding picture) still runs."""
    monkeypatch.setenv("MIRRORED_MPIEXEC", str(tmp_path / "no-mpiexec-here"))
    text, images = run_lab("06_beyond_one_machine.ipynb")
    assert "MISSING: the cells that start workers are skipped" in text
    assert "skipped: no mpiexec (see the first cell), so no workers to start" in text
    assert "skipped: no mpiexec, so no workers' step record to draw" in text
    assert "skipped: no mpiexec (see the first cell), so no link to measure" in text
    assert "Using MultiWorkerMirroredStrategy" not in text and images >= 1
