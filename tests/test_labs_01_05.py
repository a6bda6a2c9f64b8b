"""Labs 01 (Mirrored Strategy: Basic) and 05 (single- vs multi-device timing) run top to bottom.

Each notebook is executed with nbclient in a fresh Jupyter kernel, a child process
that inherits this process's environment, so the environment is set here (with
monkeypatch) before the kernel starts:

* ``MIRRORED_QUICK=1``   the labs' small settings (1,024 training images, 2 epochs, few steps);
* ``MIRRORED_OFFLINE=1`` the bundled MNIST subset, no download attempts;
* ``MPLBACKEND=Agg``     no display needed;
* no ``NUMBA_ENABLE_CUDASIM``: tests/conftest.py turns the simulator on for this pytest
  process when there is no GPU, but a lab must run as a student's would — real CUDA
  where there is a GPU, CPU devices where there is none (training in the simulator
  would take hours);
* the repository root on ``PYTHONPATH``, so ``import mirrored`` works in the kernel
  (whose working directory is labs/, as when a student opens the notebook).

The notebooks are committed without outputs; the executed copies are written to
pytest's tmp_path for a look when a test fails.

    python -m pytest tests/test_labs_01_05.py            # ~15 s on a 2-core laptop
"""
import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"

#: Seconds any one cell may take (with MIRRORED_QUICK=1 the slowest takes a few seconds).
CELL_TIMEOUT = 120


def _kernel_environment(monkeypatch):
    monkeypatch.setenv("MIRRORED_QUICK", "1")
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), path) if p))


def _run(name, monkeypatch, tmp_path):
    """Execute labs/<name>; returns (all text output, number of images)."""
    nb = nbformat.read(LABS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"{name}: commit the notebook without outputs (clear them first)"
    _kernel_environment(monkeypatch)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(LABS)}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, tmp_path / name)           # for a look after a failure
    errors = [(i, f"{o.get('ename')}: {o.get('evalue')}") for i, c in enumerate(nb.cells)
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    texts, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
            images += "image/png" in out.get("data", {})
    return "\n".join(texts), images


def _table_rows(text):
    """{strategy name: [cells]} from every timing table in the output."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(no strategy|MirroredStrategy ×\d)\s+(\d.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2).split()
    return rows


@pytest.mark.notebook
def test_lab_01_basic_mirrored_strategy(monkeypatch, tmp_path):
    text, images = _run("01_basic_mirrored_strategy.ipynb", monkeypatch, tmp_path)
    assert "Number of devices: 2" in text                     # the CPU split in two (or 2 GPUs)
    assert "per replica: 64  global batch: 128" in text
    assert "MirroredVariable" in text
    assert re.search(r"\d+/\d+ \[=+\] - \d+s \d+(s|ms|us)/step - loss: [\d.]+ - accuracy: [\d.]+", text)
    assert re.search(r"Eval loss: [\d.]+, Eval accuracy: [\d.]+", text)
    rows = _table_rows(text)
    assert {"no strategy", "MirroredStrategy ×1", "MirroredStrategy ×2"} <= set(rows)
    assert images >= 1, "the bar chart of epoch times"


@pytest.mark.notebook
def test_lab_05_single_vs_multi_device_timing(monkeypatch, tmp_path):
    text, images = _run("05_single_vs_multi_gpu_timing.ipynb", monkeypatch, tmp_path)
    rows = _table_rows(text)
    assert set(rows) == {"no strategy", "MirroredStrategy ×1", "MirroredStrategy ×2",
                         "MirroredStrategy ×4"}
    assert [rows[f"MirroredStrategy ×{n}"][0] for n in (1, 2, 4)] == ["1", "2", "4"]   # replicas
    assert "4 replica(s), global batch 256" in text                     # the step breakdown
    for phase in ("input copy", "forward+backward", "all-reduce", "optimizer"):
        assert phase in text
    assert "PCIe 4.0 x16   N=8" in text and "NVLink (A100)  N=8" in text
    assert images >= 6, f"comparison, scaling, 3 timelines, model: found {images} figures"
