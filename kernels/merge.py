"""Column-block copy: the one new op Keras's merge layers need (``Concatenate`` both ways).

Versions: v1 only. One thread per copied element, grid-stride.

Why one copy is all of Concatenate. Take a batch of examples of shape (d0, ..., dn) and
concatenate along example axis ``a`` (the batch axis not counted). In row-major order,
every axis before ``a`` (and the batch axis) picks a *row*, and axis ``a`` with every axis
after it picks a *column*. So view each input x_i, free of charge, as a matrix::

    x_i  : (R, w_i)    R   = b * d0 * ... * d(a-1)          the same for every input
                       w_i = d_a(i) * d(a+1) * ... * dn     input i's own width
    y    : (R, W)      W   = w_0 + w_1 + ...

Input i then fills columns [off_i, off_i + w_i) of every row of y, with
off_i = w_0 + ... + w_(i-1): concatenation is one column-block copy per input, and its
backward (the split of dy back into the inputs' gradients) is the same copy with source
and destination swapped. ``concat_matrix_shape`` gives (R, w); ``copy_columns`` copies.
The merge layers that add, subtract, multiply or average need no new kernel:
``kernels/elementwise.py``'s do it (``mirrored/keras/merging.py`` says how).

Layout (as every file in ``kernels/``): shape rule and checks (``concat_matrix_shape``,
``check_columns``) -> NumPy reference ``copy_columns_ref`` (the CPU backend calls it) ->
kernel ``copy_columns_kernel`` -> registration -> launcher ``copy_columns``.
Neighbours: ``kernels/gather.py`` (the other pure copy: rows by number),
``mirrored/backends.py`` (``CpuOps.copy_columns`` / ``CudaOps.copy_columns``),
``mirrored/keras/merging.py`` (the layers), ``tests/test_kernels_merge.py``.
"""
import math

import numpy as np
from numba import cuda

from kernels.launch import check_array, check_no_alias, grid_1d, launch
from kernels.registry import mat, register, sig

#: The dtypes the layers launch the copy with: every layer computes in float32 here
#: (``base_layer.Layer`` refuses any other dtype). A copy does no arithmetic, so another
#: dtype would be one more signature, not another kernel.
COPY_DTYPES = ("float32",)


# --- shape rule and checks ------------------------------------------------------------

def concat_matrix_shape(b, example_shape, axis):
    """(R, w): the matrix a batch of ``b`` examples of ``example_shape`` is viewed as for a
    concatenation along example axis ``axis`` (0-based, no batch axis; see the module
    docstring): R = b * the axes before it, w = the axis and the ones after it."""
    example_shape = tuple(int(d) for d in example_shape)
    return b * math.prod(example_shape[:axis]), math.prod(example_shape[axis:])


def check_columns(what, src_shape, dst_shape, src_col, dst_col, width):
    """Raise a clear error unless columns [src_col, src_col + width) of a (rows, *) ``src``
    can be copied into columns [dst_col, dst_col + width) of a (rows, *) ``dst``: both
    2-D with the same rows, every bound a whole number inside its matrix."""
    for name, v in (("src_col", src_col), ("dst_col", dst_col), ("width", width)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{what}: {name} must be a non-negative integer, got {v!r}.")
    if len(src_shape) != 2 or len(dst_shape) != 2:
        raise ValueError(f"{what}: src and dst must be 2-D (rows, columns), got shapes "
                         f"{tuple(src_shape)} and {tuple(dst_shape)}; view them as matrices "
                         f"first (concat_matrix_shape).")
    if src_shape[0] != dst_shape[0]:
        raise ValueError(f"{what}: src has {src_shape[0]} rows and dst {dst_shape[0]}; a column "
                         f"copy needs the same rows in both.")
    for name, col, shape in (("src", src_col, src_shape), ("dst", dst_col, dst_shape)):
        if col + width > shape[1]:
            raise ValueError(f"{what}: columns [{col}, {col + width}) are past {name}'s "
                             f"{shape[1]} columns (shape {tuple(shape)}).")


# --- NumPy reference -------------------------------------------------------------------

def copy_columns_ref(src, dst, src_col, dst_col, width):
    """dst[:, dst_col:dst_col + width] = src[:, src_col:src_col + width]; returns dst.

    Equals the loop nest::

        for r in range(rows):
            for j in range(width):
                dst[r, dst_col + j] = src[r, src_col + j]
    """
    check_columns("copy_columns", src.shape, dst.shape, src_col, dst_col, width)
    dst[:, dst_col:dst_col + width] = src[:, src_col:src_col + width]    # (rows, width)
    return dst


# --- kernel ----------------------------------------------------------------------------

@cuda.jit
def copy_columns_kernel(src, dst, src_col, dst_col, width):
    """One thread per copied element (r, j) of the (rows, width) block, grid-stride over
    t in [0, rows * width): r = t // width, j = t - r * width, and
    dst[r, dst_col + j] = src[r, src_col + j] (the reference's loop nest, flattened).

    Consecutive threads take consecutive j of one row, so a warp reads one contiguous
    run of src and writes one contiguous run of dst (two runs where it crosses a row's
    end): coalesced both ways. Memory-bound, 2 * rows * width elements moved, nothing
    reused, so no shared memory. Preconditions (the launcher checks them): src and dst
    2-D, C-contiguous, same rows and dtype, both column ranges inside, no overlap."""
    total = dst.shape[0] * width
    for t in range(cuda.grid(1), total, cuda.gridsize(1)):
        r = t // width
        j = t - r * width
        dst[r, dst_col + j] = src[r, src_col + j]


register(copy_columns_kernel, "copy_columns_kernel",
         [sig(mat(t), mat(t), "int64", "int64", "int64") for t in COPY_DTYPES], block=grid_1d(1)[1])


# --- launcher --------------------------------------------------------------------------

def copy_columns(src, dst, src_col, dst_col, width, stream=None):
    """dst[:, dst_col:dst_col + width] = src[:, src_col:src_col + width] on the GPU.
    src (rows, S), dst (rows, D): 2-D, C-contiguous, one dtype, separate memory."""
    check_array("copy_columns: src", src, src.dtype, ndim=2)
    check_array("copy_columns: dst", dst, src.dtype, ndim=2)
    check_columns("copy_columns", src.shape, dst.shape, src_col, dst_col, width)
    check_no_alias("copy_columns", dst, src)
    if dst.shape[0] and width:
        launch(copy_columns_kernel, *grid_1d(dst.shape[0] * width), stream, src, dst,
               int(src_col), int(dst_col), int(width))
    return dst
