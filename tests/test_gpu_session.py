"""benchmarks/gpu_session.sh as the plan of three device commands, driven by stand-in tools.

The plan needs a GPU, ncu and compute-sanitizer; what can be checked anywhere is the
script's own logic. ``python``, ``ncu``, ``nvidia-smi`` and a carried compute-sanitizer are
replaced by scripts that log how they were called, and each command runs in a fresh $OUT
(the device tool empties it before each command). Checked: what each command runs, in
order; that it leaves at most 8 files; that its stages' time limits fit its budget, and
the budget fits 9 minutes; one NUMBA_CACHE_DIR for every stage of every command; the
fallbacks (ncu refused, no sanitizer); a budget that runs out skips stages, saying so.
(tests/test_benchmarks_profile.py drives the profile and breakdown stages alone.)
"""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
NINE_MINUTES = 9 * 60
KILL_GRACE_S = 10            # timeout -k 10 in the script's stage()
MAX_FILES = 8                # what the device tool brings back from $OUT

FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$FAKE_LOG"
echo "$NUMBA_CACHE_DIR" >> "$FAKE_LOG.cache"
while [ $# -gt 0 ]; do [ "$1" = --out ] && echo '{}' > "$2"; shift; done    # as the programs do
"""
FAKE_NCU = r"""#!/bin/sh
echo "ncu $*" >> "$FAKE_LOG"
case "$1" in
  --version) echo "Version 2099.1 (stand-in)"; exit 0 ;;
  --import) echo '"ID","Kernel Name"'; exit 0 ;;
