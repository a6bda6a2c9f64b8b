"""Issue 49: BatchNormalization, LayerNormalization, the pooling/upsampling layers, Embedding, and
``trainable = False``, each against a float64 NumPy oracle of Keras 3's math.

Equalities claimed: a layer's output and gradient match float64 within float32 tolerance (the
ops' float32 sums); replicas are bitwise equal (our own ring and kernels fix every order); a
frozen weight is bitwise unchanged (it is never written).

    python -m pytest -n 0 -q tests/test_layers_next.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.values import components
from oracles import numeric_grad

TOL = dict(rtol=2e-4, atol=2e-5)        # float32 ops against float64


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print("seed", seed)
    return np.random.default_rng(seed)


# --- float64 oracles of Keras 3's math ------------------------------------------------------------
def bn_ref(x, gamma, beta, mean=None, var=None, eps=1e-3):
    axes = tuple(range(x.ndim - 1))
    if mean is None:
        mean, var = x.mean(axes), ((x - x.mean(axes)) ** 2).mean(axes)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta, mean, var


def ln_ref(x, gamma, beta, eps=1e-3):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def avg_pool_ref(x, pool, strides, padding):
    n, h, w, c = x.shape
    (ph, pw), (sh, sw) = pool, strides
    if padding == "valid":
        oh, ow, top, left = (h - ph) // sh + 1, (w - pw) // sw + 1, 0, 0
    else:
        oh, ow = -(-h // sh), -(-w // sw)
        top, left = max((oh - 1) * sh + ph - h, 0) // 2, max((ow - 1) * sw + pw - w, 0) // 2
    out = np.zeros((n, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            r0, c0 = i * sh - top, j * sw - left
            win = x[:, max(r0, 0):min(r0 + ph, h), max(c0, 0):min(c0 + pw, w), :]   # real cells only
            out[:, i, j, :] = win.mean(axis=(1, 2))
    return out


LAYERS = [   # (make, float64 reference of y given x, input shape)
    (lambda L: L.GlobalAveragePooling2D(), lambda x: x.mean((1, 2)), (3, 5, 2)),
    (lambda L: L.GlobalMaxPooling2D(), lambda x: x.max((1, 2)), (3, 5, 2)),
    (lambda L: L.AveragePooling2D(), lambda x: avg_pool_ref(x, (2, 2), (2, 2), "valid"), (5, 4, 2)),
    (lambda L: L.AveragePooling2D((3, 2), (2, 1), "valid"),
     lambda x: avg_pool_ref(x, (3, 2), (2, 1), "valid"), (7, 3, 2)),
    (lambda L: L.AveragePooling2D(3, 2, padding="same"),
     lambda x: avg_pool_ref(x, (3, 3), (2, 2), "same"), (5, 6, 1)),
    (lambda L: L.UpSampling2D((2, 3)), lambda x: x.repeat(2, axis=1).repeat(3, axis=2), (3, 2, 2)),
    (lambda L: L.LayerNormalization(), lambda x: ln_ref(x, 1.0, 0.0), (3, 5)),
    (lambda L: L.BatchNormalization(), lambda x: bn_ref(x, 1.0, 0.0)[0], (3, 4)),
]


@pytest.mark.parametrize("case", range(len(LAYERS)))
def test_forward_and_input_gradient_against_float64(devices, rng, case):
    devices(cpus=1)
    make, ref, shape = LAYERS[case]
    layer = make(tf.keras.layers)
    x = rng.normal(size=(3,) + shape)                         # a batch of 3: awkward sizes
    with tf.device("CPU:0"):
        xt = tf.constant(x.astype(np.float32))
        w = ref(x)                                            # random weights for a scalar loss
        v = rng.normal(size=w.shape)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt, training=True)
            loss = tf.reduce_sum(y * tf.constant(v.astype(np.float32)))
        dx = tape.gradient(loss, xt)
    np.testing.assert_allclose(y.numpy(), ref(x.astype(np.float32).astype(np.float64)), **TOL)
    want = numeric_grad(lambda z: float((ref(z) * v).sum()), x.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(dx.numpy(), want, rtol=1e-3, atol=1e-4)


def test_batch_normalization_moving_statistics_and_inference(devices, rng):
    devices(cpus=1)
    x = rng.normal(2.0, 3.0, size=(6, 2, 3))
    with tf.device("CPU:0"):
        bn = tf.keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-2)
        bn(x.astype(np.float32), training=True)
        _, mean, var = bn_ref(x, 1, 0)
        np.testing.assert_allclose(bn.moving_mean.numpy(), 0.1 * mean, **TOL)
        np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 + 0.1 * var, **TOL)
        y = bn(x.astype(np.float32))                            # inference: the moving statistics
        want, _, _ = bn_ref(x, 1, 0, 0.1 * mean, 0.9 + 0.1 * var, eps=1e-2)
        np.testing.assert_allclose(y.numpy(), want, **TOL)
        bn.trainable = False                                    # Keras 3: frozen BN runs in inference mode
        before = bn.moving_mean.numpy().copy()
        np.testing.assert_allclose(bn(x.astype(np.float32), training=True).numpy(), want, **TOL)
        assert np.array_equal(bn.moving_mean.numpy(), before)
    assert [w.name.split("/")[-1] for w in bn.weights] == ["gamma:0", "beta:0", "moving_mean:0", "moving_variance:0"]


def test_embedding_forward_and_gradient(devices, rng):
    devices(cpus=1)
    ids = rng.integers(0, 7, size=(4, 3))
    with tf.device("CPU:0"):
        emb = tf.keras.layers.Embedding(7, 5)
        v = rng.normal(size=(4, 3, 5)).astype(np.float32)
        with tf.GradientTape() as tape:
            y = emb(ids)                                        # built on its first call
            loss = tf.reduce_sum(y * tf.constant(v))
        g = tape.gradient(loss, emb.embeddings)
        table = emb.embeddings.numpy().astype(np.float64)
        assert np.abs(table).max() <= 0.05                      # Keras's 'uniform': U(-0.05, 0.05)
    np.testing.assert_array_equal(y.numpy(), table[ids].astype(np.float32))
    want = np.zeros((7, 5))
    np.add.at(want, ids, v.astype(np.float64))
    np.testing.assert_allclose(g.numpy(), want, **TOL)


# --- in fit: SGD steps against a float64 oracle, 1 and 2 replicas ---------------------------------
def bn_model_loss(params, x, t, replicas):
    """Keras's MSE of Dense(Flatten(BN(x))) with each replica's BN on its own rows (TF's
    ceil(B/N) split), and the replicas' moving-statistic updates' mean."""
    gamma, beta, kernel, bias = params
    k = -(-len(x) // replicas)
    total, means, vars_ = 0.0, [], []
    for r in range(replicas):
        xr, tr = x[r * k:(r + 1) * k], t[r * k:(r + 1) * k]
        y, mean, var = bn_ref(xr, gamma, beta)
        out = y.reshape(len(xr), -1) @ kernel + bias
        total += ((out - tr) ** 2).mean(-1).sum()
        means.append(mean)
        vars_.append(var)
    return total / len(x), np.mean(means, 0), np.mean(vars_, 0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_batch_normalization_in_fit_against_float64_sgd(devices, rng, replicas):
    devices(cpus=replicas)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3, 4)), tf.keras.layers.BatchNormalization(momentum=0.8),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    x = rng.normal(1.0, 2.0, size=(3, 8, 3, 4)).astype(np.float32)
    t = rng.normal(size=(3, 8, 2)).astype(np.float32)
    w = [a.astype(np.float64) for a in model.get_weights()]     # gamma, beta, mm, mv, kernel, bias
    params, mm, mv = [w[0], w[1], w[4], w[5]], w[2], w[3]
    for step in range(3):
        model.train_step(x[step], t[step])
        xs, ts = x[step].astype(np.float64), t[step].astype(np.float64)
        _, mean, var = bn_model_loss(params, xs, ts, replicas)
        grads = []
        for i, p in enumerate(params):
            def f(q, i=i):
                trial = list(params)
                trial[i] = q
                return bn_model_loss(trial, xs, ts, replicas)[0]
            grads.append(numeric_grad(f, p))
        params = [p - 0.1 * g for p, g in zip(params, grads)]
        mm, mv = 0.8 * mm + 0.2 * mean, 0.8 * mv + 0.2 * var
    got = model.get_weights()
    for g, want in zip(got, [params[0], params[1], mm, mv, params[2], params[3]]):
        np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-4)
    for v in model.weights:                                      # the replicas' copies: the same bits
        copies = [c.numpy() for c in components(v)]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), v.name
    np.testing.assert_allclose(model.predict(x[0], verbose=0),    # inference: the moving statistics
                               (bn_ref(x[0].astype(np.float64), params[0], params[1], mm, mv)[0]
                                .reshape(8, -1) @ params[2] + params[3]), rtol=1e-3, atol=1e-4)


def test_synchronized_batch_normalization_outside_strategy_run_is_refused(devices, rng):
    """The fused step runs the replicas one after another in one thread, where no all-reduce can
    meet: synchronized=True in training there is refused, and nothing changes
    (tests/test_sync_batchnorm.py: inside strategy.run and in fit it works)."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.BatchNormalization(synchronized=True),
                                     tf.keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match=r"synchronized=True\).*outside strategy.run"):
        model.train_step(rng.normal(size=(4, 3)).astype(np.float32), np.zeros((4, 2), np.float32))
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_embedding_model_trains_on_integer_tokens(devices, rng):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Embedding(6, 2),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.5),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = rng.integers(0, 6, size=(5, 3))                        # int64 tokens, 5 rows over 2 replicas
    labels = rng.integers(0, 3, size=5)
    table, kernel, bias = [a.astype(np.float64) for a in model.get_weights()]
    model.train_step(ids, labels)
    h = table[ids].reshape(5, -1)
    logits = h @ kernel + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dlogits = (p - np.eye(3)[labels]) / 5
    dh = (dlogits @ kernel.T).reshape(5, 3, 2)
    dtable = np.zeros_like(table)
    np.add.at(dtable, ids, dh)
    want = [table - 0.5 * dtable, kernel - 0.5 * h.T @ dlogits, bias - 0.5 * dlogits.sum(0)]
    for g, w in zip(model.get_weights(), want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# --- trainable = False ----------------------------------------------------------------------------
def test_a_frozen_layer_does_not_change_in_fit_and_gets_no_slot(devices, rng):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(5, activation="relu"),
                                     tf.keras.layers.Dense(6, activation="relu"), tf.keras.layers.Dense(3)])
    model.layers[1].trainable = False                            # the middle one: its dx still flows
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.get_weights()
    model.fit(rng.normal(size=(9, 4)).astype(np.float32), rng.integers(0, 3, 9), batch_size=5, epochs=2,
              verbose=0)
    after = model.get_weights()
    changed = [not np.array_equal(a, b) for a, b in zip(before, after)]
    assert changed == [True, True, False, False, True, True]
    assert model.step.pack.total == 4 * 5 + 5 + 6 * 3 + 3         # the pack: trainable weights only
    assert len(model.optimizer.keras_variables(model.step.pack)) == 2 + 2 * 4   # iteration, lr, m and v of 4
    assert [v.name for v in model.non_trainable_weights] == [v.name for v in model.layers[1].weights]
    lines = []
    model.summary(print_fn=lines.append)
    assert "Total params: 82" in lines and "Trainable params: 46" in lines and "Non-trainable params: 36" in lines
    model.layers[1].trainable = True                             # Keras: compile again after a change
    with pytest.raises(RuntimeError, match="compile"):
        model.fit(np.zeros((2, 4), np.float32), np.zeros(2, int), verbose=0)
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model.step.pack.total == 82


