"""``apply_gradients`` on variables that are not a model's packed parameters
(``keras/variable_updates.py``): each gradient summed across the replicas on its own, then
one update per copy, with Keras's SGD and Adam formulas.

A custom loop may keep its own ``tf.Variable``s (a temperature, a bias it learns beside the
model, a toy linear regression in a tutorial). Their gradients do not live in a model's packed
buffer, so they take this path and not the training step's. Checked against float64 NumPy
oracles of Keras's update rules, from fresh random values, outside any strategy and under
MirroredStrategy with 2 replicas on CPU devices and on (simulated) GPUs: every copy gets the
update computed from the SUM of the replicas' gradients, the copies stay bitwise equal, and
``iterations`` counts one step per ``apply_gradients``, not one per replica.

    python -m pytest -q tests/test_variable_updates.py
"""
import numpy as np
import pytest

import mirrored as tf

LR, MOMENTUM = 0.05, 0.9
BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7
SHAPES = [(3,), (2, 5)]            # two variables of different ranks, updated together
STEPS = 3


def sgd_oracle(w, grads_per_step):
    """Keras's SGD with momentum in float64: v = m*v - lr*g; w += v."""
    w = [x.astype(np.float64) for x in w]
    vel = [np.zeros_like(x) for x in w]
    for grads in grads_per_step:
        for k, g in enumerate(grads):
            vel[k] = MOMENTUM * vel[k] - LR * g
            w[k] = w[k] + vel[k]
    return w


def adam_oracle(w, grads_per_step):
    """Keras's Adam in float64: alpha = lr*sqrt(1-b2^t)/(1-b1^t); w -= alpha*m/(sqrt(v)+eps)."""
    w = [x.astype(np.float64) for x in w]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        alpha = LR * np.sqrt(1 - BETA_2 ** t) / (1 - BETA_1 ** t)
        for k, g in enumerate(grads):
            m[k] = BETA_1 * m[k] + (1 - BETA_1) * g
            v[k] = BETA_2 * v[k] + (1 - BETA_2) * g * g
            w[k] = w[k] - alpha * m[k] / (np.sqrt(v[k]) + EPSILON)
    return w


OPTIMIZERS = {"sgd-momentum": (lambda: tf.keras.optimizers.SGD(LR, momentum=MOMENTUM), sgd_oracle),
              "adam": (lambda: tf.keras.optimizers.Adam(LR, BETA_1, BETA_2, EPSILON), adam_oracle)}


def random_start(rng):
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_variables_outside_a_strategy(devices, rng, opt):
    devices(cpus=1)
    make, oracle = OPTIMIZERS[opt]
    optimizer = make()
    start = random_start(rng)
    variables = [tf.Variable(w) for w in start]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(STEPS)]
    for step in grads:
        optimizer.apply_gradients(zip([tf.constant(g) for g in step], variables))
    want = oracle(start, [[g.astype(np.float64) for g in step] for step in grads])
    for v, w in zip(variables, want):
        np.testing.assert_allclose(v.numpy(), w, rtol=2e-5, atol=2e-6)
    assert int(optimizer.iterations) == STEPS


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_mirrored_variables_get_the_sum_of_the_replicas_gradients(devices, rng, kind, opt):
    devices(cpus=2 if kind == "CPU" else 1, gpus=2 if kind == "GPU" else 0)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"])
    make, oracle = OPTIMIZERS[opt]
    start = random_start(rng)
    with strategy.scope():
        variables = [tf.Variable(w) for w in start]
        optimizer = make()
    # grads[step][replica][k]: each replica brings its own gradient for every variable
    grads = [[[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(2)]
             for _ in range(STEPS)]

    def replica_step(step):
        r = int(tf.distribute.get_replica_context().replica_id_in_sync_group)
        optimizer.apply_gradients(zip([tf.constant(g) for g in grads[step][r]], variables))

    for step in range(STEPS):
        strategy.run(replica_step, args=(step,))
    summed = [[grads[t][0][k].astype(np.float64) + grads[t][1][k] for k in range(len(SHAPES))]
              for t in range(STEPS)]
    want = oracle(start, summed)
    for v, w in zip(variables, want):
        copies = [c.numpy() for c in v.values]
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1], err_msg="the copies drifted apart")
        np.testing.assert_allclose(copies[0], w, rtol=2e-5, atol=2e-6)
    assert int(optimizer.iterations) == STEPS, "one step per apply_gradients, not one per replica"


