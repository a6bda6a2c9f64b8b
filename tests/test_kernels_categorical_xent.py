"""Fused categorical cross-entropy (kernels/categorical_xent.py) against a float64 oracle.

The CUDA kernel (in the simulator here; tests/test_kernels_compile.py compiles it for
sm_80/sm_90 with the real compiler, as every registered kernel) and the NumPy reference the
CPU backend runs, on one-hot, smoothed and soft targets: a batch of 1, one class, 10 and odd
widths, ties for the argmax, huge logits; with and without the gradient; bad input refused
before any launch. The oracle is a per-row float64 loop, written from Keras's formulas, not
from the reference.
"""
import numpy as np
import pytest
from numba import cuda

import kernels.categorical_xent as cx
from conftest import assert_close, device_zeros

#: float32 against float64: a C-term log-sum-exp and a C-term weighted sum; a few ulps of
#: the magnitudes involved (terms up to ~10 for the logits below, 200 for the huge one).
RTOL_F32 = 2e-5
ATOL_F32 = 2e-5
SHAPES = [(1, 1), (1, 10), (17, 10), (33, 17), (5, 65)]


def oracle(logits, targets, scale, smoothing):
    """Keras 3's categorical cross-entropy from logits, per row, in float64: loss, d loss /
    d logits x scale, and CategoricalAccuracy's hit (argmax of the logits == of the targets)."""
    b, c = logits.shape
    loss, grad, correct = np.empty(b), np.empty((b, c)), np.empty(b)
    for r in range(b):
        z = logits[r].astype(np.float64)
        y = targets[r].astype(np.float64) * (1 - smoothing) + smoothing / c
        log_softmax = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        loss[r] = -(y * log_softmax).sum()
        grad[r] = (np.exp(log_softmax) * y.sum() - y) * scale
        correct[r] = float(int(np.argmax(logits[r])) == int(np.argmax(targets[r])))
    return loss, grad, correct


def make_inputs(rng, b, c, kind):
    logits = (rng.standard_normal((b, c)) * 3).astype(np.float32)
    labels = rng.integers(0, c, size=b)
    if kind == "soft":                                       # rows of probabilities
        targets = rng.random((b, c)).astype(np.float32)
        targets /= targets.sum(axis=1, keepdims=True)
    else:
        targets = np.eye(c, dtype=np.float32)[labels]        # one-hot
    if c > 1 and b > 1:
        logits[0, :2] = logits[0].max() + 1                  # a tie: the first maximum wins
        logits[1, 0] = 200.0                                 # exp(200) overflows without the shift
    return logits, targets


def run(logits, targets, with_grad, scale, smoothing):
    b, c = logits.shape
    loss, correct = (cuda.to_device(np.full(b, np.nan, np.float32)) for _ in range(2))   # poisoned
    grad = cuda.to_device(np.full((b, c), np.nan, np.float32)) if with_grad else None
    cx.categorical_xent(cuda.to_device(logits), cuda.to_device(targets), loss, grad, correct,
                        scale=scale, label_smoothing=smoothing)
    return loss.copy_to_host(), grad.copy_to_host() if with_grad else None, correct.copy_to_host()


@pytest.mark.parametrize("kind", ["one-hot", "smoothed", "soft"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_and_reference_match_the_oracle(rng, shape, kind):
    logits, targets = make_inputs(rng, *shape, kind)
    smoothing = float(rng.uniform(0.05, 0.3)) if kind == "smoothed" else 0.0
    scale = 1.0 / shape[0]
    want = oracle(logits, targets, scale, smoothing)
    for with_grad in (True, False):
        loss, grad, correct = run(logits, targets, with_grad, scale, smoothing)
        assert_close(f"kernel loss {shape} {kind}", loss, want[0], RTOL_F32, ATOL_F32)
        np.testing.assert_array_equal(correct, want[2])
        if with_grad:
            assert_close(f"kernel grad {shape} {kind}", grad, want[1], RTOL_F32, ATOL_F32)
    # the reference: in float64 it is the oracle to float64 rounding; in float32, what the CPU runs
    ref64 = cx.categorical_xent_ref(logits.astype(np.float64), targets.astype(np.float64),
                                    grad_out=np.empty(shape), scale=scale, label_smoothing=smoothing)
    assert_close(f"reference loss {shape}", ref64[0], want[0], 1e-12, 1e-12)
    assert_close(f"reference grad {shape}", ref64[1], want[1], 1e-12, 1e-12)
    np.testing.assert_array_equal(ref64[2], want[2])
    ref32 = cx.categorical_xent_ref(logits, targets, grad_out=np.empty(shape, np.float32), scale=scale,
                                    label_smoothing=smoothing)
    assert_close(f"float32 reference grad {shape}", ref32[1], want[1], RTOL_F32, ATOL_F32)


def test_a_one_hot_row_has_the_sparse_gradient(rng):
    """With one-hot targets and no smoothing the gradient is softmax - onehot: the sparse
    loss's gradient, with no class index anywhere."""
    import kernels.softmax_xent as sx
    logits, targets = make_inputs(rng, 9, 7, "one-hot")
    labels = targets.argmax(axis=1)
    _, grad, _ = cx.categorical_xent_ref(logits, targets, grad_out=np.empty((9, 7), np.float32), scale=0.25)
    _, sparse_grad, _ = sx.softmax_xent_ref(logits, labels, scale=0.25)
    assert_close("one-hot vs sparse gradient", grad, sparse_grad, 1e-6, 1e-7)


@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(cx)


def test_bad_input_raises_before_launch(no_launch):
    x, t, loss, grad, cor = (device_zeros((4, 10)), device_zeros((4, 10)), device_zeros(4),
                             device_zeros((4, 10)), device_zeros(4))
    with pytest.raises(TypeError, match="float32"):
        cx.categorical_xent(x, device_zeros((4, 10), np.int64), loss, grad, cor)
    with pytest.raises(ValueError, match="shape"):
        cx.categorical_xent(x, device_zeros((4, 9)), loss, grad, cor)
    with pytest.raises(ValueError, match="label_smoothing"):
        cx.categorical_xent(x, t, loss, grad, cor, label_smoothing=1.5)
    with pytest.raises(ValueError, match="shares memory"):
        cx.categorical_xent(x, t, loss, x, cor)
