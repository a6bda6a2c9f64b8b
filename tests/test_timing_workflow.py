"""Timing (mirrored/lab/timing.py) and the lab workflow behind ``python -m mirrored``.

What is checked, and why it cannot flake:
* the phase timer never reports less than a known sleep inside a phase (a sleep
  lasts at least its length; no upper bound is asserted);
* ``timed_train_step(model, x, y, timer)`` changes the weights exactly as an untimed step does;
* ``compare`` starts every strategy from the same weights (equal initial test
  loss, although each model drew different random weights) and returns sane rows;
* the performance model equals a hand computation;
* rows timed over fewer than ``scaling.MIN_TIMED_STEPS`` steps are marked too short
  to compare, in the row and in the table;
* ``python -m mirrored --quick`` in a child process (it configures logical
  devices, which a process may do once) trains the lab's ConvNet, on two logical
  CPUs where there is no GPU, prints Keras's progress line, the real data folder and
  the table (timings marked too short) and writes a PNG; ``--help`` is plain text; a
  device that is not there exits 2 and lists devices.
"""
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import mirrored as tf
from mirrored.lab import perf_model, scaling, timing, viz
from mirrored.values import MirroredVariable

ROOT = Path(__file__).resolve().parents[1]
LONG = "/job:localhost/replica:0/task:0/device:"
#: Keras's progress line: "16/16 [=====] - 0s 5ms/step - loss: 1.2 - accuracy: 0.7"
PROGRESS = re.compile(r"^\s*(\d+)/\1 \[=+\] - \d+s \d+(s|ms|us)/step - loss: [\d.e+-]+ - accuracy: [\d.]+$",
                      re.MULTILINE)


def tiny_model(din=12, hidden=8, classes=4, optimizer="adam"):
    model = tf.keras.Sequential([tf.keras.layers.Dense(hidden, activation="relu", input_shape=(din,)),
                                 tf.keras.layers.Dense(classes)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01) if optimizer == "adam" else optimizer,
                  metrics=["accuracy"])
    return model


# --- the phase timer ---------------------------------------------------------------------

def test_a_sleep_inside_a_phase_is_measured_at_least_as_long(devices):
    cpu = devices(cpus=2)[0]
    timer = timing.PhaseTimer()
    for _ in range(3):
        with timer.phase("sleep", replica=0, device=cpu):
            time.sleep(0.02)
        with timer.phase("nothing", replica=1):
            pass
    summary = timer.summary()
    assert list(summary) == ["sleep", "nothing"]
    assert summary["sleep"]["count"] == 3
    assert summary["sleep"]["min_s"] >= 0.02
    assert summary["sleep"]["total_s"] >= 0.06
    assert summary["sleep"]["median_s"] >= summary["nothing"]["median_s"] >= 0
    records = timer.records()
    assert len(records) == 6 and all(isinstance(r, tuple) and len(r) == 4 for r in records)
    assert [r[2] for r in records] == sorted(r[2] for r in records)
    assert all(0 <= start <= end for _, _, start, end in records)
    assert set(timer.summary(by_replica=True)) == {0, 1}
    timer.reset()
    assert timer.records() == [] and timer.summary() == {}


