"""Keras 3's loss scaling inside a replica (``tape.replica_scale``): a loss object with the
default reduction (``sum_over_batch_size``) called where ``tf.distribute.get_strategy()`` has
N > 1 replicas (inside ``strategy.run``, or in the strategy's scope) returns its mean times 1/N
(Keras 3's ``scale_loss_for_distribution``, ``keras/src/losses/loss.py``), so that the SUM of the
replicas' gradients the optimizer makes is the gradient of the mean. ``'sum'``, ``'none'`` (the
course's loop, with ``compute_average_loss``) and a ``call`` returning a scalar are not scaled.

Oracles in float64 NumPy: the values themselves, and keras.io's lower-level custom ``train_step``
(``loss = self.loss_fn(y, y_pred)``) under 2 replicas with uneven shares, where Keras's rule (the
mean of each replica's own mean) differs from the global mean, so the test tells them apart.

    python -m pytest -n 0 -q tests/test_loss_scaling.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import keras

TOL = dict(rtol=1e-5, atol=1e-6)
FIT_TOL = dict(rtol=2e-4, atol=2e-5)


class MyMSE(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred - y_true), axis=-1)


class Scalar(keras.losses.Loss):
    """A ``call`` that reduces itself: Keras returns a scalar as it is."""

    def call(self, y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred - y_true))


def _two_replicas(devices):
    devices(cpus=2)
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.mark.parametrize("make", [keras.losses.MeanSquaredError, MyMSE, lambda: keras.losses.get("mse")])
def test_the_default_reduction_is_scaled_by_one_over_the_replicas_inside_run(devices, rng, make):
    strategy = _two_replicas(devices)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
    x = rng.standard_normal((7, 3)).astype(np.float32)             # shares of 4 and 3
    y = rng.standard_normal((7, 2)).astype(np.float32)
    loss_fn = make()
    shares = [(0, 4), (4, 7)]

    def step(xb, yb):
        out = model(xb, training=True)
        return (loss_fn(yb, out), loss_fn(yb, out.numpy()),          # the model's output; a NumPy one
                keras.losses.MeanSquaredError(reduction="sum")(yb, out),
                keras.losses.MeanSquaredError(reduction="none")(yb, out))

    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[slice(*shares[ctx.replica_id_in_sync_group])], y[slice(*shares[ctx.replica_id_in_sync_group])]))
    results = strategy.run(step, args=dist)
    k, b = (a.astype(np.float64) for a in model.get_weights())
    for r, (lo, hi) in enumerate(shares):
        per = ((x[lo:hi] @ k + b - y[lo:hi]) ** 2).mean(-1)          # (b_r,) per-example MSE
        fused, in_ops, total, none = (strategy.experimental_local_results(v)[r].numpy() for v in results)
        np.testing.assert_allclose(fused, per.mean() / 2, **TOL)      # Keras 3: the mean times 1/N
        np.testing.assert_allclose(in_ops, per.mean() / 2, **TOL)
        np.testing.assert_allclose(total, per.sum(), **TOL)           # 'sum': not scaled
        np.testing.assert_allclose(none, per, **TOL)                  # 'none': not scaled


def test_scope_scales_outside_none_and_a_scalar_never(devices, rng):
    strategy = _two_replicas(devices)
    yt = rng.standard_normal((5, 2)).astype(np.float32)
    yp = rng.standard_normal((5, 2)).astype(np.float32)
    mean = ((yp.astype(np.float64) - yt) ** 2).mean()
    np.testing.assert_allclose(float(MyMSE()(yt, yp)), mean, **TOL)                 # no strategy: 1
    np.testing.assert_allclose(float(keras.losses.MeanSquaredError()(yt, yp)), mean, **TOL)
    with strategy.scope():                                    # get_strategy() is the strategy here
        np.testing.assert_allclose(float(MyMSE()(yt, yp)), mean / 2, **TOL)
        np.testing.assert_allclose(float(keras.losses.MeanSquaredError()(yt, yp)), mean / 2, **TOL)
        np.testing.assert_allclose(float(Scalar()(yt, yp)), mean, **TOL)          # a scalar: as it is


def test_keras_io_lower_level_train_step_trains_at_keras_gradient_on_two_replicas(devices, rng):
    """``self.loss_fn(y, y_pred)`` in train_step, gradients summed over the replicas by
    ``optimizer.apply``: each replica's mean / 2, as Keras 3 gives it. Batches of 7 (shares 4 + 3)
    and 5 (3 + 2): the mean of the replicas' means, not the global mean."""
    strategy = _two_replicas(devices)
    lr = 0.1

    class LowLevel(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

        @property
        def metrics(self):
            return [self.loss_tracker]

    with strategy.scope():
        inputs = keras.Input(shape=(3,))
        model = LowLevel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(lr))
    x = rng.standard_normal((12, 3)).astype(np.float32)
    y = rng.standard_normal((12, 1)).astype(np.float32)
    k, b = (a.astype(np.float64) for a in model.get_weights())
    tracked = []
    for lo, hi, shares in ((0, 7, [(0, 4), (4, 7)]), (7, 12, [(7, 10), (10, 12)])):
        gk, gb = np.zeros_like(k), np.zeros_like(b)
        for s0, s1 in shares:
            xb, yb = x[s0:s1].astype(np.float64), y[s0:s1].astype(np.float64)
            e = xb @ k + b - yb
            tracked.append((e ** 2).mean() / 2)                       # what the replica's tracker gets
            d = 2 * e / e.size / 2                                     # d(mean / N) / d output
            gk, gb = gk + xb.T @ d, gb + d.sum(0)
        k, b = k - lr * gk, b - lr * gb
    history = model.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(model.get_weights()[0], k, **FIT_TOL)
    np.testing.assert_allclose(model.get_weights()[1], b, **FIT_TOL)
    np.testing.assert_allclose(history.history["loss"][0], np.mean(tracked), **FIT_TOL)


def test_the_course_loop_with_reduction_none_is_unchanged(devices, rng):
    """reduction='none' + compute_average_loss (the lab's loop): divided by the GLOBAL batch,
    no replica scaling on top."""
    strategy = _two_replicas(devices)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(3, input_shape=(4,))])
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.integers(0, 3, 6)

    def step(xb, yb):
        per_example = loss_object(yb, model(xb, training=True))
        return tf.nn.compute_average_loss(per_example, global_batch_size=6)

    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[3 * ctx.replica_id_in_sync_group:3 * ctx.replica_id_in_sync_group + 3],
                     y[3 * ctx.replica_id_in_sync_group:3 * ctx.replica_id_in_sync_group + 3]))
    total = strategy.reduce("SUM", strategy.run(step, args=dist), axis=None)
    k, b = (a.astype(np.float64) for a in model.get_weights())
    z = x @ k + b
    logp = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(float(total), -logp[np.arange(6), y].mean(), **TOL)
