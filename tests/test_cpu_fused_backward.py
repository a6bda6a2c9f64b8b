"""Conv2D(relu) + MaxPooling2D's backward adding only the arg-max terms
(kernels/cpu_conv_pool.py, ``CpuOps.conv2d_relu_pool_backward``; issue 25) against a float64
oracle built from the NumPy references (kernels/conv2d.py, pooling.py, activations.py):
dW, db and dX of the conv for the pooled gradient, to float32 rounding (the same terms in
another order). The issue's cases: 1->32, 32->64 and 3->16 channels, strides 1 and 2,
'valid' and 'same', non-overlapping pools of 2, 3 and (2, 3), odd sizes, a batch of 1,
ties; outputs start as NaN (poisoned); the bits do not depend on the thread count.

    python -m pytest -q tests/test_cpu_fused_backward.py
"""
import numpy as np
import pytest

from conftest import poisoned_host
from kernels import activations, conv2d, cpu_conv_pool, cpu_loops, pooling

#: float32 sums of up to a few hundred terms in another order than the oracle's
RTOL = 1e-5
CHANNELS = [((2, 9, 7, 1), (3, 3, 1, 32)),
            ((1, 7, 8, 32), (3, 3, 32, 64)),
            ((3, 6, 5, 3), (3, 3, 3, 16)),
            ((2, 11, 10, 7), (2, 3, 7, 5))]
GEOMETRY = [(1, "valid"), (1, "same"), (2, "valid"), (2, "same")]
POOLS = [(2, None, "valid"), (2, None, "same"), (3, None, "same"), ((2, 3), None, "valid")]


def problem(rng, x_shape, k_shape, strides, padding, pool, ties=False):
    """Inputs, the forward's pooled output and arg-max (the references'), a pooled
    gradient, and the float64 oracle's (dx, dw, db); None where the pool does not fit."""
    x = rng.standard_normal(x_shape, dtype=np.float32)
    if ties:                                   # whole-image constant rows: equal conv outputs
        x[:, ::2] = np.float32(0.5)
    k = rng.standard_normal(k_shape, dtype=np.float32) / np.float32(np.sqrt(np.prod(k_shape[:3])))
    bias = rng.standard_normal(k_shape[3], dtype=np.float32) * np.float32(0.3)
    z = conv2d.conv2d_ref(x, k, bias, strides, padding, relu=True)
    if z.shape[1] < 1 or z.shape[2] < 1:
        return None
    try:
        y, arg = pooling.max_pool_ref(z, *pool)
    except ValueError:
        return None
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dz = activations.relu_backward_ref(pooling.max_pool_backward_ref(dy, arg, z.shape, *pool), z,
                                       np.empty(z.shape, np.float32))
    want = conv2d.conv2d_backward_ref(x.astype(np.float64), k.astype(np.float64),
                                      dz.astype(np.float64), strides, padding)
    return x, k, dy, arg, y, want, dz


def assert_close(got, want, what):
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=what)


@pytest.mark.parametrize("x_shape, k_shape", CHANNELS)
@pytest.mark.parametrize("strides, padding", GEOMETRY)
@pytest.mark.parametrize("pool", POOLS)
def test_backward_is_the_references_to_float32_rounding(rng, x_shape, k_shape, strides, padding, pool):
    case = problem(rng, x_shape, k_shape, strides, padding, pool)
    if case is None:
        pytest.skip("the conv's output is smaller than the pool")
    x, k, dy, arg, y, (want_dx, want_dw, want_db), _ = case
    dx, dw, db = poisoned_host(x_shape), poisoned_host(k_shape), poisoned_host(k_shape[3])
    got = cpu_conv_pool.backward(x, k, dy, arg, y, dx, dw, db, strides, padding, *pool)
    assert got[0] is dx and got[1] is dw and got[2] is db
    assert_close(dw, want_dw, "dW")
    assert_close(db, want_db, "db")
    assert_close(dx, want_dx, "dX")
    dw2 = poisoned_host(k_shape)                        # a first layer: dX and db not asked for
    assert cpu_conv_pool.backward(x, k, dy, arg, y, None, dw2, None, strides, padding, *pool)[0] is None
    np.testing.assert_array_equal(dw2, dw)              # the same order of sums without them


@pytest.mark.parametrize("x_shape, k_shape", [((1, 12, 9, 32), (3, 3, 32, 64)), ((1, 9, 9, 1), (3, 3, 1, 32))])
def test_ties_and_a_batch_of_one(rng, x_shape, k_shape):
    """Equal conv outputs inside a window (constant input rows): the gradient goes to the
    forward's arg-max, the FIRST maximum, as the references'."""
    x, k, dy, arg, y, (want_dx, want_dw, want_db), _ = problem(rng, x_shape, k_shape, 1, "same",
                                                               (2, None, "valid"), ties=True)
    dx, dw, db = poisoned_host(x_shape), poisoned_host(k_shape), poisoned_host(k_shape[3])
    cpu_conv_pool.backward(x, k, dy, arg, y, dx, dw, db, 1, "same")
    for got, want, what in ((dw, want_dw, "dW"), (db, want_db, "db"), (dx, want_dx, "dX")):
        assert_close(got, want, what)


