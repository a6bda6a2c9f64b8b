"""Elementwise kernels behind ``mirrored.Tensor`` arithmetic (+ - * /, unary -, cast, fill).

Versions: v1 only. One thread per element, grid-stride loop. Elementwise ops are
memory-bound (1 FLOP per 8-12 bytes moved), so the only thing that matters for
speed is that consecutive threads touch consecutive addresses (coalescing) and
that the grid fills the GPU; both hold for a flat grid-stride loop.

Every kernel sees its arrays flattened to 1-D (the launcher reshapes contiguous
arrays, which is free), so one kernel serves every shape.

Layout of this file (as every file in ``kernels/``):
    NumPy references  ``binary_ref``, ``binary_scalar_ref``, ``unary_ref``, ``cast_ref``, ``fill_ref``
    device functions  one per operator
    kernels           built from the device functions by small factories
    registration      each kernel with the dtypes it is launched with (``kernels/registry.py``)
    launchers         ``binary``, ``binary_scalar``, ``unary``, ``cast``, ``fill``: check, then launch
The CPU backend (``mirrored/backends.py``) calls the ``*_ref`` functions, so the
math has one definition.
"""
import numpy as np
from numba import cuda

from kernels.launch import check_array, flat, grid_1d, launch
from kernels.registry import TENSOR_DTYPES, register, sig, vec

#: Operator name -> NumPy function: the reference definition of each operator.
#: ``rsub``/``rdiv`` are the reflected forms (``scalar - x``, ``scalar / x``).
BINARY_REF = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "rsub": lambda x, y: np.subtract(y, x),
    "rdiv": lambda x, y: np.divide(y, x),
}
UNARY_REF = {"neg": np.negative}


# --- NumPy references -------------------------------------------------------

def binary_ref(op, x, y):
    """``x <op> y`` elementwise for same-shape arrays, result in x's dtype."""
    return BINARY_REF[op](x, y).astype(x.dtype, copy=False)


def binary_scalar_ref(op, x, s):
    """``x <op> s`` with a Python scalar ``s`` converted to x's dtype first."""
    return BINARY_REF[op](x, x.dtype.type(s)).astype(x.dtype, copy=False)


def unary_ref(op, x):
    return UNARY_REF[op](x)


def fill_ref(out, value):
    """out[...] = value (converted to out's dtype)."""
    out.fill(value)
    return out


def cast_ref(x, dtype):
    """Convert to ``dtype``; float -> int truncates toward zero (as TF's cast)."""
    return x.astype(dtype)


# --- device functions: the scalar math of each operator ---------------------

@cuda.jit(device=True, inline="always")
def _add(a, b):
    return a + b


@cuda.jit(device=True, inline="always")
def _sub(a, b):
    return a - b


@cuda.jit(device=True, inline="always")
def _mul(a, b):
    return a * b


@cuda.jit(device=True, inline="always")
def _div(a, b):
    return a / b


@cuda.jit(device=True, inline="always")
def _rsub(a, b):
    return b - a


@cuda.jit(device=True, inline="always")
def _rdiv(a, b):
    return b / a


@cuda.jit(device=True, inline="always")
def _neg(a):
    return -a


# --- kernels ------------------------------------------------------------------

def _make_binary_kernel(fn):
    @cuda.jit
    def binary_kernel(x, y, out):
        """One thread per element i (grid-stride): out[i] = fn(x[i], y[i])."""
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = fn(x[i], y[i])
    return binary_kernel


def _make_scalar_kernel(fn):
    @cuda.jit
    def binary_scalar_kernel(x, s, out):
        """One thread per element i (grid-stride): out[i] = fn(x[i], s)."""
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = fn(x[i], s)
    return binary_scalar_kernel


def _make_unary_kernel(fn):
    @cuda.jit
    def unary_kernel(x, out):
        """One thread per element i (grid-stride): out[i] = fn(x[i])."""
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = fn(x[i])
    return unary_kernel


@cuda.jit
def cast_kernel(x, out):
    """One thread per element i (grid-stride): out[i] = x[i] converted to out's dtype."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = x[i]


@cuda.jit
def fill_kernel(out, value):
    """One thread per element i (grid-stride): out[i] = value."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = value


_DEVICE_FN = {"add": _add, "sub": _sub, "mul": _mul, "div": _div,
              "rsub": _rsub, "rdiv": _rdiv, "neg": _neg}
