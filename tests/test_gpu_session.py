"""benchmarks/gpu_session.sh, plan 40 and the plans 1-3, driven by stand-in tools.

The plans need a GPU, ncu and compute-sanitizer; what can be checked anywhere is the
script's own logic. ``python``, ``ncu``, ``nvidia-smi`` and a carried compute-sanitizer are
replaced by scripts that log how they were called, and each command runs in a fresh $OUT
(the device tool empties it before each command). Checked: what each command runs, in
order; that it leaves at most 8 files; that its stages' time limits fit its budget, and
the budget fits the device's limits (plan 40: itself, a rerun and a start-up within the 15
minutes a session has; plans 1-3: 9 minutes each); one NUMBA_CACHE_DIR for every stage of
every command; the fallbacks (ncu refused, no sanitizer, no full MNIST); a budget that runs
out skips stages, saying so; ``prepare`` (run here, before the device call) puts the data
and the wheels in the checkout, ignored by git.
(tests/test_benchmarks_profile.py drives the profile and breakdown stages alone;
tests/test_benchmarks_course_lab.py checks that course_lab's cold run starts empty.)
"""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
NINE_MINUTES = 9 * 60
DEVICE_BUDGET_S = 15 * 60    # a session's device time, all calls, start-ups and idle waits
START_UP_S = 60              # a fresh machine's start ("a minute or more": the device README)
KILL_GRACE_S = 10            # timeout -k 10 in the script's stage()
MAX_FILES = 8                # what the device tool brings back from $OUT

FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$FAKE_LOG"
echo "$NUMBA_CACHE_DIR" >> "$FAKE_LOG.cache"
case "$*" in *"$FAKE_SLOW"*) [ -n "$FAKE_SLOW" ] && sleep "$FAKE_SLOW_S" ;; esac   # a slow stage
case "$*" in "-m pip download"*)     # prepare: one stand-in wheel per spec, as pip names them
  dest=; for a in "$@"; do [ "$prev" = -d ] && dest=$a; prev=$a; done
  for a in "$@"; do case "$a" in *==*) n=$(echo "${a%%==*}" | tr - _)
    : > "$dest/$n-${a##*==}-cp312-cp312-manylinux_2_28_x86_64.whl" ;; esac; done ;;
esac
while [ $# -gt 0 ]; do case "$1" in --out|--json) echo '{}' > "$2" ;; esac; shift; done   # as the programs do
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
        "FAKE_NCU_REFUSE", "SANITIZER", "SANITIZE_TESTS", "XDIST", "TEST_TIMEOUT", "MNIST_FULL_DIR",
        "TESTS40", "XDIST40", "WHEEL_SPECS", "MNIST_SOURCE", "FAKE_SLOW"]
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
        f"python -m benchmarks.course_lab --data-dir .gpudata/mnist --out {out / 'course_lab.json'}"
        " --peer-epochs 3 --serial-cold",
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


PLAN40_FILES = ["course_lab.json", "course_lab.log", "custom_loop.json", "custom_loop.log",
                "host_profile.json", "host_profile.log", "tests40.log", "versions.log"]
TESTS40 = ["tests/test_steps_per_execution.py", "tests/test_lean_host.py", "tests/test_auto_resident.py",
           "tests/test_kernel_cache.py", "tests/test_kernel_disk_cache.py", "tests/test_function_replay.py",
           "tests/test_graphs.py", "tests/test_compile_ahead.py", "tests/test_kernels_tf_ops.py",
           "tests/test_ops.py", "tests/test_function_threads.py", "tests/test_sync_batchnorm.py",
           "tests/test_custom_train_step.py"]


def full_mnist(tmp_path):
    """A folder with the four MNIST file names (their contents are the lab's business)."""
    folder = tmp_path / "mnist-full"
    folder.mkdir(exist_ok=True)
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        (folder / name).write_bytes(os.urandom(16))
    return folder


def setting(name):
    return int(re.search(rf"{name}:=(\d+)", SCRIPT.read_text()).group(1))


