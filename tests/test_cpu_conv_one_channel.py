"""The lab ConvNet's first layer on the CPU: Conv2D(relu) + MaxPooling2D with ONE input
channel, SIMD across output channels (kernels/cpu_conv1.py; ``CpuOps`` uses it; issue 25),
against float64 oracles built from the NumPy references (kernels/conv2d.py, pooling.py,
activations.py): the pooled output to float32 rounding and the arg-max wherever the window
has no near-tie (exact ties, e.g. all-zero windows after the ReLU: the references' first
position); dW and db to float32 rounding. Awkward shapes (batch 1 and 3, odd 27x29 and
9x7 images, kernels 3x3, 2x3 and 3x2, 32 and 64 channels, strides 1 and 2, 'valid' and 'same', pools 2, 'same' 2, (2, 3) and the
overlapping 3-stride-2), ties, all-negative outputs; outputs start as NaN (poisoned); the
bits do not depend on the thread count; bad buffers are refused before anything is written.

    python -m pytest -q tests/test_cpu_conv_one_channel.py
"""
import numpy as np
import pytest

from conftest import poisoned_host
from kernels import activations, conv2d, cpu_conv1, cpu_loops, pooling

#: float32 sums of at most a few thousand terms, in another order than the oracle's
RTOL = 2e-5
IMAGES = [((1, 9, 7, 1), (3, 3, 1, 32)),
          ((3, 27, 29, 1), (3, 3, 1, 32)),
          ((2, 11, 10, 1), (2, 3, 1, 64)),
          ((2, 10, 11, 1), (3, 2, 1, 32))]
GEOMETRY = [(1, "valid"), (1, "same"), (2, "valid"), (2, "same")]
POOLS = [(2, None, "valid"), (2, None, "same"), ((2, 3), None, "valid"), (3, 2, "same")]


def problem(rng, x_shape, k_shape, strides, padding, pool, bias_shift=0.0, ties=False):
    """x, kernel, bias, the float32 references' conv output z, pooled y and arg, and the
    float64 oracle's z64 and pooled y64; None where the pool does not fit the conv."""
    x = rng.standard_normal(x_shape, dtype=np.float32)
    if ties:                                        # constant rows: equal conv outputs in a window
        x[:, ::2] = np.float32(0.5)
    k = rng.standard_normal(k_shape, dtype=np.float32) / np.float32(np.sqrt(np.prod(k_shape[:3])))
    bias = rng.standard_normal(k_shape[3], dtype=np.float32) * np.float32(0.3) + np.float32(bias_shift)
    z = conv2d.conv2d_ref(x, k, bias, strides, padding, relu=True)
    if min(z.shape[1:3]) < 1:
        return None
    try:
        y, arg = pooling.max_pool_ref(z, *pool)
    except ValueError:
        return None
    z64 = conv2d.conv2d_ref(x.astype(np.float64), k.astype(np.float64), bias.astype(np.float64),
                            strides, padding, relu=True)
    return x, k, bias, z, y, arg, z64, pooling.max_pool_ref(z64, *pool)[0]


def window_values(z, arg, pool):
    """z's value at each pooled pixel's position ``arg`` (-inf where that position is padding)."""
    shape, (ph, pw), (sh, sw), (pt, pb, pl, pr) = pooling.pool_geometry(z.shape, *pool)
    zp = np.pad(z, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=-np.inf)
    got = np.full(shape, np.nan)
    for a in range(ph):
        for b in range(pw):
            at = zp[:, a::sh][:, :shape[1]][:, :, b::sw][:, :, :shape[2]]
            got = np.where(arg == a * pw + b, at, got)
    return got


