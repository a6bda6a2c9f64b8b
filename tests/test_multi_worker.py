"""MultiWorkerMirroredStrategy across processes: each test starts its workers with ``mpiexec``.

The workers run ``tests/multiworker_cases.py`` (one case per launch, several checks
per case, to keep launches few) and write what they got; the checks are here:
every worker bitwise equal to every other, and equal (to float32 rounding) to one
replica training on the global batch, computed in this process. Skipped, with the
reason, where there is no ``mpiexec`` or no mpi4py (``pip install -r requirements.txt``
brings both: the mpich wheel puts ``mpiexec`` beside this Python).
"""
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import time
import warnings

import json

import numpy as np
import pytest

import mirrored as tf
from mirrored import backends, launcher, multi_worker

import multiworker_cases as cases
from conftest import SIMULATOR

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "multiworker_cases.py"
EQUIV_ATOL = 2e-6               # N replicas vs one on the global batch: float32 rounding (test_training)
FAIL_DEADLINE_S = 60            # a failing worker must end every worker within this


MPIEXEC = launcher.find_mpiexec()     # the mpich wheel's, beside this Python, else one on PATH
pytestmark = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py (python -m pip install mpi4py mpich: requirements.txt)")


def launch(n, case, out, *args, timeout=300, script=CASES, fixed_deadline=True):
    """``mpiexec -n n`` of one case of ``script``; (the finished process, seconds). The
    workers use CUDA as this test run does: the simulator here (tests/conftest.py), the
    real GPU in a session that has one (every worker's logical GPUs then share it).
    ``fixed_deadline``: every wait's deadline is 120 s (else the one counted in steps)."""
    env = dict(os.environ, MIRRORED_WORKER_TIMEOUT_S="120")
    if not fixed_deadline:
        del env["MIRRORED_WORKER_TIMEOUT_S"]
    env["NUMBA_ENABLE_CUDASIM"] = env.get("NUMBA_ENABLE_CUDASIM", "1")
    started = time.monotonic()
    cmd, env = launcher.mpiexec_command(n, [sys.executable, script, case, out, *args], MPIEXEC, env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return proc, time.monotonic() - started


def _ok(proc):
    assert proc.returncode == 0, f"workers failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def _one_replica(init, dataset):
    """The oracle: one replica on the CPU, training on the global batches."""
    model = cases.build(tf.distribute.OneDeviceStrategy("CPU:0"))
    model.set_weights(init)
    model.fit(dataset, epochs=cases.EPOCHS, verbose=0)
    return model


def _check_training(out, proc, replicas):
    _ok(proc)
    got = [np.load(out / f"train_rank{r}.npz") for r in range(2)]
    k = int(got[0]["n"])
    arrays = [[g[f"arr_{i}"] for i in range(3 * k)] for g in got]
    # per worker: initial weights, after fit, after the custom loop
    init, fit_w, loop_w = ([a[j * k:(j + 1) * k] for a in arrays] for j in range(3))
    # every worker: the chief's initial weights (they were seeded differently), the same bits after
    for a, b in zip(init[0], init[1]):
        assert np.array_equal(a, b), "initial weights differ between workers (not broadcast)"
    for name, per_worker in (("fit", fit_w), ("custom loop", loop_w)):
        for a, b in zip(*per_worker):
            assert np.array_equal(a, b), f"{name}: worker 0 and worker 1 ended with different weights"
    assert all(bool(g["copies_equal"]) for g in got), "a worker's replicas drifted apart"
    assert all(int(g["replicas"]) == replicas for g in got)
    # ... and what one replica reaches on the global batch
    x, y = cases.data()
    oracle = _one_replica(init[0][:], tf.data.Dataset.from_tensor_slices((x, y)).batch(cases.GLOBAL_BATCH))
    for a, b in zip(fit_w[0], oracle.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=EQUIV_ATOL)
    assert not np.allclose(fit_w[0][0], init[0][0]), "fit did not change the weights"
    np.testing.assert_allclose(got[0]["loss"], oracle.history.history["loss"], rtol=1e-5)
    want_eval = oracle.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(cases.GLOBAL_BATCH), verbose=0)
    for g in got:
        np.testing.assert_allclose(g["evaluated"], want_eval, rtol=1e-5)
    full = tf.data.Dataset.from_tensor_slices((x, y)).batch(cases.GLOBAL_BATCH, drop_remainder=True)
    loop_oracle = _one_replica(init[0][:], full)
    for a, b in zip(loop_w[0], loop_oracle.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=EQUIV_ATOL)
    # the first step's loss, reduced over every replica, is the global batch's mean loss
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in init[0])
    logits = np.maximum(x[:6] @ w1 + b1, 0) @ w2 + b2
    log_z = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    want_loss = np.mean(log_z - logits[np.arange(6), y[:6]])
    for g in got:
        assert g["custom_losses"][0] == pytest.approx(want_loss, rel=1e-5)
        assert np.array_equal(g["gathered"], np.arange(replicas, dtype=np.float32))
    if got[0]["resident"].size:       # fit on a data set kept on the devices: the same bits as fit
        assert np.array_equal(got[0]["resident"], np.concatenate([w.ravel() for w in fit_w[0]]))
        assert np.array_equal(got[0]["resident"], got[1]["resident"])
    # distribute_datasets_from_function: InputContext(workers, rank, replicas); each worker's
    # replicas take the next per-replica batches of its own shard
    per_replica = cases.PIPELINE_GLOBAL_BATCH // replicas
    local = replicas // 2
    for r, g in enumerate(got):
        assert g["input_context"].tolist() == [[2, r, replicas]]
        assert np.array_equal(g["first_labels"], y[r::2][:per_replica * local])
    # only the chief printed and kept the weights file
    assert proc.stdout.count("Epoch 1/2") == 1, proc.stdout
    saved = cases.build(tf.distribute.OneDeviceStrategy("CPU:0"))
    with warnings.catch_warnings():           # Keras's note: this fresh optimizer has no slots yet
        warnings.simplefilter("ignore", UserWarning)
        saved.load_weights(out / "fit.weights.h5")
    for a, w in zip(saved.get_weights(), fit_w[0]):
        assert np.array_equal(a, w)
    # the chief's files only; ModelCheckpoint(save_freq=3) over 2 epochs of 4 batches: Keras's
    # count runs across epochs (after global batches 3 and 6)
    assert sorted(p.name for p in out.iterdir()) == ["ck-1-3.weights.h5", "ck-2-2.weights.h5",
                                                     "fit.weights.h5", "log.csv", "train_rank0.npz",
                                                     "train_rank1.npz"]
    rows = (out / "log.csv").read_text().splitlines()           # the chief's CSV only: header + 2 epochs
    assert len(rows) == 1 + cases.EPOCHS and rows[0].startswith("epoch,")


