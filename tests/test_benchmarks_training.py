"""benchmarks/training.py runs and writes valid JSON (``--smoke``: tiny models, logical CPUs).

The benchmark configures logical devices, which a process may do only once, so it runs
in a child process, as a user would run it:

    MIRRORED_OFFLINE=1 python -m benchmarks.training --smoke --out /tmp/training.json

No test asserts a time: only that every number that was measured is there and positive.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_smoke

ROOT = Path(__file__).resolve().parents[1]

OURS = {("no strategy", 1), ("OneDeviceStrategy", 1), ("MirroredStrategy", 1), ("MirroredStrategy", 2),
        ("MirroredStrategy", 4), ("MirroredStrategy resident", 1), ("MirroredStrategy resident", 2),
        ("MirroredStrategy custom loop eager", 1), ("MirroredStrategy custom loop @function", 1)}


def _positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_smoke_run_writes_valid_json(tmp_path):
    out = tmp_path / "training.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # the program decides
    env["MIRRORED_OFFLINE"] = "1"
    proc = run_smoke("training", "--out", str(out), env=env)                # within SMOKE_LIMIT_S
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())

    assert doc["benchmark"] == "training" and doc["mode"] == "smoke"
    info = doc["device"]
    assert {"numpy", "numba", "numba_cuda", "date_utc", "device", "cpu_model", "threads"} <= set(info)
    assert info["device"] == "CPU" and info["threads"]["cpu_count"] >= 1
    assert doc["method"]["backend"] == "CPU"
    assert set(doc["models"]) == {"lab", "wide", "convnet", "two-conv"} == set(doc["method"]["epochs"])
    assert doc["models"]["two-conv"]["convs"] == [[2, 3], [4, 3]]

    for model in ("lab", "wide", "convnet", "two-conv"):
        rows = [r for r in doc["results"] if r["model"] == model]
        ours = {(r["strategy"], r["replicas"]) for r in rows if r["framework"] == "ours"}
        assert ours == OURS, ours
        for r in rows:
            for key in ("ms_per_step", "samples_per_s", "global_batch", "steps_per_epoch"):
                assert _positive(r[key]), (key, r)
            assert len(r["epoch_seconds"]) == doc["method"]["epochs"][model] >= 1
            assert all(_positive(t) for t in r["epoch_seconds"])
            assert _positive(r["floor"]["floor_ms"]) and _positive(r["floor"]["flops_per_step"])
            assert _positive(r["floor"]["vs_floor"])
            if r["framework"] == "ours":
                assert all(_positive(b) for b in r["peak_bytes_per_device"]), r
                assert len(r["peak_bytes_per_device"]) == r["replicas"]
                assert _positive(r["ops_per_step"]) and r["allocations_per_step"] >= 0
                assert math.isfinite(r["final_loss"])
        peers = {r["framework"] for r in rows} - {"ours"}
        skipped = {s["name"] for s in doc["skipped"]}
        assert "torch" in peers or "PyTorch rows" in skipped        # a peer is there or says why not
        assert "tf" in peers or "TensorFlow rows" in skipped

    rates = doc["rates"]
    assert _positive(rates["gemm_peak_gflops"]) and _positive(rates["copy_gbps"])
    for r in doc["ratios"]:
        assert _positive(r["value"]), r
    for t in doc["targets"]:
        assert isinstance(t["met"], bool) and _positive(t["measured"])
    assert "ms/step" in proc.stdout and "samples/s" in proc.stdout       # the table was printed


def test_smoke_without_out_writes_nothing(tmp_path):
    results = ROOT / "benchmarks" / "results"
    before = set(results.iterdir()) if results.exists() else set()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["MIRRORED_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.training", "--smoke", "--models", "lab",
                           "--no-peers"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing written" in proc.stdout
    assert (set(results.iterdir()) if results.exists() else set()) == before


def test_issue25_peer_target_needs_both_peers_rows():
    """"The faster of PyTorch and TensorFlow" is only reported when both were measured: a run
    without TensorFlow (e.g. --busy-core alone) once printed the lab target as met against
    PyTorch alone."""
    from benchmarks import training
    rng = np.random.default_rng()
    ours, torch_ms, tf_ms = rng.uniform(3, 6), rng.uniform(6, 12), rng.uniform(4, 7)

    def row(model, framework, strategy, ms):
        return {"model": model, "framework": framework, "strategy": strategy, "replicas": 1,
                "ms_per_step": ms, "row": f"{framework} {strategy}"}

    without_tf = [row("convnet", "ours", "MirroredStrategy", ours),
                  row("convnet", "torch", "eager", torch_ms)]
    names = [t["target"] for t in training.issue25_targets(without_tf)]
    assert not any("faster of PyTorch eager and TensorFlow" in n for n in names), names
    with_tf = without_tf + [row("convnet", "tf", "no strategy", tf_ms)]
    (peer,) = [t for t in training.issue25_targets(with_tf) if "faster of" in t["target"]]
    assert peer["measured"] == pytest.approx(ours / min(torch_ms, tf_ms))
    assert peer["met"] == (ours / min(torch_ms, tf_ms) <= training.TARGET_CONVNET_VS_PEERS)


def test_issue41_gpu_targets_hold_the_replayed_custom_loop_to_fits_graph_and_pytorch():
    """On a GPU, ``--rows custom`` (gpu_session.sh's plan 40) must report issue 41's two GPU
    targets: custom loop @function / fit's graph row x1 (<= 1.2) and / PyTorch eager (<= 0.3);
    neither is claimed from a run that lacks the row it divides by."""
    from benchmarks import training
    rng = np.random.default_rng()
    custom_ms, graph_ms, torch_ms = rng.uniform(0.2, 0.4), rng.uniform(0.2, 0.4), rng.uniform(0.8, 2.0)

    def row(framework, strategy, ms):
        return {"model": "convnet", "framework": framework, "strategy": strategy, "replicas": 1,
                "ms_per_step": ms, "samples_per_s": 64e3 / ms, "row": f"{framework} {strategy}"}

    custom = row("ours", "MirroredStrategy custom loop @function", custom_ms)
    graph, torch_row = row("ours", "MirroredStrategy graph", graph_ms), row("torch", "eager", torch_ms)
    _, targets = training.ratios_and_targets([custom, graph, torch_row], ["convnet"], gpu=True)
    got = {t["target"]: t for t in targets if "custom loop" in t["target"]}
    vs_graph = got["ours custom loop @function / fit graph on 1 GPU, convnet model (ms/step)"]
    vs_torch = got["ours custom loop @function on 1 GPU / PyTorch eager, convnet model (ms/step)"]
    assert vs_graph["measured"] == pytest.approx(custom_ms / graph_ms)
    assert vs_graph["met"] == (custom_ms / graph_ms <= 1.2) and vs_graph["threshold"] == 1.2
    assert vs_torch["measured"] == pytest.approx(custom_ms / torch_ms)
    assert vs_torch["met"] == (custom_ms / torch_ms <= 0.3) and vs_torch["threshold"] == 0.3
    _, targets = training.ratios_and_targets([custom], ["convnet"], gpu=True)
    assert not [t for t in targets if "custom loop" in t["target"]], targets


def test_rows_custom_on_a_gpu_times_fits_graph_x1_alone_and_may_lose_a_custom_row(monkeypatch):
    """``--rows custom`` on a GPU (plan 40's custom_loop stage): fit eager x1, the custom
    loop eager and @function, fit's graph row x1 only (what issue 41's target divides by; x2,
    x4 and the resident rows would cost the plan's budget), PyTorch's rows where torch is;
    a custom-loop row that fails to build or capture is skipped with its reason, as the
    graph rows are, so it cannot cost the others. The rows are not built: the makers are
    read as ``time_rows`` receives them."""
    import types
    import mirrored as tf
    from benchmarks import training
    seen = []

    def fake_time_rows(makers, *args, **kwargs):
        seen.extend(makers)
        return [], 3

    monkeypatch.setattr(training, "time_rows", fake_time_rows)
    spec = training.SMOKE_MODELS["convnet"]
    args = types.SimpleNamespace(rows="custom", modes="eager,graph", no_resident=False)
    training.time_models(args, tf, "GPU", True, {"convnet": spec}, None, None, {"convnet": None}, None,
                         None, 3, 1, [])
    optional = [getattr(m, "label", None) for m in seen if getattr(m, "optional", False)]
    assert optional == ["convnet ours MirroredStrategy x1 custom loop eager",
                        "convnet ours MirroredStrategy x1 custom loop @function",
                        "convnet ours MirroredStrategy x1 graph"], optional
    assert len(seen) == 4                                 # and fit eager x1, not optional
    seen.clear()
    args.rows = "all"                                     # the other row sets keep x2, x4, resident
    training.time_models(args, tf, "GPU", True, {"convnet": spec}, None, None, {"convnet": None}, None,
                         None, 3, 1, [])
    graphs = [m.label for m in seen if getattr(m, "label", "").endswith("graph")]
    assert [g.split()[-3:] for g in graphs] == [["MirroredStrategy", f"x{n}", "graph"] for n in (1, 2, 4)] + [
        ["x1", "resident", "graph"], ["x2", "resident", "graph"]], graphs
