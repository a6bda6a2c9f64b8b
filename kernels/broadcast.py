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
    host helpers      ``collapse_dims`` (fewer dimensions, same walk), ``padded`` (to MAX_DIMS)
    device functions  one switch per table: the operator is a scalar argument
    kernels           ``broadcast_binary_kernel`` (one build per table), ``where_kernel``
    launchers         ``broadcast_binary``, ``where``: check, collapse, pad, launch
(the CPU backend, ``mirrored/backends.py``, calls the references, so the math has one
definition; the GPU backend calls the launchers)

Thread -> data: one thread per output element (grid-stride over the flat output); the
thread unravels its flat index over out's shape (padded to MAX_DIMS, passed as scalar
arguments: a replayed CUDA graph needs no uploaded shape array) and reads each operand
at ``index . strides``. Same shapes collapse to one dimension on the host, so the
common case walks all three arrays in order (coalesced). The same-shape ``+ - * /`` of
the engine's layers keep ``kernels/elementwise.py``'s kernels, which skip the unravel.

TensorFlow's definitions kept here: ``floordiv`` rounds toward -inf and ``mod`` takes the
divisor's sign (``tf.math.floordiv``, ``tf.math.floormod``, Python's ``//`` and ``%``);
``pow`` of integers is integer power; ``maximum``/``minimum`` propagate NaN (as
``np.maximum``); comparisons of NaN are False except ``!=``.
"""
import numpy as np
from numba import cuda

from kernels.launch import check_array, flat, grid_1d, launch
from kernels.registry import TENSOR_DTYPES, register, sig, vec

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


_BOOL = np.dtype(np.bool_)


def result_dtype(op, dtype):
    """The dtype ``op`` answers in for inputs of ``dtype``."""
    return _BOOL if op in COMPARISON or op in LOGICAL else np.dtype(dtype)


def broadcast_shape(*shapes):
    """NumPy's broadcast of ``shapes`` (aligned at the right; a 1 stretches to the other
    size), or ValueError naming them. Plain Python: it runs once per op, on tiny tuples."""
    shapes = [tuple(s) for s in shapes]
    first = shapes[0]
    if all(s == first for s in shapes):
        return first
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        size = 1
        for s in shapes:
            n = s[k - rank + len(s)] if k >= rank - len(s) else 1
            if n != 1:
                if size not in (1, n):
                    raise ValueError(f"shapes {' and '.join(str(t) for t in shapes)} are incompatible: "
                                     f"aligned at the right, each pair of dimensions must be equal or "
                                     f"one of them 1.")
                size = n
        out.append(size)
    return tuple(out)


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


# --- the host's half of the index arithmetic ---------------------------------------------------

def collapse_dims(shape, *strides):
    """The same walk over fewer dimensions: drops the dimensions of size 1 and merges
    neighbours k-1, k wherever every operand steps through them as through one dimension
    (``strides[k-1] == strides[k] * shape[k]`` for each). Returns (shape, [strides, ...]),
    at least one dimension. Same shapes collapse to one dimension, ``(4, 3) + (3,)`` stays
    two: the kernel's divisions then run on the padded 1s, which are cheap to reason
    about, and a rank-8 operand that collapses to 6 still fits ``MAX_DIMS``.

        collapse_dims((2, 3, 4), (12, 4, 1), (0, 0, 1))  ->  ((6, 4), [(4, 1), (0, 1)])
    """
    dims = [(n, [s[k] for s in strides]) for k, n in enumerate(shape) if n != 1]
    merged = []
    for n, st in dims:
        if merged and all(prev == cur * n for prev, cur in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * n, st)             # the outer one folds into this one
        else:
            merged.append((n, st))
    if not merged:
        merged = [(1, [0] * len(strides))]
    return tuple(n for n, _ in merged), [tuple(st[k] for _, st in merged)
                                         for k in range(len(strides))]


def padded(what, shape, *strides):
    """``shape`` and each of ``strides`` padded on the left to MAX_DIMS (size 1, stride 0),
    as plain ints: what the kernels take as scalar arguments. ValueError past MAX_DIMS."""
    pad = MAX_DIMS - len(shape)
    if pad < 0:
        raise ValueError(f"{what}: {len(shape)} dimensions after merging the contiguous ones "
                         f"(shape {tuple(shape)}); the kernels take at most {MAX_DIMS}. "
                         f"Reshape the operands to fewer dimensions first.")
    return ((1,) * pad + tuple(int(n) for n in shape),
            *[(0,) * pad + tuple(int(s) for s in st) for st in strides])


# --- device functions: the scalar math of each operator ----------------------------------------
# One kernel serves every operator of a table: the operator is a number (its place in the
# table), passed as a scalar, and every thread of a launch takes the same branch. (One
# compiled kernel per operator and dtype would be ~70 kernels; the real compiler checks
# each for 4 architectures in CI, ~0.2 s apiece.)

ADD, SUB, MUL, DIV, FLOORDIV, MOD, POW, MAXIMUM, MINIMUM, SQUARED_DIFFERENCE = range(10)
LESS, LESS_EQUAL, GREATER, GREATER_EQUAL, EQUAL, NOT_EQUAL = range(6)
LOGICAL_AND, LOGICAL_OR, LOGICAL_XOR = range(3)
#: op name -> the number the kernels switch on (its place in its table).
OP_CODE = {**{op: k for k, op in enumerate(ARITHMETIC)}, **{op: k for k, op in enumerate(COMPARISON)},
           **{op: k for k, op in enumerate(LOGICAL)}}
assert [OP_CODE[op] for op in ("squared_difference", "not_equal", "logical_xor")] == [
    SQUARED_DIFFERENCE, NOT_EQUAL, LOGICAL_XOR], "the op numbers must follow the tables' order"


@cuda.jit(device=True, inline="always")
def _true_div(a, b):
    return a / b


@cuda.jit(device=True, inline="always")
def _floor_div(a, b):
    return a // b


@cuda.jit(device=True, inline="always")
def _float_pow(a, b):
    return a ** b


@cuda.jit(device=True, inline="always")
def _int_pow(a, b):
    """a ** b for integers by repeated squaring, wrapping as NumPy's integer power does
    (Numba's own ``**`` on integers goes through float64 pow). A negative exponent, which
    NumPy and TensorFlow refuse, gives 1 here (the kernel does not check elements)."""
    result = a - a + 1
    while b > 0:
        if b & 1:
            result *= a
        a *= a
        b >>= 1
    return result


def _make_arithmetic(div, power):
    """The ARITHMETIC switch; ``div`` and ``power`` are its DIV and POW branches: ``a / b``
    and ``a ** b`` for floats. Integers never reach DIV (the launcher refuses them, as TF's
    truediv casts first), so their kernel is compiled with ``a // b`` there: ``a / b`` on
    integers is float64 in Numba; their POW is ``_int_pow``."""
    @cuda.jit(device=True, inline="always")
    def arithmetic(op, a, b):
        """ARITHMETIC[op](a, b). ``//`` and ``%`` are Numba's, which follow Python (and
        NumPy): floor division, the divisor's sign, for integers and floats alike; ``**``
        of integers is integer power; maximum/minimum return a NaN operand (np.maximum's
        ``a >= b or isnan(a) ? a : b``)."""
        if op == ADD:
            return a + b
        if op == SUB:
            return a - b
        if op == MUL:
            return a * b
        if op == DIV:
            return div(a, b)
        if op == FLOORDIV:
            return a // b
        if op == MOD:
            return a % b
        if op == POW:
            return power(a, b)
        if op == MAXIMUM:
            return a if (a >= b or a != a) else b
        if op == MINIMUM:
            return a if (a <= b or a != a) else b
        d = a - b                                   # SQUARED_DIFFERENCE
        return d * d
    return arithmetic


_arithmetic_float = _make_arithmetic(_true_div, _float_pow)
_arithmetic_int = _make_arithmetic(_floor_div, _int_pow)


@cuda.jit(device=True, inline="always")
def _compare(op, a, b):
    """COMPARISON[op](a, b): IEEE comparisons, so any NaN gives False except ``!=``."""
    if op == LESS:
        return a < b
    if op == LESS_EQUAL:
        return a <= b
    if op == GREATER:
        return a > b
    if op == GREATER_EQUAL:
        return a >= b
    if op == EQUAL:
        return a == b
    return a != b                                   # NOT_EQUAL


@cuda.jit(device=True, inline="always")
def _logical(op, a, b):
    """LOGICAL[op](a, b) on bools."""
    if op == LOGICAL_AND:
        return a and b
    if op == LOGICAL_OR:
        return a or b
    return a != b                                   # LOGICAL_XOR


@cuda.jit(device=True, inline="always")
def _unravel(i, n1, n2, n3, n4, n5):
    """(k0, ..., k5): the index of flat element ``i`` in a C-order shape (n0, ..., n5).
    n0 is not needed: k0 is what is left after dividing by the others."""
    k5 = i % n5
    i //= n5
    k4 = i % n4
    i //= n4
    k3 = i % n3
    i //= n3
    k2 = i % n2
    i //= n2
    return i // n1, i % n1, k2, k3, k4, k5


# --- kernels ----------------------------------------------------------------------------------

def _make_binary_kernel(fn):
    @cuda.jit
    def broadcast_binary_kernel(x, y, out, op, n1, n2, n3, n4, n5,
                                xs0, xs1, xs2, xs3, xs4, xs5, ys0, ys1, ys2, ys3, ys4, ys5):
        """One thread per output element i (grid-stride over the flat ``out``).
        out's shape, padded to MAX_DIMS, is (n0, n1, ..., n5); x and y are read through
        their element strides (0 on a stretched axis). Loop nest:
            for i in range(out.size):
                k = unravel(i, out.shape)
                out[i] = fn(op, x[k . xs], y[k . ys])
        """
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            k0, k1, k2, k3, k4, k5 = _unravel(i, n1, n2, n3, n4, n5)
            xi = k0 * xs0 + k1 * xs1 + k2 * xs2 + k3 * xs3 + k4 * xs4 + k5 * xs5
            yi = k0 * ys0 + k1 * ys1 + k2 * ys2 + k3 * ys3 + k4 * ys4 + k5 * ys5
            out[i] = fn(op, x[xi], y[yi])
    return broadcast_binary_kernel


#: table -> the kernel that switches over it; the arithmetic one in two builds (see
#: ``_make_arithmetic``).
ARITHMETIC_FLOAT_KERNEL = _make_binary_kernel(_arithmetic_float)
ARITHMETIC_INT_KERNEL = _make_binary_kernel(_arithmetic_int)
COMPARISON_KERNEL = _make_binary_kernel(_compare)
LOGICAL_KERNEL = _make_binary_kernel(_logical)


@cuda.jit
def where_kernel(cond, x, y, out, n1, n2, n3, n4, n5, cs0, cs1, cs2, cs3, cs4, cs5,
                 xs0, xs1, xs2, xs3, xs4, xs5, ys0, ys1, ys2, ys3, ys4, ys5):
    """One thread per output element i (grid-stride), as ``broadcast_binary_kernel``,
    with three operands read through their strides: out[i] = x[.] if cond[.] else y[.]
    (a select: a NaN or inf in the branch not taken does not leak)."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        k0, k1, k2, k3, k4, k5 = _unravel(i, n1, n2, n3, n4, n5)
        ci = k0 * cs0 + k1 * cs1 + k2 * cs2 + k3 * cs3 + k4 * cs4 + k5 * cs5
        if cond[ci]:
            out[i] = x[k0 * xs0 + k1 * xs1 + k2 * xs2 + k3 * xs3 + k4 * xs4 + k5 * xs5]
        else:
            out[i] = y[k0 * ys0 + k1 * ys1 + k2 * ys2 + k3 * ys3 + k4 * ys4 + k5 * ys5]


