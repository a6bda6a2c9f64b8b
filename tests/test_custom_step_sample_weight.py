"""``compute_loss(sample_weight=)`` and ``fit(sample_weight=/class_weight=)`` for a model that
runs its own ``train_step`` or Keras 3's default one (issue 49; keras/custom_step.py).

keras.io's "Customizing what happens in fit()" guide, section "Supporting sample_weight &
class_weight": the step unpacks ``(x, y, sample_weight)`` and passes the weights to
``self.compute_loss`` and to the metrics. Keras 3's rule (``losses/loss.py``,
``reduce_weighted_values``): each example's loss times its weight, summed, divided by the
number of EXAMPLES (``sum_over_batch_size``), not by the weights' sum::

    loss = sum_i w_i * l_i / B

The oracle is that formula in float64 NumPy, SGD steps on a Dense(1) regression (MSE) from
the same initial weights on the same batches: 13 examples in batches of 5, so the last batch
(3 rows) splits 2 + 1 over 2 replicas, and a loss divided by anything but the global batch
would show. float32 tolerance (BLAS products); the replicas' copies bitwise equal (one
all-reduce, the same update on every copy). Weights come as arrays (``fit(sample_weight=)``),
as ``class_weight``, and as a data set of (x, y, sample_weight) triples; through the guide's
step and through Keras 3's default step (``custom_step.keras_train_step``, which runs for a
model with a layer that talks across replicas: a ``cross_replica`` identity layer here);
and through TensorFlow's own custom loop, ``tf.nn.compute_average_loss(..., sample_weight=)``.

    python -m pytest -n 0 -q tests/test_custom_step_sample_weight.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import keras
from mirrored.values import components

TOL = dict(rtol=2e-5, atol=2e-6)        # float32 against float64: a few SGD steps of sums of ~5 terms
LR, BATCH, EXAMPLES, FEATURES = 0.1, 5, 13, 3


class WeightedModel(keras.Model):
    """The guide's step that supports sample_weight, as it is written there."""

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class AcrossReplicas(keras.layers.Layer):
    """An identity layer that says it talks across replicas: fit then runs Keras 3's default
    train_step under ``strategy.run`` (``custom_step.runs_keras_step``)."""

    cross_replica = True

    def call(self, inputs):
        return inputs


