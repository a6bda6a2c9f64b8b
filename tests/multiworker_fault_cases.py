"""What each worker runs in tests/test_multi_worker_faults.py (started there by ``mpiexec -n 2``).

    mpiexec -n 2 python tests/multiworker_fault_cases.py models OUT --differ width|middle|end
    mpiexec -n 2 python tests/multiworker_fault_cases.py uneven OUT
    mpiexec -n 2 python tests/multiworker_fault_cases.py slow-peer OUT
    mpiexec -n 2 python tests/multiworker_fault_cases.py killed OUT

Workers that do something wrong on purpose. A case that expects an error catches it,
writes it into OUT as ``<case>_rank<r>.txt`` (so the test can see that EVERY worker
raised, not just the first to reach the abort hook), then raises it again, which ends
every worker. Tiny models: the workers share this machine's cores with other work.
"""
import os
import pathlib
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import mirrored as tf  # noqa: E402
from mirrored import workers as _workers  # noqa: E402

FEATURES, CLASSES, BATCH = 12, 3, 8
EXAMPLES = 48                       # worker r holds EXAMPLES + 8 r in the "uneven" case
WARM_STEPS = 6                      # the slow peer's steps before it stops answering
SLOW_FLOOR_S = 3.0                  # the deadline's floor in "slow-peer" (the library's: 60 s)
SLOW_SLEEP_S = 120                  # how long the slow peer stops answering (far past the deadline)


def _model(strategy, hidden):
    """Dense layers of ``hidden`` units then the classes, built (variables made) in scope."""
    with strategy.scope():
        layers = [tf.keras.layers.Dense(hidden[0], activation="relu", input_shape=(FEATURES,))]
        layers += [tf.keras.layers.Dense(h, activation="relu") for h in hidden[1:]]
        model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(CLASSES)])
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.SGD(0.1))
    return model


def _data(rng, n):
    return rng.standard_normal((n, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, n)


def _expect_error(out, case, rank, fn):
    """Run ``fn``; its error (expected) is written to OUT, then raised again."""
    try:
        fn()
    except Exception as err:
        pathlib.Path(out, f"{case}_rank{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        raise
    pathlib.Path(out, f"{case}_rank{rank}_finished").write_text("no error?")


def case_models(out, differ):
    """The chief builds Dense(6) -> Dense(3); worker 1 another model:
    width: Dense(8) -> Dense(3) (the first kernel is (12, 8), not (12, 6));
    middle: an extra Dense(4) between the two (the second kernel differs);
    end: an extra Dense(3) at the end (worker 1 makes two variables more)."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    hidden = {"width": [8], "middle": [6, 4], "end": [6, 3]}[differ] if rank == 1 else [6]
    rng = np.random.default_rng(rank)

    def build_and_fit():
        model = _model(strategy, hidden)
        x, y = _data(rng, EXAMPLES)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    _expect_error(out, "models", rank, build_and_fit)


def case_uneven(out):
    """Worker r holds EXAMPLES + 8 r examples (48 and 56), shuffled by fit."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    model = _model(strategy, [6])
    x, y = _data(np.random.default_rng(rank), EXAMPLES + 8 * rank)
    _expect_error(out, "uneven", rank,
                  lambda: model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=True, verbose=0))


def case_slow_peer(out):
    """No fixed deadline (the environment's is removed by the test): after WARM_STEPS quick
    steps worker 1 stops answering; worker 0's wait ends after max(floor, 10 x its slowest
    step), not the 600 s of the first steps, naming worker 1 and its PID."""
    _workers.STEP_DEADLINE_FLOOR_S = SLOW_FLOOR_S          # the library's 60 s would make a slow test
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id

    def step():
        return tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0))

    def steps():
        for _ in range(WARM_STEPS):
            strategy.run(step)
        deadline = getattr(_workers.world(), "deadline_s", None)     # (None before issue 26)
        pathlib.Path(out, f"slow_deadline_rank{rank}.txt").write_text(repr(deadline))
        if rank == 1:
            time.sleep(SLOW_SLEEP_S)
        strategy.run(step)

    _expect_error(out, "slow", rank, steps)


def case_killed(out):
    """Worker 1 is killed (SIGKILL: no word from it) after one step; worker 0 waits for it."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id

    def step():
        return tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0))

    strategy.run(step)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _expect_error(out, "killed", rank, lambda: strategy.run(step))


if __name__ == "__main__":
    case, out = sys.argv[1], sys.argv[2]
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    if case == "models":
        case_models(out, opts["--differ"])
    elif case == "uneven":
        case_uneven(out)
    elif case == "slow-peer":
        case_slow_peer(out)
    elif case == "killed":
        case_killed(out)
    else:
        raise SystemExit(f"unknown case {case!r}")