# --- what the real compiler checks (kernels/registry.py) ---------------------------------------

FLOAT_DTYPES = ("float32", "float64")
INT_DTYPES = ("int32", "int64")
#: Numba's name for NumPy's bool in a signature.
BOOL = "boolean"
_INTS = ("int64",) * (1 + 5 + 2 * MAX_DIMS)                  # op, n1..n5, xs0..xs5, ys0..ys5
_BLOCK = grid_1d(1)[1]
for _kernel, _variant, _dtypes, _result in (
        (ARITHMETIC_FLOAT_KERNEL, "arithmetic, floats", FLOAT_DTYPES, None),
        (ARITHMETIC_INT_KERNEL, "arithmetic, integers", INT_DTYPES, None),
        (COMPARISON_KERNEL, "comparison", TENSOR_DTYPES, BOOL),
        (LOGICAL_KERNEL, "logical", (BOOL,), BOOL)):
    register(_kernel, "broadcast_binary_kernel",
             [sig(vec(t), vec(t), vec(_result or t), *_INTS) for t in _dtypes],
             block=_BLOCK, variant=_variant)
register(where_kernel, "where_kernel",
         [sig(vec(BOOL), vec(t), vec(t), vec(t), *("int64",) * (5 + 3 * MAX_DIMS))
          for t in TENSOR_DTYPES], block=_BLOCK)


