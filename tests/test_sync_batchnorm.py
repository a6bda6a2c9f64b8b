"""``BatchNormalization(synchronized=True)`` across replicas, and the differentiable all-reduce
under it (``ReplicaContext.all_reduce`` in ``mirrored/strategy.py``; the layer in
``mirrored/keras/normalization.py``; fit's replica threads in ``mirrored/keras/custom_step.py``).

Done means (issue 49): 2 replicas with ``synchronized=True`` compute what 1 replica computes on
the global batch. So the tests run logical CPUs (2, and 3; two simulated GPUs once) on UNEVEN
global batches (7 rows: 4 + 3, so a mean of the replicas' means would show; 3 + 3 + 1; a last
batch of 1 row, 1 + 0) and compare with a float64 NumPy oracle of Keras 3's math on the whole
batch: outputs, moving statistics, d loss / d input, trained weights (float32 tolerance: our
sums are float32, and the synchronized variance is Keras's E[x**2] - E[x]**2). The replicas'
copies are compared bitwise: the ring hands every replica the same sums.

    python -m pytest -n 0 -q tests/test_sync_batchnorm.py
"""
import time

import numpy as np
import pytest

import mirrored as tf
from mirrored import keras
from mirrored.values import PerReplica, components
from oracles import numeric_grad

TOL = dict(rtol=1e-3, atol=1e-4)        # float32 sums (E[x**2] - E[x]**2) against float64
EPS, MOMENTUM, LR = 1e-3, 0.8, 0.1
TWO = ["CPU:0", "CPU:1"]


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print("seed", seed)
    return np.random.default_rng(seed)


# --- float64 oracles of Keras 3's math on the global batch -----------------------------------------
def forward(params, x, shares=1):
    """Dense(Flatten(BN(x))) in training (six params: a Dense before the BN too): the output and
    the batch's mean and variance per channel. ``shares`` > 1: each replica's rows (TF's ceil(B/N)
    split) normalized by their own statistics, and the statistics the replicas' MEAN
    (synchronized=False under MirroredStrategy)."""
    if len(params) == 6:
        x = x @ params[0] + params[1]
    gamma, beta, kernel, bias = params[-4:]
    k = -(-len(x) // shares)
    outs, means, variances = [], [], []
    for r in range(shares):
        xr = x[r * k:(r + 1) * k]
        axes = tuple(range(xr.ndim - 1))
        mean, var = xr.mean(axes), xr.var(axes)
        y = (xr - mean) / np.sqrt(var + EPS) * gamma + beta
        outs.append(y.reshape(len(xr), -1) @ kernel + bias)
        means.append(mean)
        variances.append(var)
    return np.concatenate(outs), np.mean(means, 0), np.mean(variances, 0)


def loss(params, x, t):
    """Keras's MSE over the global batch (each replica's share / B, summed by the all-reduce)."""
    return ((forward(params, x)[0] - t) ** 2).mean(-1).mean()


def sgd_step(params, x, t):
    """One SGD step of the global batch's loss: the new params, the batch's mean and variance."""
    grads = []
    for i, p in enumerate(params):
        def f(q, i=i):
            trial = list(params)
            trial[i] = q
            return loss(trial, x, t)
        grads.append(numeric_grad(f, p))
    _, mean, var = forward(params, x)
    return [p - LR * g for p, g in zip(params, grads)], mean, var


def keras_tracked(per_example):
    """What Keras's loss tracker reports for a batch of 7 on 2 replicas (4 + 3 rows): each replica's
    mean loss weighed by its rows, summed over the replicas (the tracker's sync-on-read total and
    count): the batch's mean loss, exactly, however uneven the shares."""
    means = [per_example[:4].mean(), per_example[4:].mean()]
    return (means[0] * 4 + means[1] * 3) / 7


def make_model(shape, synchronized=True, dense_first=False):
    """BN -> Flatten -> Dense(2); ``dense_first``: a Dense(4) before the BN, whose gradient then
    comes through the BN's backward (its all-reduce)."""
    first = [keras.layers.Dense(4)] if dense_first else []
    return keras.Sequential([keras.Input(shape)] + first + [keras.layers.BatchNormalization(
        synchronized=synchronized, momentum=MOMENTUM, epsilon=EPS), keras.layers.Flatten(), keras.layers.Dense(2)])


def unpack(model):
    """float64 (params for the oracle, moving mean, moving variance) of Keras's weight order."""
    w = [a.astype(np.float64) for a in model.get_weights()]      # [k0, b0,] gamma, beta, mm, mv, kernel, bias
    return w[:-4] + w[-2:], w[-4], w[-3]


def assert_copies_equal(model):
    for v in model.weights:
        copies = [c.numpy() for c in components(v)]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), f"{v.name}: the replicas differ"


