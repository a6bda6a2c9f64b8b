"""benchmarks/course_lab.py: a cold and a warm run of the lab, PyTorch beside it (issue 40).

The smoke run (one epoch, 512 images, the dense model) is the non-PyTorch path end to end;
the PyTorch rows are GPU rows, skipped here with their reason. ``cold_and_warm`` is checked
with a stand-in for the lab: the two runs share one kernel cache folder and one CUDA driver
cache folder, both empty before cold.
Also the smoke run of benchmarks/compile_gil.py (can a first run compile side by side?).
"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import course_lab  # noqa: E402
from conftest import run_smoke  # noqa: E402



def test_smoke_run_reports_a_cold_and_a_warm_run(tmp_path):
    out = tmp_path / "lab.json"
    env = dict(os.environ, MIRRORED_OFFLINE="1", NUMBA_ENABLE_CUDASIM="0",   # a GPU, else the CPU
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = run_smoke("course_lab", "--out", str(out), env=env)      # held to the smoke limit
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "smoke" and doc["epochs"] == 1
    assert set(doc["runs"]) == {"cold", "warm"} and doc["result"] == doc["runs"]["warm"]
    for name, run in doc["runs"].items():
        assert run["wall_s"] > run["fit_s"] > 0, (name, run)
        assert len(run["epochs_s"]) == 1 and 0.0 <= run["test_accuracy"] <= 1.0
        assert run["train_examples"] > 512 and run["replicas"] >= 1   # the lab's count, unedited
    skipped = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert doc["peers"] or "PyTorch rows" in skipped                 # there, or says why not
    for row in doc["peers"]:
        assert row["ms_per_step"] > 0 and row["strategy"] in ("eager", "cuda graph")


def test_cold_and_warm_share_one_fresh_kernel_cache():
    seen = []

    def fake_lab(data_dir, epochs, env, smoke):
        folders = [Path(env[name]) for name in ("NUMBA_CACHE_DIR", "CUDA_CACHE_PATH")]
        seen.append((folders, [sorted(p.name for p in f.iterdir()) for f in folders]))
        for f in folders:                                 # what a run would keep, in each
            (f / f"kernel-{len(seen)}.bin").write_bytes(b"x")
        return {"wall_s": float(len(seen))}, f"log {len(seen)}"

    runs, log = course_lab.cold_and_warm("data", 3, smoke=True, run=fake_lab)
    assert runs == {"cold": {"wall_s": 1.0}, "warm": {"wall_s": 2.0}}
    assert seen[0][0] == seen[1][0] and seen[0][0][0] != seen[0][0][1]   # the same two folders
    assert seen[0][1] == [[], []]                         # empty for cold (numba's and the driver's)
    assert seen[1][1] == [["kernel-1.bin"], ["kernel-1.bin"]]   # cold's for warm
    for folder in seen[0][0]:
        assert not folder.exists() and os.environ.get("NUMBA_CACHE_DIR") != str(folder)  # gone after
    assert "cold run" in log and "warm run" in log


def test_a_serial_cold_run_comes_first_with_compiling_ahead_off_and_caches_of_its_own():
    """``--serial-cold``: what compiling ahead (kernels/compile_ahead.py) saves a cold run."""
    seen = []

    def fake_lab(data_dir, epochs, env, smoke):
        folders = [Path(env[name]) for name in ("NUMBA_CACHE_DIR", "CUDA_CACHE_PATH")]
        seen.append((folders, [sorted(p.name for p in f.iterdir()) for f in folders],
                     env.get("MIRRORED_COMPILE_AHEAD")))
        for f in folders:
            (f / f"kernel-{len(seen)}.bin").write_bytes(b"x")
        return {"wall_s": float(len(seen))}, f"log {len(seen)}"

    runs, _ = course_lab.cold_and_warm("data", 3, smoke=True, run=fake_lab, serial_cold=True)
    assert list(runs) == ["cold, compiled at launch", "cold", "warm"]
    assert [ahead for _, _, ahead in seen] == ["0", None, None]
    assert seen[0][1] == seen[1][1] == [[], []]                 # both cold runs: empty caches
    assert set(seen[0][0]).isdisjoint(seen[1][0]) and seen[1][0] == seen[2][0]


def test_smoke_edits_apply_once_and_keep_the_lab_text_otherwise():
    full, smoke = course_lab.lab_script(2), course_lab.lab_script(2, smoke=True)
    assert "Conv2D(32, 3" in full and "Conv2D" not in smoke
    assert "mnist_train.take(512).map(scale)" in smoke and "take(" not in full
    assert "model.fit(train_dataset, epochs=2)" in full and "model.fit(train_dataset, epochs=2)" in smoke


def test_compile_gil_smoke_measures_both_ways():
    """benchmarks/compile_gil.py (the GIL and numba's compiler lock, issue 40) runs, with the
    real compiler and no GPU, and reports every figure."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = run_smoke("compile_gil", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    for name in ("compile_ptx", "nvvm"):
        assert doc[name]["sequential_s"] > 0 and doc[name]["two_threads_s"] > 0
        assert doc[name]["python_loop_speed_ratio"]["median"] > 0


def test_the_pytorch_rows_train_on_the_labs_images_as_it_scales_them(tmp_path):
    """What torch_rows hands PyTorch (GPU only, so read here without it): the lab's training
    split, scaled as the lab's scale() does; the bundled subset offline, its first 512 for
    --smoke; a --data-dir is read as the lab reads it (<dir>/mnist)."""
    import numpy as np
    import mirrored as tf
    from mirrored import datasets
    x, y = course_lab.lab_training_images(None, smoke=True)
    assert x.shape == (512, 28, 28, 1) and x.dtype == np.float32 and y.dtype == np.int64
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.5
    first = next(iter(datasets.load("mnist", split="train", as_supervised=True)))
    assert np.array_equal(x[0], tf.cast(first[0], tf.float32) / 255) and y[0] == first[1]
    empty = tmp_path / "no-mnist-here"
    empty.mkdir()
    x2, y2 = course_lab.lab_training_images(str(empty), smoke=True)   # offline: the subset
    assert np.array_equal(x2, x) and np.array_equal(y2, y)


def test_peer_epochs_time_the_pytorch_rows_apart_from_the_labs(tmp_path, monkeypatch):
    """``--peer-epochs N`` (gpu_session.sh's plan 40: 3, to fit its budget) reaches the
    PyTorch rows, not the lab, and is written down; without it they train the lab's epochs.
    The lab and the rows are stand-ins here: what is checked is main()'s wiring."""
    import random
    lab_epochs, peer_epochs = random.randint(2, 12), random.randint(1, 5)
    seen = {}

    def fake_cold_and_warm(data_dir, epochs, smoke, serial_cold=False):
        seen["lab"] = epochs
        seen.setdefault("serial", []).append(serial_cold)
        return {"cold": {"wall_s": 2.0}, "warm": {"wall_s": 1.0}}, "lab log"

    def fake_torch_rows(data_dir, epochs, smoke=False):
        seen["peers"] = epochs
        return [{"row": "PyTorch eager", "strategy": "eager", "ms_per_step": 1.5, "total_s": 1.0 * epochs}], None

    monkeypatch.setattr(course_lab, "cold_and_warm", fake_cold_and_warm)
    monkeypatch.setattr(course_lab, "torch_rows", fake_torch_rows)
    out = tmp_path / "lab.json"
    assert course_lab.main(["--epochs", str(lab_epochs), "--peer-epochs", str(peer_epochs),
                            "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert seen == {"lab": lab_epochs, "peers": peer_epochs, "serial": [False]}
    assert doc["epochs"] == lab_epochs and doc["peer_epochs"] == peer_epochs
    assert course_lab.main(["--epochs", str(lab_epochs), "--out", str(out)]) == 0
    assert seen["peers"] == lab_epochs and json.loads(out.read_text())["peer_epochs"] == lab_epochs
    assert course_lab.main(["--epochs", str(lab_epochs), "--serial-cold", "--out", str(out)]) == 0
    assert seen["serial"] == [False, False, True]
    import pytest
    with pytest.raises(SystemExit):
        course_lab.main(["--peer-epochs", "0"])
