# Set-up (Colab, Kaggle, or any Python without mirrored): install it, with the CUDA wheels
# this machine's NVIDIA driver takes. Where mirrored is already installed it does nothing.
# This cell is labs/setup_cell.py, copied to the top of every lab (tests/test_lab_setup_cell.py
# keeps the copies equal and tests the plan for given drivers).
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

#: Where to install from when the notebook is not inside a checkout (Colab opens a notebook
#: alone): your course's copy of the repository, e.g. "git+https://github.com/<you>/mirrored".
MIRRORED_REPO = os.environ.get("MIRRORED_REPO", "")


def install_plan(nvidia_smi, installed, checkout, repo):
    """What to install: ``{"extra", "commands", "why"}``.

    ``nvidia_smi``: what ``nvidia-smi`` printed (None: no NVIDIA GPU); its "CUDA Version: X.Y"
    is the newest CUDA the driver runs, which picks numba-cuda's extra (cu12 or cu13).
    ``installed``: mirrored imports already. ``checkout``: a folder holding this repository
    (its pyproject.toml), else None. ``repo``: a pip URL of the repository, else "".
    """
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi or "")
    if found is None:
        extra, why = "cu12", "no NVIDIA GPU found: the CPU runs the labs (cu12's compiler still checks the kernels)"
    elif int(found.group(1)) >= 13:
        extra, why = "cu13", f"the driver runs CUDA {found.group(1)}.{found.group(2)}"
    elif int(found.group(1)) == 12:
        extra, why = "cu12", f"the driver runs CUDA {found.group(1)}.{found.group(2)}"
    else:
        raise RuntimeError(f"this GPU's driver runs CUDA {found.group(1)}.{found.group(2)}; numba-cuda "
                           f"needs a CUDA 12 or 13 driver. Update the driver, or run on the CPU.")
    if installed:
        return {"extra": extra, "commands": [], "why": "mirrored is installed: nothing to do"}
    if checkout:
        source = ["-e", f"{checkout}[labs,mpi]"]
    elif repo:
        source = [f"mirrored[labs,mpi] @ {repo}"]
    else:
        raise RuntimeError("mirrored is not installed and this notebook is not in a checkout of it: "
                           "set MIRRORED_REPO (above, or in the environment) to a pip URL of the "
                           "repository, e.g. git+https://github.com/<you>/mirrored, and run again.")
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    return {"extra": extra, "why": why,
            "commands": [pip + source, pip + [f"numba-cuda[{extra}]>=0.30.4"]]}


def _checkout():
    for folder in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents[:2]):
        project = folder / "pyproject.toml"
        if project.exists() and 'name = "mirrored"' in project.read_text():
            return str(folder)
    return None


if __name__ == "__main__":
    smi = shutil.which("nvidia-smi")
    smi_out = subprocess.run([smi], capture_output=True, text=True).stdout if smi else None
    plan = install_plan(smi_out, importlib.util.find_spec("mirrored") is not None, _checkout(), MIRRORED_REPO)
    print(f"set-up: numba-cuda[{plan['extra']}] ({plan['why']})")
    for command in plan["commands"]:
        print("  $", " ".join(command[2:]))
        subprocess.run(command, check=True)
