"""MultiWorkerMirroredStrategy when a worker is wrong: another model, other data, a peer
that stops answering or dies (issue 26, items 5-7).

The workers run ``tests/multiworker_fault_cases.py`` under ``mpiexec -n 2`` (the launcher
of ``tests/test_multi_worker.py``, with a hard timeout: a hang fails the test); the
deadline counted in steps and the check for a dead peer are also tested here, in this
process, with a fake clock, fake MPI requests and a fake ``os.kill``.
"""
import pathlib
import re
import sys
import types

import pytest

import multiworker_fault_cases as cases
import test_multi_worker as harness
from mirrored import workers
from mirrored.errors import DeadlineExceededError

needs_mpi = harness.pytestmark                   # skipped without mpiexec and mpi4py
SCRIPT = pathlib.Path(__file__).resolve().parent / "multiworker_fault_cases.py"
END_WITHIN_S = 60                                # a wrong worker ends every worker within this


def launch(case, out, *args, **kwargs):
    proc, took = harness.launch(2, case, out, *args, script=SCRIPT, timeout=END_WITHIN_S + 60, **kwargs)
    assert proc.returncode != 0, f"the workers did not fail:\n{proc.stdout}\n{proc.stderr}"
    assert took <= END_WITHIN_S, f"the workers took {took:.0f} s to end"
    return proc.stdout + proc.stderr


def pids(output):
    """The chief's start-up table: {rank: PID}."""
    table = dict(re.findall(r"mirrored:   worker (\d+): PID (\d+) on ", output))
    return {int(rank): int(pid) for rank, pid in table.items()}


def every_workers_error(out, case):
    """The error each worker raised (each writes its own before the abort)."""
    return [(out / f"{case}_rank{r}.txt").read_text() for r in range(2)]


@needs_mpi
@pytest.mark.parametrize("differ", ["width", "middle", "end"])
def test_workers_that_build_different_models_are_refused_on_every_worker(tmp_path, differ):
    """Worker 1 builds Dense(8) where the chief has Dense(6) (width), an extra layer in the
    middle, or an extra layer at the end. Before: the chief's (12, 6) kernel silently
    replaced worker 1's (12, 8) one, or a TypeError from our own check. Now every worker
    raises, naming the first difference and both ranks (with their PIDs), before any step."""
    output = launch("models", tmp_path, "--differ", differ)
    table = pids(output)
    assert sorted(table) == [0, 1], output
    errors = every_workers_error(tmp_path, "models")
    assert errors[0] == errors[1]
    error = errors[0]
    if differ == "width":
        assert error.startswith("ValueError: MultiWorkerMirroredStrategy: the workers build different models")
        assert (f"worker 0 (PID {table[0]} on " in error and "'dense/kernel' of shape (12, 6)" in error
                and f"worker 1 (PID {table[1]} on " in error and "'dense/kernel' of shape (12, 8)" in error), error
    elif differ == "middle":                     # Dense(6) agrees; the next kernel is (6, 3) vs (6, 4)
        assert "of shape (6, 3)" in error and "of shape (6, 4)" in error, error
    else:                                        # worker 1 makes two more variables
        assert error.startswith("RuntimeError: the workers reached different collective calls"), error
        assert f"worker 1 (PID {table[1]} on " in error and "creating a variable ('dense_2/kernel'" in error
    assert not list(tmp_path.glob("models_rank*_finished"))


@needs_mpi
def test_arrays_of_different_lengths_are_refused_naming_each_workers_count(tmp_path):
    """48 examples on the chief, 56 on worker 1. Before: `cannot reshape array of size 0`
    on worker 1 (the chief's shuffle order is too short for its arrays). Now both workers
    refuse before the first step, saying who holds how many."""
    output = launch("uneven", tmp_path)
    table = pids(output)
    for error in every_workers_error(tmp_path, "uneven"):
        assert error.startswith("ValueError: fit/evaluate with arrays: the workers hold different "
                                "numbers of examples"), error
        assert (f"worker 0 (PID {table[0]} on " in error and f": {cases.EXAMPLES};" in error
                and f"worker 1 (PID {table[1]} on " in error and f": {cases.EXAMPLES + 8})" in error), error


@needs_mpi
def test_a_peer_that_stops_answering_is_named_after_steps_worth_of_time(tmp_path):
    """No fixed deadline: after WARM_STEPS quick steps worker 1 sleeps. Worker 0 waits
    max(floor, 10 x its slowest step) — the floor lowered to 3 s for the test — not the
    600 s of the first steps, and names worker 1 and its PID."""
    output = launch("slow-peer", tmp_path, fixed_deadline=False)
    table = pids(output)
    error = (tmp_path / "slow_rank0.txt").read_text()
    assert error.startswith(f"DeadlineExceededError: worker 0 of 2 waited {cases.SLOW_FLOOR_S:g} s "), error
    assert f"worker 1 (PID {table[1]} on " in error and "the slowest step so far" in error, error
    # the deadline both workers had after the warm-up: the floor (steps of milliseconds)
    assert float((tmp_path / "slow_deadline_rank0.txt").read_text()) == cases.SLOW_FLOOR_S


