"""Fused softmax cross-entropy (kernels/softmax_xent.py) against float64 oracles.

Logits and probabilities paths, int32 and int64 labels, with and without the gradient,
batch of 1, 1/10/17/65 classes, ties for the argmax, huge logits, clipped
probabilities, out-of-range labels (NaN rows from the kernel, ValueError from the
reference), and bad input raising before any launch.
"""
import numpy as np
import pytest
from numba import cuda

import kernels.softmax_xent as sx
from conftest import assert_close, device_zeros

#: float32 loss and gradient: log-sum-exp over C <= 65 terms plus a subtraction; a few
#: ulps relative to the magnitudes involved. 1e-5 relative plus 1e-6 absolute (loss
#: and gradient entries near 0 have no relative accuracy to speak of).
RTOL_F32 = 1e-5
ATOL_F32 = 1e-6
#: The float64 references against the float64 oracles.
RTOL_F64 = 1e-12
ATOL_F64 = 1e-14

#: (B, C): a batch of 1, a single class, MNIST's 10 classes, odd widths.
SHAPES = [(1, 1), (1, 10), (17, 10), (33, 17), (5, 65)]
EPS = 1e-7




# --- float64 oracles: per-row loops, independent of the references ---------------------

def oracle_softmax_xent(logits, labels, scale):
    b, c = logits.shape
    loss, grad, correct = np.empty(b), np.empty((b, c)), np.empty(b)
    for r in range(b):
        row = logits[r].astype(np.float64)
        lse = row.max() + np.log(np.exp(row - row.max()).sum())
        loss[r] = lse - row[labels[r]]
        grad[r] = np.exp(row - lse) * scale
        grad[r, labels[r]] -= scale
        correct[r] = float(int(np.argmax(row)) == int(labels[r]))
    return loss, grad, correct


def oracle_prob_xent(probs, labels, scale):
    b, c = probs.shape
    loss, grad, correct = np.empty(b), np.zeros((b, c)), np.empty(b)
    lo, hi = np.float64(np.float32(EPS)), np.float64(np.float32(1) - np.float32(EPS))
    for r in range(b):
        p = float(probs[r, labels[r]])
        loss[r] = -np.log(min(max(p, lo), hi))
        if lo <= p <= hi:
            grad[r, labels[r]] = -scale / p
        correct[r] = float(int(np.argmax(probs[r])) == int(labels[r]))
    return loss, grad, correct


def make_logits(rng, b, c):
    logits = (rng.standard_normal((b, c)) * 3).astype(np.float32)
    labels = rng.integers(0, c, size=b)
    if c > 1 and b > 1:
        logits[0, :2] = logits[0].max() + 1  # a tie: the first maximum must win
        logits[1, 0] = 200.0                 # exp(200) overflows without the max shift
    return logits, labels


def make_probs(rng, b, c):
    probs = rng.random((b, c)).astype(np.float32)
    probs /= probs.sum(axis=1, keepdims=True)
    labels = rng.integers(0, c, size=b)
    if b > 2:
        probs[0, labels[0]] = 0.0   # clipped below: loss -log(eps), no gradient
        probs[1, labels[1]] = 1.0   # clipped above
        probs[2, labels[2]] = 1e-9  # clipped below
    return probs, labels


def run(launcher, x, labels, with_grad, scale, **kwargs):
    b, c = x.shape
    loss, correct = (cuda.to_device(np.full(b, np.nan, np.float32)) for _ in range(2))
    grad = cuda.to_device(np.full((b, c), np.nan, np.float32)) if with_grad else None
    launcher(cuda.to_device(x), cuda.to_device(labels), loss, grad, correct, scale=scale,
             **kwargs)
    return loss.copy_to_host(), grad.copy_to_host() if with_grad else None, correct.copy_to_host()


#: Rows of more than one v2 block group (the simulator's blocks stage 32 rows; 4 blocks).
MANY_ROWS = 4 * sx.STAGE_ROWS + 33


@pytest.mark.parametrize("version", ["v1", "v2", None])
@pytest.mark.parametrize("label_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", SHAPES + [(MANY_ROWS, 10)])
def test_softmax_xent_kernel(rng, shape, label_dtype, version):
    if version == "v2" and shape[1] > sx.MAX_STAGED_COLS:
        pytest.skip("v2 refuses rows wider than MAX_STAGED_COLS (tested below)")
    logits, labels = make_logits(rng, *shape)
    labels = labels.astype(label_dtype)
    scale = 1.0 / shape[0]
    want = oracle_softmax_xent(logits, labels, scale)
    for with_grad in (True, False):
        loss, grad, correct = run(sx.softmax_xent, logits, labels, with_grad, scale,
                                  version=version)
        assert_close(f"softmax_xent loss {shape}", loss, want[0], RTOL_F32, ATOL_F32)
        assert np.array_equal(correct, want[2]), f"correct {correct} != {want[2]}"
        if with_grad:
            assert_close(f"softmax_xent grad {shape}", grad, want[1], RTOL_F32, ATOL_F32)


