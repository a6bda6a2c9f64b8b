"""The course lab "Mirrored Strategy: Basic", verbatim, with only its two imports changed.

``LAB_CELLS`` are the lab's code cells exactly as the course gives them, except
``import tensorflow_datasets as tfds`` -> ``import mirrored.datasets as tfds`` and
``import tensorflow as tf`` -> ``import mirrored as tf`` (the README shows the same text).
The test runs them as a student would, in a fresh Python process, on the bundled
8,000-image MNIST subset (``MIRRORED_OFFLINE=1``) and on the CPU (no GPU visible), for
1 epoch instead of the lab's 12: the one change the test makes to the text.

    python -m pytest -q tests/test_lab_convnet.py
"""
import pathlib
import re
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

from benchmarks.course_lab import LAB_CELLS, lab_script, run_lab  # noqa: E402  (one copy: the benchmark runs all 12)

#: Seconds the lab's one epoch may take here (measured: see the README; ~2 cores, shared).
LAB_TIMEOUT_S = 300


def test_the_readme_shows_the_lab_verbatim():
    readme = (ROOT / "README.md").read_text()
    for cell in LAB_CELLS:
        assert cell.strip() in readme, f"README's lab section lacks this cell:\n{cell}"


def test_the_lab_runs_verbatim_for_one_epoch_on_the_bundled_subset():
    """The cells as one script (benchmarks.course_lab.lab_script: epochs=12 -> 1 is its one
    change to the text; it adds a clock and model.evaluate after), in a fresh process."""
    script = lab_script(epochs=1)
    assert "epochs=1)" in script and "epochs=12" not in script
    for cell in LAB_CELLS[:-1]:
        assert cell in script
    start = time.perf_counter()
    result, out = run_lab(None, epochs=1, timeout_s=LAB_TIMEOUT_S,
                          env={"MIRRORED_OFFLINE": "1", "NUMBA_ENABLE_CUDASIM": "0",
                               "CUDA_VISIBLE_DEVICES": ""})
    seconds = time.perf_counter() - start
    print(f"the lab's epoch took {seconds:.1f} s")
    assert "Number of devices: 1" in out, out
    steps = -(-8000 // 64)                                    # the subset's 8,000 images, batch 64
    line = re.compile(rf"^{steps}/{steps} \[={{30}}\] - \d+s \d+(us|ms|s)/step - "
                      rf"loss: (\d\.\d{{4}}) - accuracy: (\d\.\d{{4}})$", re.M)
    (match,) = line.finditer(out)
    loss, accuracy = float(match.group(2)), float(match.group(3))
    assert loss < 1.0 and accuracy > 0.7, out                 # it learns (untrained: 2.3 and 0.1)
    # what the benchmark reports: the data it ran on, its clocks, the test accuracy
    assert result["source"].startswith("bundled subset") and result["train_examples"] == 8000
    assert 0 < result["fit_s"] < result["wall_s"] < seconds
    assert 0.7 < result["test_accuracy"] <= 1.0 and result["replicas"] == 1
    # where the wall time went: one clock per cell (named by its first line), per epoch, and
    # for Numba's compilers (the CPU loops may come from the on-disk cache: 0 s is allowed)
    assert list(result["cells_s"]) == [cell.strip().splitlines()[0][:60] for cell in LAB_CELLS[:-1]] \
        + ["model.fit(train_dataset, epochs=1)"]
    assert 0 < sum(result["cells_s"].values()) <= result["wall_s"]
    assert len(result["epochs_s"]) == 1 and 0 < result["epochs_s"][0] <= result["fit_s"]
    compile_s = result["compile_s"]
    assert compile_s["cuda_compiles"] == 0 and compile_s["cuda_kernels"] == 0   # no GPU here
    assert 0 <= compile_s["cpu_loops"] < result["epochs_s"][0]
