"""One copy kernel for transpose, slicing, broadcast_to, concat, stack and their gradients.

A view of an array is (offset, strides, shape): element ``idx`` of the view is
``buf[offset + sum_k idx_k * strides_k]`` (in elements, not bytes; a stride may be
negative, ``x[::-1]``, or 0, a broadcast). Copying one view into another is then one
kernel: one thread per element of ``shape``, decomposing its flat number into ``idx``:

    dst[dst_offset + idx . dst_strides] = src[src_offset + idx . src_strides]

    transpose       src strides permuted, dst contiguous
    x[1:5:2, ::-1]  src offset and strides of the slice, dst contiguous
    broadcast_to    src stride 0 on the stretched axes
    concat, stack   each input into its slab of dst (dst offset, dst strides)
    slice gradient  dy into the slice's place in a zero-filled dx

Layout: NumPy reference ``strided_copy_ref`` (``np.lib.stride_tricks.as_strided``);
kernel ``strided_copy_kernel`` and launcher ``strided_copy`` follow. ``src`` and ``dst``
are flat (1-D) buffers of one dtype.

Thread -> data: one thread per element of ``shape`` (grid-stride over their count in
row-major order); the thread unravels its number over ``shape`` (padded to MAX_DIMS,
scalar arguments) and moves one element. Axes that both views walk contiguously are
merged on the host first (``kernels.broadcast.collapse_dims``): a plain slice of rows is
one dimension, a 2-D transpose two. Consecutive threads write consecutive ``dst``
elements when dst is contiguous (the usual case): the writes coalesce, the reads of a
transpose do not.
"""
import numpy as np
from numba import cuda
from numpy.lib.stride_tricks import as_strided

from kernels.broadcast import collapse_dims, padded
from kernels.launch import check_array, check_no_alias, grid_1d, launch
from kernels.registry import TENSOR_DTYPES, register, sig, vec

#: The rank the kernel takes (shape and strides are padded to it).
MAX_DIMS = 6


def flat_indices(shape, offset, strides):
    """The flat position of every element of the view (offset, strides, shape), in row-major
    order of ``shape``: the kernel's index arithmetic, written with NumPy."""
    if not shape:                            # a 0-d view: its one element (np.indices(()) is empty)
        return np.array([int(offset)])
    idx = np.indices(shape, dtype=np.int64).reshape(len(shape), -1)     # (d, count)
    return int(offset) + np.asarray(strides, np.int64) @ idx


def strided_copy_ref(src, dst, shape, src_offset, src_strides, dst_offset, dst_strides):
    """Copy the view (src_offset, src_strides, shape) of flat ``src`` into the view
    (dst_offset, dst_strides, shape) of flat ``dst``. Returns dst."""
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return dst
    if min(src_strides, default=0) >= 0 and min(dst_strides, default=0) >= 0 and shape:
        # the same copy through NumPy's strided views (fast; needs no negative stride)
        item = src.itemsize
        sv = as_strided(src[int(src_offset):], shape, tuple(int(s) * item for s in src_strides))
        dv = as_strided(dst[int(dst_offset):], shape, tuple(int(s) * dst.itemsize for s in dst_strides))
        dv[...] = np.array(sv)               # a copy first: src and dst may be one buffer
        return dst
    dst[flat_indices(shape, dst_offset, dst_strides)] = src[flat_indices(shape, src_offset, src_strides)]
    return dst


# --- kernel ------------------------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def _unravel(i, n1, n2, n3, n4, n5):
    """(k0, ..., k5): the index of element number ``i`` of a C-order shape (n0, ..., n5)
    (the same function as kernels/broadcast.py's, kept in this file: a kernel that calls
    another file's device function is not kept in numba's disk cache)."""
    k5 = i % n5
    i //= n5
    k4 = i % n4
    i //= n4
    k3 = i % n3
    i //= n3
    k2 = i % n2
    i //= n2
    return i // n1, i % n1, k2, k3, k4, k5