def test_summary_counts_batch_normalization_as_keras(devices):
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(4),
                                 tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(2)])
    lines = []
    model.summary(print_fn=lines.append)
    # Keras: BN(4) has 16 params, 8 of them (moving mean and variance) non-trainable
    assert "Total params: 50" in lines and "Trainable params: 42" in lines and "Non-trainable params: 8" in lines
    assert len(model.get_weights()) == 8 and len(model.trainable_weights) == 6


# --- saving ---------------------------------------------------------------------------------------
def test_save_and_load_with_moving_statistics(devices, rng, tmp_path):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((6, 6, 2)), tf.keras.layers.Conv2D(3, 3), tf.keras.layers.BatchNormalization(),
            tf.keras.layers.AveragePooling2D(), tf.keras.layers.UpSampling2D(),
            tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.LayerNormalization(), tf.keras.layers.Dense(3)])
    model.layers[0].trainable = False
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(6, 6, 6, 2)).astype(np.float32)
    model.fit(x, rng.integers(0, 3, 6), batch_size=6, verbose=0)
    weights = model.get_weights()
    assert not np.array_equal(weights[4], np.zeros(3))          # the moving mean moved
    model.save_weights(str(tmp_path / "m.weights.h5"))
    model.save(str(tmp_path / "m.keras"))
    want = model.predict(x, verbose=0)
    with strategy.scope():
        loaded = tf.keras.models.load_model(str(tmp_path / "m.keras"))
    assert loaded.layers[0].trainable is False
    for a, b in zip(loaded.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    model.set_weights([np.zeros_like(w) for w in weights])
    model.load_weights(str(tmp_path / "m.weights.h5"))
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


def test_keras_reads_our_layout(devices, tmp_path):
    """The .weights.h5 groups hold each layer's weights in Keras 3's order (trainable first)."""
    h5py = pytest.importorskip("h5py")
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.BatchNormalization(),
                                 tf.keras.layers.Dense(2)])
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "r") as f:
        group = f["layers/batch_normalization/vars"]
        assert sorted(group) == ["0", "1", "2", "3"]
        np.testing.assert_array_equal(group["0"][()], np.ones(3))   # gamma
        np.testing.assert_array_equal(group["3"][()], np.ones(3))   # moving_variance