def test_the_bits_do_not_depend_on_the_threads(monkeypatch, rng):
    """The image blocks are fixed by the batch size; 1, 2, 3 or 5 threads run them (the
    split forced on a small problem): the same bits every time."""
    monkeypatch.setattr(cpu_loops, "SPLIT_MIN_MADDS", 0)
    x, k, dy, arg, y, _, _ = problem(rng, (7, 10, 9, 16), (3, 3, 16, 24), 1, "same", (2, None, "valid"))
    seen = []
    for threads in ("1", "2", "3", "5"):
        monkeypatch.setenv(cpu_loops.THREADS_VAR, threads)
        dx, dw, db = poisoned_host(x.shape), poisoned_host(k.shape), poisoned_host(k.shape[3])
        cpu_conv_pool.backward(x, k, dy, arg, y, dx, dw, db, 1, "same")
        seen.append((dx, dw, db))
    for got in seen[1:]:
        for g, first in zip(got, seen[0]):
            np.testing.assert_array_equal(g, first)


def test_cpu_ops_choose_the_walk_where_it_pays_else_the_general_path(rng):
    """CpuOps.conv2d_relu_pool_backward: the arg-max walk for long kernel rows (KW*Cin >= 16);
    the general path (kernels/cpu_loops.py ``conv2d_relu_pool_backward``: the pool's
    backward into dz, then dW, db, dX by blocks of images) for short rows and overlapping
    windows, whose dz and db are bitwise the two-call path's (pool backward, then
    conv2d_backward) and dW, dX that to float32 rounding (BLAS products cut in blocks)."""
    from mirrored.backends import CpuOps

    class Device:                                        # what CpuOps asks of its device
        def scratch(self, key, shape, dtype):
            return np.empty(shape, dtype)

    ops = CpuOps(Device())
    assert cpu_conv_pool.pays((3, 3, 32, 64), 2, None) and not cpu_conv_pool.pays((3, 3, 1, 32), 2, None)
    assert not cpu_conv_pool.pays((3, 3, 32, 64), 3, 2)                 # overlapping windows
    for x_shape, k_shape, pool in (((5, 9, 7, 1), (3, 3, 1, 32), (2, None, "valid")),
                                   ((2, 9, 8, 6), (3, 3, 6, 8), (3, (2, 2), "same"))):
        x, k, dy, arg, y, (want_dx64, want_dw64, _), dz_ref = problem(rng, x_shape, k_shape, 1, "valid", pool)
        want_dz = poisoned_host(dz_ref.shape)
        cpu_loops.max_pool_relu_backward(dy, arg, y, want_dz, *pool)
        want = [poisoned_host(x_shape), poisoned_host(k_shape), poisoned_host(k_shape[3])]
        cpu_loops.conv2d_backward(x, k, want_dz, *want)
        dz, got = poisoned_host(dz_ref.shape), [poisoned_host(x_shape), poisoned_host(k_shape),
                                                poisoned_host(k_shape[3])]
        ops.conv2d_relu_pool_backward(x, k, dy, arg, y, dz, *got, 1, "valid", *pool)
        np.testing.assert_array_equal(dz, want_dz)
        np.testing.assert_array_equal(got[2], want[2])                  # db
        for g, w, w64, what in ((got[0], want[0], want_dx64, "dX"), (got[1], want[1], want_dw64, "dW")):
            assert_close(g, w, what)
            assert_close(g, w64, what + " against the float64 oracle")
    x, k, dy, arg, y, (want_dx, want_dw, want_db), dz_ref = problem(rng, (2, 9, 8, 32), (3, 3, 32, 8), 1,
                                                                    "valid", (2, None, "valid"))
    dz = poisoned_host(dz_ref.shape)
    got = [poisoned_host(x.shape), poisoned_host(k.shape), poisoned_host(8)]
    ops.conv2d_relu_pool_backward(x, k, dy, arg, y, dz, *got, 1, "valid")
    assert np.isnan(dz).all()                            # the walk never writes the conv's gradient
    for g, w, what in zip(got, (want_dx, want_dw, want_db), ("dX", "dW", "db")):
        assert_close(g, w, what)


