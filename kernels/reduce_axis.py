"""Reductions over one axis: ``tf.reduce_max/min/prod/any/all``, ``tf.argmax/argmin``.

Every reduction over axis k of a C-contiguous array is, after a free reshape, a
reduction over the middle axis of ``x3`` of shape (O, N, I): O = prod(shape[:k]),
N = shape[k], I = prod(shape[k+1:]). Several axes are reduced one after the other.
(``kernels/reduction.py`` keeps the sums the engine uses: ``sum_all`` and ``sum_axis``.)

Thread -> data: one thread per output element (o, i), looping n = 0 .. N-1 in order, so
the result has the same bits every run (and a max/min/argmax sees the same ties).
Consecutive threads take consecutive i: the reads x3[o, n, i] coalesce when I > 1.

Layout: table ``REDUCE`` (op -> NumPy ufunc-like), NumPy references ``reduce_axis_ref``
and ``arg_reduce_axis_ref``; then the kernels (``reduce_axis_kernel`` for sum, prod, max,
min; ``any_all_kernel`` on bool; ``arg_reduce_axis_kernel``), each switching on the
operator's number (a scalar argument: one compiled kernel per dtype, not per op), and the
launchers ``reduce_axis`` and ``arg_reduce_axis``.

Bits: max, min, any, all, argmax and argmin are exact. A float sum or product adds in
order n = 0, 1, ...; NumPy does too when I > 1 (row after row), but when I == 1 it adds
the contiguous axis pairwise: the CPU and GPU backends then agree to float rounding
(bounded by N ulps of sum |terms|), not bit for bit.

TensorFlow's definitions kept here: max/min of an empty axis are -inf/+inf for floats
(the dtype's lowest/highest integer for integers); prod of an empty axis is 1;
``argmax``/``argmin`` return the FIRST index of the extreme value, int64, and a NaN
counts as the extreme (``np.argmax``'s rule).
"""
import numpy as np
from numba import cuda

from kernels.launch import check_array, grid_1d, launch
from kernels.registry import TENSOR_DTYPES, arr3, mat, register, sig

REDUCE = {
    "sum": np.sum,
    "prod": np.prod,
    "max": np.max,
    "min": np.min,
    "any": np.any,
    "all": np.all,
}
ARG_REDUCE = {"argmax": np.argmax, "argmin": np.argmin}


def identity_of(op, dtype):
    """The value an empty reduction gives (TensorFlow's)."""
    dtype = np.dtype(dtype)
    if op == "sum":
        return dtype.type(0)
    if op == "prod":
        return dtype.type(1)
    if op in ("any", "all"):
        return np.bool_(op == "all")
    if dtype.kind == "f":
        return dtype.type(-np.inf if op == "max" else np.inf)
    info = np.iinfo(dtype)
    return dtype.type(info.min if op == "max" else info.max)


def reduce_axis_ref(op, x3):
    """x3 (O, N, I) -> (O, I): ``op`` over the middle axis, in x3's dtype."""
    if x3.shape[1] == 0:
        return np.full((x3.shape[0], x3.shape[2]), identity_of(op, x3.dtype), x3.dtype)
    if op in ("sum", "prod"):
        return REDUCE[op](x3, axis=1, dtype=x3.dtype)
    return REDUCE[op](x3, axis=1).astype(x3.dtype, copy=False)


def arg_reduce_axis_ref(op, x3):
    """x3 (O, N, I) -> (O, I) int64: the first index of the max (min) along the middle axis."""
    if x3.shape[1] == 0:
        raise ValueError(f"{op} of an empty axis has no answer (TensorFlow raises too).")
    return ARG_REDUCE[op](x3, axis=1).astype(np.int64)


# --- device functions ---------------------------------------------------------------------------

SUM, PROD, MAX, MIN, ANY, ALL = range(6)
ARGMAX, ARGMIN = range(2)
#: op name -> the number the kernels switch on (its place in REDUCE or ARG_REDUCE).
OP_CODE = {**{op: k for k, op in enumerate(REDUCE)}, **{op: k for k, op in enumerate(ARG_REDUCE)}}
assert (OP_CODE["all"], OP_CODE["argmin"]) == (ALL, ARGMIN), "numbers follow the tables' order"


@cuda.jit(device=True, inline="always")
def _combine(op, acc, v):
    """One step of REDUCE[op]: acc <op> v. max/min keep a NaN once they met one (np.max)."""
    if op == SUM:
        return acc + v
    if op == PROD:
        return acc * v
    if acc != acc:                                   # a NaN stays the answer
        return acc
    if op == MAX:
        return v if (v > acc or v != v) else acc
    return v if (v < acc or v != v) else acc         # MIN


@cuda.jit(device=True, inline="always")
def _output_of(t, inner):
    """(o, i) of output number t of a C-order (O, I) output: consecutive threads get
    consecutive i, so their reads x3[o, n, i] are consecutive addresses."""
    return t // inner, t % inner


# --- kernels ------------------------------------------------------------------------------------

