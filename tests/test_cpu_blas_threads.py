"""BLAS threads under N CPU replicas (mirrored.backends.blas_threads_for_replicas).

While N replicas train on logical CPU devices, NumPy's BLAS gets threads // N threads
and gets its setting back afterwards; where the BLAS cannot be controlled it says so
and nothing changes.
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import backends


def test_blas_info_says_what_it_found():
    info = backends.blas_info()
    assert set(info) == {"library", "threads", "note"}
    assert (info["library"] is None) == (info["threads"] is None)


def test_threads_are_split_then_restored():
    before = backends.blas_info()["threads"]
    if before is None:
        pytest.skip(f"BLAS threads not controllable here: {backends.blas_info()['note']}")
    with backends.blas_threads_for_replicas(1):
        assert backends.blas_info()["threads"] == before        # one replica: untouched
    with backends.blas_threads_for_replicas(2):
        assert backends.blas_info()["threads"] == max(1, before // 2)
        with backends.blas_threads_for_replicas(2):               # nested (evaluate inside fit)
            assert backends.blas_info()["threads"] >= 1
    assert backends.blas_info()["threads"] == before


def test_fit_on_two_cpu_replicas_gives_the_setting_back(devices, rng):
    devices(cpus=2)
    before = backends.blas_info()["threads"]
    seen = []
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(6,))])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Spy(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(backends.blas_info()["threads"])

    x = rng.standard_normal((10, 6)).astype(np.float32)
    model.fit(x, rng.integers(0, 4, 10), batch_size=4, epochs=1, verbose=0, callbacks=[Spy()])
    assert backends.blas_info()["threads"] == before
    if before is not None:
        assert seen == [max(1, before // 2)] * 3