def test_two_workers_one_cpu_each_fit_evaluate_custom_loop(tmp_path):
    proc, _ = launch(2, "train", tmp_path)
    _check_training(tmp_path, proc, replicas=2)
    # CPU workers sharing this machine's cores: each one's OpenBLAS got half of them (in the
    # simulator the workers' devices are simulated GPUs: their OpenBLAS is left alone)
    on_cpu = "device:CPU:0'" in proc.stdout
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    split = (on_cpu and backends.blas_info()["note"] == "OpenBLAS"
             and not any(map(os.environ.get, multi_worker.BLAS_THREAD_VARS)))
    assert proc.stdout.count(f"BLAS threads: {half} (2 workers share this machine's") == 2 * split, proc.stdout


def test_two_cpu_workers_replay_a_traced_custom_loop_as_eagerly(tmp_path, monkeypatch):
    """``@tf.function`` across workers: the all-reduce between workers (MPI, driven from the
    host) and strategy.reduce's exchange are recorded as host callbacks, so the step is
    traced once and replayed (no eager fallback: the case makes it an error), with the
    eager loop's losses and weights bit for bit, the same on both workers."""
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")     # CPU workers (a real GPU where there is one)
    proc, _ = launch(2, "function", tmp_path)
    _ok(proc)
    ranks = [np.load(tmp_path / f"function_rank{r}.npz") for r in range(2)]
    for got in ranks:
        assert int(got["traces"]) == 1
        np.testing.assert_array_equal(got["losses"][0], got["losses"][1])
        np.testing.assert_array_equal(got["eager"], got["replayed"])
        assert not np.array_equal(got["start"], got["eager"]), "the loop did not train"
    # each worker fed its own rows: equal results on both means the exchanges were replayed
    np.testing.assert_array_equal(ranks[0]["losses"], ranks[1]["losses"])
    np.testing.assert_array_equal(ranks[0]["replayed"], ranks[1]["replayed"])