@cuda.jit
def reduce_axis_kernel(x3, out, op, init):
    """One thread per output (o, i) (grid-stride over the O * I outputs), looping over n:
        for o, i:  acc = init;  for n in range(N): acc = combine(op, acc, x3[o, n, i])
                   out[o, i] = acc
    ``init`` is ``identity_of(op, dtype)``: an empty axis gives it."""
    inner = out.shape[1]
    for t in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        o, i = _output_of(t, inner)
        acc = init
        for n in range(x3.shape[1]):
            acc = _combine(op, acc, x3[o, n, i])
        out[o, i] = acc


@cuda.jit
def any_all_kernel(x3, out, op):
    """``reduce_axis_kernel`` for any/all on bool: one thread per output (o, i), looping n,
    stopping at the first element that settles the answer."""
    inner = out.shape[1]
    for t in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        o, i = _output_of(t, inner)
        acc = op == ALL                              # the empty axis's answer
        for n in range(x3.shape[1]):
            if x3[o, n, i] != acc:                   # any: a True; all: a False
                acc = not acc
                break
        out[o, i] = acc


@cuda.jit
def arg_reduce_axis_kernel(x3, out, op):
    """One thread per output (o, i) (grid-stride), looping n = 1 .. N-1 in order: the index
    of the first maximum (ARGMAX) or minimum (ARGMIN), a NaN counting as the extreme (so the
    first NaN wins and ends the loop). N >= 1 (the launcher checks)."""
    inner = out.shape[1]
    for t in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        o, i = _output_of(t, inner)
        best = x3[o, 0, i]
        k = 0
        for n in range(1, x3.shape[1]):
            if best != best:                         # a NaN: nothing beats it
                break
            v = x3[o, n, i]
            if v != v or (v > best if op == ARGMAX else v < best):
                best = v
                k = n
        out[o, i] = k


# --- what the real compiler checks (kernels/registry.py) -----------------------------------------

_BLOCK = grid_1d(1)[1]
register(reduce_axis_kernel, "reduce_axis_kernel",
         [sig(arr3(t), mat(t), "int64", t) for t in TENSOR_DTYPES], block=_BLOCK)
register(any_all_kernel, "any_all_kernel", sig(arr3("boolean"), mat("boolean"), "int64"),
         block=_BLOCK)
register(arg_reduce_axis_kernel, "arg_reduce_axis_kernel",
         [sig(arr3(t), mat("int64"), "int64") for t in TENSOR_DTYPES], block=_BLOCK)


# --- launchers ------------------------------------------------------------------------------------

def _check(what, x3, out, out_dtype):
    check_array(f"{what}: x3", x3, x3.dtype, ndim=3)
    check_array(f"{what}: out", out, out_dtype, shape=(x3.shape[0], x3.shape[2]))


def reduce_axis(op, x3, out, stream=None):
    """out (O, I) = REDUCE[op] of x3 (O, N, I) over n, on the GPU (``reduce_axis_ref``).
    sum, prod, max, min: x3 and out of one dtype in TENSOR_DTYPES; any, all: bool."""
    if op not in REDUCE:
        raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(REDUCE)}.")
    dtype = np.dtype(x3.dtype)
    _check(op, x3, out, dtype)
    if (op in ("any", "all")) != (dtype == np.bool_):
        raise TypeError(f"reduce_{op} of a {dtype} tensor: any and all take bool tensors, the "
                        f"other reductions {TENSOR_DTYPES}.")
    if dtype != np.bool_ and dtype.name not in TENSOR_DTYPES:
        raise TypeError(f"reduce_{op}: tensors of {dtype} are not supported on the GPU; expected "
                        f"one of {TENSOR_DTYPES}.")
    if out.size == 0:
        return out
    if dtype == np.bool_:
        launch(any_all_kernel, *grid_1d(out.size), stream, x3, out, OP_CODE[op])
    else:
        launch(reduce_axis_kernel, *grid_1d(out.size), stream, x3, out, OP_CODE[op],
               identity_of(op, dtype))
    return out


def arg_reduce_axis(op, x3, out, stream=None):
    """out (O, I) int64 = the first index of the max (argmax) or min (argmin) of x3
    (O, N, I) over n, on the GPU (``arg_reduce_axis_ref``); N >= 1."""
    if op not in ARG_REDUCE:
        raise ValueError(f"unknown arg reduction {op!r}; expected one of {sorted(ARG_REDUCE)}.")
    _check(op, x3, out, np.int64)
    if np.dtype(x3.dtype).name not in TENSOR_DTYPES:
        raise TypeError(f"{op}: tensors of {np.dtype(x3.dtype)} are not supported on the GPU; "
                        f"expected one of {TENSOR_DTYPES}.")
    if x3.shape[1] == 0:
        raise ValueError(f"{op} of an empty axis has no answer (TensorFlow raises too).")
    if out.size:
        launch(arg_reduce_axis_kernel, *grid_1d(out.size), stream, x3, out, OP_CODE[op])
    return out
