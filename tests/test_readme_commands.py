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
    """CI does what the README's first block says, in its order: a venv INSIDE the checkout
    (``.venv``, which git ignores), the requirements, the main job, then the tests."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'VENV="\$\{CI_VENV:-\.venv\}"', ci) and 'python3 -m venv "$VENV"' in ci
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()
    steps = [ci.index(s) for s in ("pip install --quiet -r requirements.txt", "\npython -m mirrored",
                                   "\npython -m pytest")]
    assert steps == sorted(steps), "CI must install, run the main job, then the tests"
    assert "MIRRORED_OFFLINE=1" in ci                         # a clean clone with no network


#: README ``python`` blocks (by their first line) -> what runs them. "here" blocks are run by
#: test_the_readme_python_blocks_run_with_no_gpu; the others by the named test.
PYTHON_BLOCKS = {
    "# Import TensorFlow and TensorFlow Datasets":
        "tests/test_lab_convnet.py::test_the_lab_runs_verbatim_for_one_epoch_on_the_bundled_subset",
    "options = tf.distribute.InputOptions(experimental_place_dataset_on_device=True)":
        "tests/test_resident_dataset.py",                     # continues the lab's block
    "import mirrored as tf": "here",                            # Devices
    "strategy = tf.distribute.MultiWorkerMirroredStrategy()     # rank and size from MPI":
        "tests/test_multi_worker.py::test_two_workers_one_cpu_each_fit_evaluate_custom_loop",
}


def readme_python_blocks(text=README):
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_every_readme_python_block_is_run_by_a_named_test():
    blocks = readme_python_blocks()
    assert len(blocks) >= 4, len(blocks)
    for block in blocks:
        first = block.splitlines()[0].strip()
        assert first in PYTHON_BLOCKS, (f"README python block starting {first!r} is run by no "
                                        f"test: list it in PYTHON_BLOCKS")
        path, _, name = PYTHON_BLOCKS[first].partition("::")
        if path != "here":
            assert (ROOT / path).exists() and (not name or f"def {name}(" in (ROOT / path).read_text())


@pytest.mark.parametrize("simulator", ["0", "1"], ids=["no GPU", "simulated GPU"])
def test_the_readme_python_blocks_run_with_no_gpu(simulator):
    """The "Devices" block ended in IndexError at gpus[0] on a machine with no GPU (issue 37):
    it now splits the CPU there. Run with no CUDA at all, and with one simulated GPU."""
    if simulator == "0" and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("a real GPU is here: the no-GPU case is the simulator's machine")
    for block in readme_python_blocks():
        if PYTHON_BLOCKS.get(block.splitlines()[0].strip()) != "here":
            continue
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM=simulator, MIRRORED_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert done.returncode == 0, f"README block failed:\n{block}\n{done.stderr[-2000:]}"
        kind = "GPU" if simulator == "1" else "CPU"
        assert all(f"device:{kind}:{i}'" in done.stdout for i in range(4)), done.stdout


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


def test_every_benchmark_smoke_is_run_within_the_limit_by_a_test():
    """The README says each benchmark has ``--smoke``; every program with one (the README's
    list, and any other in benchmarks/) is run, as stated, by a test through
    ``conftest.run_smoke``, which holds it to ``SMOKE_LIMIT_S`` (issue 37: breakdown's ran
    200 steps x 5 rounds in the simulator and did not end in 240 s)."""
    listed = set(re.findall(r"^    python -m benchmarks\.(\w+)", README, re.M))
    with_smoke = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if '"--smoke"' in p.read_text()}
    assert listed <= with_smoke, f"README lists benchmarks without --smoke: {listed - with_smoke}"
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    unrun = {name for name in with_smoke if not re.search(rf'run_smoke\("{name}"', tests)}
    assert not unrun, f"no test runs these benchmarks' --smoke through run_smoke: {sorted(unrun)}"
