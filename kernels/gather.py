"""Row gather: ``out[i, :] = src[idx[i], :]`` — a batch taken from a data set kept on the device.

Versions: v1 only.

Why it exists: a data set that stays resident on the GPU (``InputOptions(
experimental_place_dataset_on_device=True)``, see ``mirrored/input_lib.py``) needs no
host-to-device copy of its images per step: the host sends only the batch's row
numbers (b int64 = 512 bytes for b = 64, instead of 64 x 784 float32 = 200 KB) and
this kernel copies those rows into the batch buffer on the device.

Thread mapping: one thread per output element, grid-stride over the flattened
(b, L) output: thread t handles row ``t // L``, column ``t % L``. Consecutive threads
read consecutive columns of one source row and write consecutive output addresses,
so every warp's loads and stores are coalesced (a row of MNIST is 784 float32 =
3 KB, so a warp never straddles more than two rows). Memory-bound: 2 * b * L
elements moved; nothing to reuse, so no shared memory.

Preconditions: ``src`` (n, L) and ``out`` (b, L) C-contiguous with one dtype; ``idx``
(b,) integer row numbers, every one in [0, n) — the kernel cannot check them: the
caller does (our index plans only hold valid row numbers). Any dtype Numba can copy
(float32 images, uint8 images, int64 labels as (n, 1)); one compiled kernel per dtype.

Layout: NumPy reference ``gather_rows_ref`` (the CPU backend calls it) -> kernel ->
launcher ``gather_rows``.
"""
import numpy as np
from numba import cuda

from kernels.launch import check_array, check_no_alias, grid_1d, launch
from kernels.registry import mat, register, sig, vec

#: Row dtypes of resident data sets: float32 and uint8 images, int64 and int32 labels
#: (seen as (n, 1)). Row numbers are always int64 (``mirrored/input_lib.py``).
GATHER_DTYPES = ("float32", "uint8", "int64", "int32")


# --- NumPy reference -----------------------------------------------------------------

def check_rows(what, idx, n):
    """Raise IndexError unless every row number in the host array ``idx`` lies in [0, n).

    The kernel cannot check (see ``gather_rows_kernel``), so whoever holds the row
    numbers on the host checks them here before they go to the device."""
    idx = np.asarray(idx)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"{what}: row numbers must lie in [0, {n}) (the rows of the data); "
                         f"got min {idx.min()}, max {idx.max()}. Pass row numbers of this data set.")


def gather_rows_ref(src, idx, out=None):
    """out[i, :] = src[idx[i], :] for src (n, L), idx (b,) ints; into ``out`` when given.

    Equals the loop nest::

        for i in range(b):
            for j in range(L):
                out[i, j] = src[idx[i], j]
    """
    check_rows("gather_rows", idx, src.shape[0])
    # mode="clip": the bounds are checked above, and "raise" would make NumPy gather
    # into a temporary and copy it into ``out`` (a second pass over the batch).
    return np.take(src, idx, axis=0, out=out, mode="clip")       # (b, L)


# --- kernel ----------------------------------------------------------------------------

@cuda.jit
def gather_rows_kernel(src, idx, out):
    """One thread per out[i, j] of the flattened (b, L) output (grid-stride).
    Loop nest: for t in range(b * L): out[t // L, t % L] = src[idx[t // L], t % L].

    No bounds check on idx[i], on purpose: a kernel cannot raise, so the only choices
    would be a silent clamp or zero (wrong rows, unnoticed) or reading past ``src``.
    The simulator raises IndexError there; a real GPU reads other memory, or faults
    with an illegal address that ends the CUDA context. So the precondition "every
    idx in [0, n)" is checked on the host, where the row numbers come from
    (``check_rows``, called by ``mirrored.input_lib.ResidentRows.gather``)."""
    cols = out.shape[1]
    for t in range(cuda.grid(1), out.shape[0] * cols, cuda.gridsize(1)):
        i = t // cols
        j = t - i * cols
        out[i, j] = src[idx[i], j]


register(gather_rows_kernel, "gather_rows_kernel",
         [sig(mat(t), vec("int64"), mat(t)) for t in GATHER_DTYPES], block=grid_1d(1)[1])


# --- launcher --------------------------------------------------------------------------

def gather_rows(src, idx, out, stream=None):
    """out[i, :] = src[idx[i], :] on the GPU. src (n, L), out (b, L): same dtype,
    C-contiguous; idx (b,) integer device array with every entry in [0, n)."""
    check_array("gather_rows: src", src, src.dtype, ndim=2)
    if np.dtype(idx.dtype).kind not in "iu":
        raise TypeError(f"gather_rows: idx must hold integer row numbers, got {idx.dtype}.")
    check_array("gather_rows: idx", idx, idx.dtype, ndim=1)
    check_array("gather_rows: out", out, src.dtype, shape=(idx.shape[0], src.shape[1]))
    check_no_alias("gather_rows", out, src, idx)
    if out.size:
        launch(gather_rows_kernel, *grid_1d(out.size), stream, src, idx, out)
    return out
