"""The Dropout layer (mirrored/keras/layers.py) over kernels/dropout.py's counter-based mask.

N replicas do NOT train like one replica with dropout (each replica drops different
units), so instead of that invariant these tests check: the gradient of a step against a
float64 oracle given the mask, identity in evaluate/predict, a different mask on every
replica and step, reproducibility under ``mirrored.random.set_seed``, the same mask
on the CPU and (simulated) GPU paths for the same counters, and the same launch arguments
at every step (the counter is on the device: what a CUDA graph of the step needs;
tests/test_graphs.py replays whole steps).

    python -m pytest -q tests/test_dropout_layer.py
"""
import numpy as np
import pytest

import mirrored as tf
from kernels.dropout import dropout_key, dropout_mask_ref
from tests.test_conv_layers import STEP_ATOL, STEP_RTOL, compiled, grads_f64, loss_f64
from tests.test_training import assert_replicas_bitwise_equal

layers = tf.keras.layers
RATE = 0.5


def dense_with_dropout(seed=None, din=6):
    return lambda: [layers.Dense(8, activation="relu", input_shape=(din,)),
                    layers.Dropout(RATE, seed=seed), layers.Dense(3)]


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_one_sgd_step_with_dropout_matches_a_float64_oracle(devices, rng, kind):
    """One replica, step 0: the mask is dropout_key(seed, 0, 0)'s, in forward and backward."""
    devices(cpus=1, gpus=1 if kind == "GPU" else 0)
    lr, seed, batch = 0.5, 11, 5
    model = compiled(tf.distribute.OneDeviceStrategy(f"{kind}:0"), dense_with_dropout(seed),
                     tf.keras.optimizers.SGD(lr))
    x = rng.standard_normal((batch, 6)).astype(np.float32)
    y = rng.integers(0, 3, batch)
    before = model.get_weights()
    mask = dropout_mask_ref(dropout_key(seed, 0, 0), batch * 8, RATE).reshape(batch, 8)
    assert 0 < mask.sum() < mask.size
    grads = grads_f64(model, before, x, y, [mask])
    model.train_step(x, y)
    for v, w0, g, w1 in zip(model.trainable_variables, before, grads, model.get_weights()):
        np.testing.assert_allclose(w1, w0 - lr * g, rtol=STEP_RTOL, atol=STEP_ATOL, err_msg=v.name)
    assert model._logs()["loss"] == pytest.approx(loss_f64(model, before, x, y, [mask]), rel=1e-5)


def test_evaluate_and_predict_are_the_identity(devices, rng):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with_dropout = compiled(strategy, dense_with_dropout(), "sgd")
    plain = compiled(strategy, lambda: [layers.Dense(8, activation="relu", input_shape=(6,)),
                                        layers.Dense(3)], "sgd")
    plain.set_weights(with_dropout.get_weights())
    x = rng.standard_normal((7, 6)).astype(np.float32)
    y = rng.integers(0, 3, 7)
    np.testing.assert_array_equal(with_dropout.predict(x, verbose=0), plain.predict(x, verbose=0))
    assert with_dropout.evaluate(x, y, verbose=0) == plain.evaluate(x, y, verbose=0)


def _training_outputs(model, strategy, x, calls):
    """What a last Dropout layer outputs in training, per replica, for ``calls`` calls."""
    (batch,) = list(strategy.experimental_distribute_dataset([(x, np.zeros(len(x), np.int64))]))
    outs = []
    for _ in range(calls):
        per_replica = strategy.run(lambda inputs: model(inputs[0], training=True), args=(batch,))
        outs.append([t.numpy() for t in strategy.experimental_local_results(per_replica)])
    return outs


def test_a_different_mask_on_every_replica_and_step(devices, rng):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([layers.Dense(40, input_shape=(5,), bias_initializer="ones"),
                                     layers.Dropout(RATE)])
    half = rng.standard_normal((3, 5)).astype(np.float32)
    (a0, a1), (b0, b1) = _training_outputs(model, strategy, np.concatenate([half, half]), 2)
    for out in (a0, a1, b0, b1):
        assert 0.3 < np.mean(out == 0) < 0.7                       # about RATE of the units dropped
    assert not np.array_equal(a0 == 0, a1 == 0), "replicas 0 and 1 drew the same mask"
    assert not np.array_equal(a0 == 0, b0 == 0), "steps 0 and 1 drew the same mask"
    kernel, bias = model.get_weights()
    z = half.astype(np.float64) @ kernel + bias                    # the Dense output: (3, 40)
    for out in (a0, a1, b0, b1):                                   # kept units scaled by 1/(1-rate)
        np.testing.assert_allclose(out[out != 0], (z / (1 - RATE))[out != 0], rtol=1e-5,
                                   atol=1e-5 * np.abs(z).max())      # float32 dot: cancellation


