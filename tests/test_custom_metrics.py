"""keras.metrics.Metric subclasses (add_weight, update_state, result, reset_state), standalone."""
import numpy as np

import mirrored as tf


class BinaryTruePositives(tf.keras.metrics.Metric):
    """keras.io's example, in ops."""

    def __init__(self, name="binary_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_weight(shape=(), initializer="zeros", name="tp")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = tf.cast(tf.constant(y_true), tf.bool)
        y_pred = tf.cast(tf.constant(y_pred), tf.bool)
        values = tf.cast(tf.logical_and(tf.equal(y_true, True), tf.equal(y_pred, True)), tf.float32)
        self.true_positives.assign_add(tf.reduce_sum(values))

    def result(self):
        return self.true_positives


def test_a_metric_subclass_accumulates_and_resets(devices):
    devices(cpus=1)
    with tf.device("CPU:0"):
        m = BinaryTruePositives()
        m.update_state([0, 1, 1, 1], [0, 1, 0, 1])
        assert float(m.result().numpy()) == 2.0
        m.update_state([1, 1], [1, 1])
        assert float(m.result().numpy()) == 4.0
        m.reset_state()
        assert float(m.result().numpy()) == 0.0
        assert m.name == "binary_true_positives" and len(m.variables) == 1


def test_inside_a_strategy_scope_its_state_is_one_copy(devices):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with tf.device("CPU:0"):
        with strategy.scope():
            m = BinaryTruePositives()
        m.update_state(np.array([1, 1, 0]), np.array([1, 0, 0]))
        np.testing.assert_allclose(m.result().numpy(), 1.0)


def test_the_builtin_metrics_still_work():
    m = tf.keras.metrics.Mean()
    m.update_state([1.0, 3.0])
    np.testing.assert_allclose(float(m.result().numpy()), 2.0)
    m.reset_state()
    np.testing.assert_allclose(float(m.result().numpy()), 0.0)