@pytest.mark.parametrize("user_set", [False, True])
def test_cpu_workers_on_one_machine_split_its_cores_unless_the_user_chose(monkeypatch, user_set):
    """``_share_cores``: 3 CPU workers on this machine -> cores // 3 BLAS threads each (at
    least 1); a thread count the user set (OPENBLAS_NUM_THREADS) is left alone."""
    if backends.blas_info()["note"] != "OpenBLAS":
        pytest.skip("NumPy's BLAS is not an OpenBLAS whose thread count we can set")
    for var in multi_worker.BLAS_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    if user_set:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "7")
    before = backends.blas_info()["threads"]
    try:
        backends.set_blas_threads(before + 5)            # a count the split must replace
        note = multi_worker._share_cores([_FakeDevice("CPU")], 3)
        after = backends.blas_info()["threads"]
    finally:
        backends.set_blas_threads(before)
    if user_set:
        assert note == "" and after == before + 5
    else:
        want = max(1, len(os.sched_getaffinity(0)) // 3)
        assert after == want and f"BLAS threads: {want} (3 workers share" in note
    assert multi_worker._share_cores([_FakeDevice("GPU")], 3) == ""
    assert multi_worker._share_cores([_FakeDevice("CPU")], 1) == ""


class _FakeDevice:
    def __init__(self, device_type):
        self.device_type = device_type


def test_two_workers_two_simulated_gpus_each(tmp_path):
    proc, _ = launch(2, "train", tmp_path, "--gpus", "2")
    _check_training(tmp_path, proc, replicas=4)


@pytest.mark.parametrize("workers,cpus", [(2, 2), (3, 1)])
def test_ring_across_workers_equals_mpi_allreduce(tmp_path, workers, cpus):
    proc, _ = launch(workers, "ring", tmp_path, "--cpus", str(cpus))
    _ok(proc)
    got = [np.load(tmp_path / f"ring_rank{r}.npz") for r in range(workers)]
    n = workers * cpus
    for size in (1, 2, 3, 5, 31, 33, 65, 1000, 4097, 10007):
        every = got[0][f"inputs_{size}"]                                # (N, size) float32
        assert every.shape == (n, size)
        want = every.astype(np.float64).sum(0)
        bound = 1e-6 * n * np.abs(every).astype(np.float64).sum(0) + 1e-30
        first = got[0][f"ring_{size}"][0]
        for r, g in enumerate(got):
            ring = g[f"ring_{size}"]                                    # (local, size): every replica
            for copy in ring:
                assert np.array_equal(copy, first), f"size {size}: worker {r} differs bitwise from worker 0"
            err = np.abs(ring[0].astype(np.float64) - want)
            assert (err <= bound).all(), f"size {size}: max error {err.max()} at {err.argmax()}"
            mpi_err = np.abs(ring[0].astype(np.float64) - g[f"mpi_{size}"])
            assert (mpi_err <= 2 * bound).all(), f"size {size}: ring vs MPI_Allreduce {mpi_err.max()}"
            # the step record: 2(N-1) steps, and every step crosses each worker boundary once
            assert int(g[f"steps_{size}"]) == 2 * (n - 1)
            crossings = {tuple(c) for c in g[f"crossings_{size}"]}
            assert crossings == {(w, (w + 1) % workers) for w in range(workers)}
    ints = [g["int_sum"] for g in got]
    want_ints = sum(np.arange(4) + r for r in range(workers)) * cpus
    for got_ints in ints:
        assert got_ints.dtype == np.int32 and np.array_equal(got_ints, want_ints)
    for g in got:                                   # MEAN over every worker's replicas
        assert g["int_mean"].dtype == np.float64 and np.array_equal(g["int_mean"], want_ints / n)


@pytest.mark.parametrize("aware", ["", "1"])
def test_ring_on_gpus_staged_and_handed_to_a_cuda_aware_mpi_agree_bitwise(tmp_path, monkeypatch, aware):
    """2 workers x 2 simulated GPUs: the hop between workers staged through host memory,
    and handed to MPI as device memory (a CUDA-aware MPI), give the same bits on every
    replica of every worker, within float32 rounding of the float64 sum. The wheel's MPI
    says it is not CUDA-aware; MIRRORED_CUDA_AWARE_MPI=1 overrides the answer."""
    if aware and not SIMULATOR:
        pytest.skip("on real GPUs MIRRORED_CUDA_AWARE_MPI=1 hands device pointers to this MPI, "
                    "which is not CUDA-aware (Open MPI segfaulted in MPI_Isend on the H100 "
                    "machine): the override's logic is checked in the simulator")
    monkeypatch.setenv("MIRRORED_CUDA_AWARE_MPI", aware)
    proc, _ = launch(2, "ring-gpus", tmp_path, "--gpus", "2")
    _ok(proc)
    got = [np.load(tmp_path / f"ring_gpus_rank{r}.npz") for r in range(2)]
    for g in got:
        assert bool(g["asked"]) is (aware == "1"), "Workers.cuda_aware: the wheel's MPICH says 0"
    for size in cases.RING_GPU_SIZES:
        every = got[0][f"inputs_{size}"]                               # (4, size): all replicas
        want = every.astype(np.float64).sum(0)
        bound = 1e-6 * 4 * np.abs(every).astype(np.float64).sum(0) + 1e-30
        first = got[0][f"staged_{size}"][0]
        assert (np.abs(first - want) <= bound).all(), f"size {size}: staged ring is wrong"
        for r, g in enumerate(got):
            # the direct path runs where MPI can read this "device memory": the simulator's
            # (host memory), or real GPUs with a CUDA-aware MPI
            assert f"direct_{size}" in g or not SIMULATOR
            for path in ("staged", "direct")[:1 + (f"direct_{size}" in g)]:
                for copy in g[f"{path}_{size}"]:
                    assert np.array_equal(copy, first), f"size {size}: worker {r} {path} differs"


def test_cuda_aware_mpi_setting_is_checked():
    from mirrored.workers import Workers
    os.environ["MIRRORED_CUDA_AWARE_MPI"] = "yes"
    try:
        with pytest.raises(ValueError, match="expected 1 .* 0 .* or unset"):
            Workers(None).cuda_aware
    finally:
        del os.environ["MIRRORED_CUDA_AWARE_MPI"]
    assert Workers(None).cuda_aware is False          # a lone worker has no MPI to ask


def test_a_stuck_worker_times_the_others_out(tmp_path):
    proc, took = launch(2, "stall", tmp_path, timeout=FAIL_DEADLINE_S + 30)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert took < 10 * cases.STALL_TIMEOUT_S, f"the workers took {took:.0f} s to end"
    assert f"worker 0 of 2 waited {cases.STALL_TIMEOUT_S} s" in output and "worker(s) [1]" in output, output
    assert not list(tmp_path.glob("stall_rank*_finished"))


def test_a_failing_worker_ends_every_worker_naming_its_rank(tmp_path):
    proc, took = launch(2, "fail", tmp_path, timeout=FAIL_DEADLINE_S + 30)
    assert proc.returncode != 0
    assert took <= FAIL_DEADLINE_S, f"the workers took {took:.0f} s to end"
    output = proc.stdout + proc.stderr
    assert "worker 1 of 2 failed: ValueError" in output and "worker 1 breaks on purpose" in output, output
    assert not list(tmp_path.glob("fail_rank*_finished")), "a worker went on past the failure"


# --- in this process: no launcher, no MPI --------------------------------------------------

@pytest.fixture
def lone_worker(monkeypatch):
    """This process as a plain ``python train.py``: no launcher, and mpi4py hidden."""
    from mirrored import workers
    for var in workers.LAUNCHER_SIZE_VARS + ("TF_CONFIG",):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)          # import mpi4py -> ImportError
    monkeypatch.setattr(workers, "_world", None)
    return workers


