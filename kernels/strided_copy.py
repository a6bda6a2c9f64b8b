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
kernel and launcher follow. ``src`` and ``dst`` are flat (1-D) buffers of one dtype.
"""
import numpy as np
from numpy.lib.stride_tricks import as_strided

#: The rank the kernel takes (shape and strides are padded to it).
MAX_DIMS = 6


def flat_indices(shape, offset, strides):
    """The flat position of every element of the view (offset, strides, shape), in row-major
    order of ``shape``: the kernel's index arithmetic, written with NumPy."""
    if not shape:
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
