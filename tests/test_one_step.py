"""fit and the custom training loop are one step: the same weights, bit for bit.

``model.fit`` runs ``keras/step.py``'s ``Step.train``. The MirroredStrategy tutorial's
custom loop (``strategy.run(train_step)``, a ``GradientTape``, ``optimizer.apply_gradients``)
runs each replica on its own thread, and its ``apply_gradients`` meets the other replicas
at a merge point. Both must make the same kernel launches in the same order on the same
buffers: the replica's forward, loss and backward (``engine.ReplicaProgram``), the ring over
the packed gradients and the optimizer's one update per device (``Step.reduce_and_update``).
Then, from the same weights and the same batches, their weights agree bitwise, step after
step, with Adam and with SGD with momentum, on CPU devices and on (simulated) GPUs.

A float tolerance would hide a second engine: a different summation order, a loss scaled
by another batch, a skipped regularizer term, each changes the last bits long before it
changes anything else.
"""
import numpy as np
import pytest

import mirrored as tf

OPTIMIZERS = {"sgd-momentum": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: tf.keras.optimizers.Adam(0.01)}


def make_model(strategy, features, hidden, classes, optimizer, l2):
    with strategy.scope():
        reg = tf.keras.regularizers.L2(l2) if l2 else None
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(hidden, activation="relu", input_shape=(features,), kernel_regularizer=reg),
            tf.keras.layers.Dense(classes)])
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=optimizer, metrics=["accuracy"])
    return model


def custom_loop(strategy, model, optimizer, x, y, global_batch, compiled=False):
    """The MirroredStrategy tutorial's training loop, one epoch over (x, y) in order.

    The loss of each batch is divided by that batch's size, as ``fit`` does (the tutorial
    divides by ``GLOBAL_BATCH_SIZE``, which is wrong for a short last batch).
    ``compiled``: the distributed step under ``@tf.function`` (traced, then replayed:
    tests/test_function_replay.py). Returns the step function and its losses."""
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs, batch_size):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, predictions), global_batch_size=batch_size)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    def distributed_step(batch, batch_size):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch, batch_size)), axis=None)

    step = tf.function(distributed_step) if compiled else distributed_step
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    losses = []
    for start, batch in zip(range(0, len(x), global_batch), strategy.experimental_distribute_dataset(dataset)):
        losses.append(step(batch, len(x[start:start + global_batch])))
    return step, losses


@pytest.mark.parametrize("kind,replicas", [("CPU", 2), ("GPU", 2), ("CPU", 1)])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_fit_and_the_custom_loop_give_bitwise_equal_weights(devices, rng, kind, replicas, opt):
    devices(cpus=max(replicas, 1) if kind == "CPU" else 1, gpus=replicas if kind == "GPU" else 0)
    features, hidden, classes, batch, steps = (5, 4, 3, 7, 3) if kind == "GPU" else (13, 9, 5, 33, 4)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(replicas)])
    l2 = float(rng.uniform(0.001, 0.01)) if opt == "adam" else 0.0     # model.losses on one path of each pair
    x = rng.standard_normal((steps * batch - 2, features)).astype(np.float32)   # a short last batch
    y = rng.integers(0, classes, x.shape[0])
    by_fit = make_model(strategy, features, hidden, classes, OPTIMIZERS[opt](), l2)
    by_loop = make_model(strategy, features, hidden, classes, OPTIMIZERS[opt](), l2)
    by_loop.set_weights(by_fit.get_weights())
    start = by_fit.get_weights()

    by_fit.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    custom_loop(strategy, by_loop, by_loop.optimizer, x, y, batch)

    assert int(by_fit.optimizer.iterations) == int(by_loop.optimizer.iterations) == steps
    for w0, a, b in zip(start, by_fit.get_weights(), by_loop.get_weights()):
        assert not np.array_equal(w0, a), "fit did not train"
        np.testing.assert_array_equal(a, b)
    slots_fit = by_fit.optimizer.keras_variables(by_fit.step.pack)
    slots_loop = by_loop.optimizer.keras_variables(by_loop.step.pack)
    assert len(slots_fit) == len(slots_loop) == 2 + len(by_fit.optimizer.slot_names) * len(start)
    for a, b in zip(slots_fit, slots_loop):
        np.testing.assert_array_equal(a, b)                 # the slots (momentum; Adam's m, v) too
    for model in (by_fit, by_loop):                         # every replica's copy alike
        for v in model.trainable_variables:
            for c in strategy.experimental_local_results(v)[1:]:
                np.testing.assert_array_equal(c.numpy(), strategy.experimental_local_results(v)[0].numpy())


@pytest.mark.parametrize("where", ["all-reduce", "update"])
def test_a_custom_loop_step_that_fails_leaves_no_trace(devices, rng, monkeypatch, where):
    """As fit's: a failure in the all-reduce or the update of ``apply_gradients`` leaves the
    weights, the step count and the optimizer's buffers as they were, and the next step
    trains exactly like fit's first."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((9, 6)).astype(np.float32)            # 5 + 4 rows
    y = rng.integers(0, 4, 9)
    by_fit = make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0)
    by_loop = make_model(strategy, 6, 5, 4, tf.keras.optimizers.Adam(0.01), 0.0)
    by_loop.set_weights(by_fit.get_weights())
    start = by_loop.get_weights()
    target = (strategy.extended.cross_device_ops, "all_reduce_flat") if where == "all-reduce" \
        else (by_loop.optimizer, "update")

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected failure in the {where}")
    with monkeypatch.context() as patch:
        patch.setattr(*target, broken)
        with pytest.raises(RuntimeError, match="injected"):
            custom_loop(strategy, by_loop, by_loop.optimizer, x, y, 9)
    assert int(by_loop.optimizer.iterations) == 0
    assert all(len(cache) == 0 for cache in by_loop.optimizer.caches())   # Adam's scalars: dropped
    for a, b in zip(start, by_loop.get_weights()):
        np.testing.assert_array_equal(a, b)
    custom_loop(strategy, by_loop, by_loop.optimizer, x, y, 9)
    by_fit.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    assert int(by_loop.optimizer.iterations) == 1
    for a, b in zip(by_fit.get_weights(), by_loop.get_weights()):
        np.testing.assert_array_equal(a, b)
