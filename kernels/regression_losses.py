"""Per-example losses against float targets: mean squared error and binary cross-entropy.

Keras's ``MeanSquaredError`` (``loss='mse'``) and ``BinaryCrossentropy``, fused with their
gradient as ``softmax_xent.py`` fuses the classification loss. For a row r of C outputs
``z`` (the model's last layer) and targets ``y``, each loss is the mean over the row:

    mse            loss[r] = mean_j (z - y)^2                       grad = 2 (z - y) / C * scale
    bce, logits    loss[r] = mean_j max(z, 0) - z y + log1p(exp(-|z|))   grad = (sigmoid(z) - y) / C * scale
    bce, probs     p = clip(z, EPSILON, 1 - EPSILON)
                   loss[r] = mean_j -(y log p + (1 - y) log(1 - p))  grad = (p - y) / (p (1 - p)) / C * scale
                   (0 where the clip is active, as TF's gradient of clip_by_value)

The logits form is TensorFlow's ``sigmoid_cross_entropy_with_logits``: no exp of a
positive number, so it never overflows. ``scale`` folds in the loss reduction
(``1 / global batch`` in training), as in ``softmax_xent``.

Thread -> data: one thread per row r (grid-stride over rows), looping over its C
columns; rows are short here (a regression head has a few outputs), so a row per
thread is the simple version that is enough. NumPy reference: ``regression_loss_ref``,
which the CPU backend runs and the tests compare the kernel with.
"""
import math

import numpy as np
from numba import cuda, float32

from kernels.launch import check_array, check_no_alias, grid_1d, launch
from kernels.registry import mat, register, sig, vec
from kernels.softmax_xent import EPSILON

#: The losses, by the name ``mirrored.keras.losses`` gives the model program.
KINDS = ("mse", "bce_logits", "bce_probs")


def regression_loss_ref(kind, pred, target, loss_out=None, grad_out=None, scale=1.0):
    """The NumPy reference: ``loss_out`` (B,) and, if given, ``grad_out`` (B, C), float32."""
    if kind not in KINDS:
        raise ValueError(f"regression loss kind must be one of {KINDS}, got {kind!r}.")
    z = np.asarray(pred, np.float32)
    y = np.asarray(target, np.float32)
    if z.shape != y.shape or z.ndim != 2:
        raise ValueError(f"{kind}: predictions {z.shape} and targets {y.shape} must both be (B, C).")
    b, c = z.shape
    loss_out = np.empty(b, np.float32) if loss_out is None else loss_out
    if b == 0:
        return loss_out, grad_out
    if kind == "mse":
        d = z - y
        loss_out[...] = (d * d).mean(axis=1)
        grad = 2.0 * d
    elif kind == "bce_logits":
        loss_out[...] = (np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))).mean(axis=1)
        grad = 1.0 / (1.0 + np.exp(-z)) - y
    else:
        p = np.clip(z, EPSILON, 1 - EPSILON)
        loss_out[...] = (-(y * np.log(p) + (1 - y) * np.log(1 - p))).mean(axis=1)
        inside = (z >= EPSILON) & (z <= 1 - EPSILON)
        grad = np.where(inside, (p - y) / (p * (1 - p)), 0.0)
    if grad_out is not None:
        grad_out[...] = grad * np.float32(scale / c)
    return loss_out, grad_out


def _make_kernel(kind, with_grad):
    mse, logits = kind == "mse", kind == "bce_logits"

    @cuda.jit
    def regression_loss_kernel(pred, target, loss, grad, scale):
        """One thread per row r (grid-stride); pred, target, grad (B, C); loss (B,)."""
        rows, cols = pred.shape
        lo = float32(EPSILON)
        hi = float32(1.0) - lo
        per_col = scale / float32(cols)
        for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
            total = float32(0.0)
            for j in range(cols):
                z = pred[r, j]
                y = target[r, j]
                if mse:
                    d = z - y
                    total += d * d
                    g = float32(2.0) * d
                elif logits:
                    total += max(z, float32(0.0)) - z * y + math.log1p(math.exp(-abs(z)))
                    g = float32(1.0) / (float32(1.0) + math.exp(-z)) - y
                else:
                    p = min(max(z, lo), hi)
                    total += -(y * math.log(p) + (float32(1.0) - y) * math.log(float32(1.0) - p))
                    g = (p - y) / (p * (float32(1.0) - p)) if lo <= z <= hi else float32(0.0)
                if with_grad:
                    grad[r, j] = g * per_col
            loss[r] = total / float32(cols)

    return regression_loss_kernel


#: Compiled kernels, keyed by (kind, with_grad).
KERNELS = {(k, g): _make_kernel(k, g) for k in KINDS for g in (False, True)}

for (_kind, _with_grad), _kernel in KERNELS.items():
    register(_kernel, "regression_loss_kernel",
             [sig(mat("float32"), mat("float32"), vec("float32"), mat("float32"), "float32")],
             block=grid_1d(1)[1], variant=f"kind={_kind}, with_grad={_with_grad}")


def regression_loss(kind, pred, target, loss_out, grad_out=None, scale=1.0, stream=None):
    """The loss (and gradient, unless ``grad_out`` is None) on the GPU; arguments as the
    reference, every array float32, C-contiguous, on the device."""
    if kind not in KINDS:
        raise ValueError(f"regression loss kind must be one of {KINDS}, got {kind!r}.")
    check_array(f"{kind}: pred", pred, np.float32, ndim=2)
    b, c = pred.shape
    check_array(f"{kind}: target", target, np.float32, shape=(b, c))
    check_array(f"{kind}: loss_out", loss_out, np.float32, shape=(b,))
    if grad_out is not None:
        check_array(f"{kind}: grad_out", grad_out, np.float32, shape=(b, c))
        check_no_alias(kind, grad_out, pred, target, loss_out)
    check_no_alias(kind, loss_out, pred, target)
    if b == 0:
        return loss_out, grad_out
    with_grad = grad_out is not None
    launch(KERNELS[(kind, with_grad)], *grid_1d(b), stream, pred, target, loss_out,
           grad_out if with_grad else pred, np.float32(scale))
    return loss_out, grad_out
