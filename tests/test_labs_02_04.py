"""Labs 02-04 run top to bottom, with small settings, as the course runs them.

Executed by the ``run_lab`` fixture (tests/conftest.py): MIRRORED_QUICK=1, the bundled
MNIST subset, each lab twice: on this machine's devices (CPU devices where there is no GPU;
lab 04 starts its own simulator process for the kernel demos) and in the CUDA simulator.

    python -m pytest tests/test_labs_02_04.py            # ~75 s on a 2-core laptop
    python -m pytest -m "not notebook"                    # everything else
"""
import re

import pytest

NOTEBOOKS = ["02_custom_training_loop.ipynb", "03_ring_allreduce_step_through.ipynb",
             "04_kernels_walkthrough.ipynb"]


@pytest.mark.notebook
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_lab_runs_top_to_bottom(name, run_lab):
    text, images = run_lab(name)
    assert images >= 2, f"{name}: expected figures in the outputs, found {images}"
    if name.startswith("02"):
        assert "Number of devices: 2" in text
        assert "Epoch 2, Loss:" in text
        assert "copies bitwise equal: False" not in text
        # @tf.function: Python's print once per trace (one batch shape in quick mode), the
        # eager and compiled loops timed side by side
        assert text.count("tracing distributed_train_step for images") == 1, text
        assert 'Tensor("traced", shape=(' in text
        assert re.search(r"^ +eager: +[\d.]+ ms/step", text, re.M) and \
            re.search(r"^ *@tf.function: +[\d.]+ ms/step", text, re.M), text
        assert "traces of distributed_train_step: 1" in text
        # section 11: synchronized BatchNormalization is one device on the global batch, the
        # per-replica one is not; the measured batch variances follow the stated formulas
        gaps = dict(re.findall(r"^(synchronized=\w+) *: max \|difference\| from one device on the global "
                               r"batch: (\S+)$", text, re.M))
        assert float(gaps["synchronized=True"]) < 1e-4 < 0.1 < float(gaps["synchronized=False"]), gaps
        rows = re.findall(r"^synchronized=\w+ *: batch variance over n = \d+ rows: mean ([\d.]+) \(formula "
                          r"\(n-1\)/n sigma\*\*2 = ([\d.]+)\), relative spread ([\d.]+) \(formula "
                          r"sqrt\(2/\(n-1\)\) = ([\d.]+)\)$", text, re.M)
        assert len(rows) == 2, text
        for mean, want, spread, want_spread in rows:
            assert abs(float(mean) / float(want) - 1) < 0.15 and abs(float(spread) / float(want_spread) - 1) < 0.25, rows
        assert "synchronized copies bitwise equal on every step: True" in text
    elif name.startswith("03"):
        assert "6 steps = 2 (N - 1)" in text
        assert "equal to NumPy's sum on every device: True" in text
        # the bytes table counts sent + received in every column: at N = 2 the ring's device
        # and reduce-to-one's device 0 carry the same 2 x 1.389 MB (sent alone: 1 buffer)
        assert re.search(r"^ 2\s+2\.777 MB\s+1\.000\s+1\.000\s+2\.777 MB\s+2\.777 MB$", text, re.M), text
    else:
        assert text.count(" OK ") == 12 and "WRONG" not in text        # 3 versions x 4 transposes
        # conv2d v1 and v2 against NumPy: 2 paddings x 2 strides x 2 versions, v2 == v1 bitwise
        assert len([line for line in text.splitlines()
                    if line.startswith("conv2d padding=") and line.endswith(" OK")]) == 8
        assert text.count("v2 bitwise equal to v1: True") == 4
        assert "(n, oh, ow, co)" in text and "(0, 0, 9, 12)" in text    # thread 300's output
        assert "Timings skipped:" in text or "median µs" in text        # real GPU only
        assert "out[1, 3] =" in text and "thread (3, 1) of block (0, 0)" in text
        # the real compiler's table (kernels.report): the four v3 rows, then one row per version
        assert text.count("gemm_v3[trans_a=") == 4 and "problem(s)" not in text
        assert "spill+stack B" in text
        # section 8: the launch table, computed by benchmarks.launch in a child process
        assert "numba / cached" in text and ("driver: stubbed" in text or "driver: real" in text)
