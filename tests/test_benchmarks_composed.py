"""benchmarks/composed.py --smoke: issue 48's speed rows (a custom Huber loss beside "mse",
keras.io's SimpleDense beside Dense) run, train, and report their ratios against the goals.
The speed itself is the program's to measure (benchmarks/results/), never a timed test.

    python -m pytest -q tests/test_benchmarks_composed.py
"""
import json

from conftest import run_smoke


def test_the_smoke_run_trains_every_row_and_reports_the_ratios(tmp_path):
    out = tmp_path / "composed.json"
    proc = run_smoke("composed", "--out", str(out), env={"MIRRORED_OFFLINE": "1",
                                                         **{k: v for k, v in __import__("os").environ.items()
                                                            if k != "NUMBA_ENABLE_CUDASIM"}})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc["rows"]) == {"convnet mse", "convnet huber", "dense builtin", "dense custom"}
    for label, row in doc["rows"].items():
        assert row["ms_per_step"] > 0 and len(row["epochs_s"]) == 2, label
        assert 0 < row["final_loss"] < 10, label
    # the same initial weights, the same math: the custom layer's model trains as the built-in
    dense = doc["rows"]["dense custom"]["final_loss"], doc["rows"]["dense builtin"]["final_loss"]
    assert abs(dense[0] - dense[1]) < 1e-3 * max(1.0, abs(dense[1])), dense
    assert set(doc["ratios"]) == {"convnet huber / convnet mse", "dense custom / dense builtin"}
    for info in doc["ratios"].values():
        assert info["ratio"] > 0 and info["met"] == (info["ratio"] <= info["goal"])
    assert "goal <=" in proc.stdout
