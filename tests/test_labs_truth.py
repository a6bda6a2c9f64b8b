"""What the labs print must be able to say "no": the checks they show a student can fail.

    python -m pytest tests/test_labs_truth.py
"""
import zlib

import numpy as np
import pytest

from mirrored.lab import labs


def _write(folder, sums):
    for rank, crc in sums.items():
        (folder / f"weights-{rank}.crc32").write_text(f"{crc:08x}")


def test_lab_06s_weight_check_passes_only_when_every_worker_wrote_the_same_checksum(tmp_path, rng):
    crc = zlib.crc32(rng.standard_normal(17).astype(np.float32).tobytes())
    _write(tmp_path, {0: crc, 1: crc, 2: crc})
    assert labs.same_weights_on_every_worker(tmp_path, 3) == {r: f"{crc:08x}" for r in range(3)}
    _write(tmp_path, {2: crc ^ 1})                                     # worker 2's weights differ
    with pytest.raises(ValueError, match=r"weights differ.*2: '"):
        labs.same_weights_on_every_worker(tmp_path, 3)
    with pytest.raises(ValueError, match=r"worker\(s\) \[3\] wrote no weights checksum"):
        labs.same_weights_on_every_worker(tmp_path, 4)                  # one never finished


def _timed_row(rng, replicas, examples, batch_size, epochs):
    """``EpochTimer.row`` after fitting a small dense model on ``replicas`` logical CPUs."""
    import mirrored as tf
    from mirrored.lab import scaling
    with tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)]).scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(5,))])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd")
    clock = scaling.EpochTimer()
    model.fit(rng.standard_normal((examples, 5)).astype(np.float32), rng.integers(0, 3, examples),
              batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[clock])
    return clock.row(f"MirroredStrategy ×{replicas}")


def test_the_epoch_timers_row_shows_the_global_batch_not_an_average(devices, rng):
    """8,000 examples in batches of 128 are 63 steps, the last of 64: the row's global batch
    is 128 (lab 01 showed ceil(8000 / 63) = 127). Here 100 examples in batches of 16 over 2
    replicas: 7 steps, the last of 4; ceil(100 / 7) would say 15."""
    devices(cpus=2)
    row = _timed_row(rng, replicas=2, examples=100, batch_size=16, epochs=2)
    assert row["steps_per_epoch"] == 7 and row["global_batch"] == 16, row


def test_a_run_of_one_epoch_does_not_call_its_warm_up_a_timed_epoch(devices, rng):
    """``python -m mirrored --epochs 1``: its one epoch is the warm-up; the table's footer said
    "median of 1 timed epoch(s) after warm-up". Now the row counts 0 timed epochs and says so."""
    from mirrored.lab import scaling
    devices(cpus=1)
    row = _timed_row(rng, replicas=1, examples=40, batch_size=8, epochs=1)
    assert row["epochs_timed"] == 0 and row["too_short"]
    text = scaling.format_table(scaling.add_efficiency([row]))
    assert "the warm-up epoch itself" in text and "median of 1 timed" not in text, text
