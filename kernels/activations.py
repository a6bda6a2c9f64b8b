"""Dense-layer activations: fused bias-add + ReLU, ReLU backward, bias-add alone, softmax.

Versions: v1 only.

    bias_relu      out = max(x + bias, 0)     Dense(activation="relu") forward, fused so
                                              x is read once instead of twice
    relu_backward  dx = dy where y > 0 else 0 needs only the forward *output* y
                                              (y > 0 exactly where x + bias > 0)
    bias_add       out = x + bias             Dense with no activation (the logits layer)
    softmax        row-wise, stable           Dense(activation="softmax")

The first three are elementwise over a (B, N) matrix: one thread per element with a
grid-stride loop over the flattened array, bias indexed by the column ``i % N``.
Memory-bound, so coalescing (consecutive threads, consecutive addresses) is all that
matters. Softmax needs a whole row: one thread per row, three sweeps over the row.
That is right for the narrow rows of a classifier (10 classes, read from L1 after
the first sweep); a wide row (thousands of columns) would want a block per row and a
shared-memory reduction, which this project does not need.

NaN: every kernel gives NaN exactly where its NumPy reference does (ReLU keeps a NaN,
as ``np.maximum``; its backward passes no gradient where the output is NaN, as
``y > 0``; softmax makes a row holding a NaN all NaN); tests/test_nan.py checks it.

In place is allowed: ``out`` may be the very same array as ``x`` (each element is read
and then written by the same thread), but must not partly overlap an input or
overlap ``bias``.

Layout: NumPy references ``*_ref`` (the CPU backend calls them, any float dtype) →
kernels → launchers (check, then ``launch``).
"""
import math

import numpy as np
from numba import cuda, float32

from kernels.launch import check_array, check_out, flat, grid_1d, launch
from kernels.registry import mat, register, sig, vec


# --- NumPy references ------------------------------------------------------------

def bias_relu_ref(x, bias, out=None):
    """max(x + bias, 0) for x (B, N), bias (N,); written into ``out`` when given."""
    out = np.add(x, bias, out=out)  # (B, N)
    return np.maximum(out, 0, out=out)


def relu_backward_ref(dy, y, out=None):
    """dx = dy where y > 0 else 0; y is the ReLU *output* (B, N)."""
    keep = y > 0  # (B, N) bool, taken before out (which may be y) is written
    if out is None:
        out = np.empty_like(dy)  # (B, N)
    np.copyto(out, dy)
    np.copyto(out, 0, where=~keep)
    return out


def bias_add_ref(x, bias, out=None):
    """x + bias for x (B, N), bias (N,)."""
    return np.add(x, bias, out=out)


def softmax_ref(x, out=None):
    """Row-wise softmax of x (B, C), stable: exp(x - rowmax) / sum(exp(x - rowmax))."""
    out = np.subtract(x, x.max(axis=1, keepdims=True), out=out)  # (B, C), <= 0
    np.exp(out, out=out)
    out /= out.sum(axis=1, keepdims=True)
    return out


# --- kernels ---------------------------------------------------------------------

@cuda.jit
def bias_relu_kernel(x, bias, out):
    """One thread per element i of the flattened (B, N) arrays (grid-stride).
    Preconditions: x, out are 1-D views of C-contiguous (B, N); bias has N elements.
    Loop nest: for i in range(B * N): out[i] = max(x[i] + bias[i % N], 0).
    NaN stays NaN, as NumPy's ``maximum`` keeps it (``v > 0`` alone is False for NaN and
    would turn it into 0: a NaN input would then give finite outputs on GPUs only).
    """
    n = bias.size
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        v = x[i] + bias[i % n]
        out[i] = v if (v > 0 or math.isnan(v)) else float32(0.0)


@cuda.jit
def relu_backward_kernel(dy, y, out):
    """One thread per element i (grid-stride); all arrays flattened, same size.
    Loop nest: for i in range(size): out[i] = dy[i] if y[i] > 0 else 0.
    """
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = dy[i] if y[i] > 0 else float32(0.0)


