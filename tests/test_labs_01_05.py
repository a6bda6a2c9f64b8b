"""Labs 01 (Mirrored Strategy: Basic) and 05 (single- vs multi-device timing) run top to bottom.

Executed by the ``run_lab`` fixture (tests/conftest.py): MIRRORED_QUICK=1, the bundled
MNIST subset, each lab twice: on this machine's devices (CPU devices where there is no GPU)
and in the CUDA simulator (a machine with a GPU: lab 01's CPU model beside it, issue 51).

    python -m pytest tests/test_labs_01_05.py            # ~25 s on a 2-core laptop (the ConvNet)
"""
import re

import pytest


def _table_rows(text):
    """{strategy name: [cells]} from every timing table in the output."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(no strategy|MirroredStrategy ×\d)\s+(\d.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2).split()
    return rows


def _samples_per_s(cells):
    """The samples/s cell of a table row (the sixth after the name), marks and commas dropped."""
    return float(cells[5].replace(",", "").rstrip("*!"))


@pytest.mark.notebook
def test_lab_01_basic_mirrored_strategy(run_lab):
    text, images = run_lab("01_basic_mirrored_strategy.ipynb")
    assert "Number of devices: 2" in text                     # the CPU split in two (or 2 GPUs)
    assert "per replica: 64  global batch: 128" in text
    assert "MirroredVariable" in text
    assert re.search(r"\d+/\d+ \[=+\] - \d+s \d+(s|ms|us)/step - loss: [\d.]+ - accuracy: [\d.]+", text)
    assert re.search(r"Eval loss: [\d.]+, Eval accuracy: [\d.]+", text)
    rows = _table_rows(text)
    assert {"no strategy", "MirroredStrategy ×1", "MirroredStrategy ×2"} <= set(rows)
    assert images >= 1, "the bar chart of epoch times"
    # §7's sentence is the table's: the order it states is the order of the samples/s printed
    said = re.search(r"^(No verdict|Here 'MirroredStrategy ×1' (?:was|ran at)).*$", text, re.M)
    assert said, "no sentence under section 7's table"
    one, none = rows["MirroredStrategy ×1"], rows["no strategy"]
    if said.group(1) == "No verdict":
        assert any(c.endswith(("*", "!")) for c in one + none), (said.group(0), one, none)
    else:
        ratio = _samples_per_s(one) / _samples_per_s(none)
        percent = int(re.search(r"(\d+)% of", said.group(0)).group(1))
        assert abs(percent - 100 * ratio) <= 1, (said.group(0), ratio)
        assert ("slower" in said.group(0)) == (ratio < 1 and "inside" not in said.group(0)), said.group(0)


@pytest.mark.notebook
def test_lab_05_single_vs_multi_device_timing(run_lab):
    text, images = run_lab("05_single_vs_multi_gpu_timing.ipynb")
    rows = _table_rows(text)
    assert set(rows) == {"no strategy", "MirroredStrategy ×1", "MirroredStrategy ×2",
                         "MirroredStrategy ×4"}
    assert [rows[f"MirroredStrategy ×{n}"][0] for n in (1, 2, 4)] == ["1", "2", "4"]   # replicas
    assert "4 replica(s), global batch 256" in text                     # the step breakdown
    for phase in ("input copy", "forward+backward", "all-reduce", "optimizer"):
        assert phase in text
    assert "PCIe 4.0 x16   N=8" in text and "NVLink (A100)  N=8" in text
    # The sentences computed from the numbers agree with them
    gain = _samples_per_s(rows["MirroredStrategy ×4"]) / _samples_per_s(rows["no strategy"])
    said = re.search(r"Here 'MirroredStrategy ×4' gave ([\d.]+)× the samples/s", text)
    assert said and abs(float(said.group(1)) - gain) < 0.02 * gain + 0.01, (said and said.group(0), gain)
    failed = "calibrate: the breakdown's compute" in text          # the CalibrationWarning
    assert ("The calibration failed on this machine" in text) == failed
    assert failed or re.search(r"At N = 8, per step: compute [\d.]+ ms, the ring over PCIe", text)
    assert images >= 6, f"comparison, scaling, 3 timelines, model: found {images} figures"