# --- launchers --------------------------------------------------------------------------------

def _kernel_for(op, dtype):
    """The kernel that computes ``op`` on ``dtype``, or an error saying what is supported."""
    dtype = np.dtype(dtype)
    if op in LOGICAL:
        if dtype != np.bool_:
            raise TypeError(f"{op} takes bool tensors, got {dtype}.")
        return LOGICAL_KERNEL
    if op not in ALL_OPS:
        raise ValueError(f"unknown broadcasting operator {op!r}; expected one of {sorted(ALL_OPS)}.")
    if dtype.name not in TENSOR_DTYPES:
        raise TypeError(f"{op}: tensors of {dtype} are not supported on the GPU; expected one "
                        f"of {TENSOR_DTYPES}.")
    if op in COMPARISON:
        return COMPARISON_KERNEL
    if dtype.kind == "f":
        return ARITHMETIC_FLOAT_KERNEL
    if op == "div":
        raise TypeError(f"div of {dtype} tensors: cast to a float dtype first (TensorFlow's "
                        f"truediv does the same).")
    return ARITHMETIC_INT_KERNEL


def _operand_strides(what, operands, out):
    """Broadcast strides of each operand into ``out``'s shape, after checking that their
    shapes broadcast to exactly that shape."""
    shape = broadcast_shape(*(a.shape for a in operands))
    if tuple(out.shape) != shape:
        raise ValueError(f"{what}: out has shape {tuple(out.shape)}, but the operands "
                         f"{' and '.join(str(tuple(a.shape)) for a in operands)} broadcast to {shape}.")
    return [broadcast_strides(a.shape, shape) for a in operands]