@needs_mpi
def test_a_killed_workers_rank_is_in_the_chiefs_start_up_table(tmp_path):
    """Worker 1 is SIGKILLed. The launcher (the mpich wheel's Hydra) names only the PID,
    and ends the survivors at once (they cannot speak); the chief's start-up table names
    that PID's rank."""
    output = launch("killed", tmp_path)
    table = pids(output)
    assert sorted(table) == [0, 1], output
    lost = re.search(r"PID (\d+) RUNNING AT .*\n=\s+EXIT CODE: 9", output)
    if lost is None:
        pytest.skip(f"this launcher does not name the PID of a killed worker:\n{output[-2000:]}")
    assert int(lost.group(1)) == table[1], output


# --- in this process: a fake clock, fake MPI requests ---------------------------------------

@pytest.fixture
def fake(monkeypatch):
    """A fake clock (1 µs per yield, the asked time per sleep), MPI requests that never
    complete, and ``os.kill`` answering from ``dead`` (PIDs whose processes ended)."""
    clock, dead = [0.0], set()

    def sched_yield():
        clock[0] += 1e-6

    def sleep(seconds):
        clock[0] += seconds

    def kill(pid, sig):
        assert sig == 0, "the liveness check only asks"
        if pid in dead:
            raise ProcessLookupError(pid)

    fake_mpi = types.SimpleNamespace(Request=types.SimpleNamespace(Testall=lambda requests: False))
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=fake_mpi))
    monkeypatch.setattr(workers, "os", types.SimpleNamespace(sched_yield=sched_yield, kill=kill))
    monkeypatch.setattr(workers, "time", types.SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
    return types.SimpleNamespace(clock=clock, dead=dead, sleep=sleep)


def _two_workers_on_one_host():
    me = workers.Workers(None, timeout_s=None)
    me.size, me.pids, me.hosts, me.pid_namespaces = 2, [100, 4242], ["here", "here"], ["pid:[1]", "pid:[1]"]
    return me


def test_the_deadline_is_counted_in_steps_after_the_first_ones(fake):
    """Warm-up: FIRST_STEPS_TIMEOUT_S until WARMUP_STEPS steps are done; then max(floor,
    factor x the slowest step since); a fixed timeout stays fixed."""
    me = _two_workers_on_one_host()
    step_lengths = [30.0, 20.0, 0.5, 2.0, 0.1]          # the first two compile
    for done, length in enumerate(step_lengths):
        timed = step_lengths[workers.WARMUP_STEPS:done]
        assert me.deadline_s == (workers.FIRST_STEPS_TIMEOUT_S if done <= workers.WARMUP_STEPS
                                 else max(workers.STEP_DEADLINE_FLOOR_S, workers.STEP_DEADLINE_FACTOR * max(timed)))
        fake.sleep(length)
        me.step_done()
    slowest = max(step_lengths[workers.WARMUP_STEPS:])    # 2.0: the compiling steps don't count
    assert me.slowest_step_s == slowest
    assert me.deadline_s == max(workers.STEP_DEADLINE_FLOOR_S, workers.STEP_DEADLINE_FACTOR * slowest)
    fake.sleep(10.0)                                      # a slow step raises the deadline
    me.step_done()
    assert me.deadline_s == workers.STEP_DEADLINE_FACTOR * 10.0
    start = fake.clock[0]
    with pytest.raises(DeadlineExceededError, match=r"worker 0 of 2 waited 100 s for a ring step with "
                                                    r"worker\(s\) \[1\], which never answered \(worker 1 "
                                                    r"\(PID 4242 on here\); the deadline: 10 x the slowest "
                                                    r"step so far \(10 s\), at least 60 s\)"):
        me._wait([], "a ring step", [0, 1])
    assert 100.0 < fake.clock[0] - start < 100.1
    me.timeout_s = 7.0                                    # CommunicationOptions(timeout_seconds=7)
    assert me.deadline_s == 7.0


def test_a_dead_peer_on_this_host_is_named_within_a_second(fake):
    """A peer whose process ended (kill -9, a crash) is named, rank and PID, about a
    second into the wait, not at the deadline (600 s before the first steps)."""
    me = _two_workers_on_one_host()
    fake.dead.add(4242)
    with pytest.raises(DeadlineExceededError, match=r"worker 0 of 2 lost worker 1 \(PID 4242 on here\) "
                                                    r"while waiting .* for a ring step: its process has ended"):
        me._wait([], "a ring step", [1])
    assert workers._LIVENESS_EVERY_S <= fake.clock[0] < workers._LIVENESS_EVERY_S + 0.1
    me.timeout_s = 5.0                                   # on another host, or in another PID
    for hosts, spaces in ((["here", "elsewhere"], ["pid:[1]"] * 2),      # namespace (a container
                          (["here", "here"], ["pid:[1]", "pid:[2]"])):   # with the same host name):
        me.hosts, me.pid_namespaces = hosts, spaces                            # not asked, the deadline
        with pytest.raises(DeadlineExceededError, match=rf"waited 5 s .*worker 1 \(PID 4242 on {hosts[1]}\)"):
            me._wait([], "a ring step", [1])


def test_the_liveness_check_asks_the_real_system():
    """``_gone`` with the real ``os.kill``: a process that ended (and was reaped) is gone,
    this process and its parent are not."""
    import os
    import subprocess
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    me = workers.Workers(None, timeout_s=None)
    me.size, me.pids = 3, [os.getpid(), os.getppid(), ended.pid]
    me.hosts, me.pid_namespaces = ["here"] * 3, [workers._pid_namespace()] * 3
    if me.pid_namespaces[0] is None:
        pytest.skip("no /proc/self/ns/pid here: the liveness check is off")
    assert me._gone([0, 1, 2]) == [2]
