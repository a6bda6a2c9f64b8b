"""The set-up cell at the top of every lab (labs/setup_cell.py): which numba-cuda extra and
which pip commands, for the drivers students meet (Colab's T4, Kaggle's P100 and two T4s,
a laptop with no GPU) — tested without a GPU by giving it what nvidia-smi would print.

    python -m pytest tests/test_lab_setup_cell.py
"""
import glob
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")   # the [labs] extra's; a bare install has none

LABS = os.path.join(os.path.dirname(__file__), "..", "labs")
SOURCE = open(os.path.join(LABS, "setup_cell.py")).read()


def _plan_function():
    space = {"__name__": "setup_cell_under_test"}          # not __main__: installs nothing
    exec(compile(SOURCE, "labs/setup_cell.py", "exec"), space)
    return space["install_plan"]


def _smi(cuda):
    return (f"| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: {cuda}     |\n"
            f"|   0  Tesla T4   Off  | 00000000:00:04.0 Off |   0 |\n")


@pytest.mark.parametrize("cuda, extra", [("12.4", "cu12"), ("12.2", "cu12"), ("13.0", "cu13"), ("13.1", "cu13")])
def test_the_driver_picks_the_extra_and_the_repository_is_installed_with_it(cuda, extra):
    plan = _plan_function()(_smi(cuda), installed=False, checkout=None, repo="git+https://example.org/m")
    assert plan["extra"] == extra and cuda in plan["why"]
    install, wheels = plan["commands"]
    assert install[:4] == [sys.executable, "-m", "pip", "install"]
    assert install[-1] == "mirrored[labs,mpi] @ git+https://example.org/m"
    assert wheels[-1] == f"numba-cuda[{extra}]>=0.30.4"


def test_a_checkout_is_installed_editable_and_an_installed_mirrored_needs_nothing(tmp_path):
    plan = _plan_function()
    got = plan(_smi("12.4"), installed=False, checkout=str(tmp_path), repo="")
    assert got["commands"][0][-2:] == ["-e", f"{tmp_path}[labs,mpi]"]
    assert plan(_smi("12.4"), installed=True, checkout=None, repo="")["commands"] == []


def test_no_gpu_takes_cu12_and_an_old_driver_or_no_source_is_a_clear_error():
    plan = _plan_function()
    assert plan(None, installed=False, checkout="/x", repo="")["extra"] == "cu12"
    with pytest.raises(RuntimeError, match="CUDA 11.8; numba-cuda needs a CUDA 12 or 13 driver"):
        plan(_smi("11.8"), installed=False, checkout="/x", repo="")
    with pytest.raises(RuntimeError, match="set MIRRORED_REPO"):
        plan(_smi("12.4"), installed=False, checkout=None, repo="")


def test_every_lab_starts_with_the_same_set_up_cell():
    notebooks = sorted(glob.glob(os.path.join(LABS, "*.ipynb")))
    assert len(notebooks) >= 6
    for path in notebooks:
        first = next(c for c in nbformat.read(path, 4).cells if c.cell_type == "code")
        assert first.source.strip() == SOURCE.strip(), (
            f"{os.path.basename(path)}: its first code cell differs from labs/setup_cell.py; copy it "
            f"there again (one set-up cell for every lab)")
