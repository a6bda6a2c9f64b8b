"""TensorFlow's ops (``mirrored/ops.py``) and the tape that differentiates them (``autodiff.py``).

Every op's forward is checked against a float64 NumPy oracle, and its gradient against
central finite differences of that oracle (the ops run in float64 here, so the difference
quotient is accurate to ~1e-7): an oracle independent of the gradient rules. Fresh random
inputs each run, awkward broadcast shapes, and one deliberately wrong oracle that must miss.
On a CPU device and on a simulated GPU (the same answers, dtypes and errors).

    python -m pytest -q tests/test_ops.py
"""
import warnings

import numpy as np
import pytest

import mirrored as tf
from mirrored.errors import InvalidArgumentError

DEVICES = ["CPU:0", "GPU:0"]


@pytest.fixture
def on(devices):
    """Place the test on a CPU device or a simulated GPU: returns a ``tf.device`` context."""
    def place(name):
        devices(cpus=1, gpus=1 if name.startswith("GPU") else 0)
        return tf.device(name)
    return place


@pytest.fixture
def cpu(devices):
    """The test's tensors on the CPU device (the default device is a GPU where one exists,
    the simulator's too, which runs a Python thread per element: too slow for many steps)."""
    with tf.device("CPU:0"):
        yield


def numeric_grad(f, arrays, k, eps=1e-6):
    """d sum(f(*arrays)) / d arrays[k] by central differences, float64."""
    x = arrays[k]
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        plus = [a.copy() for a in arrays]
        minus = [a.copy() for a in arrays]
        plus[k][i] += eps
        minus[k][i] -= eps
        g[i] = (np.sum(f(*plus)) - np.sum(f(*minus))) / (2 * eps)
    return g


def tape_grads(fn, arrays):
    """fn on float64 tensors of ``arrays`` under a tape: (value, [d sum(value) / d each])."""
    ts = [tf.constant(a) for a in arrays]
    with tf.GradientTape() as tape:
        tape.watch(ts)
        y = fn(*ts)
    return y, tape.gradient(y, ts)