BINARY_KERNELS = {op: _make_binary_kernel(_DEVICE_FN[op]) for op in BINARY_REF}
SCALAR_KERNELS = {op: _make_scalar_kernel(_DEVICE_FN[op]) for op in BINARY_REF}
UNARY_KERNELS = {op: _make_unary_kernel(_DEVICE_FN[op]) for op in UNARY_REF}


# --- what the real compiler checks (kernels/registry.py) -----------------------

#: Division is launched for floats only: ``mirrored.Tensor`` casts integer operands to
#: float before ``/`` (TensorFlow's truediv), so an integer div kernel never runs.
FLOAT_DTYPES = ("float32", "float64")
_OP_DTYPES = {op: FLOAT_DTYPES if op in ("div", "rdiv") else TENSOR_DTYPES for op in BINARY_REF}
#: ``cast`` also meets uint8: images as stored, converted to float32 on the device.
CAST_DTYPES = ("uint8",) + TENSOR_DTYPES

_BLOCK = grid_1d(1)[1]
for _op, _kernel in BINARY_KERNELS.items():
    register(_kernel, "binary_kernel", [sig(vec(t), vec(t), vec(t)) for t in _OP_DTYPES[_op]],
             block=_BLOCK, variant=f"op={_op}")
for _op, _kernel in SCALAR_KERNELS.items():
    register(_kernel, "binary_scalar_kernel", [sig(vec(t), t, vec(t)) for t in _OP_DTYPES[_op]],
             block=_BLOCK, variant=f"op={_op}")
for _op, _kernel in UNARY_KERNELS.items():
    register(_kernel, "unary_kernel", [sig(vec(t), vec(t)) for t in TENSOR_DTYPES],
             block=_BLOCK, variant=f"op={_op}")
register(cast_kernel, "cast_kernel",
         [sig(vec(src), vec(dst)) for src in CAST_DTYPES for dst in CAST_DTYPES if src != dst],
         block=_BLOCK)
register(fill_kernel, "fill_kernel", [sig(vec(t), t) for t in TENSOR_DTYPES], block=_BLOCK)


# --- launchers ----------------------------------------------------------------


def _check_op(op, table):
    if op not in table:
        raise ValueError(f"unknown elementwise operator {op!r}; expected one of {sorted(table)}.")


def binary(op, x, y, out, stream=None):
    """out = x <op> y on the GPU; x, y, out: same shape and dtype, C-contiguous."""
    _check_op(op, BINARY_REF)
    check_array(f"{op}: x", x, x.dtype)
    check_array(f"{op}: y", y, x.dtype, shape=x.shape)
    check_array(f"{op}: out", out, x.dtype, shape=x.shape)
    if out.size:
        launch(BINARY_KERNELS[op], *grid_1d(out.size), stream, flat(x), flat(y), flat(out))
    return out


def binary_scalar(op, x, s, out, stream=None):
    """out = x <op> s on the GPU, ``s`` a Python scalar converted to x's dtype."""
    _check_op(op, BINARY_REF)
    check_array(f"{op}: x", x, x.dtype)
    check_array(f"{op}: out", out, x.dtype, shape=x.shape)
    if out.size:
        s = np.dtype(x.dtype).type(s)
        launch(SCALAR_KERNELS[op], *grid_1d(out.size), stream, flat(x), s, flat(out))
    return out


def unary(op, x, out, stream=None):
    """out = <op> x on the GPU (``op`` is ``"neg"``)."""
    _check_op(op, UNARY_REF)
    check_array(f"{op}: x", x, x.dtype)
    check_array(f"{op}: out", out, x.dtype, shape=x.shape)
    if out.size:
        launch(UNARY_KERNELS[op], *grid_1d(out.size), stream, flat(x), flat(out))
    return out


def cast(x, out, stream=None):
    """out = x converted to out's dtype, on the GPU."""
    check_array("cast: x", x, x.dtype)
    check_array("cast: out", out, out.dtype, shape=x.shape)
    if out.size:
        launch(cast_kernel, *grid_1d(out.size), stream, flat(x), flat(out))
    return out


def fill(out, value, stream=None):
    """out[...] = value on the GPU (zeros for gradients, slots, counters)."""
    check_array("fill: out", out, out.dtype)
    if out.size:
        launch(fill_kernel, *grid_1d(out.size), stream, flat(out), np.dtype(out.dtype).type(value))
    return out
