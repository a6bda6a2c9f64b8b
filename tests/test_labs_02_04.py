"""Labs 02-04 run top to bottom, with small settings, as the course runs them.

Each notebook is executed with nbclient in a fresh Jupyter kernel, a child
process that inherits this process's environment, so the environment is set
here before the kernel starts:

* ``MIRRORED_QUICK=1``   the labs' small settings (a 2,000-image MNIST subset ...);
* ``MIRRORED_OFFLINE=1`` the bundled MNIST subset, no download attempts;
* ``MPLBACKEND=Agg``     no display needed;
* no ``NUMBA_ENABLE_CUDASIM``: tests/conftest.py turns the simulator on for this
  pytest process when there is no GPU, but a notebook must run as a student's
  would, with real CUDA where there is a GPU and the CPU devices where there is
  none. (Lab 04 starts its own simulator process for the kernel demos.)
* the repository root on ``PYTHONPATH``, so ``import mirrored`` works in the kernel.

The notebooks are committed without outputs; the executed copies are written
to pytest's tmp_path for inspection when a test fails.

    python -m pytest tests/test_labs_02_04.py            # ~30 s on a 2-core laptop
    python -m pytest -m "not notebook"                    # everything else
"""
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"

#: Seconds any one cell may take (the slowest, lab 04's simulator check, takes ~10 s).
CELL_TIMEOUT = 120

NOTEBOOKS = ["02_custom_training_loop.ipynb", "03_ring_allreduce_step_through.ipynb",
             "04_kernels_walkthrough.ipynb"]


def _kernel_environment(monkeypatch):
    monkeypatch.setenv("MIRRORED_QUICK", "1")
    monkeypatch.setenv("MIRRORED_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), path) if p))


def _errors(nb):
    """(cell index, first line of source, error) of every cell that printed an error."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append((i, cell.source.splitlines()[0] if cell.source else "",
                              f"{out.get('ename')}: {out.get('evalue')}"))
    return found


@pytest.mark.notebook
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_lab_runs_top_to_bottom(name, monkeypatch, tmp_path):
    path = LABS / name
    nb = nbformat.read(path, as_version=4)
    # Committed without outputs: the executed notebook is what a student makes.
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
    assert not _errors(nb), _errors(nb)
    texts = []
    images = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
            images += "image/png" in out.get("data", {})
    text = "\n".join(texts)
    assert images >= 2, f"{name}: expected figures in the outputs, found {images}"
    if name.startswith("02"):
        assert "Number of devices: 2" in text
        assert "Epoch 2, Loss:" in text
        assert "copies bitwise equal: False" not in text
    elif name.startswith("03"):
        assert "6 steps = 2 (N - 1)" in text
        assert "equal to NumPy's sum on every device: True" in text
    else:
        assert text.count(" OK ") == 12 and "WRONG" not in text        # 3 versions x 4 transposes
        assert "out[1, 3] =" in text and "thread (3, 1) of block (0, 0)" in text
