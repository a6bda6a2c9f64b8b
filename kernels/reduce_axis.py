"""Reductions over one axis: ``tf.reduce_max/min/prod/any/all``, ``tf.argmax/argmin``.

Every reduction over axis k of a C-contiguous array is, after a free reshape, a
reduction over the middle axis of ``x3`` of shape (O, N, I): O = prod(shape[:k]),
N = shape[k], I = prod(shape[k+1:]). Several axes are reduced one after the other.
(``kernels/reduction.py`` keeps the sums the engine uses: ``sum_all`` and ``sum_axis``.)

Thread -> data: one thread per output element (o, i), looping n = 0 .. N-1 in order, so
the result has the same bits every run (and a max/min/argmax sees the same ties).
Consecutive threads take consecutive i: the reads x3[o, n, i] coalesce when I > 1.

Layout: table ``REDUCE`` (op -> NumPy ufunc-like), NumPy references ``reduce_axis_ref``
and ``arg_reduce_axis_ref``; kernels and launchers follow.

TensorFlow's definitions kept here: max/min of an empty axis are -inf/+inf for floats
(the dtype's lowest/highest integer for integers); prod of an empty axis is 1;
``argmax``/``argmin`` return the FIRST index of the extreme value, int64, and a NaN
counts as the extreme (``np.argmax``'s rule).
"""
import numpy as np

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
