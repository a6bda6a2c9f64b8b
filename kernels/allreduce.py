"""The two step kernels of the ring all-reduce: reduce-scatter and all-gather.

Versions: v1 only. One thread per element of the chunk, grid-stride loop.

A ring all-reduce (``mirrored/ring.py``, ``RingAllReduce``) splits
every device's flat buffer into N chunks and moves one chunk per device per
step to the next device in the ring. Each step on the receiving device is one
of two tiny kernels, given the chunk as element offsets ``[lo, hi)`` so that
one compiled kernel serves every chunk of every step:

    reduce-scatter step   own[lo:hi] += peer[lo:hi]     (N-1 steps)
    all-gather step       own[lo:hi]  = peer[lo:hi]     (N-1 steps)

``own`` is the receiving device's buffer, ``peer`` the sending device's buffer,
read *straight out of the sender's memory*: logical GPUs carved from one card
share one address space, and physical GPUs with peer access enabled can read
each other's memory over NVLink/PCIe. (Without peer access the host code first
copies the chunk into a scratch buffer on the receiving device and passes that
as ``peer`` to the reduce kernel, which does not know the difference; an
all-gather step is then just that device-to-device copy, straight into ``own``.)

Both kernels are memory-bound: the reduce step reads 2 and writes 1 element
per addition (12 bytes per float32 element), the gather step reads 1 and
writes 1 (8 bytes). Coalescing (consecutive threads, consecutive addresses)
and a grid that fills the GPU are all that matter, as for ``elementwise.py``.

Why no atomics, no fused multi-chunk tricks: the order of additions must be
fixed so that every replica ends bitwise equal and reruns are identical. Each
element of a chunk is added by exactly one thread, once per step, and the ring
fixes the order of the steps (see ``RingAllReduce``).

Layout of this file (as every file in ``kernels/``):
    NumPy references  ``ring_reduce_step_ref``, ``ring_gather_step_ref`` (in place, like the kernels)
    kernels           ``ring_reduce_step_kernel``, ``ring_gather_step_kernel``
    registration      both, for every dtype the strategy reduces (``kernels/registry.py``)
    launchers         ``ring_reduce_step``, ``ring_gather_step``: check, then launch
The CPU backend (``mirrored/backends.py``, ``CpuOps.ring_*``) calls the refs.
"""
import numpy as np
from numba import cuda

from kernels.launch import check_array, grid_1d, launch
from kernels.registry import TENSOR_DTYPES, register, sig, vec


# --- NumPy references -------------------------------------------------------
# In place, like the kernels: the ring's whole point is to reuse the buffers.

def ring_reduce_step_ref(own, peer, lo, hi):
    """own[lo:hi] += peer[lo:hi], in own's dtype (float32 adds in float32)."""
    own[lo:hi] += peer[lo:hi]
    return own


def ring_gather_step_ref(own, peer, lo, hi):
    """own[lo:hi] = peer[lo:hi]: take over a chunk that is already fully reduced."""
    own[lo:hi] = peer[lo:hi]
    return own


# --- kernels ------------------------------------------------------------------

@cuda.jit
def ring_reduce_step_kernel(own, peer, lo, hi):
    """Reduce-scatter step: own[i] += peer[i] for lo <= i < hi.

    Thread -> data: thread t (global index ``cuda.grid(1)``) handles elements
    i = lo + t, lo + t + G, lo + t + 2G, ... below hi, where G is the number of
    threads in the grid (grid-stride loop): consecutive threads touch
    consecutive addresses in both arrays.
    ``own``: the receiving device's flat buffer. ``peer``: the sending device's
    flat buffer (its memory, read directly) or a staged copy; same size, dtype.
    Equals: ``for i in range(lo, hi): own[i] += peer[i]``.
    """
    for i in range(lo + cuda.grid(1), hi, cuda.gridsize(1)):
        own[i] += peer[i]


@cuda.jit
def ring_gather_step_kernel(own, peer, lo, hi):
    """All-gather step: own[i] = peer[i] for lo <= i < hi.

    Thread -> data: as ``ring_reduce_step_kernel`` (grid-stride from lo).
    Equals: ``for i in range(lo, hi): own[i] = peer[i]``.
    """
    for i in range(lo + cuda.grid(1), hi, cuda.gridsize(1)):
        own[i] = peer[i]


# What the real compiler checks (kernels/registry.py): flat buffers of every dtype the
# strategy reduces, chunk bounds as int64.
for _kernel, _name in ((ring_reduce_step_kernel, "ring_reduce_step_kernel"),
                       (ring_gather_step_kernel, "ring_gather_step_kernel")):
    register(_kernel, _name, [sig(vec(t), vec(t), "int64", "int64") for t in TENSOR_DTYPES],
             block=grid_1d(1)[1])


# --- launchers ----------------------------------------------------------------

def _check_step(what, own, peer, lo, hi):
    check_array(f"{what}: own", own, own.dtype, ndim=1)
    check_array(f"{what}: peer", peer, own.dtype, shape=own.shape)
    lo, hi = int(lo), int(hi)
    if not 0 <= lo <= hi <= own.shape[0]:
        raise ValueError(f"{what}: chunk [{lo}, {hi}) is not inside the buffer of "
                         f"{own.shape[0]} elements; expected 0 <= lo <= hi <= size.")
    return lo, hi


def ring_reduce_step(own, peer, lo, hi, stream=None):
    """own[lo:hi] += peer[lo:hi] on the GPU, on ``stream``.

    own, peer: 1-D, same size and dtype, C-contiguous; ``peer`` may live on
    another logical device of the same card, or on a peer-enabled GPU.
    An empty chunk (lo == hi) launches nothing.
    """
    lo, hi = _check_step("ring_reduce_step", own, peer, lo, hi)
    if hi > lo:
        # One thread per element of the chunk, not of the buffer.
        launch(ring_reduce_step_kernel, *grid_1d(hi - lo), stream, own, peer, np.int64(lo), np.int64(hi))
    return own


def ring_gather_step(own, peer, lo, hi, stream=None):
    """own[lo:hi] = peer[lo:hi] on the GPU, on ``stream`` (see ``ring_reduce_step``)."""
    lo, hi = _check_step("ring_gather_step", own, peer, lo, hi)
    if hi > lo:
        launch(ring_gather_step_kernel, *grid_1d(hi - lo), stream, own, peer, np.int64(lo), np.int64(hi))
    return own
