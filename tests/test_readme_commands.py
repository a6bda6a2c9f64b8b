"""Every command the README shows is run by a test, and the README stays short.

The README's commands are found where a reader copies them from: fenced ``bash`` blocks and
the indented command lines of "Benchmarks". Each must be listed in ``RUN_BY`` with the test
that runs it (this file runs the quick ones itself; the installs and the suite are what CI,
``.ci/run``, runs on every landing). A command added to the README without a test fails here.

    python -m pytest tests/test_readme_commands.py
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: The README is for a reader who wants to start and to understand a step; results and long
#: tables live in benchmarks/RESULTS.md and kernels/README.md.
MAX_README_LINES = 400

#: README command (a regular expression over the whole line) -> the test that runs it.
RUN_BY = {
    r"python3 -m venv \.venv && source \.venv/bin/activate.*": ".ci/run (a fresh venv)",
    r"python -m pip install -r requirements\.txt && python -m mirrored\b.*":
        "tests/test_timing_workflow.py::test_main_job_quick_runs_two_replicas_and_writes_a_plot",
    r"python -m pip install -r requirements\.txt && python -m pytest\b.*": ".ci/run (the suite)",
    r"mpiexec -n 2 python train\.py.*": "tests/test_multi_worker.py::test_two_workers_one_cpu_each_fit_evaluate_custom_loop",
    r"NUMBA_ENABLE_CUDASIM=1 python -m mirrored info --logical-gpus 4.*":
        "tests/test_readme_commands.py::test_info_with_four_simulated_logical_gpus",
    r"python -m benchmarks\.training\b.*": "tests/test_benchmarks_training.py",
    r"python -m benchmarks\.breakdown\b.*": "tests/test_benchmarks_breakdown.py",
    r"python -m benchmarks\.kernels\b.*": "tests/test_benchmarks_kernels.py",
    r"python -m benchmarks\.allreduce\b.*": "tests/test_benchmarks_allreduce.py",
    r"python -m benchmarks\.multiworker\b.*": "tests/test_benchmarks_multiworker.py",
    r"python -m benchmarks\.launch\b.*": "tests/test_launch_cache.py",
    r"python -m benchmarks\.profile\b.*": "tests/test_benchmarks_profile.py",
}


def readme_commands(text=README):
    """The command lines of the README's ``bash`` blocks and of its indented command lines."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        commands += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    commands += [line.split("  #")[0].strip() for line in text.splitlines()
                 if re.match(r"^    (python -m|bash) ", line)]
    return commands


def test_every_readme_command_is_run_by_a_named_test_that_exists():
    commands = readme_commands()
    assert len(commands) >= 10, commands
    for command in commands:
        where = [test for pattern, test in RUN_BY.items() if re.fullmatch(pattern, command)]
        assert where, (f"README command {command!r} is run by no test: add a test that runs it "
                       f"and list it in RUN_BY")
        target = where[0].split(" ")[0]
        path, _, name = target.partition("::")
        assert (ROOT / path).exists(), f"{command!r}: {path} does not exist"
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"{command!r}: {target} does not exist"
        if path.endswith(".py") and not name:     # a benchmark's tests run its module
            module = re.search(r"-m (\S+)", command)[1]
            assert module in (ROOT / path).read_text(), f"{path} never runs {module}"


def test_ci_runs_the_install_and_the_suite_as_the_readme_says():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "pip install --quiet -r requirements.txt" in ci
    assert "python -m pytest" in ci


def test_the_readme_stays_short_and_links_what_moved_out():
    lines = README.count("\n") + 1
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"
    for link in ("benchmarks/RESULTS.md", "kernels/README.md"):
        assert link in README and (ROOT / link).exists()


def test_the_command_finder_sees_fences_and_indented_lines():
    text = "x\n```bash\nfoo --a   # note\n\nbar\n```\n    python -m baz  # c\n  python -m no\n"
    assert readme_commands(text) == ["foo --a", "bar", "python -m baz"]


def test_info_with_four_simulated_logical_gpus():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "mirrored", "info", "--logical-gpus", "4"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "simulat" in done.stdout.lower()
    for i in range(4):
        assert f"/device:GPU:{i}" in done.stdout, done.stdout
