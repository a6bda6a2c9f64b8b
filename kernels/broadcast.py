"""Elementwise ops between arrays of different shapes: NumPy's broadcasting, by strides.

What ``x + bias_row``, ``x * tf.constant(2.0)``, ``x > 0`` and ``tf.where(c, a, b)`` run.
(``kernels/elementwise.py`` keeps the same-shape fast path the engine's layers use.)

Broadcasting, as NumPy and TensorFlow define it: shapes are aligned at the right; a
dimension of 1 (or a missing one) is stretched to the other's size. The trick that makes
one kernel serve every pair of shapes: give a stretched dimension the *stride 0*. Then
output element ``i``, decomposed into its index ``(i_0, ..., i_{d-1})`` in the output's
shape, reads ``x[sum_k i_k * xs_k]`` and ``y[sum_k i_k * ys_k]``; nothing is copied.

    shapes (4, 3) and (3,)  ->  out (4, 3), x strides (3, 1), y strides (0, 1)

Layout (as every file in ``kernels/``):
    tables            ``ARITHMETIC`` (result in the inputs' dtype), ``COMPARISON`` and
                      ``LOGICAL`` (result bool)
    NumPy references  ``broadcast_binary_ref``, ``where_ref``, ``broadcast_strides``
    (kernels, registration and launchers follow the references; the CPU backend,
    ``mirrored/backends.py``, calls the references, so the math has one definition)

TensorFlow's definitions kept here: ``floordiv`` rounds toward -inf and ``mod`` takes the
divisor's sign (``tf.math.floordiv``, ``tf.math.floormod``, Python's ``//`` and ``%``);
``pow`` of integers is integer power; ``maximum``/``minimum`` propagate NaN (as
``np.maximum``); comparisons of NaN are False except ``!=``.
"""
import numpy as np

#: Rank the kernels take (TensorFlow's own broadcasting kernels stop at 8; images are 4-D).
MAX_DIMS = 6

#: op -> NumPy function; result in the inputs' (common) dtype.
ARITHMETIC = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,                  # floats only (Tensor casts integers first, as TF's truediv)
    "floordiv": np.floor_divide,
    "mod": np.mod,                     # floor mod: the divisor's sign
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "squared_difference": lambda x, y: np.square(x - y),
}
#: op -> NumPy function; result bool.
COMPARISON = {
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "equal": np.equal,
    "not_equal": np.not_equal,
}
#: op -> NumPy function on bool inputs; result bool.
LOGICAL = {
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}
ALL_OPS = {**ARITHMETIC, **COMPARISON, **LOGICAL}


def result_dtype(op, dtype):
    """The dtype ``op`` answers in for inputs of ``dtype``."""
    return np.dtype(np.bool_) if op in COMPARISON or op in LOGICAL else np.dtype(dtype)


def broadcast_shape(*shapes):
    """NumPy's broadcast of ``shapes``, or ValueError naming them."""
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        raise ValueError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} are incompatible: "
                         f"aligned at the right, each pair of dimensions must be equal or one of "
                         f"them 1.") from None


def broadcast_strides(shape, out_shape):
    """Element strides that read a C-contiguous array of ``shape`` at each index of
    ``out_shape``: 0 along a stretched (or missing) dimension."""
    shape, out_shape = tuple(shape), tuple(out_shape)
    pad = len(out_shape) - len(shape)
    strides, step = [0] * len(out_shape), 1
    for k in range(len(shape) - 1, -1, -1):
        strides[pad + k] = step if shape[k] != 1 or out_shape[pad + k] == 1 else 0
        step *= shape[k]
    return tuple(strides)


# --- NumPy references -------------------------------------------------------------------------

def broadcast_binary_ref(op, x, y):
    """``x <op> y`` with NumPy broadcasting; x and y of one dtype; bool for comparisons."""
    out = ALL_OPS[op](x, y)
    return np.asarray(out).astype(result_dtype(op, x.dtype), copy=False)


def where_ref(cond, x, y):
    """``x`` where ``cond``, else ``y``, all three broadcast together (``tf.where``)."""
    return np.where(cond, x, y).astype(x.dtype, copy=False)