def test_a_pair_that_is_not_a_variable_is_refused(devices, rng):
    devices(cpus=1)
    optimizer = tf.keras.optimizers.SGD(LR)
    g = tf.constant(rng.standard_normal(3).astype(np.float32))
    with pytest.raises(TypeError, match=r"\(gradient, variable\) pairs"):
        optimizer.apply_gradients([(g, np.zeros(3, np.float32))])
    assert int(optimizer.iterations) == 0


@pytest.mark.parametrize("bad", [(5,), (10,), (5, 2)], ids=["broadcasts", "same-size", "transposed"])
@pytest.mark.parametrize("where", ["no strategy", "2 replicas"])
def test_a_gradient_of_another_shape_is_refused_before_anything_changes(devices, rng, bad, where):
    # (5,) for a (2, 5) variable would broadcast in NumPy; (10,) and (5, 2) have its size and
    # would pass a flat kernel: all three updated the variable silently wrong before.
    devices(cpus=2)
    start = random_start(rng)
    strategy = (tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]) if where == "2 replicas"
                else tf.distribute.get_strategy())
    with strategy.scope():
        variables = [tf.Variable(w) for w in start]
        optimizer = tf.keras.optimizers.Adam(LR)
    grads = [rng.standard_normal(SHAPES[0]).astype(np.float32), rng.standard_normal(bad).astype(np.float32)]

    def apply():
        optimizer.apply_gradients(zip([tf.constant(g) for g in grads], variables))

    with pytest.raises(ValueError, match=rf"has shape \({bad[0]},.*the variable \(2, 5\)"):
        strategy.run(apply) if where == "2 replicas" else apply()
    for v, w in zip(variables, start):
        for copy in getattr(v, "values", (v,)):
            np.testing.assert_array_equal(copy.numpy(), w, err_msg="a refused update changed a variable")
    assert int(optimizer.iterations) == 0


def test_none_gradients_are_left_out_as_keras_does(devices, rng):
    # Keras: a variable with no gradient is skipped with a warning; all None is an error;
    # an empty list is a no-op that does not count a step.
    devices(cpus=1)
    start = random_start(rng)
    variables = [tf.Variable(w) for w in start]
    optimizer = tf.keras.optimizers.SGD(LR)
    g = rng.standard_normal(SHAPES[0]).astype(np.float32)
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        optimizer.apply_gradients([(tf.constant(g), variables[0]), (None, variables[1])])
    np.testing.assert_allclose(variables[0].numpy(), start[0].astype(np.float64) - LR * g, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(variables[1].numpy(), start[1])
    assert int(optimizer.iterations) == 1
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        optimizer.apply_gradients([(None, v) for v in variables])
    optimizer.apply_gradients([])
    assert int(optimizer.iterations) == 1
    np.testing.assert_array_equal(variables[1].numpy(), start[1])


def test_a_step_that_fails_making_slots_changes_no_copy(devices, rng, monkeypatch):
    # Out of memory for the second copy's Adam slots: every copy's slots are made before the
    # first update, so no copy was updated and the step is not counted (the copies would
    # otherwise differ: the first updated, the second not).
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    start = random_start(rng)
    with strategy.scope():
        variables = [tf.Variable(w) for w in start]
        optimizer = tf.keras.optimizers.Adam(LR)
    made = []
    real = type(optimizer)._slot_buffers

    def slots_until_the_second(self, key, dev, like):
        if len(made) == 1 and key not in made:
            raise tf.errors.ResourceExhaustedError("OOM making slots (the test's)")
        if key not in made:
            made.append(key)
        return real(self, key, dev, like)

    monkeypatch.setattr(type(optimizer), "_slot_buffers", slots_until_the_second)
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    with pytest.raises(tf.errors.ResourceExhaustedError):
        strategy.run(lambda: optimizer.apply_gradients(zip([tf.constant(g) for g in grads], variables)))
    for v, w in zip(variables, start):
        for copy in v.values:
            np.testing.assert_array_equal(copy.numpy(), w, err_msg="a copy was updated by a failed step")
    assert int(optimizer.iterations) == 0
    monkeypatch.undo()
    strategy.run(lambda: optimizer.apply_gradients(zip([tf.constant(g) for g in grads], variables)))
    assert int(optimizer.iterations) == 1
    for v in variables:
        np.testing.assert_array_equal(v.values[0].numpy(), v.values[1].numpy())
