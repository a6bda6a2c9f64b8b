"""The CPU backend's BLAS and its thread policy (mirrored/backends.py, ``blas_policy``,
``blas_threads``): fit, evaluate and predict run with the policy's BLAS thread count
(one by default, so that a busy core cannot stall a spinning BLAS thread; issue 25) and
give the BLAS back as they found it; one host thread drives every replica
(keras/step.py, ``Step.copy_in``).
"""
import threading

import numpy as np
import pytest

import mirrored as tf
from mirrored import backends
from mirrored.keras import engine


def test_blas_info_says_what_it_found():
    info = backends.blas_info()
    assert set(info) == {"library", "threads", "note", "kernel", "version"}
    assert (info["library"] is None) == (info["threads"] is None)
    assert info["threads"] is None or info["threads"] >= 1


@pytest.mark.parametrize("env, threads", [
    ({}, backends.AUTO_BLAS_THREADS),
    ({"MIRRORED_BLAS_THREADS": "auto"}, backends.AUTO_BLAS_THREADS),
    ({"MIRRORED_BLAS_THREADS": " 3 "}, 3),
    ({"MIRRORED_BLAS_THREADS": "keep"}, None),
    ({"OPENBLAS_NUM_THREADS": "2"}, None),                         # the user's own choice stays
    ({"OMP_NUM_THREADS": "4", "MIRRORED_BLAS_THREADS": "2"}, 2),   # ours, named, wins
])
def test_blas_policy_reads_the_variables(env, threads):
    got, why = backends.blas_policy(env)
    assert got == threads
    assert "MIRRORED_BLAS_THREADS" in why or "OPENBLAS_NUM_THREADS" in why


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_blas_policy_refuses_a_bad_value_saying_what_it_takes(bad):
    with pytest.raises(ValueError, match="MIRRORED_BLAS_THREADS.*'auto', 'keep' or a whole number"):
        backends.blas_policy({"MIRRORED_BLAS_THREADS": bad})