@pytest.mark.parametrize("label_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(1, 1), (1, 10), (17, 10), (5, 65)])
def test_prob_xent_kernel(rng, shape, label_dtype):
    probs, labels = make_probs(rng, *shape)
    labels = labels.astype(label_dtype)
    want = oracle_prob_xent(probs, labels, 0.5)
    for with_grad in (True, False):
        loss, grad, correct = run(sx.prob_xent, probs, labels, with_grad, 0.5)
        assert_close(f"prob_xent loss {shape}", loss, want[0], RTOL_F32, ATOL_F32)
        assert np.array_equal(correct, want[2])
        if with_grad:
            assert_close(f"prob_xent grad {shape}", grad, want[1], RTOL_F32, ATOL_F32)


def test_v1_and_v2_give_bitwise_equal_results(rng):
    """v2 only moves where the row is read from: the same float32 operations, in order."""
    logits, labels = make_logits(rng, MANY_ROWS, 10)
    labels[5] = 10                                            # a bad label: a NaN row in both
    v1 = run(sx.softmax_xent, logits, labels, True, 1 / MANY_ROWS, version="v1")
    v2 = run(sx.softmax_xent, logits, labels, True, 1 / MANY_ROWS, version="v2")
    for a, b in zip(v1, v2):
        assert np.array_equal(a, b, equal_nan=True)


def test_v2_refuses_wide_rows_and_unknown_versions(forbid_launches, rng):
    forbid_launches(sx)
    x = rng.random((3, sx.MAX_STAGED_COLS + 1)).astype(np.float32)
    with pytest.raises(ValueError, match="v2 stages at most"):
        run(sx.softmax_xent, x, np.zeros(3, np.int32), True, 1.0, version="v2")
    with pytest.raises(ValueError, match="unknown version"):
        run(sx.softmax_xent, x, np.zeros(3, np.int32), True, 1.0, version="v3")


@pytest.mark.parametrize("with_grad", [True, False])
@pytest.mark.parametrize("launcher", [sx.softmax_xent, sx.prob_xent,
                                      lambda *a, **k: sx.softmax_xent(*a, **k, version="v1")])
def test_out_of_range_label_gives_nan_row(rng, launcher, with_grad):
    x = rng.random((4, 10)).astype(np.float32)
    labels = np.array([3, -1, 10, 0], np.int32)
    loss, grad, correct = run(launcher, x, labels, with_grad, 1.0)
    assert np.isnan(loss[[1, 2]]).all() and np.isfinite(loss[[0, 3]]).all()
    if with_grad:
        assert np.isnan(grad[[1, 2]]).all() and np.isfinite(grad[[0, 3]]).all()
    assert (correct[[1, 2]] == 0).all()


# --- references -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,rtol,atol", [(np.float64, RTOL_F64, ATOL_F64),
                                             (np.float32, RTOL_F32, ATOL_F32)])
def test_refs_match_oracles(rng, dtype, rtol, atol):
    for shape in SHAPES:
        logits, labels = make_logits(rng, *shape)
        logits = logits.astype(dtype)
        want = oracle_softmax_xent(logits, labels, 0.25)
        outs = (np.full(shape[0], np.nan, dtype), np.full(shape, np.nan, dtype),
                np.full(shape[0], np.nan, dtype))
        got = sx.softmax_xent_ref(logits, labels, *outs, scale=0.25)
        assert all(g is o for g, o in zip(got, outs)), "refs must write into the outs"
        for name, g, w in zip(("loss", "grad", "correct"), got, want):
            assert_close(f"softmax_xent_ref {name} {np.dtype(dtype)} {shape}", g, w, rtol, atol)
        probs, labels = make_probs(rng, *shape)
        want = oracle_prob_xent(probs, labels, 0.25)
        got = sx.prob_xent_ref(probs.astype(dtype), labels, scale=0.25)
        for name, g, w in zip(("loss", "grad", "correct"), got, want):
            assert_close(f"prob_xent_ref {name} {np.dtype(dtype)} {shape}", g, w,
                         RTOL_F32, ATOL_F32)


@pytest.mark.parametrize("ref", [sx.softmax_xent_ref, sx.prob_xent_ref])
def test_ref_rejects_out_of_range_labels(ref):
    x = np.full((2, 3), 1 / 3, np.float32)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        ref(x, np.array([0, 3]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        ref(x, np.array([-1, 0]))


# --- bad input ---------------------------------------------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(sx)


_dev = device_zeros


@pytest.mark.parametrize("launcher", [sx.softmax_xent, sx.prob_xent])
def test_bad_input_raises_before_launch(no_launch, launcher):
    x, lab, loss, grad, cor = _dev((4, 10)), _dev(4, np.int32), _dev(4), _dev((4, 10)), _dev(4)
    with pytest.raises(TypeError, match="float32"):
        launcher(_dev((4, 10), np.float64), lab, loss, grad, cor)
    with pytest.raises(TypeError, match="int32 or int64"):
        launcher(x, _dev(4, np.float32), loss, grad, cor)
    with pytest.raises(ValueError, match="shape"):
        launcher(x, _dev(5, np.int32), loss, grad, cor)
    with pytest.raises(ValueError, match="shape"):
        launcher(x, lab, loss, _dev((4, 9)), cor)
    with pytest.raises(ValueError, match="C-contiguous"):
        launcher(_dev((4, 20))[:, ::2], lab, loss, grad, cor)
    with pytest.raises(ValueError, match="shares memory"):
        launcher(x, lab, loss, x, cor)            # grad written over the logits
    with pytest.raises(ValueError, match="shares memory"):
        launcher(x, lab, loss, grad, loss)        # two outputs in one buffer