def test_plain_python_is_one_worker_without_mpi(lone_worker, devices):
    devices(cpus=1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.cluster_resolver.task_id == 0 and strategy.cluster_resolver.task_type == "worker"
    assert strategy.num_replicas_in_sync == len(strategy.extended.devices)
    assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
    assert lone_worker.world().comm is None
    out = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(2.0)))
    n = strategy.num_replicas_in_sync
    assert float(strategy.reduce("SUM", out, axis=None)) == 2.0 * n * n


def test_a_launched_worker_without_mpi4py_is_told_what_to_install(lone_worker, monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(ImportError, match="one of 2 workers.*pip install mpi4py mpich"):
        lone_worker.world()


@pytest.mark.parametrize("done_after_s", [0.004, 0.3, None])
def test_a_wait_yields_the_core_then_sleeps_then_times_out(monkeypatch, done_after_s):
    """``Workers._wait``: short waits give the core away on every poll (a peer on the same
    core runs at once), long ones sleep between polls, and past the deadline it raises.
    A fake clock advances 1 µs per yield and 1 ms per sleep; fake MPI requests complete
    at ``done_after_s`` (None: never)."""
    import types
    from mirrored import workers
    from mirrored.errors import DeadlineExceededError
    clock, calls = [0.0], []

    def sched_yield():
        calls.append("yield")
        clock[0] += 1e-6

    def sleep(seconds):
        calls.append("sleep")
        clock[0] += seconds

    fake_mpi = types.SimpleNamespace(Request=types.SimpleNamespace(
        Testall=lambda requests: done_after_s is not None and clock[0] >= done_after_s))
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=fake_mpi))
    monkeypatch.setattr(workers, "os", types.SimpleNamespace(sched_yield=sched_yield))
    monkeypatch.setattr(workers, "time", types.SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
    me = workers.Workers(None, timeout_s=2.0)
    if done_after_s is None:
        with pytest.raises(DeadlineExceededError, match=r"worker 0 of 1 waited 2 s for a ring step "
                                                        r"with worker\(s\) \[3\]"):
            me._wait([], "a ring step", [0, 3])
        assert 2.0 < clock[0] < 2.0 + 0.1, "the deadline is kept to within a few polls"
    else:
        me._wait([], "a ring step", [3])
        assert done_after_s <= clock[0] < done_after_s + 0.02
    yields = calls.index("sleep") if "sleep" in calls else len(calls)
    assert set(calls[:yields]) == {"yield"} and set(calls[yields:]) <= {"sleep"}   # yield, then sleep
    if done_after_s is not None and done_after_s < workers._YIELD_FOR_S:
        assert "sleep" not in calls                      # a short wait never sleeps
    else:                                                # a long one yields ~_YIELD_FOR_S, then sleeps
        assert workers._YIELD_FOR_S - 1e-6 <= yields * 1e-6 < workers._YIELD_FOR_S + 1e-3
        assert calls.count("sleep") >= 100


def test_nccl_runs_as_the_ring_with_the_reason():
    options = tf.distribute.experimental.CommunicationOptions
    impl = tf.distribute.experimental.CommunicationImplementation
    with pytest.warns(UserWarning, match="does not use NCCL.*ring"):      # the guide's option: accepted
        assert options(implementation=impl.NCCL).implementation is impl.NCCL
    assert options(implementation="ring").implementation is impl.RING
    assert options().implementation is impl.AUTO
    with pytest.raises(ValueError, match="timeout_seconds"):
        options(timeout_seconds=0)


def test_tf_config_must_agree_with_mpi():
    from mirrored.multi_worker import check_tf_config

    def config(workers, task_type="worker", index=0, chief=0):
        cluster = {"worker": [f"host{i}:2222" for i in range(workers)]}
        if chief:
            cluster["chief"] = ["chief:2222"]
        return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}

    check_tf_config(1, 2, config(2, index=1))                 # agrees: nothing to say
    check_tf_config(0, 3, config(2, "chief", 0, chief=1))     # TF's chief is worker 0
    check_tf_config(2, 3, config(2, "worker", 1, chief=1))
    check_tf_config(0, 4, {})                                 # no TF_CONFIG: MPI decides
    with pytest.raises(ValueError, match="describes 3 worker.*MPI started 2"):
        check_tf_config(0, 2, config(3))
    with pytest.raises(ValueError, match="task 'worker' 0 .*MPI made it rank 1"):
        check_tf_config(1, 2, config(2, index=0))
    with pytest.raises(ValueError, match="not the JSON"):
        check_tf_config(0, 1, {"TF_CONFIG": "{cluster"})
    with pytest.raises(ValueError, match="'ps'"):
        check_tf_config(0, 2, config(2, "ps"))