def _model(rng):
    model = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(6,))])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _Spy(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(backends.blas_info()["threads"])


@pytest.mark.skipif(backends.blas_info()["threads"] is None, reason="no BLAS whose threads we can set")
@pytest.mark.parametrize("policy", ["auto", "2", "keep"])
def test_fit_runs_at_the_policys_thread_count_and_gives_the_blas_back(monkeypatch, rng, policy):
    for var in backends.BLAS_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MIRRORED_BLAS_THREADS", policy)
    start = 3                                   # not any policy's count: a missed restore shows
    backends.set_blas_threads(start)
    try:
        model, spy = _model(rng), _Spy()
        x = rng.standard_normal((10, 6)).astype(np.float32)
        model.fit(x, rng.integers(0, 4, 10), batch_size=4, epochs=1, verbose=0, callbacks=[spy])
        want = {"auto": backends.AUTO_BLAS_THREADS, "2": 2, "keep": start}[policy]
        assert spy.seen == [want] * 3
        assert backends.blas_info()["threads"] == start
        model.predict(x, verbose=0)
        model.evaluate(x, rng.integers(0, 4, 10), verbose=0)
        assert backends.blas_info()["threads"] == start
    finally:
        monkeypatch.delenv("MIRRORED_BLAS_THREADS")
        backends.set_blas_threads(start)


def test_a_bad_policy_stops_fit_before_anything_changes(monkeypatch, rng):
    monkeypatch.setenv("MIRRORED_BLAS_THREADS", "many")
    model = _model(rng)
    model.build((None, 6))
    before = [w.copy() for w in model.get_weights()]
    x = rng.standard_normal((5, 6)).astype(np.float32)
    with pytest.raises(ValueError, match="MIRRORED_BLAS_THREADS='many'"):
        model.fit(x, rng.integers(0, 4, 5), batch_size=4, epochs=1, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_fit_on_two_cpu_replicas_runs_on_the_callers_thread(devices, rng, monkeypatch):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = _model(rng)
    caller = threading.get_ident()
    threads = []                                # the thread each replica's forward pass runs on
    real_forward = engine.ReplicaProgram.forward

    def forward(self, *args, **kwargs):
        threads.append((self.r, threading.get_ident()))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(engine.ReplicaProgram, "forward", forward)
    x = rng.standard_normal((10, 6)).astype(np.float32)
    model.fit(x, rng.integers(0, 4, 10), batch_size=4, epochs=1, verbose=0)
    # 3 steps of 2 batch sizes (4, 4, 2) x 2 replicas: each size's first step runs the
    # Python (recorded), the second step of size 4 replays it (program/passes.py)
    assert sorted(r for r, _ in threads) == [0, 0, 1, 1]
    assert {t for _, t in threads} == {caller}


def test_info_reports_the_blas_and_the_policy_in_force(monkeypatch):
    from mirrored.info import report
    monkeypatch.setenv("MIRRORED_BLAS_THREADS", "3")
    text = report()
    assert "BLAS policy  3 thread(s) while fit/evaluate/predict run (MIRRORED_BLAS_THREADS=3)" in text
    assert "conv loops" in text and "MIRRORED_CPU_THREADS" in text
    monkeypatch.setenv("MIRRORED_BLAS_THREADS", "lots")
    assert "BLAS policy  invalid: MIRRORED_BLAS_THREADS='lots'" in report()    # said, not raised


@pytest.mark.skipif(backends.blas_info()["threads"] is None, reason="no BLAS whose threads we can set")
def test_the_custom_loop_runs_at_the_policys_thread_count_eagerly_and_replayed(monkeypatch, devices, rng):
    """``strategy.run`` (eager) and a ``@function``'s replay run their steps inside the
    policy, as fit does, and give the BLAS back; inside an outer policy block (the replay
    calls strategy.run while tracing; a user's own block) they touch the BLAS not at all."""
    from mirrored.backends import CpuOps
    from test_one_step import make_model
    from conftest import tutorial_train_step
    for var in backends.BLAS_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MIRRORED_BLAS_THREADS", "2")
    start = 3                                          # not the policy's count: a missed restore shows
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    model = make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0)
    x = rng.standard_normal((24, 6)).astype(np.float32)
    batches = list(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 4, 24))).batch(8)))
    step = tutorial_train_step(model, 8)
    replayed = tf.function(lambda b: strategy.run(step, args=(b,)))
    seen, original = [], CpuOps.adam                  # the update op: run by eager steps and replays
    monkeypatch.setattr(CpuOps, "adam", lambda self, *a: seen.append(backends.blas_info()["threads"])
                        or original(self, *a))
    backends.set_blas_threads(start)
    try:
        strategy.run(step, args=(batches[0],))        # eager
        assert backends.blas_info()["threads"] == start
        for b in batches:                              # the trace, then two replays
            replayed(b)
            assert backends.blas_info()["threads"] == start
        assert seen == [2] * 8                         # 2 replicas x 4 steps, each at the policy's 2
        sets = []
        monkeypatch.setattr(backends, "set_blas_threads", lambda n, _o=backends.set_blas_threads:
                            sets.append(n) or _o(n))
        with backends.blas_threads():                  # one block around the loop: one set, one restore
            for b in batches:
                strategy.run(step, args=(b,))
                replayed(b)
        assert sets == [2, start] and seen[8:] == [2] * 12
    finally:
        monkeypatch.undo()
        backends.set_blas_threads(start)