def test_plan_40_runs_its_stages_in_order_within_its_budget_and_eight_files(tmp_path):
    """Plan 40, the one command a session lent a GPU runs first: versions, the course lab
    cold then warm with PyTorch beside it, host_profile, issue 40/41's GPU tests, the custom
    loop rows, then the summary; 8 files; the limits (and the summary's) within PLAN40_S; and
    PLAN40_S, a rerun of it and a machine's start-up within a session's 15 minutes."""
    budget, summary = setting("PLAN40_S"), setting("SUMMARY40_S")
    assert 2 * (budget + KILL_GRACE_S) + START_UP_S <= DEVICE_BUDGET_S, budget
    assert budget + 2 * KILL_GRACE_S <= 600                # one call: the device's 10-minute limit

    mnist = full_mnist(tmp_path)
    stdout, files, calls = command(tmp_path, "40", MNIST_FULL_DIR=str(mnist))
    out = tmp_path / "out40"
    assert files == PLAN40_FILES and len(files) <= MAX_FILES
    assert [c for c in calls if c.startswith("python")] == [
        "python -",                                                         # versions
        f"python -m benchmarks.course_lab --data-dir {mnist} --out {out / 'course_lab.json'} --peer-epochs 3 --serial-cold",
        f"python -m benchmarks.host_profile --json {out / 'host_profile.json'} --model conv "
        "--modes graph,eager --epochs 3",
        "python -c import pytest_timeout",                                  # --timeout if there
        "python -m pytest -v -p no:cacheprovider -n 7 --dist loadfile --timeout 120 -rfEs " + " ".join(TESTS40),
        f"python -m benchmarks.training --out {out / 'custom_loop.json'} --models convnet --rows custom "
        "--no-resident --epochs 3",
        f"python - {out}"]                                                  # the summary
    assert list(limits(stdout)) == ["versions", "course_lab", "host_profile", "tests40", "custom_loop"]
    assert sum(limits(stdout).values()) + summary <= budget, limits(stdout)
    assert "WARNING" not in stdout and "=== plan 40: summary" in stdout
    for test_file in TESTS40:                              # the files exist, and their gpu tests
        assert (ROOT / test_file).is_file(), test_file     # are collected there (marker: gpu)
    caches = (tmp_path / "calls.log.cache").read_text().split()
    assert set(caches) == {str(tmp_path / "numba-cache")}, caches


def test_plan_40_without_the_full_mnist_warns_before_the_lab(tmp_path):
    stdout, files, calls = command(tmp_path, "40", MNIST_FULL_DIR=str(tmp_path / "nothing-here"))
    assert files == PLAN40_FILES
    warning = stdout.index("=== course_lab: WARNING: no ")
    assert "bundled 8,000-image subset" in stdout[warning:] and warning < stdout.index("=== course_lab (limit")


def test_plan_40_cuts_limits_to_what_is_left_and_skips_stages_when_its_budget_runs_out(tmp_path):
    """A course lab that takes 6 s of a 35 s plan (20 s for the stages): its limit was cut
    to the 20 s left, and after it the stages that find under 15 s left are skipped, each
    saying so; the summary still runs and still says what it found."""
    stdout, files, calls = command(tmp_path, "40", PLAN40_S="35", MNIST_FULL_DIR=str(full_mnist(tmp_path)),
                                   FAKE_SLOW="benchmarks.course_lab", FAKE_SLOW_S="6")
    assert limits(stdout)["course_lab"] <= 20
    for name in ("host_profile", "tests40", "custom_loop"):
        assert f"=== {name}: skipped" in stdout, stdout
        assert "skipped" in (tmp_path / "out40" / f"{name}.log").read_text()
    assert not [c for c in calls if " -m " in c and "-m benchmarks.course_lab" not in c], calls
    assert calls[-1].startswith("python - ") and "=== plan 40: summary" in stdout
    assert len(files) <= MAX_FILES