BINARY = [
    ("add", lambda a, b: a + b, np.add),
    ("sub", lambda a, b: a - b, np.subtract),
    ("mul", lambda a, b: a * b, np.multiply),
    ("div", lambda a, b: a / b, np.divide),
    ("pow", lambda a, b: tf.pow(a, b), np.power),
    ("maximum", tf.maximum, np.maximum),
    ("minimum", tf.minimum, np.minimum),
    ("squared_difference", tf.math.squared_difference, lambda a, b: (a - b) ** 2),
]
SHAPES = [((3, 1, 5), (4, 1)), ((), (2, 3)), ((2, 3), (3,)), ((4, 1), (1, 4))]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name,op,ref", BINARY, ids=[b[0] for b in BINARY])
def test_binary_ops_broadcast_and_differentiate_like_float64_numpy(on, rng, dev, name, op, ref):
    with on(dev):
        for sa, sb in SHAPES:
            a = rng.uniform(0.5, 2.0, sa)
            b = rng.uniform(0.5, 2.0, sb)
            if name in ("maximum", "minimum"):
                b = b + 0.01 * (np.abs(b - np.broadcast_to(a, np.broadcast_shapes(sa, sb)).reshape(-1)[:b.size].reshape(sb)) < 1e-3)
            y, (ga, gb) = tape_grads(op, [a, b])
            np.testing.assert_allclose(y.numpy(), ref(a, b), rtol=1e-12)
            assert y.shape == np.broadcast_shapes(sa, sb) and y.dtype == np.float64
            np.testing.assert_allclose(ga.numpy(), numeric_grad(ref, [a, b], 0), rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(gb.numpy(), numeric_grad(ref, [a, b], 1), rtol=1e-5, atol=1e-7)
            assert ga.shape == sa and gb.shape == sb


UNARY = [
    ("abs", tf.abs, np.abs), ("exp", tf.exp, np.exp), ("log", tf.math.log, np.log),
    ("sqrt", tf.sqrt, np.sqrt), ("square", tf.square, np.square), ("tanh", tf.tanh, np.tanh),
    ("sigmoid", tf.sigmoid, lambda x: 1 / (1 + np.exp(-x))), ("sin", tf.sin, np.sin),
    ("relu", tf.nn.relu, lambda x: np.maximum(x, 0)),
    ("leaky_relu", tf.nn.leaky_relu, lambda x: np.where(x > 0, x, 0.2 * x)),
    ("softplus", tf.nn.softplus, lambda x: np.log1p(np.exp(x))),
    ("neg", lambda x: -x, np.negative),
    ("rsqrt", tf.math.rsqrt, lambda x: 1 / np.sqrt(x)),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name,op,ref", UNARY, ids=[u[0] for u in UNARY])
def test_unary_ops_and_their_gradients(on, rng, dev, name, op, ref):
    with on(dev):
        x = rng.uniform(0.2, 2.0, (3, 4)) * rng.choice([-1, 1], (3, 4))
        if name in ("log", "sqrt", "rsqrt"):
            x = np.abs(x)
        y, (g,) = tape_grads(op, [x])
        np.testing.assert_allclose(y.numpy(), ref(x), rtol=1e-12)
        np.testing.assert_allclose(g.numpy(), numeric_grad(ref, [x], 0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dev", DEVICES)
def test_reductions_with_axes_keepdims_and_ties(on, rng, dev):
    with on(dev):
        x = rng.normal(size=(3, 4, 5))
        for axis in (None, 0, 1, -1, [0, 2]):
            for keepdims in (False, True):
                for op, ref in ((tf.reduce_sum, np.sum), (tf.reduce_mean, np.mean), (tf.reduce_max, np.max),
                                (tf.reduce_min, np.min), (tf.reduce_prod, np.prod)):
                    ax = tuple(axis) if isinstance(axis, list) else axis
                    y, (g,) = tape_grads(lambda t: op(t, axis=axis, keepdims=keepdims), [x])
                    np.testing.assert_allclose(y.numpy(), ref(x, axis=ax, keepdims=keepdims), rtol=1e-12)
                    np.testing.assert_allclose(g.numpy(), numeric_grad(lambda a: ref(a, axis=ax, keepdims=keepdims), [x], 0),
                                               rtol=1e-5, atol=1e-7)
        ties = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])        # TF: the gradient is shared
        _, (g,) = tape_grads(lambda t: tf.reduce_max(t, axis=1), [ties])
        np.testing.assert_array_equal(g.numpy(), [[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
        np.testing.assert_array_equal(tf.argmax(ties, axis=1).numpy(), [1, 0])   # first of the ties
        assert tf.argmax(ties, axis=1).dtype == np.int64


@pytest.mark.parametrize("dev", DEVICES)
def test_matmul_shapes_slicing_joining(on, rng, dev):
    with on(dev):
        a, b = rng.normal(size=(3, 4)), rng.normal(size=(4, 2))
        for ta, tb in ((False, False), (True, False), (False, True), (True, True)):
            aa, bb = (a.T.copy() if ta else a), (b.T.copy() if tb else b)
            y, (ga, gb) = tape_grads(lambda x, w: tf.matmul(x, w, transpose_a=ta, transpose_b=tb), [aa, bb])
            ref = lambda x, w: (x.T if ta else x) @ (w.T if tb else w)   # noqa: E731
            np.testing.assert_allclose(y.numpy(), ref(aa, bb), rtol=1e-12)
            np.testing.assert_allclose(ga.numpy(), numeric_grad(ref, [aa, bb], 0), rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(gb.numpy(), numeric_grad(ref, [aa, bb], 1), rtol=1e-5, atol=1e-7)
        x = rng.normal(size=(2, 3, 4))
        cases = [
            (lambda t: t[:, 1], lambda v: v[:, 1]),
            (lambda t: t[..., ::-2], lambda v: v[..., ::-2]),
            (lambda t: t[1, tf.newaxis, 1:3], lambda v: v[1, None, 1:3]),
            (lambda t: tf.transpose(t, [2, 0, 1]), lambda v: np.transpose(v, [2, 0, 1])),
            (lambda t: tf.reshape(t, (4, -1)), lambda v: v.reshape(4, -1)),
            (lambda t: tf.concat([t, t * 2.0], axis=1), lambda v: np.concatenate([v, v * 2], axis=1)),
            (lambda t: tf.stack([t[0], t[1]], axis=2), lambda v: np.stack([v[0], v[1]], axis=2)),
            (lambda t: tf.broadcast_to(t[:, :1], (2, 3, 4)) * t, lambda v: np.broadcast_to(v[:, :1], (2, 3, 4)) * v),
            (lambda t: tf.expand_dims(t, 0)[0] - tf.squeeze(t[:, :1], 1)[:, None],
             lambda v: v - v[:, 0][:, None]),
            (lambda t: tf.nn.softmax(t), lambda v: np.exp(v) / np.exp(v).sum(-1, keepdims=True)),
            (lambda t: tf.nn.log_softmax(t, axis=1), lambda v: v - np.log(np.exp(v).sum(1, keepdims=True))),
        ]
        for fn, ref in cases:
            y, (g,) = tape_grads(fn, [x])
            np.testing.assert_allclose(y.numpy(), ref(x), rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(g.numpy(), numeric_grad(ref, [x], 0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dev", DEVICES)
def test_where_comparisons_one_hot_and_cross_entropies(on, rng, dev):
    with on(dev):
        x = rng.normal(size=(4, 3))
        y, (g,) = tape_grads(lambda t: tf.where(t > 0, t * t, -t), [x])
        ref = lambda v: np.where(v > 0, v * v, -v)   # noqa: E731
        np.testing.assert_allclose(y.numpy(), ref(x))
        np.testing.assert_allclose(g.numpy(), numeric_grad(ref, [x], 0), rtol=1e-5, atol=1e-7)
        t = tf.constant(x)
        for got, want in ((t > 0, x > 0), (t <= 0.1, x <= 0.1), (t == t, x == x), (t != 0.5, x != 0.5)):
            assert got.dtype == np.bool_
            np.testing.assert_array_equal(got.numpy(), want)
        labels = rng.integers(0, 3, 4)
        oh = tf.one_hot(labels, 3).numpy()
        np.testing.assert_array_equal(oh, np.eye(3, dtype=np.float32)[labels])
        logp = x - np.log(np.exp(x).sum(1, keepdims=True))
        np.testing.assert_allclose(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=t).numpy(),
            -logp[np.arange(4), labels], rtol=1e-12)
        z = rng.uniform(size=(4, 3))
        np.testing.assert_allclose(tf.nn.sigmoid_cross_entropy_with_logits(labels=z, logits=t).numpy(),
                                   np.maximum(x, 0) - x * z + np.log1p(np.exp(-np.abs(x))), rtol=1e-12)
        _, (g,) = tape_grads(lambda v: tf.nn.softmax_cross_entropy_with_logits(z, v), [x])
        sm = np.exp(x) / np.exp(x).sum(1, keepdims=True)
        want = sm * z.sum(1, keepdims=True) - z
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-10)
        assert not np.allclose(g.numpy(), sm - z.T.mean()), "a wrong oracle must miss"


def test_tensorflow_dtype_rules(cpu):
    f, i = tf.constant([1.5, 2.5]), tf.constant([3, 4])
    assert (f * 2).dtype == np.float32 and (i * 2).dtype == np.int32     # a number takes the dtype
    with pytest.raises(InvalidArgumentError, match="float32.*int32"):
        f + i
    with pytest.raises(TypeError, match="non-integer"):
        i * 0.5
    assert (i / tf.constant([2, 2])).dtype == np.float64              # TF's truediv of int32
    np.testing.assert_array_equal((tf.constant([-7, 7]) // 2).numpy(), [-4, 3])   # floor
    np.testing.assert_array_equal((tf.constant([-7, 7]) % 3).numpy(), [2, 1])     # floor mod
    m = tf.reduce_mean(tf.constant([[-3, -2], [7, 8]]), axis=1)                 # truncates toward 0
    assert m.dtype == np.int32 and m.numpy().tolist() == [-2, 7]
    with pytest.raises(InvalidArgumentError, match=r"\(2,\).*\(3,\)"):
        f + tf.constant([1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="unhashable"):
        {f: 1}
    assert {f.ref(): 1}[f.ref()] == 1
    v = tf.Variable([1.0, 2.0])                     # a variable's ref too (TF's Variable.ref())
    keys = {v.ref(): "v", f.ref(): "f"}
    assert keys[v.ref()] == "v" and v.ref().deref() is v and v.ref() != tf.Variable([1.0, 2.0]).ref()


def test_nested_tapes_give_second_derivatives(cpu, rng):
    for value in rng.uniform(-2, 2, 3):
        x = tf.Variable(value)
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                y = x ** 3
            dy = inner.gradient(y, x)
        d2y = outer.gradient(dy, x)
        np.testing.assert_allclose(dy.numpy(), 3 * np.float32(value) ** 2, rtol=1e-5)
        np.testing.assert_allclose(d2y.numpy(), 6 * np.float32(value), rtol=1e-5)
        # composed: f = sin(x) exp(x) + x^2 / 2;  f' = e^x (sin + cos) + x;  f'' = 2 e^x cos + 1
        x64 = tf.constant(value)
        with tf.GradientTape() as outer:
            outer.watch(x64)
            with tf.GradientTape() as inner:
                inner.watch(x64)
                f = tf.sin(x64) * tf.exp(x64) + x64 * x64 / 2.0
            df = inner.gradient(f, x64)
        d2f = outer.gradient(df, x64)
        np.testing.assert_allclose(df.numpy(), np.exp(value) * (np.sin(value) + np.cos(value)) + value, rtol=1e-12)
        np.testing.assert_allclose(d2f.numpy(), 2 * np.exp(value) * np.cos(value) + 1, rtol=1e-12)


def test_tape_rules_persistent_unconnected_integers_and_non_scalar_targets(cpu):
    x, w = tf.constant([1.0, 2.0]), tf.Variable([3.0, 4.0])
    unused = tf.Variable(1.0)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = x * w                                         # non-scalar: the gradient of its sum
        z = tf.reduce_sum(y * y)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), [3, 4])
    np.testing.assert_array_equal(tape.gradient(z, w).numpy(), 2 * np.array([3, 8.0]) * [1, 2])
    assert tape.gradient(z, unused) is None
    assert tape.gradient(z, unused, unconnected_gradients="zero").numpy() == 0.0
    g = tape.gradient(z, {"a": x, "b": w})
    assert set(g) == {"a", "b"}
    with tf.GradientTape() as t2:
        n = tf.Variable([1, 2])
        k = n * 2
    assert t2.gradient(k, n) is None                     # integers carry no gradient
    with tf.GradientTape() as t3:
        c = tf.constant(2.0)
        out = c * c
    assert t3.gradient(out, c) is None                   # a constant nobody watched
    with tf.GradientTape() as t4:
        t4.watch(x)
        with t4.stop_recording():
            s = x * 2.0
        v = x * 3.0
    assert t4.gradient(s, x) is None and t4.gradient is not None
    with pytest.raises(RuntimeError, match="persistent"):
        t4.gradient(v, x)


def test_linear_regression_with_two_variables_converges_like_float64_numpy(cpu, rng):
    """The course's custom-training week: y = W x + b fitted with a tape and a hand MSE."""
    xs = rng.normal(size=200).astype(np.float32)
    ys = (3.0 * xs + 2.0 + rng.normal(scale=0.1, size=200)).astype(np.float32)
    w0, b0, lr = 5.0, 0.0, 0.1
    W, b = tf.Variable(w0), tf.Variable(b0)
    ow, ob = float(w0), float(b0)
    for _ in range(30):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ys - (W * xs + b)))
        dW, db = tape.gradient(loss, [W, b])
        W.assign_sub(lr * dW)
        b.assign_sub(lr * db)
        err = ys.astype(np.float64) - (ow * xs + ob)
        ow, ob = ow - lr * np.mean(-2 * err * xs), ob - lr * np.mean(-2 * err)
    np.testing.assert_allclose([W.numpy(), b.numpy()], [ow, ob], rtol=1e-4)
    assert abs(W.numpy() - 3.0) < 0.1 and abs(b.numpy() - 2.0) < 0.1


def test_a_loss_written_in_ops_differentiates_a_model_through_its_fused_backward(cpu, rng):
    """model(x) is one node of the tape: its backward is the engine's."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
    x = rng.normal(size=(5, 4)).astype(np.float32)
    y = rng.normal(size=(5, 3)).astype(np.float32)
    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = tf.reduce_mean(tf.square(pred - y)) + 0.0 * tf.reduce_sum(pred)
    gk, gb = tape.gradient(loss, model.trainable_variables)
    k, bias = (v.astype(np.float64) for v in model.get_weights())
    err = x.astype(np.float64) @ k + bias - y
    np.testing.assert_allclose(gk.numpy(), x.T @ (2 * err / err.size), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gb.numpy(), (2 * err / err.size).sum(0), rtol=1e-4, atol=1e-6)


def test_a_traced_function_of_ops_alone_replays_without_falling_back(cpu, rng):
    w = tf.Variable(np.zeros(3, np.float32))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(x * w, axis=1) - y))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    xs = rng.normal(size=(4, 3)).astype(np.float32)
    ys = (xs @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
    want_w = np.zeros(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            loss = step(tf.constant(xs), tf.constant(ys))
            err = xs @ want_w - ys
            want_loss = np.mean(err ** 2)
            want_w = want_w - 0.1 * (2 * xs.T @ err / 4)
            np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-4, atol=1e-6)


def test_random_tensors_repeat_under_set_seed_and_differ_between_calls(cpu):
    tf.random.set_seed(7)
    a, b = tf.random.normal((1000,)).numpy(), tf.random.uniform((3, 4), -1, 1).numpy()
    tf.random.set_seed(7)
    np.testing.assert_array_equal(tf.random.normal((1000,)).numpy(), a)
    np.testing.assert_array_equal(tf.random.uniform((3, 4), -1, 1).numpy(), b)
    assert abs(a.mean()) < 0.15 and abs(a.std() - 1) < 0.1 and b.min() >= -1 and b.max() < 1
    s1, s2 = tf.random.normal((4,), seed=3).numpy(), tf.random.normal((4,), seed=3).numpy()
    assert not np.array_equal(s1, s2)                      # one op seed: a stream, advanced


def test_keras_random_seeds_as_keras_3(cpu):
    """seed=int: the same numbers each call; a SeedGenerator: new numbers, repeatable from its seed."""
    a = tf.keras.random.normal((50,), seed=5).numpy()
    np.testing.assert_array_equal(tf.keras.random.normal((50,), seed=5).numpy(), a)
    g1, g2 = tf.keras.random.SeedGenerator(11), tf.keras.random.SeedGenerator(11)
    first = tf.keras.random.uniform((20,), seed=g1).numpy()
    second = tf.keras.random.uniform((20,), seed=g1).numpy()
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(tf.keras.random.uniform((20,), seed=g2).numpy(), first)
    u = tf.keras.random.uniform((1000,), minval=-2.0, maxval=3.0, seed=1).numpy()
    assert u.min() >= -2.0 and u.max() < 3.0 and abs(u.mean() - 0.5) < 0.2
    x = tf.ones((1000,))
    d = tf.keras.random.dropout(x, 0.25, seed=g1).numpy()
    assert set(np.unique(d)) <= {0.0, np.float32(1 / 0.75)} and 0.15 < (d == 0).mean() < 0.35


def test_builtin_losses_on_any_tensors_as_tf_quickstart_calls_them(cpu, rng):
    """``loss_fn(y_train[:1], predictions).numpy()`` on NumPy predictions (TF's quickstart),
    and each built-in loss on tensors made by ops, against float64 NumPy; differentiable."""
    logits = rng.normal(size=(5, 4))
    labels = rng.integers(0, 4, 5)
    onehot = np.eye(4)[labels]
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    probs = np.exp(logp)
    cases = [
        (tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), labels, logits, -logp[np.arange(5), labels]),
        (tf.keras.losses.SparseCategoricalCrossentropy(), labels, probs, -logp[np.arange(5), labels]),
        (tf.keras.losses.CategoricalCrossentropy(from_logits=True), onehot, logits, -(onehot * logp).sum(1)),
        (tf.keras.losses.MeanSquaredError(), onehot, logits, ((logits - onehot) ** 2).mean(1)),
        (tf.keras.losses.BinaryCrossentropy(from_logits=True), onehot, logits,
         (np.maximum(logits, 0) - logits * onehot + np.log1p(np.exp(-np.abs(logits)))).mean(1)),
    ]
    for loss, y, pred, want in cases:
        got = loss(y, pred.astype(np.float32))
        assert isinstance(got, tf.Tensor) and got.shape == ()
        np.testing.assert_allclose(got.numpy(), want.mean(), rtol=1e-5, err_msg=type(loss).__name__)
    none = tf.keras.losses.MeanSquaredError(reduction="none")(onehot, logits.astype(np.float32))
    np.testing.assert_allclose(none.numpy(), ((logits - onehot) ** 2).mean(1), rtol=1e-5)
    x = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, x)
    np.testing.assert_allclose(tape.gradient(value, x).numpy(), (probs - onehot) / 5, rtol=1e-10)


def test_ops_and_gradients_equal_tensorflows_where_it_is_installed(cpu, rng):
    """The same compositions in TensorFlow (skipped where it is not installed)."""
    real = pytest.importorskip("tensorflow")
    x = rng.normal(size=(3, 4)).astype(np.float32)
    w = rng.normal(size=(4, 2)).astype(np.float32)
    b = rng.normal(size=(2,)).astype(np.float32)
    programs = [
        lambda t, x, w, b: t.reduce_sum(t.square(t.matmul(x, w) + b)),
        lambda t, x, w, b: t.reduce_mean(t.where(x > 0, t.exp(-x), x * x)) + t.reduce_max(t.matmul(x, w)),
        lambda t, x, w, b: t.reduce_sum(t.nn.softmax(t.matmul(x, w)) * b) + t.reduce_sum(t.nn.relu(x[:, 1:3])),
        lambda t, x, w, b: t.reduce_sum(t.nn.sparse_softmax_cross_entropy_with_logits(
            labels=t.constant([0, 1, 1]), logits=t.matmul(x, w) - b)),
    ]
    for program in programs:
        results = []
        for t in (tf, real):
            xs = [t.Variable(a) for a in (x, w, b)]
            with t.GradientTape() as tape:
                y = program(t, *xs)
            results.append([y.numpy()] + [g.numpy() for g in tape.gradient(y, xs)])
        for ours, theirs in zip(*results):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_python_control_flow_on_a_tensor_in_a_traced_function_is_never_a_stale_branch(cpu, rng):
    """``if tf.reduce_sum(x) > 0:`` inside @tf.function: TF's values on every call (here by
    the eager fallback, with its one warning), never the branch the trace took."""
    @tf.function
    def f(x):
        if tf.reduce_sum(x) > 0:
            return x * 2.0
        return x - 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            v = rng.normal(size=3).astype(np.float32)
            want = v * 2 if v.sum() > 0 else v - 1
            np.testing.assert_allclose(f(tf.constant(v)).numpy(), want, rtol=1e-6)
    assert len([w for w in caught if "eagerly" in str(w.message)]) == 1


@pytest.mark.parametrize("dev", DEVICES)
def test_gather_nd_and_its_gradient(on, rng, dev):
    """``tf.gather_nd``: NumPy's ``p[tuple(index row)]`` for each last-axis row of the indices
    (rows of every length up to params' rank, indices of any leading shape); the gradient (a
    scatter-add) against central differences; bad indices refused by name."""
    with on(dev):
        p = rng.normal(size=(3, 4, 2))
        for k, lead in ((1, (2,)), (2, (3,)), (3, (2, 2)), (2, (1, 2))):
            idx = np.stack([rng.integers(0, p.shape[j], lead) for j in range(k)], axis=-1)
            want = lambda v, idx=idx, k=k: np.stack([v[tuple(r)] for r in idx.reshape(-1, k)]).reshape(
                idx.shape[:-1] + v.shape[k:])
            y, (g,) = tape_grads(lambda t, idx=idx: tf.gather_nd(t, idx) * 2.0, [p])
            np.testing.assert_allclose(y.numpy(), want(p) * 2.0, rtol=1e-6)
            np.testing.assert_allclose(g.numpy(), numeric_grad(lambda v, w=want: w(v) * 2.0, [p], 0),
                                       rtol=1e-6, atol=1e-8)
        with pytest.raises(InvalidArgumentError, match="rows of length 4 for params of rank 3"):
            tf.gather_nd(p, np.zeros((2, 4), np.int64))
        with pytest.raises(InvalidArgumentError, match="must be integers"):
            tf.gather_nd(p, np.zeros((2, 1), np.float32))


@pytest.mark.parametrize("dev", DEVICES)
def test_gather_along_each_axis_and_its_gradient(on, rng, dev):
    """``tf.gather``: np.take's values on every axis, indices of any shape; the gradient (a
    scatter-add: repeated indices add up) against central differences; out of range: zeros."""
    with on(dev):
        p = rng.normal(size=(4, 3, 2))
        for axis, idx in ((0, rng.integers(0, 4, (2, 3))), (1, np.array([2, 0, 2])), (2, np.array([[1], [1]]))):
            y, (g,) = tape_grads(lambda t: tf.gather(t, idx, axis=axis) * 3.0, [p])
            np.testing.assert_array_equal(y.numpy(), np.take(p, idx, axis=axis) * 3.0)
            np.testing.assert_allclose(g.numpy(), numeric_grad(lambda v: np.take(v, idx, axis=axis) * 3.0, [p], 0),
                                       rtol=1e-6, atol=1e-8)
        labels = tf.gather(tf.constant([5, 6, 7]), np.array([2, 0]))
        assert labels.dtype == np.int32 and labels.numpy().tolist() == [7, 5]
        np.testing.assert_array_equal(tf.gather(p, np.array([1, 9])).numpy()[1], np.zeros((3, 2)))