def test_bad_buffers_and_overlapping_windows_are_refused_before_writing(rng):
    x, k, dy, arg, y, _, _ = problem(rng, (1, 8, 8, 16), (3, 3, 16, 4), 1, "valid", (2, None, "valid"))
    dx, dw, db = poisoned_host(x.shape), poisoned_host(k.shape), poisoned_host(4)
    with pytest.raises(ValueError, match="overlap"):
        cpu_conv_pool.backward(x, k, dy, arg, y, dx, dw, db, 1, "valid", 3, 2)
    with pytest.raises(ValueError, match=r"conv2d_relu_pool_backward: dw.*\(3, 3, 16, 4\)"):
        cpu_conv_pool.backward(x, k, dy, arg, y, dx, poisoned_host((3, 3, 16, 5)), db)
    with pytest.raises(ValueError, match="arg must be int32"):
        cpu_conv_pool.backward(x, k, dy, arg.astype(np.int64), y, dx, dw, db)
    with pytest.raises(ValueError, match="conv2d_relu_pool_backward: y"):
        cpu_conv_pool.backward(x, k, dy, arg, y[:, :1], dx, dw, db)
    assert np.isnan(dx).all() and np.isnan(dw).all() and np.isnan(db).all()


def test_a_model_trains_alike_with_the_walk_or_the_general_path(devices, monkeypatch, rng):
    """A two-conv model whose second conv reads 8 channels (runs of 24: the walk) trains,
    over a few steps, to the same weights as with the general path, to float32 rounding."""
    import mirrored as tf
    from mirrored import backends

    def model():
        m = tf.keras.Sequential([
            tf.keras.layers.Conv2D(8, 3, activation="relu", input_shape=(13, 12, 1)),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(6, 3, activation="relu", padding="same"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)])
        m.compile(optimizer=tf.keras.optimizers.SGD(0.05),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    devices(cpus=1)
    x = rng.standard_normal((9, 13, 12, 1)).astype(np.float32)
    y = rng.integers(0, 3, 9)
    calls = []
    walk = cpu_conv_pool.backward
    monkeypatch.setattr(cpu_conv_pool, "backward", lambda *a, **k: calls.append(1) or walk(*a, **k))
    with tf.device("CPU:0"):
        fused = model()
        start = fused.get_weights()
        fused.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert calls                                         # the second conv took the walk
    monkeypatch.setattr(cpu_conv_pool, "pays", lambda *a: False)
    monkeypatch.setattr(backends.cpu_conv_pool, "pays", lambda *a: False)
    with tf.device("CPU:0"):
        plain = model()
        plain.set_weights(start)
        plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(fused.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not all(np.array_equal(a, b) for a, b in zip(start, fused.get_weights()))


def test_the_general_backward_takes_the_forwards_columns_only_while_they_hold_them(monkeypatch, rng):
    """CpuOps's im2col buffer (one per shape) remembers whose columns it holds: the pair's
    backward right after its forward does not make them again; after a backward that
    wrote dx's product into it, or another conv's use of it, the next backward does.
    The gradients are the same bits either way."""
    from mirrored.backends import CpuOps

    class Device:                                        # a device's scratch: one buffer per key
        def __init__(self):
            self.kept = {}

        def scratch(self, key, shape, dtype):
            return self.kept.setdefault((key, tuple(shape), dtype), poisoned_host(shape, dtype))

    made = []
    im2col = cpu_loops._im2col
    monkeypatch.setattr(cpu_loops, "_im2col", lambda *a: made.append(1) or im2col(*a))
    ops = CpuOps(Device())
    x, k, dy, arg, y, (want_dx, want_dw, want_db), dz_ref = problem(rng, (5, 9, 7, 3), (3, 3, 3, 4), 1,
                                                                    "same", (2, None, "valid"))
    bias = rng.standard_normal(4, dtype=np.float32)
    out, out_arg = poisoned_host(y.shape), poisoned_host(y.shape, np.int32)
    other = rng.standard_normal(x.shape, dtype=np.float32)
    results = []
    for forward_first, between in ((True, False), (False, False), (True, False), (True, True)):
        if forward_first:
            ops.conv2d_relu_pool(x, k, bias, out, out_arg, 1, "same")
        if between:                                     # another conv of that shape uses the buffer
            ops.conv2d(other, k, bias, poisoned_host(dz_ref.shape), 1, "same", True)
        made.clear()
        got = [poisoned_host(x.shape), poisoned_host(k.shape), poisoned_host(4)]
        ops.conv2d_relu_pool_backward(x, k, dy, arg, y, poisoned_host(dz_ref.shape), *got, 1, "same")
        assert bool(made) is not (forward_first and not between)   # made again only when not held
        results.append(got)
    for got in results[1:]:
        for g, first in zip(got, results[0]):
            np.testing.assert_array_equal(g, first)
    for g, w, what in zip(results[0], (want_dx, want_dw, want_db), ("dX", "dW", "db")):
        assert_close(g, w, what)
