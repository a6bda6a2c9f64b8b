"""The course lab "Mirrored Strategy: Basic", verbatim, with only its two imports changed.

``LAB_CELLS`` are the lab's code cells exactly as the course gives them, except
``import tensorflow_datasets as tfds`` -> ``import mirrored.datasets as tfds`` and
``import tensorflow as tf`` -> ``import mirrored as tf`` (the README shows the same text).
The test runs them as a student would, in a fresh Python process, on the bundled
8,000-image MNIST subset (``MIRRORED_OFFLINE=1``) and on the CPU (no GPU visible), for
1 epoch instead of the lab's 12: the one change the test makes to the text.

    python -m pytest -q tests/test_lab_convnet.py
"""
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

from benchmarks.course_lab import LAB_CELLS  # noqa: E402  (one copy: the benchmark runs all 12 epochs)

#: Seconds the lab's one epoch may take here (measured: see the README; ~2 cores, shared).
LAB_TIMEOUT_S = 300


def test_the_readme_shows_the_lab_verbatim():
    readme = (ROOT / "README.md").read_text()
    for cell in LAB_CELLS:
        assert cell.strip() in readme, f"README's lab section lacks this cell:\n{cell}"


def test_the_lab_runs_verbatim_for_one_epoch_on_the_bundled_subset(tmp_path):
    source = "\n".join(LAB_CELLS)
    assert source.count("epochs=12") == 1
    source = source.replace("epochs=12", "epochs=1")        # the one change: 1 epoch, not 12
    (tmp_path / "lab.py").write_text(source)
    env = dict(os.environ, MIRRORED_OFFLINE="1", NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "lab.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=LAB_TIMEOUT_S)
    seconds = time.perf_counter() - start
    print(f"the lab's epoch took {seconds:.1f} s")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "Number of devices: 1" in out, out
    steps = -(-8000 // 64)                                    # the subset's 8,000 images, batch 64
    line = re.compile(rf"^{steps}/{steps} \[={{30}}\] - \d+s \d+(us|ms|s)/step - "
                      rf"loss: (\d\.\d{{4}}) - accuracy: (\d\.\d{{4}})$", re.M)
    (match,) = line.finditer(out)
    loss, accuracy = float(match.group(2)), float(match.group(3))
    assert loss < 1.0 and accuracy > 0.7, out                 # it learns (untrained: 2.3 and 0.1)