def assert_close(got, want, what):
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def check_forward(case, out, arg, pool):
    x, k, bias, z, y, want_arg, z64, y64 = case
    assert_close(out, y64, "pooled output")
    # The arg-max: a window maximum (to rounding) everywhere, the references' own where the
    # window is all zeros (exact ties after the ReLU: the first position) ...
    assert_close(window_values(z64, arg, pool), y64, "the value at the arg-max")
    zeros = y == 0
    np.testing.assert_array_equal(arg[zeros], want_arg[zeros])
    # ... and the references' wherever the best beats every other value by more than rounding.
    second = np.full(y.shape, -np.inf)
    for pos in range(np.prod(np.broadcast_to(pool[0], (2,)))):
        v = window_values(z64, np.full(y.shape, pos, np.int32), pool)
        second = np.where(pos != want_arg, np.maximum(second, np.nan_to_num(v, nan=-np.inf)), second)
    clear = (y64 - second) > 1e-4 * max(float(np.abs(y64).max()), 1e-30)
    np.testing.assert_array_equal(arg[clear], want_arg[clear])


@pytest.mark.parametrize("x_shape, k_shape", IMAGES)
@pytest.mark.parametrize("strides, padding", GEOMETRY)
@pytest.mark.parametrize("pool", POOLS)
def test_forward_is_the_references_to_float32_rounding(rng, x_shape, k_shape, strides, padding, pool):
    case = problem(rng, x_shape, k_shape, strides, padding, pool)
    if case is None:
        pytest.skip("the conv's output is smaller than the pool")
    x, k, bias, z, y = case[:5]
    out, arg = poisoned_host(y.shape), poisoned_host(y.shape, np.int32)
    cpu_conv1.forward(x, k, bias, out, arg, strides, padding, *pool)
    check_forward(case, out, arg, pool)


def backward_oracle(x, k, dy, arg, z, strides, padding, pool):
    """dW, db (float64) of the conv for the pooled gradient dy, through the pool and ReLU."""
    dz = activations.relu_backward_ref(pooling.max_pool_backward_ref(dy, arg, z.shape, *pool), z,
                                       np.empty(z.shape, np.float32))
    _, dw, db = conv2d.conv2d_backward_ref(x.astype(np.float64), k.astype(np.float64),
                                           dz.astype(np.float64), strides, padding)
    return dw, db


@pytest.mark.parametrize("x_shape, k_shape", IMAGES)
@pytest.mark.parametrize("strides, padding", GEOMETRY)
@pytest.mark.parametrize("pool", POOLS)
def test_backward_is_the_references_to_float32_rounding(rng, x_shape, k_shape, strides, padding, pool):
    case = problem(rng, x_shape, k_shape, strides, padding, pool)
    if case is None:
        pytest.skip("the conv's output is smaller than the pool")
    x, k, bias, z, y, arg = case[:6]
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    want_dw, want_db = backward_oracle(x, k, dy, arg, z, strides, padding, pool)
    dw, db = poisoned_host(k.shape), poisoned_host(k.shape[3])
    assert cpu_conv1.backward(x, k, dy, arg, y, dw, db, strides, padding, *pool)[0] is None   # no dX
    assert_close(dw, want_dw, "dW")
    assert_close(db, want_db, "db")


@pytest.mark.parametrize("pool", [(2, None, "valid"), (3, 2, "same")])
def test_ties_all_negative_outputs_and_a_batch_of_one(rng, pool):
    """Constant rows (equal conv outputs inside windows), then a bias so negative that the
    ReLU zeroes everything: arg the first position, dW and db exactly 0."""
    case = problem(rng, (1, 9, 8, 1), (3, 3, 1, 32), 1, "same", pool, ties=True)
    x, k, bias, z, y, arg = case[:6]
    out, got_arg = poisoned_host(y.shape), poisoned_host(y.shape, np.int32)
    cpu_conv1.forward(x, k, bias, out, got_arg, 1, "same", *pool)
    check_forward(case, out, got_arg, pool)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dw, db = poisoned_host(k.shape), poisoned_host(32)
    cpu_conv1.backward(x, k, dy, got_arg, out, dw, db, 1, "same", *pool)
    want_dw, want_db = backward_oracle(x, k, dy, arg, z, 1, "same", pool)
    assert_close(dw, want_dw, "dW")
    assert_close(db, want_db, "db")

    case = problem(rng, (1, 9, 8, 1), (3, 3, 1, 32), 1, "valid", pool, bias_shift=-50.0)
    x, k, bias, z, y, arg = case[:6]
    assert (y == 0).all()
    out, got_arg = poisoned_host(y.shape), poisoned_host(y.shape, np.int32)
    cpu_conv1.forward(x, k, bias, out, got_arg, 1, "valid", *pool)
    np.testing.assert_array_equal(out, y)
    np.testing.assert_array_equal(got_arg, arg)
    dw, db = poisoned_host(k.shape), poisoned_host(32)
    cpu_conv1.backward(x, k, rng.standard_normal(y.shape, dtype=np.float32), got_arg, out, dw, db, 1, "valid", *pool)
    assert (dw == 0).all() and (db == 0).all()