esac
if [ -n "$FAKE_NCU_REFUSE" ]; then echo "==ERROR== ERR_NVGPUCTRPERM"; exit 0; fi
while [ $# -gt 0 ]; do [ "$1" = --export ] && out="$2"; shift; done
echo report > "$out.ncu-rep"
"""
FAKE_SMI = """#!/bin/sh
echo "name, driver_version"; echo "Stand-in GPU, 999.1"
"""
FAKE_SANITIZER = """#!/bin/sh
echo "sanitizer $*" >> "$FAKE_LOG"
[ "$1" = --version ] && echo "Compute Sanitizer stand-in"
exit 0
"""


def tools(tmp_path, sanitizer=True):
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PYTHON), ("ncu", FAKE_NCU), ("nvidia-smi", FAKE_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if sanitizer:                                  # where the carried wheel unpacks it
        where = site / "nvidia" / "cu13" / "compute-sanitizer"
        where.mkdir(parents=True, exist_ok=True)
        (where / "compute-sanitizer").write_text(FAKE_SANITIZER)   # not executable: the script chmods
    return bin_dir, site


def command(tmp_path, what, refuse=False, sanitizer=True, **env_extra):
    """One device command: ``bash gpu_session.sh WHAT`` in a fresh $OUT. (stdout, files, calls)."""
    bin_dir, site = tools(tmp_path, sanitizer)
    out, log = tmp_path / f"out{what}", tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, OUT=str(out), FAKE_LOG=str(log), PYTHON=str(bin_dir / "python"),
               SITE=str(site), NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"),
               PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
               CUDA_BIN=str(tmp_path / "no-toolkit"),    # not the machine's toolkit
               WHEELS=str(tmp_path / "no-wheels"), **env_extra)   # nor a checkout's .whl/
    # the script's knobs from the caller's environment (e.g. TESTS_S=280 on a device run)
    knobs = [n for n in env if n.endswith(("_S", "_ARGS"))] + [
        "FAKE_NCU_REFUSE", "SANITIZER", "SANITIZE_TESTS", "XDIST", "TEST_TIMEOUT", "MNIST_FULL_DIR"]
    for name in knobs:
        if name not in env_extra:
            env.pop(name, None)
    if refuse:
        env["FAKE_NCU_REFUSE"] = "1"
    proc = subprocess.run(["bash", str(SCRIPT), what], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [c for c in (log.read_text().splitlines() if log.exists() else []) if " -m pip " not in c]
    files = sorted(p.name for p in out.iterdir())
    return proc.stdout, files, calls


def limits(stdout):
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^=== (\S+) \(limit (\d+)s\)", stdout, re.M)}


def test_the_three_commands_in_order_each_within_nine_minutes_and_eight_files(tmp_path):
    plan = re.search(r"PLAN_S:=(\d+)", SCRIPT.read_text())
    assert plan and int(plan.group(1)) + KILL_GRACE_S <= NINE_MINUTES
    budget = int(plan.group(1))

    stdout, files, calls = command(tmp_path, "1")
    assert files == ["breakdown.json", "breakdown.log", "course_lab.json", "course_lab.log",
                     "training.json", "training.log", "versions.log"]
    out = tmp_path / "out1"
    training = f"python -m benchmarks.training --out {out / 'training.json'} --models lab,convnet"
    assert [c for c in calls if c.startswith("python")] == [
        "python -", training + " --no-resident --epochs 5",
        f"python -m benchmarks.course_lab --data-dir .gpudata/mnist --out {out / 'course_lab.json'}",
        f"python -m benchmarks.breakdown --device gpu --out {out / 'breakdown.json'}"]
    assert set(limits(stdout)) == {"versions", "training", "course_lab", "breakdown"}
    assert sum(limits(stdout).values()) <= budget, limits(stdout)

    stdout, files, calls = command(tmp_path, "2")
    out = tmp_path / "out2"
    assert files == ["kernels.json", "kernels.log", "launch.json", "launch.log", "profile-details.csv",
                     "profile-raw.csv", "profile.log", "profile.ncu-rep"]
    assert calls[0] == f"python -m benchmarks.kernels --out {out / 'kernels.json'}"
    assert calls[1] == f"python -m benchmarks.launch --out {out / 'launch.json'}"
    run = [c for c in calls if c.startswith("ncu --target-processes")]
    assert len(run) == 1 and run[0].endswith("-m benchmarks.profile --no-times --only conv|pool"), calls
    # the exports are not stages: their limit (EXPORT_S, 3 calls) counts beside the stages'
    export = int(re.search(r"EXPORT_S:=(\d+)", SCRIPT.read_text()).group(1))
    assert sum(limits(stdout).values()) + 3 * export <= budget, limits(stdout)

    stdout, files, calls = command(tmp_path, "3")
    assert files == ["sanitize-memcheck.log", "sanitize-racecheck.log", "sanitize-synccheck.log", "tests.log"]
    runs = [c for c in calls if c.startswith("sanitizer --tool")]
    assert [c.split()[2] for c in runs] == ["memcheck", "racecheck", "synccheck"]
    for c in runs:
        assert "--target-processes all" in c and "--error-exitcode 3" in c and "-m pytest" in c
        tests = [w for w in c.split() if w.startswith("tests/")]
        assert "tests/test_graphs.py" in tests and "tests/test_dropout_layer.py" in tests
        assert "tests/test_kernels_dropout.py" in tests and len(tests) >= 10, tests    # the glob, expanded
        assert "tests/test_kernels_compile.py" not in tests        # the compiler alone: no launches
        assert "tests/test_kernels_cpu_loops.py" not in tests      # no CUDA at all
    assert calls[-1].startswith("python -m pytest -q -p no:cacheprovider -n 12"), calls   # then the suite
    assert sum(limits(stdout).values()) <= budget, limits(stdout)

    caches = (tmp_path / "calls.log.cache").read_text().split()
    assert set(caches) == {str(tmp_path / "numba-cache")} and (tmp_path / "numba-cache").is_dir()


def test_plan_2_falls_back_to_event_times_when_ncu_is_refused(tmp_path):
    _, files, calls = command(tmp_path, "2", refuse=True)
    assert files == ["kernels.json", "kernels.log", "launch.json", "launch.log", "profile-times.log",
                     "profile.json", "profile.log"]
    assert calls[-1] == (f"python -m benchmarks.profile --out {tmp_path / 'out2' / 'profile.json'} "
                         f"--only conv|pool --launches 20"), calls


def test_plan_3_without_a_sanitizer_says_so_and_still_runs_the_suite(tmp_path):
    _, files, calls = command(tmp_path, "3", sanitizer=False)
    assert len(files) <= MAX_FILES
    for tool in ("memcheck", "racecheck", "synccheck"):
        assert "no compute-sanitizer" in (tmp_path / "out3" / f"sanitize-{tool}.log").read_text()
    assert len(calls) == 1 and "-m pytest" in calls[0] and "-n 12" in calls[0], calls


def test_a_spent_budget_skips_stages_and_says_so(tmp_path):
    stdout, files, calls = command(tmp_path, "1", PLAN_S="5")
    assert "=== training: skipped" in stdout and "=== breakdown: skipped" in stdout
    assert not [c for c in calls if "benchmarks." in c]


@pytest.mark.parametrize("args,message", [([], "usage"), (["nonsense"], "unknown stage nonsense")])
def test_bad_arguments_are_refused(tmp_path, args, message):
    env = dict(os.environ, OUT=str(tmp_path / "out"), WHEELS=str(tmp_path / "no-wheels"))
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stdout