def build(kind, n, devices):
    devices(cpus=max(n, 1))
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    with strategy.scope():
        inputs = keras.Input(shape=(FEATURES,))
        if kind == "guide's step":
            model = WeightedModel(inputs, keras.layers.Dense(1)(inputs))
        else:                                                  # Keras 3's default train_step
            model = keras.Model(inputs, keras.layers.Dense(1)(AcrossReplicas()(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return model


def oracle(w0, x, y, weights, epochs):
    """float64 SGD on ``sum_i w_i (x_i k + b - y_i)^2 / B`` per batch, batches in order."""
    k, b = (np.asarray(v, np.float64) for v in w0)
    for _ in range(epochs):
        for lo in range(0, len(x), BATCH):
            xb, yb, wb = (a[lo:lo + BATCH].astype(np.float64) for a in (x, y, weights))
            r = xb @ k + b - yb                                # (B, 1)
            d = 2 * wb[:, None] * r / len(xb)                  # d loss / d y_pred
            k, b = k - LR * xb.T @ d, b - LR * d.sum(0)
    return k, b


def weighted_loss(w, x, y, weights):
    """Keras 3's weighted mse over all of x: sum w_i l_i / N (one batch)."""
    k, b = (np.asarray(v, np.float64) for v in w)
    per_example = ((x.astype(np.float64) @ k + b - y) ** 2).mean(1)
    return (weights * per_example).sum() / len(x)


def check_trained(model, want):
    for v, oracle_value in zip(model.trainable_variables, want):
        copies = [c.numpy() for c in components(v)]
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])        # replicas: bitwise equal
        np.testing.assert_allclose(copies[0], oracle_value, **TOL, err_msg=v.name)


def data(rng):
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = rng.normal(size=(EXAMPLES, 1)).astype(np.float32)
    return x, y


@pytest.mark.parametrize("kind", ["guide's step", "Keras's default step"])
@pytest.mark.parametrize("n", [1, 2])
def test_fit_with_sample_weight_arrays_trains_to_the_weighted_oracle(devices, rng, n, kind):
    model = build(kind, n, devices)
    x, y = data(rng)
    sw = rng.uniform(0.1, 3.0, size=EXAMPLES).astype(np.float32)
    w0 = model.get_weights()
    model.fit(x, y, sample_weight=sw, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    want = oracle(w0, x, y, sw, epochs=2)
    check_trained(model, want)
    # evaluate with the weights: one batch, Keras's sum w l / N
    logs = model.evaluate(x, y, sample_weight=sw, batch_size=EXAMPLES, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["loss"], weighted_loss(want, x, y, sw), **TOL)
    # unit weights are no weights: the same as a fit without them
    plain, weighted = build(kind, n, devices), build(kind, n, devices)
    weighted.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    weighted.fit(x, y, sample_weight=np.ones(EXAMPLES, np.float32), batch_size=BATCH, epochs=1,
                 shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), weighted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [1, 2])
def test_fit_with_class_weight_weighs_each_example_by_its_class(devices, rng, n):
    model = build("guide's step", n, devices)
    x, _ = data(rng)
    y = rng.integers(0, 2, size=(EXAMPLES, 1)).astype(np.float32)    # classes 0 and 1 (Keras rounds y)
    class_weight = {0: 0.5, 1: 3.0}
    w0 = model.get_weights()
    model.fit(x, y, class_weight=class_weight, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    check_trained(model, oracle(w0, x, y, np.where(y[:, 0] > 0, 3.0, 0.5), epochs=1))


@pytest.mark.parametrize("kind", ["guide's step", "Keras's default step"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_data_set_of_triples_trains_to_the_weighted_oracle(devices, rng, n, kind):
    model = build(kind, n, devices)
    x, y = data(rng)
    sw = rng.uniform(0.1, 3.0, size=(EXAMPLES, 1)).astype(np.float32)    # (N, 1): Keras takes it too
    w0 = model.get_weights()
    ds = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(BATCH)
    model.fit(ds, epochs=1, verbose=0)
    check_trained(model, oracle(w0, x, y, sw[:, 0], epochs=1))


def test_compute_loss_divides_by_the_examples_not_the_weights(devices, rng):
    """Outside fit, on one device: ``compute_loss`` is Keras's sum w l / B; a weight of the
    wrong length says what it needs."""
    model = build("guide's step", 1, devices)
    x, y = data(rng)
    sw = rng.uniform(0.1, 3.0, size=EXAMPLES).astype(np.float32)
    with tf.device("CPU:0"):
        loss = model.compute_loss(y=y, y_pred=model(x), sample_weight=sw)
        np.testing.assert_allclose(float(loss.numpy()), weighted_loss(model.get_weights(), x, y, sw), **TOL)
        with pytest.raises(ValueError, match="one weight per example"):
            model.compute_loss(y=y, y_pred=model(x), sample_weight=sw[:4])


def test_sample_weight_with_a_data_set_is_keras_s_error(devices, rng):
    model = build("guide's step", 1, devices)
    x, y = data(rng)
    with pytest.raises(ValueError, match="included as part of the dataset"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), sample_weight=np.ones(EXAMPLES),
                  verbose=0)
    with pytest.raises(ValueError, match="class_weight` and `sample_weight"):
        model.fit(x, y, sample_weight=np.ones(EXAMPLES), class_weight={0: 1.0}, verbose=0)


@pytest.mark.parametrize("n", [1, 2])
def test_compute_average_loss_with_sample_weight_in_a_custom_loop(devices, rng, n):
    """TensorFlow's ``tf.nn.compute_average_loss(per_example, sample_weight=w,
    global_batch_size=B)``: the losses times their weights, summed, over B; the course's loop
    with it trains to the same oracle."""
    model = build("guide's step", n, devices)
    strategy = model.distribute_strategy
    with strategy.scope():
        optimizer = keras.optimizers.SGD(LR)
        loss_object = keras.losses.MeanSquaredError(reduction="none")
    x, y = data(rng)
    sw = rng.uniform(0.1, 3.0, size=EXAMPLES).astype(np.float32)
    w0 = model.get_weights()

    def step(inputs):
        xb, yb, wb = inputs
        with tf.GradientTape() as tape:
            per_example = loss_object(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, sample_weight=wb, global_batch_size=BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    data_set = tf.data.Dataset.from_tensor_slices((x[:10], y[:10], sw[:10])).batch(BATCH)   # whole batches
    for inputs in strategy.experimental_distribute_dataset(data_set):
        strategy.run(step, args=(inputs,))
    check_trained(model, oracle(w0, x[:10], y[:10], sw[:10], epochs=1))
    # a number weighs every example alike (the fused loss path keeps it)
    per_example = np.arange(4, dtype=np.float32)
    assert tf.nn.compute_average_loss(per_example, sample_weight=0.5, global_batch_size=8) == np.float32(0.375)
