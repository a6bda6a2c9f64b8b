"""benchmarks/breakdown.py runs and accounts for the whole step (a tiny run, in a child
process as a user runs it; no test asserts a time):

    MIRRORED_OFFLINE=1 python -m benchmarks.breakdown --steps 3 --rounds 2 --no-peers --out X
    MIRRORED_OFFLINE=1 python -m benchmarks.breakdown --smoke --out X     # 1 step x 1 round

The second is the --device gpu path in the CUDA simulator; a third test checks, on
stand-ins, where that path puts its marks and its synchronisation.
"""
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from conftest import run_smoke

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"input copy", "conv2d fwd", "max_pooling2d fwd", "flatten fwd", "dense fwd", "dense_1 fwd",
         "loss", "dense_1 bwd", "dense bwd", "flatten bwd", "max_pooling2d bwd", "conv2d bwd",
         "all-reduce", "optimizer", "step, other", "fit loop", "total (fit)"}


def test_breakdown_names_every_part_of_the_convnet_step_and_they_add_up(tmp_path):
    out = tmp_path / "breakdown.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["MIRRORED_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.breakdown", "--steps", "3", "--rounds", "2",
                           "--no-peers", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "breakdown" and doc["model"] == "convnet" and doc["steps_per_round"] == 3
    rows = {r["part"]: r for r in doc["rows"]}
    assert set(rows) == PARTS, set(rows) ^ PARTS
    for name, per_round in doc["rounds_ms"].items():
        assert len(per_round) == 2 and all(math.isfinite(v) for v in per_round), name
    for r in range(2):                 # every round: the parts add up to the whole epoch per step
        parts = sum(v[r] for k, v in doc["rounds_ms"].items() if k != "total (fit)")
        assert math.isclose(parts, doc["rounds_ms"]["total (fit)"][r], rel_tol=1e-9)
    assert rows["conv2d fwd"]["ms_per_step"] > 0 and rows["optimizer"]["ms_per_step"] > 0
    assert "conv2d bwd" in proc.stdout and "median ms/step" in proc.stdout


def test_gpu_breakdown_smoke_times_every_part_in_the_simulator(tmp_path):
    """``--smoke``: the --device gpu path (a PhaseTimer on GPU:0's stream, a synchronisation
    at the end of each step) on the simulator's GPU, a tiny ConvNet, one step."""
    out = tmp_path / "breakdown.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}   # --smoke chooses it
    env["MIRRORED_OFFLINE"] = "1"
    proc = run_smoke("breakdown", "--out", str(out), env=env)     # the README's form, in SMOKE_LIMIT_S
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["device_mode"] == "gpu" and doc["device"]["simulator"] is True and doc["smoke"] is True
    rows = {r["part"]: r for r in doc["rows"]}
    assert set(rows) == PARTS | {"step (GPU, synchronised)"}, set(rows) ^ PARTS
    gpu = {k: v[0] for k, v in doc["gpu_rounds_ms"].items()}
    assert set(gpu) == PARTS - {"fit loop", "total (fit)"} | {"step"}
    assert all(math.isfinite(v) and v >= 0 for k, v in gpu.items() if k != "step, other"), gpu
    for part in ("conv2d fwd", "conv2d bwd", "max_pooling2d fwd", "loss", "optimizer"):  # kernels ran
        assert gpu[part] > 0 and rows[part]["gpu_ms_per_step"] == gpu[part], part
    # The parts do not overlap: together they fit inside the step (to the clock's grain),
    # and the step inside the epoch.
    assert gpu["step, other"] > -0.01 * gpu["step"], gpu
    assert gpu["step"] <= doc["rounds_ms"]["total (fit)"][0] * 1.001
    assert "GPU ms/step" in proc.stdout and "conv2d bwd" in proc.stdout


def test_gpu_mode_marks_each_part_on_the_replica_device_and_waits_at_the_end_of_the_step():
    """``instrument(model, timer)``, on stand-ins for a model: every part is a phase of
    replica 0 on the step's device, in the order the step calls them, and the device
    is synchronised inside the step's phase, after its last part (so the step's end mark
    comes after all its work). ``gpu_seconds`` sums the timer's phases per part."""
    from benchmarks import breakdown

    log = []

    class Timer:                                   # the PhaseTimer calls Parts makes
        def phase(self, name, replica, device):
            @contextlib.contextmanager
            def block():
                log.append(("begin", name, replica, device.name))
                yield
                log.append(("end", name))
            return block()

        def reset(self):
            log.append("reset")

        def summary(self):
            return {"step": {"total_s": 2.0}, "conv fwd": {"total_s": 0.5}, "loss": {"total_s": 0.25}}

    dev = SimpleNamespace(name="GPU:0", synchronize=lambda: log.append("synchronize"))
    layer = SimpleNamespace(name="conv", forward=lambda state, x, training=False: log.append("forward"),
                            backward=lambda state, dy: log.append("backward"))
    program = SimpleNamespace(loss=lambda *a: log.append("loss"))
    step = SimpleNamespace(devices=[dev], programs=[program],
                           host_part=lambda batch: log.append("host part"),
                           all_reduce=lambda: log.append("all-reduce"),
                           update=lambda: log.append("update"))

    def train(batch):                              # Step.train's order, through the wrapped methods
        step.host_part(batch)
        layer.forward(None, batch, True)
        program.loss()
        layer.backward(None, batch)
        step.all_reduce()
        step.update()
    step.train = train
    parts = breakdown.instrument(SimpleNamespace(step=step, layers=[layer]), timer=Timer())
    step.train("batch")

    def phase(name, inner):
        return [("begin", name, 0, "GPU:0"), inner, ("end", name)]
    assert log == ([("begin", "step", 0, "GPU:0")] + phase("input copy", "host part")
                   + phase("conv fwd", "forward") + phase("loss", "loss") + phase("conv bwd", "backward")
                   + phase("all-reduce", "all-reduce") + phase("optimizer", "update")
                   + ["synchronize", ("end", "step")])
    assert set(parts.seconds) == {"step", "input copy", "conv fwd", "loss", "conv bwd", "all-reduce", "optimizer"}
    assert all(v >= 0 for v in parts.seconds.values())
    assert parts.gpu_seconds() == {"step": 2.0, "input copy": 0.0, "conv fwd": 0.5, "loss": 0.25,
                                   "conv bwd": 0.0, "all-reduce": 0.0, "optimizer": 0.0}
    parts.reset()
    assert log[-1] == "reset" and set(parts.seconds.values()) == {0.0}