def broadcast_binary(op, x, y, out, stream=None):
    """out = x <op> y on the GPU, with NumPy broadcasting (``broadcast_binary_ref``).
    x, y: one dtype, C-contiguous, any shapes that broadcast to out's; out: that shape,
    ``result_dtype(op, x.dtype)`` (bool for comparisons and logical ops)."""
    kernel = _kernel_for(op, x.dtype)
    check_array(f"{op}: x", x, x.dtype)
    check_array(f"{op}: y", y, x.dtype)
    check_array(f"{op}: out", out, result_dtype(op, x.dtype))
    strides = _operand_strides(op, (x, y), out)
    if out.size:
        shape, xs, ys = padded(op, *_collapsed(out.shape, strides))
        launch(kernel, *grid_1d(out.size), stream, flat(x), flat(y), flat(out), OP_CODE[op],
               *shape[1:], *xs, *ys)
    return out


def where(cond, x, y, out, stream=None):
    """out = x where cond else y on the GPU (``where_ref``); cond bool, x, y and out of one
    dtype, all C-contiguous, broadcast together to out's shape."""
    check_array("where: cond", cond, np.bool_)
    check_array("where: x", x, x.dtype)
    check_array("where: y", y, x.dtype)
    check_array("where: out", out, x.dtype)
    if np.dtype(x.dtype).name not in TENSOR_DTYPES:
        raise TypeError(f"where: tensors of {np.dtype(x.dtype)} are not supported on the GPU; "
                        f"expected one of {TENSOR_DTYPES}.")
    strides = _operand_strides("where", (cond, x, y), out)
    if out.size:
        shape, cs, xs, ys = padded("where", *_collapsed(out.shape, strides))
        launch(where_kernel, *grid_1d(out.size), stream, flat(cond), flat(x), flat(y), flat(out),
               *shape[1:], *cs, *xs, *ys)
    return out


def _collapsed(shape, strides):
    """(shape, *strides) after ``collapse_dims``: the arguments ``padded`` takes."""
    shape, strides = collapse_dims(shape, *strides)
    return (shape, *strides)