def global_batches(rng, shape, steps=2, b=7, n=2):
    x = rng.normal(1.0, 2.0, size=(steps, b) + shape).astype(np.float32)
    x[:, :-(-b // n)] += 10.0                     # replica 0's share (ceil(B/N) rows) far from the others' shares
    return x, rng.normal(size=(steps, b, 2)).astype(np.float32)


def shares(a, n=2):
    """TF's rebatching split of a global batch: ceil(B/N) rows per replica, in order."""
    k = -(-len(a) // n)
    return PerReplica([a[r * k:(r + 1) * k] for r in range(n)])


# --- the all-reduce under a tape ----------------------------------------------------------------------
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_the_gradient_of_an_all_reduce_is_the_all_reduce_of_the_gradients(devices, rng, op):
    """TF's rule: replica r's loss is sum(w_r * all_reduce(x_r**2, y_r)); the sum of every replica's
    loss has d/d x_r = 2 x_r * sum_r' w_r' (SUM; / N for MEAN), which replica r's tape gives when
    the backward all-reduces the upstream gradients. A nested value goes through too."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(TWO)
    x, y, w = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3))

    def step(xr, yr, wr):
        xr, yr, wr = tf.constant(xr), tf.constant(yr), tf.constant(wr)
        with tf.GradientTape() as tape:
            tape.watch([xr, yr])
            a, b = tf.distribute.get_replica_context().all_reduce(op, (xr * xr, yr))
            out = tf.reduce_sum(a * wr) + tf.reduce_sum(b * wr)
        return (a,) + tuple(tape.gradient(out, [xr, yr]))

    got = strategy.run(step, args=(PerReplica(list(x)), PerReplica(list(y)), PerReplica(list(w))))
    scale = 1.0 if op == "sum" else 0.5
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    for r in range(2):
        np.testing.assert_allclose(got[0].values[r].numpy(), (x64 ** 2).sum(0) * scale, rtol=1e-6)
        np.testing.assert_allclose(got[1].values[r].numpy(), 2 * x64[r] * w64.sum(0) * scale, rtol=1e-5)
        np.testing.assert_allclose(got[2].values[r].numpy(), w64.sum(0) * scale, rtol=1e-6)
    assert np.array_equal(got[0].values[0].numpy(), got[0].values[1].numpy())    # the ring's bits


def test_a_replica_that_raises_before_the_backward_all_reduce_releases_the_other(devices):
    """Replica 0 waits in its backward's all-reduce for replica 1, which raises instead: replica 0
    is released at once and the caller gets replica 1's error (not a wait of MERGE_TIMEOUT_S)."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(TWO)

    def step():
        ctx = tf.distribute.get_replica_context()
        x = tf.constant([1.0, 2.0])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ctx.all_reduce("sum", x * x)
        if ctx.local_replica_id == 1:
            raise ValueError("replica 1 fails between forward and backward")
        return tape.gradient(y, x)

    start = time.monotonic()
    with pytest.raises(ValueError, match="replica 1 fails"):
        strategy.run(step)
    assert time.monotonic() - start < 30


def outputs_and_dx(model, xr, tr, global_batch, optimizer=None):
    """One replica's share of a custom-loop step (``strategy.run``'s function): the model's
    outputs and d loss / d x for the mean squared error over ``global_batch`` examples
    (``tf.nn.compute_average_loss``); with ``optimizer``, the weights' gradients applied too."""
    xr, tr = tf.constant(xr), tf.constant(tr)
    with tf.GradientTape() as tape:
        tape.watch(xr)
        out = model(xr, training=True)
        per_example = tf.reduce_mean(tf.square(out - tr), axis=-1)
        loss_r = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
    weights = model.trainable_variables if optimizer is not None else []
    grads = tape.gradient(loss_r, [xr] + weights)
    if optimizer is not None:
        optimizer.apply_gradients(zip(grads[1:], weights))
    return out, tf.identity(grads[0])


# --- the layer: a custom loop, fit, evaluate ---------------------------------------------------------
@pytest.mark.parametrize("shape, n", [((3,), 2), ((2, 2, 3), 2), ((3,), 3)])
def test_replicas_in_a_custom_loop_compute_one_replica_on_the_global_batch(devices, rng, shape, n):
    """strategy.run(step) with a GradientTape (7 rows: 4 + 3 on 2 replicas, 3 + 3 + 1 on 3, where
    the ring adds in a different order per chunk): each replica's outputs are the rows of the global
    batch's forward, its d loss / d x the rows of the global loss's gradient (through the
    all-reduced statistics), and after apply_gradients the weights and moving statistics are one
    replica's SGD on the global batch, step after step."""
    devices(cpus=n)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    with strategy.scope():
        keras.utils.set_random_seed(int(rng.integers(1 << 30)))
        model = make_model(shape)
        optimizer = keras.optimizers.SGD(LR)
    x, t = global_batches(rng, shape, n=n)
    b = x.shape[1]
    params, mm, mv = unpack(model)

    def step(xr, tr):
        return outputs_and_dx(model, xr, tr, b, optimizer)

    for s in range(len(x)):
        out, dx = strategy.run(step, args=(shares(x[s], n), shares(t[s], n)))
        xs, ts = x[s].astype(np.float64), t[s].astype(np.float64)
        want_dx = numeric_grad(lambda q: loss(params, q, ts), xs)
        np.testing.assert_allclose(np.concatenate([v.numpy() for v in out.values]), forward(params, xs)[0], **TOL)
        np.testing.assert_allclose(np.concatenate([v.numpy() for v in dx.values]), want_dx, rtol=1e-3, atol=1e-5)
        params, mean, var = sgd_step(params, xs, ts)
        mm, mv = MOMENTUM * mm + (1 - MOMENTUM) * mean, MOMENTUM * mv + (1 - MOMENTUM) * var
        got, got_mm, got_mv = unpack(model)
        for g, want in zip(got + [got_mm, got_mv], params + [mm, mv]):
            np.testing.assert_allclose(g, want, **TOL)
        assert_copies_equal(model)


def test_fit_and_evaluate_on_two_replicas_are_one_replica_on_the_global_batch(devices, rng):
    """fit (Keras's train_step, a replica thread per device: the model has a cross_replica layer)
    of Dense -> BN -> Dense on 2 batches of 7 rows (4 + 3): the weights (the first Dense's through
    the BN's backward all-reduce) and moving statistics of float64 SGD on the global
    batches; the epoch's loss Keras's (the batches' losses weighed by their rows); evaluate with
    the moving statistics; the copies bitwise equal."""
    devices(cpus=2)
    with tf.distribute.MirroredStrategy(TWO).scope():
        keras.utils.set_random_seed(int(rng.integers(1 << 30)))
        model = make_model((3,), dense_first=True)
        model.compile(keras.optimizers.SGD(LR), "mse")
    assert model.layers[1].cross_replica
    x, t = global_batches(rng, (3,))
    params, mm, mv = unpack(model)
    tracked = []
    for s in range(len(x)):
        tracked.append(keras_tracked(((forward(params, x[s].astype(np.float64))[0] - t[s]) ** 2).mean(-1)))
        params, mean, var = sgd_step(params, x[s].astype(np.float64), t[s].astype(np.float64))
        mm, mv = MOMENTUM * mm + (1 - MOMENTUM) * mean, MOMENTUM * mv + (1 - MOMENTUM) * var
    history = model.fit(x.reshape(-1, 3), t.reshape(-1, 2), batch_size=7, epochs=1, shuffle=False, verbose=0)
    got, got_mm, got_mv = unpack(model)
    for g, want in zip(got + [got_mm, got_mv], params + [mm, mv]):
        np.testing.assert_allclose(g, want, **TOL)
    np.testing.assert_allclose(history.history["loss"], [np.mean(tracked)], **TOL)
    assert_copies_equal(model)
    xe, te = x[0].astype(np.float64), t[0].astype(np.float64)
    k0, b0, gamma, beta, kernel, bias = params
    inferred = ((xe @ k0 + b0 - mm) / np.sqrt(mv + EPS) * gamma + beta) @ kernel + bias
    score = model.evaluate(x[0], t[0], batch_size=7, verbose=0)
    np.testing.assert_allclose(score, keras_tracked(((inferred - te) ** 2).mean(-1)), **TOL)


def test_unsynchronized_replicas_keep_their_own_statistics(devices, rng):
    """The contrast (TensorFlow's default): with synchronized=False each replica normalizes by
    its own rows' statistics and the moving statistics are the MEAN of the replicas' updates
    (ON_READ / MEAN variables), which misses the spread between the replicas' means; with
    synchronized=True they are the global batch's. The same data, one step each."""
    devices(cpus=2)
    x, t = global_batches(rng, (3,), steps=1)
    xs = x[0].astype(np.float64)
    variances = {}
    for synchronized in (False, True):
        with tf.distribute.MirroredStrategy(TWO).scope():
            model = make_model((3,), synchronized)
            model.compile(keras.optimizers.SGD(0.0), "mse")      # no update: the statistics alone
        params, _, _ = unpack(model)
        out, mean, var = forward(params, xs, shares=1 if synchronized else 2)
        model.fit(x[0], t[0], batch_size=7, epochs=1, shuffle=False, verbose=0)
        _, mm, mv = unpack(model)
        np.testing.assert_allclose(mm, (1 - MOMENTUM) * mean, **TOL)
        np.testing.assert_allclose(mv, MOMENTUM + (1 - MOMENTUM) * var, **TOL)
        assert_copies_equal(model)
        variances[synchronized] = mv
    assert np.all(variances[True] > variances[False] + 1.0)      # the shift of 10 between the shares


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_a_replica_with_no_rows_still_meets_the_others(devices, rng, loop):
    """9 rows in batches of 4: the last batch is 1 row, so replica 1 gets none (TF's split). Its
    synchronized layer still runs on 0 rows, forward and backward, adding zeros to the all-reduces
    the other replica waits in (the program skips an empty replica's layers otherwise). fit
    (Keras's train_step: the fused loss path of the tape) and a custom loop (a loss of ops) both
    train as float64 SGD of one replica on the global batches, Dense -> BN -> Dense."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(TWO)
    with strategy.scope():
        keras.utils.set_random_seed(int(rng.integers(1 << 30)))
        model = make_model((3,), dense_first=True)
        model.compile(keras.optimizers.SGD(LR), "mse")
    x = rng.normal(size=(9, 3)).astype(np.float32)
    t = rng.normal(size=(9, 2)).astype(np.float32)
    params, mm, mv = unpack(model)
    for lo in range(0, 9, 4):
        xs, ts = x[lo:lo + 4].astype(np.float64), t[lo:lo + 4].astype(np.float64)
        params, mean, var = sgd_step(params, xs, ts)
        mm, mv = MOMENTUM * mm + (1 - MOMENTUM) * mean, MOMENTUM * mv + (1 - MOMENTUM) * var
    if loop == "fit":
        model.fit(x, t, batch_size=4, epochs=1, shuffle=False, verbose=0)
    else:
        def step(xr, tr):
            with tf.GradientTape() as tape:
                out = model(xr, training=True)
                loss_r = tf.nn.compute_average_loss(tf.reduce_mean(tf.square(out - tr), axis=-1),
                                                    global_batch_size=rows[0])
            grads = tape.gradient(loss_r, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

        rows = [0]                                    # this step's global batch
        for lo in range(0, 9, 4):
            rows[0] = min(4, 9 - lo)
            strategy.run(step, args=(shares(x[lo:lo + 4]), shares(t[lo:lo + 4])))
    got, got_mm, got_mv = unpack(model)
    for g, want in zip(got + [got_mm, got_mv], params + [mm, mv]):
        np.testing.assert_allclose(g, want, **TOL)
    assert_copies_equal(model)


def test_one_replica_is_the_unsynchronized_math_and_the_config_round_trips(devices, rng):
    """On one replica synchronized=True changes nothing (the same bits as synchronized=False);
    get_config keeps ``synchronized`` and from_config gives it back."""
    devices(cpus=1)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    outs = []
    for synchronized in (False, True):
        with tf.distribute.MirroredStrategy(["CPU:0"]).scope():
            layer = keras.layers.BatchNormalization(synchronized=synchronized)

            def step(xr):
                return layer(tf.constant(xr), training=True)
            outs.append(tf.distribute.get_strategy().run(step, args=(x,)).numpy())
    assert np.array_equal(outs[0], outs[1])
    config = keras.layers.BatchNormalization(synchronized=True, momentum=0.9).get_config()
    assert config["synchronized"] is True
    again = keras.layers.BatchNormalization.from_config(config)
    assert again.synchronized and again.cross_replica and again.momentum == 0.9
    assert not keras.layers.BatchNormalization().cross_replica


def test_a_traced_custom_loop_replays_the_same_bits(devices, rng):
    """The custom loop's step as a ``@tf.function``: traced once (the replicas join the trace,
    the all-reduces included, in the order they ran), then replayed: the weights and moving
    statistics are the eager loop's, bit for bit, and the Python ran only while tracing."""
    devices(cpus=2)
    x, t = global_batches(rng, (3,), steps=3, b=8)
    results, ran = [], []
    for traced in (False, True):
        strategy = tf.distribute.MirroredStrategy(TWO)
        with strategy.scope():
            keras.utils.set_random_seed(7)
            model = make_model((3,), dense_first=True)
            optimizer = keras.optimizers.SGD(LR)

        def step(xr, tr):
            ran.append(traced)
            with tf.GradientTape() as tape:
                out = model(xr, training=True)
                loss_r = tf.nn.compute_average_loss(tf.reduce_mean(tf.square(out - tr), axis=-1),
                                                    global_batch_size=8)
            grads = tape.gradient(loss_r, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        def train(xb, tb):
            strategy.run(step, args=(xb, tb))
        if traced:
            train = tf.function(train)
        data = tf.data.Dataset.from_tensor_slices((x.reshape(-1, 3), t.reshape(-1, 2))).batch(8)
        for xb, tb in strategy.experimental_distribute_dataset(data):
            train(xb, tb)
        assert_copies_equal(model)
        results.append(model.get_weights())
    assert ran.count(False) == 3 * 2 and ran.count(True) == 2       # eager: every step; traced: once
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_on_two_simulated_gpus(devices, rng):
    """The CUDA path (Numba's simulator; tiny shapes): the statistics' all-reduce and its
    gradient's go through the ring between two GPU devices inside the replicas' forward and
    backward; outputs, d loss / d x and the moving statistics are one device's on the global batch
    (5 rows: 3 + 2), the copies bitwise equal."""
    devices(cpus=1, gpus=2)
    strategy = tf.distribute.MirroredStrategy(["GPU:0", "GPU:1"])
    with strategy.scope():
        model = make_model((2,))
    x, t = global_batches(rng, (2,), steps=1, b=5)
    params, mm, mv = unpack(model)

    def step(xr, tr):
        return outputs_and_dx(model, xr, tr, 5)

    out, dx = strategy.run(step, args=(shares(x[0]), shares(t[0])))
    xs, ts = x[0].astype(np.float64), t[0].astype(np.float64)
    want, mean, var = forward(params, xs)
    np.testing.assert_allclose(np.concatenate([v.numpy() for v in out.values]), want, **TOL)
    np.testing.assert_allclose(np.concatenate([v.numpy() for v in dx.values]),
                               numeric_grad(lambda q: loss(params, q, ts), xs), rtol=1e-3, atol=1e-5)
    _, got_mm, got_mv = unpack(model)
    np.testing.assert_allclose(got_mm, MOMENTUM * mm + (1 - MOMENTUM) * mean, **TOL)
    np.testing.assert_allclose(got_mv, MOMENTUM * mv + (1 - MOMENTUM) * var, **TOL)
    assert_copies_equal(model)


def test_a_classifier_reports_accuracy_and_saves_synchronized(devices, rng, tmp_path):
    """The common case: Conv2D -> BN(synchronized) -> Dense, compiled with metrics=["accuracy"]
    (kept on the host for Keras's train_step, not the fused step's kernel count): 2 replicas
    report the loss, accuracy and validation scores of 1 replica, train to its weights (SGD,
    float32 tolerance), and a saved .keras file loads with ``synchronized`` kept. Three epochs:
    the third trains after a validation pass that replayed the layer's recorded inference."""
    devices(cpus=2)
    x = rng.normal(size=(12, 4, 4, 1)).astype(np.float32)
    y = rng.integers(0, 3, 12)
    runs = []
    for devs in (["CPU:0"], TWO):
        with tf.distribute.MirroredStrategy(devs).scope():
            keras.utils.set_random_seed(5)
            model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3),
                                      keras.layers.BatchNormalization(synchronized=True), keras.layers.Flatten(),
                                      keras.layers.Dense(3)])
            model.compile(keras.optimizers.SGD(LR), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        history = model.fit(x, y, batch_size=6, epochs=3, validation_data=(x[:6], y[:6]), shuffle=False,
                            verbose=0).history
        assert sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"], history
        runs.append((history, model.get_weights()))
    (h1, w1), (h2, w2) = runs
    for key in h1:
        np.testing.assert_allclose(h2[key], h1[key], **TOL)
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, **TOL)
    assert_copies_equal(model)
    model.save(tmp_path / "sync.keras")
    loaded = keras.models.load_model(tmp_path / "sync.keras")
    assert loaded.layers[1].synchronized
    # one device against 2 replicas' rows (6 + 6): BLAS's bits may differ, so a float32 tolerance
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_sample_weights_on_two_replicas_are_one_replica_on_the_global_batch(devices, rng):
    """fit runs Keras's train_step for such a model, and that step takes sample weights (Keras 3's
    weighted loss): fit(sample_weight=...) on 2 synchronized replicas trains to the weights of
    1 replica on the same batches (the BN statistics are the global batch's either way, the
    weighted loss its share), and evaluate(sample_weight=...) gives the same score."""
    x = rng.normal(size=(14, 3)).astype(np.float32)
    t = rng.normal(size=(14, 2)).astype(np.float32)
    w = rng.uniform(0.1, 2.0, size=14).astype(np.float32)
    seed = int(rng.integers(1 << 30))
    results = []
    for names in (TWO, ["CPU:0"]):
        devices(cpus=len(names))
        with tf.distribute.MirroredStrategy(names).scope():
            keras.utils.set_random_seed(seed)
            model = make_model((3,), dense_first=True)
            model.compile(keras.optimizers.SGD(LR), "mse")
        history = model.fit(x, t, sample_weight=w, batch_size=7, epochs=1, shuffle=False, verbose=0)
        score = model.evaluate(x, t, sample_weight=w, batch_size=7, verbose=0)
        if len(names) == 2:
            assert_copies_equal(model)
        assert not np.isclose(score, model.evaluate(x, t, batch_size=7, verbose=0), rtol=1e-3)  # weights used
        results.append((history.history["loss"], score, model.get_weights()))
    (h2, s2, w2), (h1, s1, w1) = results
    np.testing.assert_allclose(h2, h1, **TOL)
    np.testing.assert_allclose(s2, s1, **TOL)
    for a, b in zip(w2, w1):
        np.testing.assert_allclose(a, b, **TOL)
