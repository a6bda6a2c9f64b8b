"""Elementwise functions of one tensor: ``tf.abs``, ``tf.exp``, ``tf.nn.relu``, ...

One thread per element over the flattened array (grid-stride), like
``kernels/elementwise.py``: memory-bound, so all that matters is coalesced access.

Layout (as every file in ``kernels/``):
    table             ``UNARY_MATH``: op -> NumPy function (the definition)
    NumPy reference   ``unary_math_ref``
    device functions  one switch over the table per dtype (constants in that dtype)
    kernels           ``unary_math_kernel`` (one build per dtype), ``sin_cos_kernel``
                      (libdevice's trig reduction needs a stack frame: kept apart),
                      ``logical_not_kernel``
    launcher          ``unary_math``: check, launch
(the CPU backend calls the reference, the GPU backend the launcher)

Thread -> data: one thread per element i of the flattened arrays (grid-stride):
``out[i] = op(x[i])``. The operator is a scalar argument (its number in the table) and
every thread of a launch takes the same branch: one compiled kernel per dtype instead
of one per operator and dtype (the real compiler checks each for 4 architectures in CI).

Bits. The GPU computes exp, log, tanh, ... with libdevice's float32 (float64) functions,
NumPy with its own: they may differ by an ulp or two (TensorFlow's CPU and GPU kernels
differ the same way). Exact: neg, abs, sign, square, reciprocal, relu, leaky_relu, round,
floor, ceil, logical_not. The simulator runs Python's ``math`` (in float64, rounded when
stored), so the tests compare the others within a few ulps.

TensorFlow's definitions kept here: ``round`` rounds half to even (``tf.round``, as
``np.round``); ``sign(0) = 0``; ``relu(NaN) = NaN``; ``leaky_relu(x) = x if x > 0 else
alpha * x``; ``softplus(x) = log(1 + exp(x))`` computed without overflow;
``sigmoid`` without overflow for large ``|x|``.
"""
import math

import numpy as np
from numba import cuda

from kernels.launch import check_array, flat, grid_1d, launch
from kernels.registry import register, sig, vec


def _sigmoid(x):
    # exp of a negative number only: no overflow for any x
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def _softplus(x):
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype, copy=False)


def _relu(x):
    return np.where(x > 0, x, np.where(np.isnan(x), x, 0)).astype(x.dtype, copy=False)


#: op -> NumPy function of (x, alpha); ``alpha`` is used by leaky_relu and elu only.
UNARY_MATH = {
    "neg": lambda x, a: np.negative(x),
    "abs": lambda x, a: np.abs(x),
    "sign": lambda x, a: np.sign(x),
    "square": lambda x, a: np.square(x),
    "exp": lambda x, a: np.exp(x),
    "log": lambda x, a: np.log(x),
    "log1p": lambda x, a: np.log1p(x),
    "expm1": lambda x, a: np.expm1(x),
    "sqrt": lambda x, a: np.sqrt(x),
    "rsqrt": lambda x, a: 1 / np.sqrt(x),
    "reciprocal": lambda x, a: 1 / x,
    "sin": lambda x, a: np.sin(x),
    "cos": lambda x, a: np.cos(x),
    "tanh": lambda x, a: np.tanh(x),
    "sigmoid": lambda x, a: _sigmoid(x),
    "softplus": lambda x, a: _softplus(x),
    "relu": lambda x, a: _relu(x),
    "leaky_relu": lambda x, a: np.where(x > 0, x, x * x.dtype.type(a)),
    "elu": lambda x, a: np.where(x > 0, x, x.dtype.type(a) * np.expm1(np.minimum(x, 0))),
    "round": lambda x, a: np.round(x),
    "floor": lambda x, a: np.floor(x),
    "ceil": lambda x, a: np.ceil(x),
    "logical_not": lambda x, a: np.logical_not(x),
}
#: Ops defined for integer tensors too (the rest are float-only, as in TensorFlow).
INTEGER_OK = ("neg", "abs", "sign", "square", "relu")
#: Ops on bool tensors.
BOOL_OPS = ("logical_not",)


