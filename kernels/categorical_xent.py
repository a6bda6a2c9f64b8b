"""Fused categorical cross-entropy: one-hot (or soft) targets, loss, gradient, correct flag.

Keras's ``CategoricalCrossentropy(from_logits=True, label_smoothing=s)`` (``loss=
'categorical_crossentropy'``, the loss of keras.io's examples, whose labels come from
``keras.utils.to_categorical``) and ``CategoricalAccuracy``, in one kernel. For a row r of C
logits ``z`` and targets ``y`` (B, C) float32:

    y_s[j]     = y[j] * (1 - s) + s / C                 label smoothing, Keras's rule
    lse        = log(sum_j exp(z[j]))                    online, as softmax_xent.py
    loss[r]    = sum_j y_s[j] * (lse - z[j])             = -sum_j y_s[j] log softmax(z)[j]
    grad[r, j] = (softmax(z)[j] * sum(y_s) - y_s[j]) * scale
    correct[r] = 1.0 if argmax(z) == argmax(y) else 0.0  (first max wins, as np.argmax)

The gradient needs no argmax and no class index: it is softmax minus the (smoothed) target
row, so a one-hot row gives exactly sparse softmax cross-entropy's gradient, and a soft
target (mixup, smoothing) trains as well. ``sum(y_s)`` is 1 for a one-hot or probability
row; the kernel keeps the general form, which is the true derivative for any row.
``scale`` folds in the loss reduction (1 / GLOBAL batch in training), as in
``softmax_xent.py``. Keras with ``from_logits=False`` on a softmax layer's output uses that
layer's logits (TensorFlow's backend does so), and so do we (``keras/losses.py``).

Versions: v1 only, one thread per row reading its row from global memory. Rows here are
a few classes wide (10 for MNIST, Fashion-MNIST, CIFAR-10); ``softmax_xent.py``'s v2 shows
the shared-memory staging that would be the next step.

Thread -> data: one thread per row r (grid-stride over rows), two sweeps over its C
columns: (1) running max, sum of exponentials, argmax of z, argmax of y, sum of y;
(2) loss and gradient together. NumPy reference: ``categorical_xent_ref`` (what the CPU
backend runs), float64 oracle in tests/test_kernels_categorical_xent.py.
"""
import math

import numpy as np
from numba import cuda, float32

from kernels.launch import check_array, check_no_alias, grid_1d, launch
from kernels.registry import mat, register, sig, vec


# --- NumPy reference -----------------------------------------------------------------------

def categorical_xent_ref(logits, targets, loss_out=None, grad_out=None, correct_out=None,
                         scale=1.0, label_smoothing=0.0):
    """(loss (B,), grad (B, C) or None, correct (B,)) from logits and targets, both (B, C).

    Any float dtype; results in logits' dtype, written into the ``*_out`` arrays when given
    (``grad_out`` None: no gradient, as in evaluation)."""
    logits = np.asarray(logits)
    b, c = logits.shape
    dtype = logits.dtype.type
    y = np.asarray(targets, logits.dtype)                                     # (B, C)
    if y.shape != (b, c):
        raise ValueError(f"categorical_xent: targets {y.shape} must have the logits' shape {(b, c)}.")
    loss = np.empty(b, logits.dtype) if loss_out is None else loss_out         # (B,)
    correct = np.empty(b, logits.dtype) if correct_out is None else correct_out  # (B,)
    if b == 0:
        return loss, grad_out, correct
    s = dtype(label_smoothing)
    ys = y * (dtype(1) - s) + s / dtype(c) if label_smoothing else y           # (B, C) smoothed
    shifted = logits - logits.max(axis=1, keepdims=True)                       # (B, C), <= 0
    sums = np.exp(shifted).sum(axis=1, keepdims=True)                          # (B, 1) >= 1
    lse = np.log(sums)                                                         # (B, 1)
    np.sum(ys * (lse - shifted), axis=1, out=loss)
    np.equal(logits.argmax(axis=1), y.argmax(axis=1), out=correct, casting="unsafe")
    if grad_out is not None:
        probs = np.exp(shifted) / sums                                         # (B, C) softmax
        grad_out[...] = (probs * ys.sum(axis=1, keepdims=True) - ys) * dtype(scale)
    return loss, grad_out, correct


# --- kernel --------------------------------------------------------------------------------

