"""``python -m benchmarks.profile``: what Nsight Compute will be pointed at.

The real run needs a GPU (and ncu: benchmarks/gpu_session.sh's profile stage); here the
smoke mode proves, in the CUDA simulator and in a child process (the program picks its
own CUDA mode at import), that every case is built, checked and launched, that ``--only``
and ``--no-times`` do what they say, and, in this process, that a wrong kernel is never
profiled. No test asserts a time.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SIMULATOR, run_smoke

ROOT = Path(__file__).resolve().parent.parent
#: Every case, in launch order (benchmarks/kernels.py's conv_pool_cases, then memory_cases).
PREFIXES = ("conv2d v1 forward", "conv2d v2 forward", "conv2d backward dW+db",
            "conv2d backward dX+dW+db", "max_pool 2x2 forward", "max_pool 2x2 backward",
            "conv2d v3 forward", "conv2d v3 fused +relu+pool", "conv2d backward v2 dW+db",
            "max_pool 2x2 backward v2 +relu mask", "conv2d second conv v1 forward",
            "conv2d second conv v3 forward", "conv2d second conv backward v1 dX+dW+db",
            "conv2d second conv backward v2 dX+dW+db",
            "elementwise add", "softmax_xent (10 classes)", "softmax_xent v1", "sgd momentum", "adam")


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)          # --smoke must choose the simulator itself
    return subprocess.run([sys.executable, "-m", "benchmarks.profile", "--smoke", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_profile_smoke_launches_every_case_in_order_and_times_each_launch(tmp_path):
    out = tmp_path / "profile.json"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}   # --smoke chooses
    proc = run_smoke("profile", "--out", str(out), env=env)    # the README's form, in SMOKE_LIMIT_S
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "profile" and doc["device"]["simulator"] is True
    launches = 1                                               # profile.py's SMOKE_LAUNCHES
    assert doc["method"]["launches"] == launches and doc["method"]["smoke"] is True
    rows = doc["rows"]
    assert len(rows) == len(PREFIXES), [r["name"] for r in rows]
    for k, (row, prefix) in enumerate(zip(rows, PREFIXES), start=1):
        assert row["name"].startswith(prefix), (row["name"], prefix)
        assert row["case"] == k and row["launches"] == launches and row["bytes"] > 0
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"], row
        assert f"case {k}: {row['name']}" in proc.stdout     # the order ncu's report follows
    assert doc["skipped"] == []


def test_profile_only_and_no_times(tmp_path):
    out = tmp_path / "profile.json"
    proc = run("--only", "MAX_POOL|^adam$", "--no-times", "--launches", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"].split(" (")[0] for r in rows] == ["max_pool 2x2 forward", "max_pool 2x2 backward",
                                                        "max_pool 2x2 backward v2 +relu mask", "adam"]
    assert not any("median_us" in r for r in rows)              # no events under ncu
    nothing = run("--only", "no such kernel")
    assert nothing.returncode == 2 and "no case matches" in nothing.stdout


@pytest.mark.skipif(not SIMULATOR, reason="runs main(['--smoke']) in this process: needs the simulator")
def test_a_wrong_kernel_is_reported_and_never_profiled(monkeypatch, capsys):
    from benchmarks import kernels as kbench
    from benchmarks import profile

    calls = {"good": 0, "bad": 0}

    def fake_cases(batch, hw, nbytes, second=None):
        def bump(name):
            calls[name] += 1
        yield kbench.Case("good kernel", "test", 8, lambda: bump("good"), lambda: None)
        yield kbench.Case("bad kernel", "test", 8, lambda: bump("bad"), lambda: "1 of 2 wrong")

    monkeypatch.setattr(profile, "cases", fake_cases)
    assert profile.main(["--smoke", "--launches", "3"]) == 1      # the stage fails visibly
    assert calls == {"good": profile.WARMUP + 3, "bad": 1}        # checked once, then left alone
    text = capsys.readouterr().out
    assert "skipped: bad kernel: wrong result, not profiled: 1 of 2 wrong" in text
    assert "case 1: good kernel" in text and "case 2" not in text


# --- benchmarks/gpu_session.sh's profile and breakdown stages, with stand-ins --------------
# The stages need a GPU and Nsight Compute; what can be checked anywhere is the script's
# own logic: the flags it gives ncu, the exports, and the fallback to CUDA-event timing
# when ncu is missing or refused. ``ncu`` and ``python`` are replaced by scripts that log
# their arguments (the fake ncu writes a report unless told to refuse, as ncu does).

FAKE_NCU = r"""#!/bin/sh
echo "ncu $*" >> "$FAKE_LOG"
case "$1" in
  --version) echo "Version 2099.1 (stand-in)"; exit 0 ;;
  --import) echo '"ID","Kernel Name","Section Name","Metric Name","Metric Value"'; exit 0 ;;
esac
if [ -n "$FAKE_NCU_REFUSE" ]; then
  echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters on the target device 0."
  exit 0
fi
while [ $# -gt 0 ]; do [ "$1" = --export ] && out="$2"; shift; done
echo report > "$out.ncu-rep"
"""
FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$FAKE_LOG"
"""


def session(tmp_path, *stages, refuse=False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("ncu", FAKE_NCU), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "calls.log"
    env = dict(os.environ, OUT=str(out), FAKE_LOG=str(log), PYTHON=str(bin_dir / "python"),
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("FAKE_NCU_REFUSE", None)
    if refuse:
        env["FAKE_NCU_REFUSE"] = "1"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), *stages], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    calls = [c for c in calls if " -m pip " not in c]            # carried wheels, if any
    return proc, out, calls


def test_session_profile_stage_runs_ncu_on_the_profile_ranges_and_exports(tmp_path):
    proc, out, calls = session(tmp_path, "profile", "breakdown")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = [c for c in calls if c.startswith("ncu --target-processes")]
    assert len(run) == 1, calls
    args = run[0].split()
    for flag, value in (("--profile-from-start", "off"), ("--clock-control", "none"),
                        ("--target-processes", "all"), ("--export", str(out / "profile"))):
        assert args[args.index(flag) + 1] == value, (flag, run[0])
    sections = {args[i + 1] for i, a in enumerate(args) if a == "--section"}
    assert {"SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "LaunchStats",
            "Occupancy", "WarpStateStats", "SchedulerStats"} <= sections, sections
    assert run[0].endswith("-m benchmarks.profile --no-times")          # the program, untimed
    imports = [c for c in calls if c.startswith("ncu --import")]
    assert any("--page details --csv" in c for c in imports) and any("--page raw --csv" in c for c in imports)
    assert (out / "profile.ncu-rep").exists() and (out / "profile-details.csv").exists()
    assert (out / "profile-raw.csv").exists()
    assert not [c for c in calls if "benchmarks.profile --out" in c]       # no fallback
    assert f"python -m benchmarks.breakdown --device gpu --out {out / 'breakdown.json'}" in calls


def test_session_profile_stage_falls_back_to_event_timing_when_ncu_is_refused(tmp_path):
    proc, out, calls = session(tmp_path, "profile", refuse=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cannot read this GPU's performance counters" in (out / "profile.log").read_text()
    assert calls[-1] == f"python -m benchmarks.profile --out {out / 'profile.json'} --launches 20", calls
    assert not [c for c in calls if c.startswith("ncu --import")]
