"""What the labs print must be able to say "no": the checks they show a student can fail.

    python -m pytest tests/test_labs_truth.py
"""
import warnings
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


# --- sentences the labs compute from their own numbers (issue 37) ------------------------

def _row(name, samples_per_s, epochs, replicas=1, **more):
    return dict(name=name, replicas=replicas, samples_per_s=samples_per_s, epoch_times_s=epochs,
                global_batch=64 * replicas, **more)


@pytest.mark.parametrize("ratio, word", [(1.16, "faster"), (0.8, "slower"), (1.01, "inside")])
def test_lab_01s_one_device_sentence_follows_the_measured_order(ratio, word):
    """Lab 01 §7 once explained why one device is slower while its table showed it faster
    (104-116% in 5 of 7 runs): the sentence now comes from the rows, either way."""
    from mirrored.lab import scaling
    steady = [9.0, 1.00, 1.02, 1.01]                        # warm-up, then a 2% spread
    rows = [_row("no strategy", 1000.0, steady), _row("MirroredStrategy ×1", 1000.0 * ratio, steady)]
    text = scaling.one_device_verdict(rows)
    assert word in text and f"{ratio:.0%}" in text, text
    for other in {"faster", "slower", "inside"} - {word}:
        assert other not in text, text


def test_lab_01s_one_device_sentence_draws_nothing_from_a_flagged_or_short_row():
    from mirrored.lab import scaling
    rows = [_row("no strategy", 1000.0, [9.0, 2.14, 7.79], timing_flags=["epoch times spread 3.64x (over 2x)"]),
            _row("MirroredStrategy ×1", 1300.0, [9.0, 1.0, 1.0])]
    assert scaling.one_device_verdict(rows).startswith("No verdict"), scaling.one_device_verdict(rows)
    rows = [_row("no strategy", 1000.0, [9.0]), _row("MirroredStrategy ×1", 800.0, [9.0], too_short=True)]
    assert scaling.one_device_verdict(rows).startswith("No verdict")


def test_lab_01s_table_flags_a_spread_that_python_m_mirrored_would_flag():
    """Lab 01 §6 builds its rows from two EpochTimers; add_timing_flags marks them as
    compare() does (a run whose epochs spread 3.6x was printed unmarked)."""
    from mirrored.lab import scaling
    rows = scaling.add_efficiency([_row("no strategy", 1000.0, [9.0, 2.140, 7.793]),
                                   _row("MirroredStrategy ×2", 1560.0, [9.0, 1.0, 1.1], replicas=2)])
    scaling.add_timing_flags(rows)
    text = scaling.format_table(rows)
    assert "! no strategy: epoch times spread 3.64x" in text, text


@pytest.mark.parametrize("gain, word", [(1.64, "more than"), (0.5, "less"), (1.02, "about the same")])
def test_lab_05s_scaling_sentence_follows_the_measured_gain(gain, word):
    """Lab 05's exercise 2 said throughput 'can stay flat or even drop' with logical devices;
    four replicas on two cores once gave 1.64x. The sentence is the measurement's."""
    from mirrored.lab import scaling
    rows = [_row("no strategy", 1000.0, [9.0, 1.0, 1.0]),
            _row("MirroredStrategy ×2", 1000.0 * min(gain, 1.2), [9.0, 1.0, 1.0], replicas=2),
            _row("MirroredStrategy ×4", 1000.0 * gain, [9.0, 1.0, 1.0], replicas=4)]
    text = scaling.scaling_verdict(rows, cores=2)
    assert f"{gain:.2f}×" in text and "×4" in text and word in text, text


def _calibration(compute_s, fit_step_s, params=347_146):
    from mirrored.lab import perf_model
    breakdown = {"phases": {perf_model.INPUT_COPY: {"median_s": compute_s * 0.1},
                            perf_model.FORWARD_BACKWARD: {"median_s": compute_s * 0.9}},
                 "step_s": compute_s * 1.2, "global_batch": 64}
    measured = {"replicas": 1, "global_batch": 64, "samples_per_s": 64 / fit_step_s}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", perf_model.CalibrationWarning)
        return perf_model.calibrate(breakdown, grad_bytes=4 * params, measured=measured)


def test_lab_05s_model_sentence_says_when_the_calibration_failed():
    """Lab 05 §5: the breakdown's compute (17.1 ms) was longer than fit's step (7.61 ms), the
    overhead became 0, and the text still concluded that 'the overhead does matter'."""
    from mirrored.lab import perf_model
    failed = _calibration(17.1e-3, 7.61e-3)
    assert failed["calibrated"] is False and failed["overhead_s"] == 0
    text = perf_model.model_verdict(failed, 8, 25e9, "PCIe")
    assert "calibration failed" in text and "17.1 ms" in text and "7.61 ms" in text
    assert "matters" not in text, text
    fine = _calibration(1e-3, 3e-3)                           # 2 ms of overhead on 1 ms of compute
    assert fine["calibrated"] is True and fine["overhead_s"] == pytest.approx(2e-3)
    text = perf_model.model_verdict(fine, 8, 25e9, "PCIe")
    assert "the per-step overhead 2 ms" in text and "overhead 2 ms (6" in text and ": matters)" in text, text
    assert "the ring over PCIe 0.0972 ms (3%: hardly matters)" in text, text