@cuda.jit
def bias_add_kernel(x, bias, out):
    """One thread per element i of the flattened (B, N) arrays (grid-stride).
    Loop nest: for i in range(B * N): out[i] = x[i] + bias[i % N].
    """
    n = bias.size
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = x[i] + bias[i % n]


@cuda.jit
def softmax_kernel(x, out):
    """One thread per row r (grid-stride over rows) of x, out: (B, C), C >= 1.
    Three sweeps over the row: its max m, the sum s of exp(x - m), then the output.
    Subtracting the max makes every exponent <= 0, so exp never overflows.
    Loop nest: for r in range(B): m = max_j x[r, j]; s = sum_j exp(x[r, j] - m);
               for j in range(C): out[r, j] = exp(x[r, j] - m) / s.
    """
    rows, cols = x.shape
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        m = x[r, 0]
        for j in range(1, cols):
            m = max(m, x[r, j])
        s = float32(0.0)
        for j in range(cols):
            s += math.exp(x[r, j] - m)
        inv = float32(1.0) / s
        for j in range(cols):
            out[r, j] = math.exp(x[r, j] - m) * inv


# What the real compiler checks (kernels/registry.py): the launchers below pass
# flattened float32 vectors to the elementwise kernels and (B, C) matrices to softmax.
_F32 = vec("float32")
register(bias_relu_kernel, "bias_relu_kernel", sig(_F32, _F32, _F32), block=grid_1d(1)[1])
register(relu_backward_kernel, "relu_backward_kernel", sig(_F32, _F32, _F32),
         block=grid_1d(1)[1])
register(bias_add_kernel, "bias_add_kernel", sig(_F32, _F32, _F32), block=grid_1d(1)[1])
register(softmax_kernel, "softmax_kernel", sig(mat("float32"), mat("float32")),
         block=grid_1d(1)[1])


# --- launchers -----------------------------------------------------------------------


def _check_bias_args(what, x, bias, out):
    check_array(f"{what}: x", x, np.float32, ndim=2)
    check_array(f"{what}: bias", bias, np.float32, shape=(x.shape[1],))
    check_array(f"{what}: out", out, np.float32, shape=x.shape)
    check_out(what, out, same_ok=(x,), others=(bias,))


def bias_relu(x, bias, out, stream=None):
    """out = max(x + bias, 0) on the GPU. x, out: (B, N) float32; bias (N,) float32;
    all C-contiguous; ``out`` may be ``x`` (in place)."""
    _check_bias_args("bias_relu", x, bias, out)
    if out.size:
        launch(bias_relu_kernel, *grid_1d(out.size), stream, flat(x), bias, flat(out))
    return out


def relu_backward(dy, y, out, stream=None):
    """out = dy where y > 0 else 0 on the GPU. dy, y, out: same shape, float32,
    C-contiguous; ``out`` may be ``dy`` or ``y`` (in place)."""
    check_array("relu_backward: dy", dy, np.float32)
    check_array("relu_backward: y", y, np.float32, shape=dy.shape)
    check_array("relu_backward: out", out, np.float32, shape=dy.shape)
    check_out("relu_backward", out, same_ok=(dy, y), others=())
    if out.size:
        launch(relu_backward_kernel, *grid_1d(out.size), stream, flat(dy), flat(y),
               flat(out))
    return out


def bias_add(x, bias, out, stream=None):
    """out = x + bias on the GPU. x, out: (B, N) float32; bias (N,) float32."""
    _check_bias_args("bias_add", x, bias, out)
    if out.size:
        launch(bias_add_kernel, *grid_1d(out.size), stream, flat(x), bias, flat(out))
    return out


def softmax(x, out, stream=None):
    """Row-wise softmax on the GPU. x, out: (B, C) float32, C-contiguous;
    ``out`` may be ``x`` (each row is read, then written, by one thread)."""
    check_array("softmax: x", x, np.float32, ndim=2)
    check_array("softmax: out", out, np.float32, shape=x.shape)
    check_out("softmax", out, same_ok=(x,), others=())
    if out.size:
        launch(softmax_kernel, *grid_1d(x.shape[0]), stream, x, out)
    return out