def test_nan_inputs_stay_nan_as_in_the_references(rng):
    case = problem(rng, (2, 8, 9, 1), (3, 3, 1, 32), 1, "valid", (2, None, "valid"))
    x, k, bias = case[:3]
    x[0, 2, 3, 0] = np.nan
    z = conv2d.conv2d_ref(x, k, bias, 1, "valid", relu=True)
    want, want_arg = pooling.max_pool_ref(z, 2)
    out, arg = poisoned_host(want.shape), poisoned_host(want.shape, np.int32)
    cpu_conv1.forward(x, k, bias, out, arg)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out).any()
    nan = np.isnan(want)
    np.testing.assert_array_equal(arg[nan], want_arg[nan])          # NaN taken first, as the reference


def test_the_bits_do_not_depend_on_the_threads(monkeypatch, rng):
    """Forced to split (threshold 0), on 1, 2 and 3 threads: the same bits each time."""
    monkeypatch.setattr(cpu_loops, "PIPELINE_MIN_MADDS", 0)
    case = problem(rng, (7, 13, 11, 1), (3, 3, 1, 32), 1, "same", (2, None, "valid"))
    x, k, bias, z, y, arg = case[:6]
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv(cpu_loops.THREADS_VAR, threads)
        out, got_arg = poisoned_host(y.shape), poisoned_host(y.shape, np.int32)
        cpu_conv1.forward(x, k, bias, out, got_arg, 1, "same")
        dw, db = poisoned_host(k.shape), poisoned_host(32)
        cpu_conv1.backward(x, k, dy, got_arg, out, dw, db, 1, "same")
        results.append((out, got_arg, dw, db))
    for later in results[1:]:
        for g, first in zip(later, results[0]):
            np.testing.assert_array_equal(g, first)
    check_forward(case, results[0][0], results[0][1], (2, None, "valid"))


def test_bad_buffers_are_refused_before_writing(rng):
    x = rng.standard_normal((2, 8, 8, 1), dtype=np.float32)
    k = rng.standard_normal((3, 3, 1, 32), dtype=np.float32)
    out, arg = poisoned_host((2, 3, 3, 32)), poisoned_host((2, 3, 3, 32), np.int32)
    dw, db = poisoned_host(k.shape), poisoned_host(32)
    with pytest.raises(ValueError, match=r"one input channel and a multiple of 32 output channels"):
        cpu_conv1.forward(np.repeat(x, 2, axis=3), np.repeat(k, 2, axis=2), None, out, arg)
    with pytest.raises(ValueError, match=r"multiple of 32"):
        cpu_conv1.forward(x, k[..., :31], None, out[..., :31].copy(), arg[..., :31].copy())
    with pytest.raises(ValueError, match=r"conv2d_relu_pool: out: expected a float32 array of shape \(2, 3, 3, 32\)"):
        cpu_conv1.forward(x, k, None, poisoned_host((2, 3, 4, 32)), arg)
    with pytest.raises(ValueError, match="arg must be int32"):
        cpu_conv1.forward(x, k, None, out, arg.astype(np.int64))
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu_conv1.forward(x, k, None, np.asfortranarray(out), arg)
    with pytest.raises(ValueError, match="x must be float32"):
        cpu_conv1.forward(x.astype(np.float64), k, None, out, arg)
    assert np.isnan(out).all() and (arg == -7).all()
    with pytest.raises(ValueError, match=r"conv2d_relu_pool_backward: dw"):
        cpu_conv1.backward(x, k, out, np.zeros(arg.shape, np.int32), out, poisoned_host((3, 3, 1, 31)), db)
    with pytest.raises(ValueError, match=r"conv2d_relu_pool_backward: y"):
        cpu_conv1.backward(x, k, out, np.zeros(arg.shape, np.int32), out[:, :2], dw, db)
    assert np.isnan(dw).all() and np.isnan(db).all()