def unary_math_ref(op, x, alpha=0.0):
    """``op(x)`` elementwise, in x's dtype."""
    with np.errstate(all="ignore"):          # log(0) = -inf, sqrt(-1) = NaN: as TF, no warning
        return np.asarray(UNARY_MATH[op](x, alpha)).astype(x.dtype, copy=False)


# --- device functions: one switch over UNARY_MATH per dtype ------------------------------------

(NEG, ABS, SIGN, SQUARE, EXP, LOG, LOG1P, EXPM1, SQRT, RSQRT, RECIPROCAL, SIN, COS, TANH,
 SIGMOID, SOFTPLUS, RELU, LEAKY_RELU, ELU, ROUND, FLOOR, CEIL, LOGICAL_NOT) = range(23)
#: op name -> the number the kernel switches on (its place in UNARY_MATH).
OP_CODE = {op: k for k, op in enumerate(UNARY_MATH)}
assert OP_CODE["logical_not"] == LOGICAL_NOT and OP_CODE["elu"] == ELU, "numbers follow UNARY_MATH"

FLOAT_DTYPES = ("float32", "float64")
INT_DTYPES = ("int32", "int64")


def _make_float_math(dtype):
    """The switch for floats of ``dtype``: its constants are that dtype (a Python ``1.0``
    would make float32 math float64), the formulas are the reference's."""
    zero, half, one = (np.dtype(dtype).type(v) for v in (0.0, 0.5, 1.0))
    two = one + one

    @cuda.jit(device=True, inline="always")
    def floor(a):
        """math.floor, with NaN and +-inf returned as they are: their own floor (and
        Python's math.floor, which the simulator runs, refuses them)."""
        if a - a != zero:
            return a
        return math.floor(a)

    @cuda.jit(device=True, inline="always")
    def round_half_even(a):
        """np.round: the nearest integer, ties to the even one. a - floor(a) is exact
        (the fraction of a; a + 1 for -1 < a < 0 may round, but only where either answer
        is 0), so the tie test is exact; r - 2 floor(r / 2) is r's parity, exactly."""
        r = floor(a)
        frac = a - r
        if frac > half or (frac == half and r - two * floor(r * half) != zero):
            r += one
        return r

    @cuda.jit(device=True, inline="always")
    def float_math(op, a, alpha):
        """UNARY_MATH[op](a, alpha) for a float ``a`` (``alpha`` in a's dtype)."""
        if op == NEG:
            return -a
        if op == ABS:
            return abs(a)
        if op == SIGN:                              # np.sign: NaN stays NaN, +-0 gives 0
            return one if a > zero else (-one if a < zero else (zero if a == zero else a))
        if op == SQUARE:
            return a * a
        if op == EXP:
            return math.exp(a)
        if op == LOG:
            return math.log(a)
        if op == LOG1P:
            return math.log1p(a)
        if op == EXPM1:
            return math.expm1(a)
        if op == SQRT:
            return math.sqrt(a)
        if op == RSQRT:
            return one / math.sqrt(a)
        if op == RECIPROCAL:
            return one / a
        if op == TANH:
            return math.tanh(a)
        if op == SIGMOID:                           # exp of -|a| only: never overflows
            e = math.exp(-abs(a))
            return one / (one + e) if a >= zero else e / (one + e)
        if op == SOFTPLUS:                          # max(a, 0) + log1p(exp(-|a|))
            return max(a, zero) + math.log1p(math.exp(-abs(a)))
        if op == RELU:                              # NaN passes through
            return a if (a > zero or a != a) else zero
        if op == LEAKY_RELU:
            return a if a > zero else a * alpha
        if op == ELU:                               # here a <= 0 or NaN: min(a, 0) is a
            return a if a > zero else alpha * math.expm1(a)
        if op == ROUND:
            return round_half_even(a)
        if op == FLOOR:
            return floor(a)
        return -floor(-a)                           # CEIL
    return float_math


def _make_int_math(dtype):
    """The switch for integers of ``dtype``: the INTEGER_OK operators only (the launcher
    refuses the others, as TensorFlow has no integer kernels for them)."""
    zero, one = np.dtype(dtype).type(0), np.dtype(dtype).type(1)

    @cuda.jit(device=True, inline="always")
    def int_math(op, a, alpha):
        """UNARY_MATH[op](a) for an integer ``a`` (``alpha`` unused)."""
        if op == NEG:
            return -a
        if op == ABS:
            return abs(a)
        if op == SIGN:
            return one if a > zero else (-one if a < zero else zero)
        if op == SQUARE:
            return a * a
        return a if a > zero else zero              # RELU
    return int_math