# --- a simulated GPU: the same layers through the CUDA kernels of the ops -------------------------
def test_batch_normalization_model_on_a_simulated_gpu(devices, rng):
    devs = devices(cpus=1, gpus=2)
    strategy = tf.distribute.MirroredStrategy(["GPU:0", "GPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((2, 2, 2)), tf.keras.layers.BatchNormalization(),
                                     tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    x = rng.normal(size=(4, 2, 2, 2)).astype(np.float32)
    t = rng.normal(size=(4, 2)).astype(np.float32)
    w = [a.astype(np.float64) for a in model.get_weights()]
    model.train_step(x, t)
    xs = x.astype(np.float64)

    def loss(params):
        total = 0.0
        for r in range(2):
            y, _, _ = bn_ref(xs[2 * r:2 * r + 2], params[0], params[1])
            total += ((y.mean((1, 2)) @ params[2] + params[3] - t[2 * r:2 * r + 2]) ** 2).mean(-1).sum()
        return total / 4
    params = [w[0], w[1], w[4], w[5]]
    grads = [numeric_grad(lambda q, i=i: loss(params[:i] + [q] + params[i + 1:]), p) for i, p in enumerate(params)]
    got = model.get_weights()
    for g, p, d in zip([got[0], got[1], got[4], got[5]], params, grads):
        np.testing.assert_allclose(g, p - 0.1 * d, rtol=1e-3, atol=1e-4)
    means = [bn_ref(xs[2 * r:2 * r + 2], 1, 0)[1] for r in range(2)]
    np.testing.assert_allclose(got[2], 0.01 * np.mean(means, 0), rtol=1e-3, atol=1e-6)
    assert len(devs) >= 2
