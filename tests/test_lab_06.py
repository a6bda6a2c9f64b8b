"""Lab 06 (Beyond one machine) runs top to bottom: it starts 2 workers with mpiexec itself.

Executed by the ``run_lab`` fixture (tests/conftest.py) with MIRRORED_QUICK=1.

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