@cuda.jit
def strided_copy_kernel(src, dst, count, n1, n2, n3, n4, n5,
                        src_offset, ss0, ss1, ss2, ss3, ss4, ss5,
                        dst_offset, ds0, ds1, ds2, ds3, ds4, ds5):
    """One thread per element e of the view's shape (n0, ..., n5) (grid-stride over its
    ``count`` elements). Loop nest:
        for e in range(count):
            k = unravel(e, shape)
            dst[dst_offset + k . ds] = src[src_offset + k . ss]
    Strides are in elements and may be negative or 0."""
    for e in range(cuda.grid(1), count, cuda.gridsize(1)):
        k0, k1, k2, k3, k4, k5 = _unravel(e, n1, n2, n3, n4, n5)
        dst[dst_offset + k0 * ds0 + k1 * ds1 + k2 * ds2 + k3 * ds3 + k4 * ds4 + k5 * ds5] = \
            src[src_offset + k0 * ss0 + k1 * ss1 + k2 * ss2 + k3 * ss3 + k4 * ss4 + k5 * ss5]


#: What the copy moves: every tensor dtype, bool masks and uint8 images.
COPY_DTYPES = TENSOR_DTYPES + ("boolean", "uint8")
register(strided_copy_kernel, "strided_copy_kernel",
         [sig(vec(t), vec(t), *("int64",) * (1 + 5 + 2 * (1 + MAX_DIMS))) for t in COPY_DTYPES],
         block=grid_1d(1)[1])


# --- launcher ----------------------------------------------------------------------------------

def _view_range(what, buffer, shape, offset, strides):
    """Raise unless every element of the view (offset, strides, shape) is inside
    ``buffer``: the kernel does not check its indices."""
    lo = offset + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = offset + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))
    if lo < 0 or hi >= buffer.shape[0]:
        raise ValueError(f"strided_copy: the {what} view (offset {offset}, strides {tuple(strides)}, "
                         f"shape {tuple(shape)}) reaches elements {lo} .. {hi} of a buffer of "
                         f"{buffer.shape[0]}.")


def strided_copy(src, dst, shape, src_offset, src_strides, dst_offset, dst_strides, stream=None):
    """The view (src_offset, src_strides, shape) of flat ``src`` into the view (dst_offset,
    dst_strides, shape) of flat ``dst``, on the GPU (``strided_copy_ref``). src and dst: 1-D,
    one dtype of COPY_DTYPES, separate buffers (a copy within one buffer would race: copy
    through a temporary). Strides in elements, rank <= MAX_DIMS after merging. Returns dst."""
    shape = tuple(int(n) for n in shape)
    src_strides = tuple(int(s) for s in src_strides)
    dst_strides = tuple(int(s) for s in dst_strides)
    src_offset, dst_offset = int(src_offset), int(dst_offset)
    check_array("strided_copy: src", src, src.dtype, ndim=1)
    check_array("strided_copy: dst", dst, src.dtype, ndim=1)
    dtype = np.dtype(src.dtype)
    if (dtype.name if dtype != np.bool_ else "boolean") not in COPY_DTYPES:
        raise TypeError(f"strided_copy: {dtype} buffers are not supported on the GPU; expected "
                        f"one of {COPY_DTYPES}.")
    if not len(shape) == len(src_strides) == len(dst_strides):
        raise ValueError(f"strided_copy: shape {shape}, src strides {src_strides} and dst strides "
                         f"{dst_strides} must have one entry per dimension.")
    if min(shape, default=0) < 0:
        raise ValueError(f"strided_copy: shape {shape} has a negative dimension.")
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return dst
    _view_range("source", src, shape, src_offset, src_strides)
    _view_range("destination", dst, shape, dst_offset, dst_strides)
    check_no_alias("strided_copy", dst, src)
    merged, (ss, ds) = collapse_dims(shape, src_strides, dst_strides)
    dims, ss, ds = padded("strided_copy", merged, ss, ds)
    launch(strided_copy_kernel, *grid_1d(count), stream, src, dst, count, *dims[1:],
           src_offset, *ss, dst_offset, *ds)
    return dst
