"""mirrored.Tensor on CPU and (simulated) GPU devices against NumPy on random inputs."""
import numpy as np
import pytest

import mirrored as tf
from conftest import assert_sum_close

# float32 elementwise results are exact IEEE operations on both backends; only
# the order of additions in reductions differs from NumPy's pairwise sum
# (checked with conftest.assert_sum_close).

SHAPES = [(1,), (31,), (3, 17), (2, 3, 5)]


@pytest.fixture(params=["CPU:1", "GPU:1"])
def where(request, devices):
    """Run each test on a second logical CPU and on a second logical (simulated) GPU."""
    devices(cpus=2, gpus=2 if request.param.startswith("GPU") else 0)
    return request.param


@pytest.mark.parametrize("shape", SHAPES)
def test_arithmetic_matches_numpy(where, shape, rng):
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32) + 3.0     # away from 0 for division
    s = float(rng.uniform(0.5, 2.0))
    with tf.device(where):
        x, y = tf.constant(a), tf.constant(b)
        assert x.device.endswith(where)
        cases = {
            "x+y": (x + y, a + b), "x-y": (x - y, a - b), "x*y": (x * y, a * b), "x/y": (x / y, a / b),
            "x+s": (x + s, a + np.float32(s)), "s-x": (s - x, np.float32(s) - a),
            "x*s": (x * s, a * np.float32(s)), "s/y": (s / y, np.float32(s) / b), "-x": (-x, -a),
        }
    for what, (got, want) in cases.items():
        assert got.device == x.device, what
        assert got.dtype == np.float32 and got.shape == shape, what
        np.testing.assert_array_equal(got.numpy(), want, err_msg=what)


@pytest.mark.parametrize("shape", SHAPES)
def test_reductions_match_float64_numpy(where, shape, rng):
    a = rng.standard_normal(shape).astype(np.float32)
    x = tf.constant(a, device=where)
    assert_sum_close(tf.reduce_sum(x).numpy(), a)
    assert_sum_close(tf.reduce_mean(x).numpy() * a.size, a)
    for axis in range(-len(shape), len(shape)):
        got = tf.reduce_sum(x, axis=axis)
        assert got.shape == np.sum(a, axis=axis).shape
        assert_sum_close(got.numpy(), a, axis=axis)
        kept = tf.reduce_mean(x, axis=axis, keepdims=True)
        assert kept.shape == np.mean(a, axis=axis, keepdims=True).shape
        assert_sum_close(kept.numpy() * a.shape[axis], a, axis=axis, keepdims=True)


def test_integer_tensors_and_casts(where, rng):
    a = rng.integers(-50, 50, size=(4, 7)).astype(np.int32)
    x = tf.constant(a, device=where)
    assert x.dtype == tf.int32
    np.testing.assert_array_equal((x * 3 - 2).numpy(), a * 3 - 2)
    assert tf.reduce_sum(x).numpy() == a.sum()
    f = tf.cast(x, tf.float32)
    assert f.dtype == tf.float32 and f.device == x.device
    np.testing.assert_array_equal(f.numpy(), a.astype(np.float32))
    back = tf.cast(f * 0.5, tf.int32)                 # truncates toward zero, as TF
    np.testing.assert_array_equal(back.numpy(), (a * 0.5).astype(np.int32))
    np.testing.assert_allclose((x / 4).numpy(), a / 4)  # integer truediv answers in float


def test_tf_default_dtypes_and_scalars(where):
    with tf.device(where):
        assert tf.constant(1.5).dtype == tf.float32
        assert tf.constant([1, 2]).dtype == tf.int32
        assert tf.constant(np.arange(3)).dtype == tf.int64         # NumPy keeps its dtype
        s = tf.constant(2.0)
    assert s.shape == () and isinstance(s.numpy(), np.floating) and float(s) == 2.0
    assert repr(tf.constant([0], dtype=tf.int64, device=where)) == \
        "<tf.Tensor: shape=(1,), dtype=int64, numpy=array([0])>"
    assert tf.constant(7, shape=(2, 2), device=where).numpy().tolist() == [[7, 7], [7, 7]]


def test_errors_name_what_was_wrong(devices):
    devices(cpus=2, gpus=1)
    a = tf.constant(np.ones(3, np.float32), device="CPU:0")
    b = tf.constant(np.ones(3, np.float32), device="CPU:1")
    with pytest.raises(tf.errors.InvalidArgumentError, match="CPU:0.*CPU:1"):
        a + b
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\(3,\).*\(4,\)"):
        a * tf.constant(np.ones(4, np.float32), device="CPU:0")
    with pytest.raises(tf.errors.InvalidArgumentError, match="float32.*int32"):
        a - tf.constant(np.ones(3, np.int32), device="CPU:0")
    with pytest.raises(TypeError, match="non-integer"):
        tf.constant([1, 2], device="CPU:0") + 0.5
    with pytest.raises(ValueError, match="out of range"):
        tf.reduce_sum(a, axis=3)


def test_numpy_values_pass_through_for_the_input_pipeline(rng):
    img = rng.integers(0, 256, size=(28, 28, 1)).astype(np.uint8)
    scaled = tf.cast(img, tf.float32) / 255
    assert isinstance(scaled, np.ndarray) and scaled.dtype == np.float32
    assert tf.reduce_sum(np.ones((2, 3)), axis=0).tolist() == [2.0, 2.0, 2.0]
    assert isinstance(tf.identity(img), np.ndarray)


def test_empty_tensors(where):
    x = tf.constant(np.zeros((0, 3), np.float32), device=where)
    assert (x + 1).shape == (0, 3)
    assert tf.reduce_sum(x).numpy() == 0.0
    assert tf.reduce_sum(x, axis=0).numpy().tolist() == [0.0, 0.0, 0.0]