@pytest.mark.skipif(backends.blas_info()["threads"] is None, reason="no BLAS whose threads we can set")
@pytest.mark.parametrize("where", ["in __enter__", "exit skipped"])
def test_a_ctrl_c_inside_a_policy_block_does_not_switch_the_policy_off_for_later_fits(
        monkeypatch, rng, where):
    """A KeyboardInterrupt can land anywhere, inside the block's own ``__enter__`` (after it
    counted itself open) or between its enter and its exit (a ``with`` it never reached). Found
    by test_faults_round4_runtime's random Ctrl-C landing there: every later fit in the process
    then took itself for nested and ran at whatever thread count the BLAS had. A block whose exit
    never ran stops counting once it is gone."""
    for var in backends.BLAS_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MIRRORED_BLAS_THREADS", "2")
    start = 3
    backends.set_blas_threads(start)
    try:
        if where == "in __enter__":
            original = backends.set_blas_threads
            monkeypatch.setattr(backends, "set_blas_threads",
                                lambda n: (_ for _ in ()).throw(KeyboardInterrupt()))
            with pytest.raises(KeyboardInterrupt):
                with backends.blas_threads():
                    pass
            monkeypatch.setattr(backends, "set_blas_threads", original)
        else:
            block = backends.blas_threads()
            block.__enter__()                          # its __exit__ never runs
            del block
        backends.set_blas_threads(start)
        model, spy = _model(rng), _Spy()
        x = rng.standard_normal((10, 6)).astype(np.float32)
        model.fit(x, rng.integers(0, 4, 10), batch_size=4, epochs=1, verbose=0, callbacks=[spy])
        assert spy.seen == [2] * 3                     # the policy, not the 3 left in the BLAS
        assert backends.blas_info()["threads"] == start
    finally:
        monkeypatch.delenv("MIRRORED_BLAS_THREADS")
        backends.set_blas_threads(start)


@pytest.mark.skipif(backends.blas_info()["threads"] is None, reason="no BLAS whose threads we can set")
def test_an_eager_loop_outside_strategy_run_runs_at_the_policys_thread_count(monkeypatch, devices, rng):
    """keras.io's "Writing a training loop from scratch": ``model(x)`` under a tape,
    ``tape.gradient`` and ``optimizer.apply`` called eagerly, no ``strategy.run``, no
    ``@function``. Every product runs at the policy's count, as in fit (before, at whatever
    the BLAS had: OpenBLAS's one spinning thread per core, 4-62 s an epoch instead of 1-3 s
    on a busy 2-core machine); ``model(x)`` and ``tape.gradient`` set it once each and give
    the BLAS back, not once per product; an eager ``tf.matmul`` gets the policy too; inside an
    outer block nothing is set."""
    from mirrored.backends import cpu_loops
    for var in backends.BLAS_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MIRRORED_BLAS_THREADS", "2")
    start = 3                                          # not the policy's count: a missed set shows
    devices(cpus=1)
    with tf.distribute.MirroredStrategy(["CPU:0"]).scope():     # the CPU backend, called as the
        inputs = tf.keras.Input(shape=(12,))                  # guide does: outside strategy.run
        h = tf.keras.layers.Dense(8, activation="relu")(inputs)
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(4)(h))
        optimizer = tf.keras.optimizers.Adam(1e-3)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = rng.standard_normal((6, 12)).astype(np.float32), rng.integers(0, 4, 6)
    seen, sets = [], []                                # the BLAS's count at each product; each set
    original = cpu_loops.matmul_split
    monkeypatch.setattr(cpu_loops, "matmul_split",
                        lambda *a: seen.append(backends.blas_info()["threads"]) or original(*a))
    monkeypatch.setattr(backends, "set_blas_threads", lambda n, _o=backends.set_blas_threads:
                        sets.append(n) or _o(n))

    def step(outside=start):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        assert backends.blas_info()["threads"] == outside        # given back after the call
        grads = tape.gradient(loss_value, model.trainable_weights)
        assert backends.blas_info()["threads"] == outside
        optimizer.apply(grads, model.trainable_weights)

    backends.set_blas_threads(start)
    try:
        for _ in range(2):
            seen.clear(), sets.clear()
            step()
            # forward: 2 products; backward: 2 dW + 1 dx (the first layer's dx is not needed)
            assert seen == [2] * 5
            assert sets == [2, start, 2, start]        # model(x), then tape.gradient: a set, a restore
        seen.clear(), sets.clear()
        with tf.device("CPU:0"):
            tf.matmul(tf.constant(x), tf.constant(x.T))    # an op on its own: its own block
        assert seen == [2] and sets == [2, start]
        seen.clear(), sets.clear()
        with backends.blas_threads():                  # a user's block around the loop: one set
            step(outside=2)
            step(outside=2)
        assert seen == [2] * 10 and sets == [2, start]
        assert backends.blas_info()["threads"] == start
    finally:
        monkeypatch.undo()
        backends.set_blas_threads(start)
