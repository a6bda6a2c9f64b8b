"""The CPU backend's BLAS, as the benchmarks record it (mirrored.backends.blas_info),
and what fit does with BLAS threads: nothing — one host thread drives every replica,
so one product at a time gets all of the cores (keras/step.py, ``Step.copy_in``).
"""
import numpy as np

import mirrored as tf
from mirrored import backends


def test_blas_info_says_what_it_found():
    info = backends.blas_info()
    assert set(info) == {"library", "threads", "note"}
    assert (info["library"] is None) == (info["threads"] is None)
    assert info["threads"] is None or info["threads"] >= 1


def test_fit_on_two_cpu_replicas_runs_on_the_callers_thread_with_blas_untouched(devices, rng):
    import threading
    devices(cpus=2)
    before = backends.blas_info()["threads"]
    seen = []
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(6,))])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    caller = threading.get_ident()

    class Spy(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(backends.blas_info()["threads"])

    # Record the thread each replica's forward pass runs on.
    threads = []
    from mirrored.keras import engine
    real_forward = engine.ReplicaProgram.forward

    def forward(self, *args, **kwargs):
        threads.append((self.r, threading.get_ident()))
        return real_forward(self, *args, **kwargs)

    engine.ReplicaProgram.forward = forward
    try:
        x = rng.standard_normal((10, 6)).astype(np.float32)
        model.fit(x, rng.integers(0, 4, 10), batch_size=4, epochs=1, verbose=0, callbacks=[Spy()])
    finally:
        engine.ReplicaProgram.forward = real_forward
    assert sorted(r for r, _ in threads) == [0, 0, 0, 1, 1, 1]       # 3 steps x 2 replicas
    assert {t for _, t in threads} == {caller}
    assert seen == [before] * 3