def test_phases_from_several_threads_and_collectives(devices):
    devs = [d for d in devices(cpus=3) if d.device_type == "CPU"]
    timer = timing.PhaseTimer()

    def work(r):
        with timer.phase("compute", r, devs[r]):
            time.sleep(0.01)
    threads = [threading.Thread(target=work, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with timer.collective("all-reduce", devs):
        time.sleep(0.005)
    recs = timer.records()
    assert sorted(r for r, name, *_ in recs if name == "compute") == [0, 1, 2]
    reduce = [rec for rec in recs if rec[1] == "all-reduce"]
    assert sorted(r for r, *_ in reduce) == [0, 1, 2]
    assert all(e - s >= 0.005 for _, _, s, e in reduce)
    assert min(s for _, _, s, _ in reduce) >= max(e for _, n, _, e in recs if n == "compute")


@pytest.mark.gpu
def test_cuda_events_time_gpu_work(devices):
    """On a real GPU the timer reads CUDA events: a phase lasts as long as the kernels in it."""
    gpu = devices(cpus=1, gpus=1)[-1]
    timer = timing.PhaseTimer()
    with gpu.activate():
        a = gpu.from_numpy(np.ones((2048, 2048), np.float32))
        out = gpu.empty((2048, 2048), np.float32)
        gpu.ops.gemm(a, a, out)                    # compile and warm up
        with timer.phase("gemm", 0, gpu):
            for _ in range(5):
                gpu.ops.gemm(a, a, out)
    (_, name, start, end), = timer.records()
    assert name == "gemm" and end > start >= 0
    assert end - start > 5 * 2 * 2048 ** 3 / 2e15, "faster than 2 PFLOP/s: not timing the kernels"


# --- the instrumented step ------------------------------------------------------------------

@pytest.mark.parametrize("kind,n", [("CPU", 1), ("CPU", 3), ("GPU", 2)])
def test_a_timed_train_step_updates_weights_exactly_like_an_untimed_one(devices, rng, kind, n):
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    din, hidden, classes, batch = (5, 4, 3, 7) if kind == "GPU" else (12, 8, 4, 19)   # B not divisible by N
    names = [f"{kind}:{i}" for i in range(n)]
    make = lambda: tiny_model(din, hidden, classes)                                    # noqa: E731
    with tf.distribute.MirroredStrategy(names).scope():
        timed = make()
    with tf.distribute.MirroredStrategy(names).scope():
        plain = make()
    plain.set_weights(timed.get_weights())
    timer = timing.PhaseTimer()
    steps = 2 if kind == "GPU" else 3                                                  # the simulator is slow
    for _ in range(steps):
        x = rng.standard_normal((batch, din)).astype(np.float32)
        y = rng.integers(0, classes, batch)
        timing.timed_train_step(timed, x, y, timer)
        plain.train_step(x, y)
    for a, b in zip(timed.get_weights(), plain.get_weights()):
        assert np.array_equal(a, b), "timing a step must not change what it does"
    for v in timed.trainable_variables:
        if isinstance(v, MirroredVariable):
            assert all(np.array_equal(v.values[0].numpy(), c.numpy()) for c in v.values[1:])
    summary = timer.summary(by_replica=True)
    assert sorted(summary) == list(range(n))
    expected = set(timing.STEP_PHASES) - ({timing.ALL_REDUCE} if n == 1 else set())
    for r in range(n):
        assert set(summary[r]) == expected
        assert all(s["count"] == steps for s in summary[r].values())


def test_step_breakdown_gives_a_per_replica_timeline(devices, rng):
    devices(cpus=2)
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        model = tiny_model()
    x = rng.standard_normal((64, 12)).astype(np.float32)
    y = rng.integers(0, 4, 64)
    bd = timing.step_breakdown(model, (x, y), steps=4, warmup=1, batch_size=16, timeline_steps=2)
    assert bd["replicas"] == 2 and bd["steps"] == 4 and bd["global_batch"] == 16
    assert bd["step_s"] > 0
    assert set(bd["phases"]) == set(timing.STEP_PHASES)
    assert all(p["count"] == 4 * 2 for p in bd["phases"].values())       # 4 steps x 2 replicas
    assert set(bd["per_replica"]) == {0, 1}
    spans = bd["timeline_step_s"]
    assert len(spans) == 2 and spans[0][0] == 0.0 and spans[0][1] <= spans[1][0]
    assert len(bd["timeline"]) == 2 * 2 * 4                               # steps x replicas x phases
    for r, phase, start, end in bd["timeline"]:
        assert r in (0, 1) and phase in timing.STEP_PHASES
        assert -1e-9 <= start <= end <= spans[-1][1] + 1e-9
    text = timing.format_breakdown(bd)
    assert "forward+backward" in text and "all-reduce" in text
    cal = perf_model.calibrate(bd, model=model)
    assert cal["grad_bytes"] == 4 * model.count_params()
    assert cal["compute_per_example_s"] > 0 and cal["overhead_s"] >= 0


# --- compare ------------------------------------------------------------------------------

def test_compare_starts_every_strategy_from_the_same_weights(devices, rng):
    devices(cpus=4)
    n, din = 96, 12
    x = rng.standard_normal((n, din)).astype(np.float32)
    y = rng.integers(0, 4, n)
    xt, yt = x[:40], y[:40]
    drawn = []

    def model_fn():
        model = tiny_model(din)
        drawn.append(model.get_weights())     # each model draws its own random weights...
        return model
    strategies = scaling.lab_strategies([f"CPU:{i}" for i in range(4)], (1, 2, 4))
    with tf.device("CPU:0"):                  # "no strategy" too (not the simulated GPU)
        rows = scaling.compare(model_fn, (x, y, xt, yt), strategies, epochs=2, batch_per_replica=8,
                              verbose=0)
    assert not np.array_equal(drawn[0][0], drawn[1][0])
    # ...but every run starts from the first model's: the same untrained test loss.
    losses = [r["initial_loss"] for r in rows]
    assert all(math.isclose(l, losses[0], rel_tol=1e-5) for l in losses), losses
    assert [r["name"] for r in rows] == ["no strategy", "MirroredStrategy ×1", "MirroredStrategy ×2",
                                         "MirroredStrategy ×4"]
    assert [r["replicas"] for r in rows] == [1, 1, 2, 4]
    assert [r["global_batch"] for r in rows] == [8, 8, 16, 32]
    assert [r["steps_per_epoch"] for r in rows] == [12, 12, 6, 3]
    assert rows[3]["devices"] == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    for r in rows:
        assert r["epochs_timed"] == 1 and len(r["epoch_times_s"]) == 2
        assert r["too_short"] and r["timed_steps"] == r["steps_per_epoch"]
        assert r["epoch_time_s"] > 0 and r["ms_per_step"] > 0
        assert math.isclose(r["samples_per_s"], n / r["epoch_time_s"], rel_tol=1e-9)
        assert math.isclose(r["ms_per_step"], r["epoch_time_s"] / r["steps_per_epoch"] * 1e3)
        assert 0 <= r["test_accuracy"] <= 1 and math.isfinite(r["test_loss"])
        expected_eff = r["samples_per_s"] / (r["replicas"] * rows[0]["samples_per_s"])
        assert math.isclose(r["efficiency"], expected_eff)
    assert rows[0]["efficiency"] == 1.0 and rows[0]["baseline"] == "no strategy"
    table = scaling.format_table(rows)
    for name in ("no strategy", "MirroredStrategy ×4", "samples/s", "efficiency", "test acc"):
        assert name in table


def test_rows_from_too_few_timed_steps_are_marked_too_short_to_compare(devices, rng):
    devices(cpus=2)
    x = rng.standard_normal((96, 12)).astype(np.float32)
    y = rng.integers(0, 4, 96)
    strategies = scaling.lab_strategies(["CPU:0", "CPU:1"], (1, 2), include_default=False)
    rows = scaling.compare(tiny_model, (x, y), strategies, epochs=6, batch_per_replica=8, verbose=0)
    # x1: 12 steps x 5 timed epochs = 60 >= MIN_TIMED_STEPS; x2: 6 x 5 = 30 < it
    assert [r["timed_steps"] for r in rows] == [60, 30] and scaling.MIN_TIMED_STEPS == 50
    assert [r["too_short"] for r in rows] == [False, True]
    lines = scaling.format_table(rows).splitlines()
    one, two = (next(line for line in lines if line.startswith(name)) for name in
                ("MirroredStrategy ×1", "MirroredStrategy ×2"))
    assert "*" not in one and two.count("*") == 4           # epoch s, ms/step, samples/s, efficiency
    assert lines[-1].startswith("* too short to compare")
    only = scaling.compare(tiny_model, (x, y), strategies[:1], epochs=1, batch_per_replica=1, verbose=0)
    assert only[0]["too_short"], "a single (warm-up) epoch is never comparable, however long"


def test_compare_rejects_data_it_cannot_use(devices):
    devices(cpus=1)
    with pytest.raises(TypeError, match="data must be"):
        scaling.compare(tiny_model, "mnist", [None], epochs=1, verbose=0)


# --- the performance model ----------------------------------------------------------------

def test_performance_model_equals_the_hand_computation():
    # t(4) = 10 ms / 4 + 2*3/4 * 4 MB / (25 GB/s) + 1 ms = 2.5 + 0.24 + 1 = 3.74 ms
    t4 = perf_model.predict_step_time(4, compute_s=0.010, grad_bytes=4e6, link_bandwidth=25e9,
                                  overhead_s=0.001)
    assert math.isclose(t4, 0.00374, rel_tol=1e-12)
    assert math.isclose(perf_model.predict_step_time(1, 0.010, 4e6, 25e9, 0.001), 0.011)   # no ring on 1
    # a latency of 5 us per ring step adds 2(N-1) of them
    assert math.isclose(perf_model.ring_allreduce_time(4e6, 4, 25e9, latency_s=5e-6), 2.4e-4 + 6 * 5e-6)
    rows = perf_model.performance_model([1, 2, 4], 0.010, 4e6, links={"PCIe": 25e9, "NVLink": 300e9},
                                    overhead_s=0.001)
    assert [(r["link"], r["n"]) for r in rows] == [("PCIe", 1), ("PCIe", 2), ("PCIe", 4),
                                                  ("NVLink", 1), ("NVLink", 2), ("NVLink", 4)]
    pcie4 = rows[2]
    assert math.isclose(pcie4["step_s"], 0.00374)
    assert math.isclose(pcie4["speedup"], 0.011 / 0.00374)
    assert math.isclose(pcie4["efficiency"], 0.011 / 0.00374 / 4)
    assert rows[5]["step_s"] < pcie4["step_s"], "a faster link cannot be slower"


def test_predicted_throughput_with_the_lab_batch_rule():
    cal = {"compute_per_example_s": 1e-5, "overhead_s": 2e-4, "grad_bytes": 203560}
    rows = perf_model.predict_throughput(cal, [1, 4], batch_per_replica=64, links={"PCIe": 25e9})
    one, four = rows
    assert math.isclose(one["step_s"], 64e-5 + 2e-4)
    ring = 2 * 3 / 4 * 203560 / 25e9
    assert math.isclose(four["step_s"], 64e-5 + ring + 2e-4)          # compute(4*64)/4 = compute(64)
    assert math.isclose(four["samples_per_s"], 4 * 64 / four["step_s"])


def test_plots_write_pngs(tmp_path):
    rows = [{"name": "no strategy", "replicas": 1, "epoch_time_s": 1.0, "samples_per_s": 100.0,
             "efficiency": 1.0},
            {"name": "MirroredStrategy ×2", "replicas": 2, "epoch_time_s": 0.8, "samples_per_s": 125.0,
             "efficiency": 0.625}]
    path = tmp_path / "cmp.png"
    fig = viz.plot_comparison(rows, path)
    assert path.stat().st_size > 1000 and fig is not None
    pred = perf_model.predict_throughput({"compute_per_example_s": 1e-5, "overhead_s": 1e-4,
                                      "grad_bytes": 1e5}, [1, 2, 4], 64)
    fig = viz.plot_performance_model(rows[1:], pred)
    fig.savefig(tmp_path / "model.png")
    assert (tmp_path / "model.png").stat().st_size > 1000


# --- python -m mirrored ----------------------------------------------------------------------

def _cli(*args, cwd, env=None):
    env = dict(os.environ, MIRRORED_OFFLINE="1", MPLBACKEND="Agg", **(env or {}),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("NUMBA_ENABLE_CUDASIM", None)         # a real GPU if there is one, else the CPU
    env.pop("MIRRORED_QUICK", None)
    return subprocess.run([sys.executable, "-m", "mirrored", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_main_job_quick_runs_two_replicas_and_writes_a_plot(tmp_path):
    """``python -m mirrored --quick`` as a newcomer runs it: two replicas where there is no
    GPU, two timed epochs after the warm-up, figures marked too short to compare, the real
    folder the full data set would be kept in, a PNG. ``--model dense`` keeps it to seconds;
    that the default is the lab's ConvNet is checked below (``test_the_default_model...``),
    and the ConvNet trains through the same ``scaling.compare`` in tests/test_labs_01_05.py."""
    png, data = tmp_path / "timing.png", tmp_path / "my data"
    proc = _cli("--quick", "--model", "dense", "--plot", str(png), cwd=tmp_path,
                env={"MIRRORED_DATA_DIR": str(data)})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "(epoch 1/3)" in out and "(epoch 3/3)" in out and "Epoch 3/3" in out   # interleaved
    # each header's epoch is the progress line's under it ("Epoch 2/3", not "Epoch 1/1")
    pairs = re.findall(r"\(epoch (\d+/\d+)\)[^\n]*\n(?:[^\n]*\n)*?Epoch (\d+/\d+)", out)
    assert len(pairs) == 9 and all(a == b for a, b in pairs), pairs
    assert PROGRESS.search(out), f"no Keras progress line in:\n{out}"
    assert "Using MirroredStrategy with devices" in proc.stderr     # TF's INFO log: stderr
    table = out[out.index("MNIST lab: no strategy vs MirroredStrategy"):]
    assert "data:    MNIST" in table and "devices: " in table
    assert "model:   the dense stack: Flatten → Dense(64, relu) → Dense(10)" in table
    assert f"kept in {data / 'mnist'} once downloaded" in table and "<data_dir>" not in out
    assert "epochs:  3 (first epoch is warm-up, not timed)" in table
    assert re.search(r"strategy\s+replicas\s+batch\s+steps\s+epoch s\s+ms/step\s+samples/s\s+"
                     r"efficiency\s+test acc", table)
    names = ["no strategy", "MirroredStrategy ×1"]
    if "devices: CPU:0, CPU:1: 2 logical CPU devices" in table:      # no GPU: the CPU split in 2
        names.append("MirroredStrategy ×2")
        assert "global batch 128 split 2 × 64, gradients summed by" in out
    else:
        assert "devices: GPU:0" in table, table
    for name in names:
        row = re.search(rf"^{re.escape(name)}\s+\d.*$", table, re.MULTILINE)
        assert row, name
        assert row.group(0).count("*") == 4, f"timings not marked too short: {row.group(0)}"
    assert "* too short to compare" in table
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot:    {png}" in out


def test_the_help_is_plain_text_and_offers_both_models(tmp_path):
    proc = _cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--model {conv,dense}" in proc.stdout and "--quick" in proc.stdout
    for markup in ("``", ":func:", ":class:", ".. code", "::\n"):
        assert markup not in proc.stdout, f"reStructuredText markup {markup!r} in --help"


def test_the_default_model_is_the_labs_convnet_and_dense_is_the_option():
    """What each kind builds is tests/test_labs_helpers.py's (``labs.make_model``)."""
    from mirrored.lab import labs, workflow
    from mirrored.__main__ import build_parser
    assert build_parser().parse_args([]).model == "conv" == workflow.DEFAULT_MODEL
    assert build_parser().parse_args(["--model", "dense"]).model == "dense"
    assert tuple(workflow.MODELS) == labs.MODEL_KINDS


@pytest.mark.parametrize("args,flag", [(("--epochs", "0"), "--epochs"), (("--model", "resnet"), "--model")])
def test_bad_flags_get_argparse_usage(tmp_path, args, flag):
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 2 and "usage:" in proc.stderr and flag in proc.stderr