@pytest.mark.parametrize("n", [1, 2, 7, 10])
def test_shard_keeps_every_kth_element(n):
    ds = tf.data.Dataset.range(n)
    for k in (1, 2, 3):
        parts = [[int(e) for e in ds.shard(k, i)] for i in range(k)]
        assert parts == [list(range(i, n, k)) for i in range(k)]
        assert [len(ds.shard(k, i)) for i in range(k)] == [len(p) for p in parts]
    with pytest.raises(ValueError, match="0 <= index < num_shards"):
        ds.shard(2, 2)


def test_array_batches_follow_the_chiefs_shuffle_across_workers(rng):
    from mirrored.keras.data_adapters import ArrayBatches

    chief_order = rng.permutation(7)

    class TwoWorkers:                      # what ArrayBatches asks of extended
        num_workers = 2

        def broadcast_from_chief(self, value, what):
            assert sorted(value) == list(range(7))          # this worker's own permutation
            return chief_order

    x, y = np.arange(7.0)[:, None], np.arange(7)
    got = np.concatenate([yb for _, yb in ArrayBatches(x, y, 3, True, TwoWorkers())])
    assert np.array_equal(got, chief_order)
    alone = ArrayBatches(x, y, 3, False, TwoWorkers())    # no shuffle: nothing to agree on
    assert np.array_equal(np.concatenate([yb for _, yb in alone]), y)
