"""What ``keras/step.py``'s Step works out once and reuses: the split's bounds per batch
size and the loss kernel's mode per loss object. Reused answers must stay right when the
batch size changes (a short last batch) and when ``compile`` sets another loss.

    python -m pytest -q tests/test_step_memos.py
"""
import numpy as np

import mirrored as tf


def _model(strategy, loss):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(5, input_shape=(3,)), tf.keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss=loss)
    model.build((None, 3))
    return model


def test_the_split_follows_tensorflows_rule_for_every_batch_size(devices, rng):
    devices(cpus=3)
    model = _model(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"]),
                   tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for b in [int(v) for v in rng.integers(1, 40, 6)] + [1, 2, 31, 33, 1]:
        x = rng.random((b, 3), dtype=np.float32)
        y = rng.integers(0, 4, b)
        parts, _, scale = model.step.split((x, y))
        k = -(-b // 3)                                        # ceil(B / N) rows per replica
        want = [(min(r * k, b), min((r + 1) * k, b)) for r in range(3)]
        assert [len(px) for px, _ in parts] == [hi - lo for lo, hi in want], (b, want)
        for (px, py), (lo, hi) in zip(parts, want):
            np.testing.assert_array_equal(px, x[lo:hi])
            np.testing.assert_array_equal(py, y[lo:hi])
        assert scale == 1.0 / b


def test_the_loss_mode_follows_compile(devices):
    devices(cpus=1)
    model = _model(tf.distribute.MirroredStrategy(["CPU:0"]),
                   tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model.step.loss_mode() == "logits"
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=False))
    assert model.step.loss_mode() == "probs"
    model.compile(optimizer="sgd", loss="mse")
    assert model.step.loss_mode() == "mse"
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model.step.loss_mode() == "logits"