def _make_kernel(with_grad):
    @cuda.jit
    def categorical_xent_kernel(logits, targets, loss, grad, correct, scale, smoothing):
        """One thread per row r (grid-stride); logits, targets, grad (B, C), C >= 1; loss,
        correct (B,); grad ignored unless ``with_grad`` (a compile-time constant). Loop nest:
            for r in range(B):
                m, s, best, ybest, ysum = z[r, 0], 1, 0, 0, y[r, 0]
                for j in 1..C-1:   # sweep 1: online max and sum, argmax z, argmax y, sum y
                for j in 0..C-1:   # sweep 2: ys = y (1 - smoothing) + smoothing / C
                    loss += ys * (m + log s - z);  grad = (exp(z - m) / s * sum(ys) - ys) * scale
        """
        rows, cols = logits.shape
        keep = float32(1.0) - smoothing
        spread = smoothing / float32(cols)
        for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
            m = logits[r, 0]
            s = float32(1.0)                      # sum_j exp(z[j] - m), rescaled as m grows
            best = 0
            ybest = 0
            ysum = targets[r, 0]
            for j in range(1, cols):
                v = logits[r, j]
                if v > m or (math.isnan(v) and not math.isnan(m)):   # first max (or NaN), as np.argmax
                    s = s * math.exp(m - v) + float32(1.0)
                    m = v
                    best = j
                else:
                    s += math.exp(v - m)
                t = targets[r, j]
                u = targets[r, ybest]
                if t > u or (math.isnan(t) and not math.isnan(u)):
                    ybest = j
                ysum += t
            lse = m + math.log(s)
            ys_sum = ysum * keep + smoothing      # sum_j ys[j]
            inv = scale / s                        # softmax * scale = exp(z - m) * (scale / s)
            total = float32(0.0)
            for j in range(cols):
                v = logits[r, j]
                ys = targets[r, j] * keep + spread
                total += ys * (lse - v)
                if with_grad:
                    grad[r, j] = math.exp(v - m) * inv * ys_sum - ys * scale
            loss[r] = total
            correct[r] = float32(1.0) if best == ybest else float32(0.0)

    return categorical_xent_kernel


#: Compiled kernels, keyed by with_grad (False: evaluation, no gradient written).
KERNELS = {g: _make_kernel(g) for g in (False, True)}

for _with_grad, _kernel in KERNELS.items():
    register(_kernel, "categorical_xent_kernel",
             [sig(mat("float32"), mat("float32"), vec("float32"), mat("float32"), vec("float32"),
                  "float32", "float32")],
             block=grid_1d(1)[1], variant=f"with_grad={_with_grad}")


# --- launcher ------------------------------------------------------------------------------

def categorical_xent(logits, targets, loss_out, grad_out, correct_out, scale=1.0,
                     label_smoothing=0.0, stream=None):
    """The fused categorical cross-entropy on the GPU (see the module docstring).

    logits, targets (B, C) float32; loss_out, correct_out (B,) float32; grad_out (B, C)
    float32 or None (no gradient). All C-contiguous on the device, outputs disjoint from
    the inputs and each other. Returns (loss_out, grad_out, correct_out)."""
    check_array("categorical_xent: logits", logits, np.float32, ndim=2)
    b, c = logits.shape
    check_array("categorical_xent: targets", targets, np.float32, shape=(b, c))
    check_array("categorical_xent: loss_out", loss_out, np.float32, shape=(b,))
    check_array("categorical_xent: correct_out", correct_out, np.float32, shape=(b,))
    if grad_out is not None:
        check_array("categorical_xent: grad_out", grad_out, np.float32, shape=(b, c))
    if b and not c:
        raise ValueError(f"categorical_xent: need at least one class, got shape {tuple(logits.shape)}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"categorical_xent: label_smoothing must lie in [0, 1], got {label_smoothing}.")
    outs = [o for o in (loss_out, grad_out, correct_out) if o is not None]
    for i, o in enumerate(outs):             # each output clear of the inputs and the later outputs
        check_no_alias("categorical_xent", o, logits, targets, *outs[i + 1:])
    if b == 0:
        return loss_out, grad_out, correct_out
    with_grad = grad_out is not None
    # Without a gradient the kernel never touches ``grad``: the logits fill the slot.
    launch(KERNELS[with_grad], *grid_1d(b), stream, logits, targets, loss_out,
           grad_out if with_grad else logits, correct_out, np.float32(scale),
           np.float32(label_smoothing))
    return loss_out, grad_out, correct_out
