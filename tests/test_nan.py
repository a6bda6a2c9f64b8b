"""NaN goes where the NumPy reference sends it, in every kernel a training step runs.

TensorFlow propagates NaN; our CPU backend runs the NumPy references, our GPU backend the
kernels, so a NaN input must come out of both in the same places, or a model trained on
GPUs gets finite losses and NaN weights where the CPU reports a NaN loss. Each test puts
NaNs at random places of fresh random inputs and compares the simulated kernel with its
reference: NaN exactly where the reference has NaN, the other values close. The model
test does it for a whole ``fit`` on 2 logical CPUs and 2 simulated logical GPUs.
(``tests/test_kernels_pooling.py`` covers MaxPooling2D's NaN rule the same way.)
"""
import numpy as np
import pytest
from numba import cuda

import kernels.activations as act
import kernels.dropout as dropout
import kernels.gemm as gemm
import kernels.reduction as reduction
import kernels.softmax_xent as sx
from conftest import poisoned

#: float32 kernel against its float32 reference: a few roundings apart at most.
RTOL_F32 = 1e-5
ATOL_F32 = 1e-6


def sprinkle(rng, x, count):
    """x with ``count`` NaNs at random places (x is changed and returned)."""
    x.reshape(-1)[rng.choice(x.size, min(count, x.size), replace=False)] = np.nan
    return x


def assert_same_nans(name, got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    where = np.argwhere(np.isnan(got) != np.isnan(want))
    assert not where.size, (f"{name}: NaN in one and not the other at {where[:3].tolist()}: "
                            f"kernel {got[tuple(where[0])]!r}, reference {want[tuple(where[0])]!r}")
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=RTOL_F32, atol=ATOL_F32, err_msg=name)


def test_relu_forward_keeps_nan_and_backward_matches(rng):
    x = sprinkle(rng, rng.standard_normal((7, 33)).astype(np.float32), 9)
    bias = rng.standard_normal(33).astype(np.float32)
    bias[4] = np.nan                                          # a NaN bias: a NaN column
    out = poisoned(x.shape)
    act.bias_relu(cuda.to_device(x), cuda.to_device(bias), out)
    y = out.copy_to_host()
    assert np.isnan(y).any()
    assert_same_nans("bias_relu", y, act.bias_relu_ref(x, bias))
    out = poisoned(x.shape)
    act.bias_add(cuda.to_device(x), cuda.to_device(bias), out)
    assert_same_nans("bias_add", out.copy_to_host(), act.bias_add_ref(x, bias))
    dy = sprinkle(rng, rng.standard_normal(x.shape).astype(np.float32), 5)
    out = poisoned(x.shape)
    act.relu_backward(cuda.to_device(dy), cuda.to_device(y), out)
    assert_same_nans("relu_backward", out.copy_to_host(), act.relu_backward_ref(dy, y))


def test_softmax_rows_with_nan(rng):
    x = sprinkle(rng, rng.standard_normal((9, 10)).astype(np.float32), 4)
    out = poisoned(x.shape)
    act.softmax(cuda.to_device(x), out)
    assert_same_nans("softmax", out.copy_to_host(), act.softmax_ref(x.copy()))


def _xent(launcher, x, labels, scale, **kw):
    b, c = x.shape
    loss, grad, correct = poisoned((b,)), poisoned((b, c)), poisoned((b,))
    launcher(cuda.to_device(x), cuda.to_device(labels), loss, grad, correct, scale, **kw)
    return loss.copy_to_host(), grad.copy_to_host(), correct.copy_to_host()


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_softmax_xent_with_nan_logits(rng, version):
    """Loss and gradient NaN on the rows holding a NaN; the correct flag follows np.argmax
    (the first NaN is the row's arg-max): a NaN after the row's largest value used to
    leave the kernel's arg-max on that value."""
    x = rng.standard_normal((12, 10)).astype(np.float32)
    labels = rng.integers(0, 10, 12)
    for r in range(6):                       # rows 0-5: one NaN each, at the label or after
        x[r, labels[r]] = np.nan if r % 2 else x[r, labels[r]]
        x[r, (labels[r] + 1 + r) % 10] = np.nan
    got = _xent(sx.softmax_xent, x, labels, 1 / 12, version=version)
    want = sx.softmax_xent_ref(x, labels, scale=1 / 12)
    for name, g, w in zip(("loss", "grad", "correct"), got, want):
        assert_same_nans(f"softmax_xent {version} {name}", g, w)


def test_prob_xent_with_nan_probabilities(rng):
    p = rng.random((12, 10)).astype(np.float32)
    p /= p.sum(axis=1, keepdims=True)
    labels = rng.integers(0, 10, 12)
    for r in range(6):
        p[r, labels[r] if r % 2 else (labels[r] + 3) % 10] = np.nan
    got = _xent(sx.prob_xent, p, labels, 0.5)
    want = sx.prob_xent_ref(p, labels, scale=0.5)
    assert np.isnan(want[0][1])              # the label's probability is NaN: a NaN loss
    for name, g, w in zip(("loss", "grad", "correct"), got, want):
        assert_same_nans(f"prob_xent {name}", g, w)


def test_gemm_reduction_and_dropout_with_nan(rng):
    a = sprinkle(rng, rng.standard_normal((17, 9)).astype(np.float32), 2)
    b = rng.standard_normal((9, 13)).astype(np.float32)
    out = poisoned((17, 13))
    gemm.gemm(cuda.to_device(a), cuda.to_device(b), out)
    assert_same_nans("gemm", out.copy_to_host(), gemm.gemm_ref(a, b))
    x3 = a.reshape(1, 17, 9)
    out = poisoned((1, 9))
    reduction.sum_axis(cuda.to_device(x3), out)
    assert_same_nans("sum_axis", out.copy_to_host(), reduction.sum_axis_ref(x3))
    key = dropout.dropout_key(rng.integers(1 << 30), 3, 1)
    out = poisoned(a.shape)
    dropout.dropout(cuda.to_device(a), out, 0.5, key)
    assert_same_nans("dropout", out.copy_to_host(), dropout.dropout_ref(a, key, 0.5))


# --- a whole fit: CPU and simulated GPU replicas agree on NaN ------------------------------------

def test_one_nan_pixel_gives_the_same_nans_on_cpus_and_gpus(devices, rng):
    """One NaN pixel in the batch: on every backend the reported loss is NaN and the same
    weights become NaN (the GPU ReLU mapped the NaN to 0: finite loss, NaN first layer)."""
    import mirrored as tf
    from mirrored.keras import layers, models
    x = rng.random((8, 12)).astype(np.float32)
    x[3, 5] = np.nan
    y = rng.integers(0, 4, 8)
    results = {}
    for k in ("CPU", "GPU"):
        devices(cpus=2 if k == "CPU" else 1, gpus=2 if k == "GPU" else 0)
        tf.random.set_seed(7)
        strategy = tf.distribute.MirroredStrategy([f"{k}:0", f"{k}:1"])
        with strategy.scope():
            model = models.Sequential([layers.Dense(6, activation="relu", input_shape=(12,)),
                                       layers.Dense(4)])
        model.compile(optimizer="sgd",
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results[k] = history.history["loss"][0], model.get_weights()
    (loss_cpu, w_cpu), (loss_k, w_k) = results["CPU"], results["GPU"]
    assert np.isnan(loss_cpu) and np.isnan(loss_k)
    assert any(np.isnan(w).any() for w in w_cpu)
    for a, b in zip(w_cpu, w_k):
        assert np.array_equal(np.isnan(a), np.isnan(b))