# --- kernels ----------------------------------------------------------------------------------

def _make_unary_math_kernel(fn):
    @cuda.jit
    def unary_math_kernel(x, out, op, alpha):
        """One thread per element i (grid-stride): out[i] = fn(op, x[i], alpha)."""
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = fn(op, x[i], alpha)
    return unary_math_kernel


#: dtype name -> its kernel
UNARY_MATH_KERNELS = {**{t: _make_unary_math_kernel(_make_float_math(t)) for t in FLOAT_DTYPES},
                      **{t: _make_unary_math_kernel(_make_int_math(t)) for t in INT_DTYPES}}


@cuda.jit
def sin_cos_kernel(x, out, op):
    """One thread per element i (grid-stride): out[i] = sin(x[i]) (op SIN) or cos(x[i]).
    Its own kernel because libdevice's sinf/cos reduce a huge argument (|x| > 105,615 in
    float32) by Payne-Hanek, with a small array in local memory (a stack frame) and, for
    float32, a few float64 multiplications: allowed here, and only here
    (tests/test_kernels_compile.py), so that the other operators' kernel stays free of both."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = math.sin(x[i]) if op == SIN else math.cos(x[i])


@cuda.jit
def logical_not_kernel(x, out):
    """One thread per element i (grid-stride): out[i] = not x[i] (bool)."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = not x[i]


# --- what the real compiler checks (kernels/registry.py) ---------------------------------------

_BLOCK = grid_1d(1)[1]
for _t, _kernel in UNARY_MATH_KERNELS.items():
    register(_kernel, "unary_math_kernel", sig(vec(_t), vec(_t), "int64", _t), block=_BLOCK,
             variant=_t)
register(sin_cos_kernel, "sin_cos_kernel", [sig(vec(t), vec(t), "int64") for t in FLOAT_DTYPES],
         block=_BLOCK)
register(logical_not_kernel, "logical_not_kernel", sig(vec("boolean"), vec("boolean")), block=_BLOCK)


# --- launcher ---------------------------------------------------------------------------------

def unary_math(op, x, out, alpha=0.0, stream=None):
    """out = op(x) elementwise on the GPU (``unary_math_ref``); x and out of one dtype and
    shape, C-contiguous: float32/float64 for every op, int32/int64 for INTEGER_OK, bool
    for logical_not. ``alpha``: leaky_relu's slope, elu's scale."""
    if op not in UNARY_MATH:
        raise ValueError(f"unknown unary operator {op!r}; expected one of {sorted(UNARY_MATH)}.")
    dtype = np.dtype(x.dtype)
    check_array(f"{op}: x", x, dtype)
    check_array(f"{op}: out", out, dtype, shape=x.shape)
    if op in BOOL_OPS or dtype == np.bool_:
        if not (op in BOOL_OPS and dtype == np.bool_):
            raise TypeError(f"{op} of a {dtype} tensor: logical_not takes bool tensors, and "
                            f"bool tensors take only {BOOL_OPS}.")
        if out.size:
            launch(logical_not_kernel, *grid_1d(out.size), stream, flat(x), flat(out))
        return out
    if dtype.name in INT_DTYPES and op not in INTEGER_OK:
        raise TypeError(f"{op} of a {dtype} tensor: integer tensors take only {INTEGER_OK}; "
                        f"cast to a float dtype first (as TensorFlow requires).")
    if dtype.name not in UNARY_MATH_KERNELS:
        raise TypeError(f"{op}: tensors of {dtype} are not supported on the GPU; expected one of "
                        f"{tuple(UNARY_MATH_KERNELS)}.")
    if out.size == 0:
        return out
    if op in ("sin", "cos"):
        launch(sin_cos_kernel, *grid_1d(out.size), stream, flat(x), flat(out), OP_CODE[op])
    else:
        launch(UNARY_MATH_KERNELS[dtype.name], *grid_1d(out.size), stream, flat(x), flat(out),
               OP_CODE[op], dtype.type(alpha))
    return out