def test_training_is_reproducible_under_set_seed(devices, rng):
    devices(cpus=2)
    x = rng.standard_normal((4, 9, 6)).astype(np.float32)
    y = rng.integers(0, 3, (4, 9))
    runs = []
    for seed in (5, 5, 6):
        tf.random.set_seed(seed)
        model = compiled(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]), dense_with_dropout(),
                         tf.keras.optimizers.Adam(0.01))
        if runs:
            model.set_weights(runs[0][0])                      # the same start: only masks differ
        start = model.get_weights()
        for s in range(4):
            model.train_step(x[s], y[s])
        runs.append((start, model.get_weights()))
        assert_replicas_bitwise_equal(model)
    (_, first), (_, again), (_, other) = runs
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other)), "seed 6 gave seed 5's masks"


def test_cpu_and_simulated_gpu_draw_the_same_mask_for_the_same_counters(devices, rng):
    devices(cpus=1, gpus=1)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    outs = {}
    for kind in ("CPU", "GPU"):
        strategy = tf.distribute.OneDeviceStrategy(f"{kind}:0")
        with strategy.scope():
            model = tf.keras.Sequential([layers.Dense(6, input_shape=(5,), bias_initializer="ones"),
                                         layers.Dropout(RATE, seed=21)])
        if outs:
            model.set_weights(weights)
        weights = model.get_weights()
        outs[kind] = [model(x, training=True).numpy() for _ in range(2)]    # steps 0 and 1
    for step in range(2):
        cpu, gpu = outs["CPU"][step], outs["GPU"][step]
        want = dropout_mask_ref(dropout_key(21, step, 0), cpu.size, RATE).reshape(cpu.shape)
        np.testing.assert_array_equal(cpu != 0, want)
        np.testing.assert_array_equal(gpu != 0, want)
        np.testing.assert_allclose(gpu, cpu, rtol=1e-6, atol=1e-6)


def test_bad_dropout_arguments():
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\)"):
        layers.Dropout(1.0)
    with pytest.raises(ValueError, match="rate must be a number"):
        layers.Dropout("half")
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        layers.Dropout(0.5, seed=-1)
    with pytest.raises(NotImplementedError, match="noise_shape"):
        layers.Dropout(0.5, noise_shape=(1, 4))


def test_every_step_launches_the_same_arguments_and_draws_its_own_mask(devices, rng):
    """What a CUDA graph of the step needs (mirrored/program/capture.py): a training forward's dropout
    launches are the same, argument for argument (buffers and numbers), at every step, and
    still each step draws its own mask, the eager one for its counter: the counter lives on
    the device and a launch in the step advances it. A restored state is written into the
    same counter (a captured graph reads that one)."""
    devices(cpus=1, gpus=1)
    strategy = tf.distribute.OneDeviceStrategy("GPU:0")
    with strategy.scope():
        model = tf.keras.Sequential([layers.Dense(6, input_shape=(5,), bias_initializer="ones"),
                                     layers.Dropout(RATE, seed=21)])
    x = rng.standard_normal((4, 5)).astype(np.float32)
    dev, dropout = model.step.devices[0], model.layers[1]
    calls = []

    def recorded(name):
        original = getattr(dev.ops, name)

        def call(*args):
            calls[-1].append((name,) + tuple(("array", id(a)) if hasattr(a, "shape") and np.ndim(a)
                                             else ("value", int(a) if isinstance(a, (int, np.integer))
                                                   else float(a)) for a in args))
            return original(*args)
        return call
    for name in ("dropout_next_key", "dropout_keyed"):
        setattr(dev.ops, name, recorded(name))
    outs = []
    for _ in range(3):
        calls.append([])
        outs.append(model(x, training=True).numpy())
    counter = dropout._counters[0][1]
    dropout.set_training_state({"seed": np.uint64(21), "steps": np.array([1])}, "a test")
    calls.append([])
    outs.append(model(x, training=True).numpy())                     # step 1 again
    assert dropout._counters[0][1] is counter, "a restore must write into the counter, not replace it"
    assert [c[0] for c in calls[0]] == ["dropout_next_key", "dropout_keyed"]
    assert calls[0] == calls[1] == calls[2] == calls[3], "a launch argument changed between steps"
    for out, step in zip(outs, (0, 1, 2, 1)):
        want = dropout_mask_ref(dropout_key(21, step, 0), out.size, RATE).reshape(out.shape)
        np.testing.assert_array_equal(out != 0, want)
    assert not np.array_equal(outs[0] != 0, outs[1] != 0) and not np.array_equal(outs[1] != 0, outs[2] != 0)
    assert dropout._steps == {0: 2} and list(dropout.training_state()["steps"]) == [2]