def test_prepare_puts_the_full_mnist_and_the_wheels_in_the_checkout_ignored_by_git(tmp_path):
    """``prepare`` runs here (no GPU): in a checkout (a copy of the script in a fresh git
    repository), the four MNIST files in .gpudata/mnist, the wheels in .whl (pip download,
    cp312 for the device's python3), both ignored by git, and the device call to make; run
    twice, it downloads nothing again and ignores each folder once."""
    repo = tmp_path / "checkout"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "gpu_session.sh").write_text(SCRIPT.read_text())
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    bin_dir, _ = tools(tmp_path)
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.log"), PYTHON=str(bin_dir / "python"),
               MNIST_SOURCE=str(full_mnist(tmp_path)), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in ("MNIST_FULL_DIR", "WHEELS", "WHEEL_SPECS", "PLAN40_S"):
        env.pop(name, None)
    for _ in range(2):
        proc = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_session.sh"), "prepare"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    mnist = sorted(p.name for p in (repo / ".gpudata" / "mnist").iterdir())
    assert mnist == sorted(p.name for p in (tmp_path / "mnist-full").iterdir())
    wheels = sorted(p.name for p in (repo / ".whl").iterdir())
    assert [w.split("-")[:3] for w in wheels] == [["numba_cuda", "0.30.4", "cp312"], ["numpy", "2.4.6", "cp312"]]
    downloads = [c for c in (tmp_path / "calls.log").read_text().splitlines() if "pip download" in c]
    assert len(downloads) == 1 and "--python-version 3.12" in downloads[0] and "--no-deps" in downloads[0]
    exclude = (repo / ".git" / "info" / "exclude").read_text().splitlines()
    assert exclude.count("/.gpudata/") == 1 and exclude.count("/.whl/") == 1
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    assert ".gpudata" not in status and ".whl" not in status, status
    call = re.search(r'run\(command="bash benchmarks/gpu_session.sh 40", carry=\[".whl", ".gpudata"\], '
                     r'timeout_s=(\d+)\)', proc.stdout)
    assert call, proc.stdout
    timeout_s = int(call.group(1))                        # the script's worst case fits in it,
    assert setting("PLAN40_S") + KILL_GRACE_S <= timeout_s <= 600    # and twice it with a start-up
    assert 2 * timeout_s + START_UP_S <= DEVICE_BUDGET_S, timeout_s  # fits the session's device time


def test_prepare_without_the_mnist_files_says_where_it_looked(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "gpu_session.sh").write_text(SCRIPT.read_text())
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    env = dict(os.environ, MNIST_SOURCE=str(tmp_path / "no-mnist"), PYTHON="false")
    env.pop("MNIST_FULL_DIR", None)
    proc = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_session.sh"), "prepare"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"no {tmp_path / 'no-mnist'}/train-images-idx3-ubyte.gz" in proc.stdout
    assert "MNIST_SOURCE=DIR" in proc.stdout


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


def test_plan_40_summary_reads_the_programs_json(tmp_path):
    """The summary printed last (the device call's output_tail) computes issue 40's steady
    ms/step from the lab's epochs 3-12 (steps: the training images over 64 per replica) and
    shows each figure the programs wrote; a file missing or malformed is named, not a crash."""
    import json
    import statistics
    import sys
    code = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF", SCRIPT.read_text(), re.S).group(1)
    rng = __import__("numpy").random.default_rng()
    epochs = [float(v) for v in rng.uniform(0.2, 0.3, 12)]
    run = {"wall_s": 6.5, "fit_s": 4.0, "epochs_s": epochs, "test_accuracy": 0.9861, "replicas": 1,
           "train_examples": 60000, "source": "full", "compile_s": {"cuda_compiles": 15, "cuda_kernels": 4.2}}
    docs = {"course_lab.json": {"runs": {"cold": run, "warm": dict(run, wall_s=3.9)}, "skipped": [],
                                "peers": [{"row": "PyTorch CUDA graph", "ms_per_step": 0.306}]},
            "host_profile.json": {"model": "conv", "modes": {"graph": {
                "verbose0_ms_per_step": 0.25, "verbose1_ms_per_step": 0.26, "quiet_over_loud": 0.25 / 0.26}}},
            "custom_loop.json": "{not json"}
    for name, doc in docs.items():
        (tmp_path / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    proc = subprocess.run([sys.executable, "-", str(tmp_path)], input=code, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    steady = statistics.median(epochs[2:]) / 938 * 1e3
    assert f"course_lab warm: wall 3.90 s, fit 4.00 s, epoch 1 {epochs[0]:.2f} s, steady {steady:.3f} ms/step, " \
           "accuracy 0.9861, 15 kernels compiled in 4.20 s (full, 60000 images)" in proc.stdout, proc.stdout
    assert "course_lab PyTorch CUDA graph: 0.306 ms/step" in proc.stdout
    assert "host_profile conv graph: verbose=0 0.250, verbose=1 0.260 ms/step, ratio 0.96" in proc.stdout
    assert "custom_loop.json: none (JSONDecodeError)" in proc.stdout