def test_cpu_ops_take_this_path_for_one_channel_and_no_dx(rng):
    """CpuOps: Cin = 1, Cout a multiple of 32 and no dX -> these loops (the conv's gradient
    buffer dz is never written); with dX wanted, or Cout not a multiple of 32 -> the general
    path (it writes dz)."""
    from mirrored.backends import CpuOps

    class Device:                                        # a device's scratch: one buffer per key
        def __init__(self):
            self.kept = {}

        def scratch(self, key, shape, dtype):
            return self.kept.setdefault((key, tuple(shape), dtype), poisoned_host(shape, dtype))

    ops = CpuOps(Device())
    assert cpu_conv1.pays((3, 3, 1, 32), False) and cpu_conv1.pays((5, 5, 1, 64), False)
    assert not cpu_conv1.pays((3, 3, 1, 32), True) and not cpu_conv1.pays((3, 3, 1, 31), False)
    assert not cpu_conv1.pays((3, 3, 2, 32), False)
    for cout, with_dx in ((32, False), (32, True), (16, False)):
        case = problem(rng, (3, 10, 9, 1), (3, 3, 1, cout), 1, "valid", (2, None, "valid"))
        x, k, bias, z, y, arg = case[:6]
        out, got_arg = poisoned_host(y.shape), poisoned_host(y.shape, np.int32)
        ops.conv2d_relu_pool(x, k, bias, out, got_arg, 1, "valid")
        check_forward(case, out, got_arg, (2, None, "valid"))
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        dz = poisoned_host(z.shape)
        dx = poisoned_host(x.shape) if with_dx else None
        dw, db = poisoned_host(k.shape), poisoned_host(cout)
        ops.conv2d_relu_pool_backward(x, k, dy, got_arg, out, dz, dx, dw, db, 1, "valid")
        want_dw, want_db = backward_oracle(x, k, dy, arg, z, 1, "valid", (2, None, "valid"))
        assert_close(dw, want_dw, "dW")
        assert_close(db, want_db, "db")
        assert bool(np.isnan(dz).all()) == (cout % 32 == 0 and not with_dx)
        if with_dx:
            assert not np.isnan(dx).any()


def test_a_lab_convnet_trains_alike_on_this_path_or_the_general_one(devices, monkeypatch, rng):
    """The lab's shape of model, small (Conv2D(32, 3, relu) on one channel -> MaxPooling2D
    -> Flatten -> Dense): a few steps of SGD reach the same weights, to float32 rounding,
    with kernels/cpu_conv1.py or with the general path (im2col + BLAS, dz). (Not Adam: it
    divides each gradient by its own size, so a near-zero gradient's rounding difference
    would show; tests/test_cpu_conv_fused.py's two-conv test says when it did.)"""
    import mirrored as tf
    from mirrored import backends

    def model():
        m = tf.keras.Sequential([
            tf.keras.layers.Conv2D(32, 3, activation="relu", input_shape=(11, 9, 1)),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)])
        m.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    devices(cpus=1)
    x = rng.standard_normal((9, 11, 9, 1)).astype(np.float32)
    y = rng.integers(0, 3, 9)
    calls = []
    forward, backward = cpu_conv1.forward, cpu_conv1.backward
    monkeypatch.setattr(cpu_conv1, "forward", lambda *a, **k: calls.append("f") or forward(*a, **k))
    monkeypatch.setattr(cpu_conv1, "backward", lambda *a, **k: calls.append("b") or backward(*a, **k))
    with tf.device("CPU:0"):
        ours = model()
        start = ours.get_weights()
        ours.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert "f" in calls and "b" in calls
    monkeypatch.setattr(backends.cpu_conv1, "pays", lambda *a, **k: False)
    with tf.device("CPU:0"):
        plain = model()
        plain.set_weights(start)
        plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not all(np.array_equal(a, b) for a, b in zip(start, ours.get_weights()))
