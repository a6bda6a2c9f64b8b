"""Devices: physical, logical, and the two backends behind one interface.

A *device* here is what TensorFlow calls a logical device: a place where arrays
live and kernels run, named like ``/job:localhost/replica:0/task:0/device:GPU:1``.
Each one has

* a backend: ``CudaDevice`` (Numba CUDA device arrays, the GPU's primary context,
  its own non-default stream) or ``CpuDevice`` (NumPy arrays, no stream);
* its own memory accounting, so a ``memory_limit`` can be enforced with a clear
  ``ResourceExhaustedError``;
* ``ops``: the backend's implementation of every kernel (``backends.py``).

Code above this layer (tensors, strategies, Keras) calls the same methods on
either kind and never asks which it has.

Logical devices: ``mirrored.config.set_logical_device_configuration`` splits a
physical GPU (or the CPU) into N logical devices, as TensorFlow does. On a GPU
they share one CUDA context (the card's primary context) but have separate
allocations and streams, so N replicas really run side by side on one card: this
is how multi-GPU code runs, is tested and is timed on a one-GPU machine.

The list of logical devices is built on first use and frozen from then on;
configuring it after that raises ``RuntimeError`` (TensorFlow's rule).

Neighbours: ``config.py`` (the TF-named functions over this module),
``backends.py`` (ops), ``tensor.py`` (arrays on a device), ``kernels/launch.py``
(real CUDA or the simulator).
"""
import collections
import contextlib
import re
import signal
import threading
import weakref
from collections import namedtuple

import numpy as np

from mirrored.backends import at_boundary
from mirrored.errors import ResourceExhaustedError

PhysicalDevice = namedtuple("PhysicalDevice", ["name", "device_type"])
PhysicalDevice.__doc__ = "A physical device, e.g. PhysicalDevice(name='/physical_device:GPU:0', device_type='GPU')."
LogicalDevice = namedtuple("LogicalDevice", ["name", "device_type"])
LogicalDevice.__doc__ = ("A logical device, e.g. LogicalDevice(name='/job:localhost/replica:0/"
                         "task:0/device:GPU:0', device_type='GPU').")

LONG_PREFIX = "/job:localhost/replica:0/task:0/device:"
MIB = 1024 * 1024

#: Pinned host buffers per (shape, dtype) that ``CudaDevice.upload_into`` stages
#: through: two, so the host fills one while the copy queued the step before may
#: still be reading the other.
STAGING_BUFFERS = 2
#: Where ``CudaDevice.empty_parts`` starts each part: a multiple of this many bytes (every
#: dtype's alignment, and the 256 bytes cudaMalloc itself aligns to).
PART_ALIGN = 256


class LogicalDeviceConfiguration:
    """One logical device to carve out of a physical one.

    ``memory_limit`` is in MiB, as in TensorFlow (``None``: no limit of ours;
    the card's own memory still applies).
    """

    def __init__(self, memory_limit=None, experimental_priority=None, experimental_device_ordinal=None):
        if memory_limit is not None and (isinstance(memory_limit, bool) or
                                         not isinstance(memory_limit, (int, float, np.integer, np.floating))):
            raise TypeError(f"memory_limit is a number of MiB (an int, as in TensorFlow), got "
                            f"{memory_limit!r}: write memory_limit=1024 for 1 GiB.")
        if memory_limit is not None and memory_limit <= 0:
            raise ValueError(f"memory_limit must be a positive number of MiB or None, got {memory_limit!r}.")
        self.memory_limit = memory_limit
        self.experimental_priority = experimental_priority
        self.experimental_device_ordinal = experimental_device_ordinal

    def __repr__(self):
        return f"LogicalDeviceConfiguration(memory_limit={self.memory_limit})"


# --- the cuda module, imported lazily --------------------------------------------
# Importing numba.cuda fixes the simulator-or-real choice for the process (tests
# decide it in tests/conftest.py), so nothing here touches it at import time.

def numba_cuda():
    """``numba.cuda``, imported on first use (the simulator-or-real choice stays open until then)."""
    from numba import cuda
    return cuda


def cuda_mode():
    """``"real"``, ``"simulator"`` or ``"none"`` (no usable CUDA GPU)."""
    from kernels.launch import SIMULATOR
    if SIMULATOR:
        return "simulator"
    try:
        return "real" if numba_cuda().is_available() else "none"
    except Exception:  # a broken driver counts as no GPU
        return "none"


# --- devices ----------------------------------------------------------------------

#: The device methods a ``@function``'s trace sees (``backends.at_boundary``), by what they
#: do: write device memory, hand a device value to the host (a trace cannot replay that),
#: make a buffer, order two streams. Every class of device has them wrapped when it is
#: made (``Device.__init_subclass__``), so a trace sees them whoever calls them.
BOUNDARY_METHODS = {"upload_into": "write", "copy_into": "write", "copy_peer_into": "write",
                    "synchronize": "write", "to_numpy": "read", "download_into": "read",
                    "mpi_buffer": "read", "from_numpy": "from_numpy", "copy_from": "copy_from",
                    "empty": "made", "empty_parts": "made", "record_event": "ordering",
                    "wait_event": "ordering"}


def _at_boundary(cls):
    """Wrap the boundary methods ``cls`` defines itself (once, as the class is made)."""
    for name, kind in BOUNDARY_METHODS.items():
        method = vars(cls).get(name)
        if method is not None and not hasattr(method, "boundary_kind"):
            setattr(cls, name, at_boundary(kind, method))


class Device:
    """A logical device: where arrays live and kernels run. Subclassed per backend."""

    device_type = None  # "CPU" or "GPU"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _at_boundary(cls)

    def __init__(self, index, physical, memory_limit_mib=None):
        self.index = index                  # logical index among devices of this type
        self.physical = physical            # PhysicalDevice it was carved from
        self.name = f"{LONG_PREFIX}{self.device_type}:{index}"
        self.memory_limit = None if memory_limit_mib is None else int(memory_limit_mib * MIB)
        self._bytes = 0                     # charged and not yet refunded (see bytes_in_use)
        self.peak_bytes_in_use = 0
        self._refunds = collections.deque()  # bytes freed by the garbage collector, to subtract
        self._lock = threading.Lock()
        self._scratch = {}                  # (key, shape, dtype) -> buffer; see scratch()

    # -- identity
    @property
    def short_name(self):
        return f"{self.device_type}:{self.index}"

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}>"

    def logical_device(self):
        return LogicalDevice(self.name, self.device_type)

    # -- memory accounting (every allocation of ours goes through _account)
    @property
    def bytes_in_use(self):
        """Bytes of this device's allocations that are alive now."""
        with self._lock:
            self._settle()
            return self._bytes

    def _settle(self):
        """Subtract the refunds queued by ``_refund`` (called with the lock held)."""
        while self._refunds:
            self._bytes -= self._refunds.popleft()

    def _check_fits(self, nbytes):
        """Raise ResourceExhaustedError if ``nbytes`` more would pass the limit (lock held)."""
        if self.memory_limit is not None and self._bytes + nbytes > self.memory_limit:
            raise ResourceExhaustedError(
                f"OOM on {self.name}: allocating {nbytes:,} bytes would exceed its "
                f"memory_limit of {self.memory_limit:,} bytes ({self._bytes:,} in use). "
                f"Use a smaller batch or model, or a larger memory_limit in "
                f"set_logical_device_configuration.")

    def _account(self, buf, nbytes):
        """Charge ``nbytes`` for ``buf``; refunded when ``buf`` is garbage-collected."""
        with self._lock:
            self._settle()
            self._check_fits(nbytes)
            self._bytes += nbytes
            self.peak_bytes_in_use = max(self.peak_bytes_in_use, self._bytes)
        weakref.finalize(memory_owner(buf), self._refund, nbytes)
        return buf

    def _refund(self, nbytes):
        """A finalizer: the garbage collector runs it wherever it happens to collect, which
        can be inside ``_account`` on this very thread with the lock held (a deadlock the
        test suite hit). So it takes no lock: it only queues the amount (a deque's append
        is atomic), and the next reader subtracts it under the lock (``_settle``)."""
        self._refunds.append(nbytes)

    def reset_peak(self):
        self.peak_bytes_in_use = self.bytes_in_use

    def scratch(self, key, shape, dtype):
        """A buffer this device keeps for internal use under ``key``: made (and charged)
        once per (key, shape, dtype), then the same buffer on every call.

        For buffers no caller ever holds (a reduction's partial sums, a count nobody
        reads). Allocating those per call costs a cudaMalloc each time, and numba's
        deferred frees then flush with cuMemFree, which synchronises the whole card,
        about every ten frees, stalling every logical device on it. Reuse is safe:
        every op of this device runs on its one stream, in order, so the next user of
        the buffer starts after the last one finished.
        """
        full_key = (key, tuple(shape), np.dtype(dtype))
        buf = self._scratch.get(full_key)
        if buf is None:
            buf = self._scratch[full_key] = self.empty(shape, dtype)
        return buf

    def caches(self):
        """The dicts of buffers this device made on first use (its ``scratch``): a step
        that fails drops what it added (``keras/step.py``'s ``Step.rolled_back_on_error``)."""
        return [self._scratch]

    # -- the interface every backend implements
    def empty(self, shape, dtype):
        """An uninitialised array of ``shape``/``dtype`` on this device."""
        raise NotImplementedError

    def from_numpy(self, array):
        """Copy a host (NumPy) array to this device."""
        raise NotImplementedError

    def to_numpy(self, buf):
        """Copy an array of this device to a new NumPy array (waits for pending work)."""
        raise NotImplementedError

    def download_into(self, host, buf):
        """Copy ``buf`` (an array of this device) into the existing NumPy array ``host``
        of the same shape and dtype: ``to_numpy`` without an allocation (waits for
        pending work). The cross-worker ring sends its chunks from one such array."""
        if tuple(host.shape) != tuple(buf.shape) or host.dtype != np.dtype(buf.dtype):
            raise ValueError(f"download_into: the device array {np.dtype(buf.dtype)}{list(buf.shape)} "
                             f"does not fit the host array {host.dtype}{list(host.shape)}.")
        self._download_into(host, buf)
        return host

    def mpi_buffer(self, buf):
        """What MPI is handed to read or write ``buf`` (an array of this device) in place:
        the array itself (NumPy on a CPU; on a GPU a device array, whose
        ``__cuda_array_interface__`` a CUDA-aware MPI reads through mpi4py)."""
        return buf

    def copy_from(self, buf, src):
        """A copy, on this device, of ``buf`` living on device ``src``."""
        raise NotImplementedError

    def copy_into(self, dst, src):
        """Copy ``src`` (same size, on this device) into the existing array ``dst``."""
        raise NotImplementedError

    def copy_peer_into(self, dst, buf, src):
        """Copy ``buf``, an array of device ``src`` (same kind as this one), into ``dst``
        on this device, queued on this device's stream. Ordering against ``src``'s
        stream is the caller's (``wait_for``, or the ring's events). One address space
        (CPU, logical GPUs of one card): a plain copy."""
        self.copy_into(dst, buf)

    def upload_into(self, dst, array):
        """Copy the host (NumPy) ``array`` into ``dst``, an existing array of this
        device with the same shape and dtype: ``from_numpy`` without an allocation.

        Training reuses one input buffer per batch size this way: a fresh array
        per step would cost its accounting (a ``weakref.finalize``) on the CPU, and
        a device allocation (cudaMalloc, then a free) on the GPU, every step.
        """
        raise NotImplementedError

    def empty_parts(self, specs):
        """Arrays of ``specs`` [(shape, dtype), ...] that ``upload_parts`` fills together: on
        a GPU, views of one allocation, so one copy fills them all (``CudaDevice``); here,
        separate arrays."""
        return tuple(self.empty(shape, dtype) for shape, dtype in specs)

    def upload_parts(self, dsts, arrays):
        """``upload_into(dst, array)`` for each pair: a step's x and y."""
        for dst, array in zip(dsts, arrays):
            self.upload_into(dst, array)

    def synchronize(self):
        """Wait until every kernel and copy queued on this device has finished."""

    def record_event(self, event):
        """Mark ``event`` done once this device's stream reaches this point (None: a CPU,
        nothing to do). ``ring.py`` orders its transfers with these two."""
        if event is not None:
            event.record(self.stream)

    def wait_event(self, event):
        """Make this device's stream wait, on the GPU, for ``event`` (None: nothing to do)."""
        if event is not None:
            event.wait(self.stream)

    def activate(self):
        """Context manager binding the calling thread to this device (CUDA context)."""
        return contextlib.nullcontext()

    def memory_info(self):
        """(free, total) bytes as far as we know; ``None`` where unknown."""
        return None, self.memory_limit


_at_boundary(Device)


def memory_owner(buf):
    """The object whose lifetime is the allocation's, so the refund happens when
    the memory is really freed, not when the first array over it goes (and
    ``traced_function.OutputPool`` can tell when nothing holds a buffer any more).

    * Real numba-cuda: ``buf.gpu_data`` is an ``OwnedPointer``, and every slice or
      reshape gets its *own* ``OwnedPointer`` (a reference count on the allocation).
      The base array's pointer can be collected while views still hold the memory
      (``batch_reduce`` returns slices of a fused buffer and drops the buffer), so we
      follow ``.owner`` to the allocation itself: numba keeps it in its context's
      table until the last view goes, then frees it and drops it.
    * Simulator: the NumPy array inside (``_ary``); CPU: the array itself. A NumPy
      view keeps its ``.base`` alive, so we walk to the array that owns the bytes.
    """
    gpu_data = getattr(buf, "gpu_data", None)
    if gpu_data is not None:
        return gpu_data.owner                   # the MemoryPointer all views count on
    arr = getattr(buf, "_ary", buf)
    while isinstance(getattr(arr, "base", None), np.ndarray):
        arr = arr.base
    return arr


class CpuDevice(Device):
    """The NumPy backend: arrays are ``np.ndarray``, ops are the kernels' references."""

    device_type = "CPU"

    def __init__(self, index, physical, memory_limit_mib=None):
        super().__init__(index, physical, memory_limit_mib)
        from mirrored.backends import CpuOps
        self.ops = CpuOps(self)
        self.stream = None

    def empty(self, shape, dtype):
        arr = np.empty(shape, dtype)
        return self._account(arr, arr.nbytes)

    def from_numpy(self, array):
        arr = np.array(array, copy=True, order="C")
        return self._account(arr, arr.nbytes)

    def to_numpy(self, buf):
        return np.array(buf, copy=True)

    def _download_into(self, host, buf):
        np.copyto(host, buf)

    def copy_from(self, buf, src):
        return self.from_numpy(src.to_numpy(buf) if src is not self else buf)

    def copy_into(self, dst, src):
        dst.reshape(-1)[...] = src.reshape(-1)

    def upload_into(self, dst, array):
        np.copyto(dst, array, casting="no")     # same shape and dtype, or a clear error
        return dst


class CudaDevice(Device):
    """The CUDA backend: arrays are Numba device arrays, ops are our kernels.

    Several logical devices may share one physical GPU (``gpu_id``): same
    primary context, separate streams and allocation accounting.
    """

    device_type = "GPU"

    def __init__(self, index, physical, gpu_id, memory_limit_mib=None):
        super().__init__(index, physical, memory_limit_mib)
        from mirrored.backends import CudaOps
        self.gpu_id = gpu_id
        with self.activate():
            self.stream = numba_cuda().stream()   # never the legacy default stream
        self.ops = CudaOps(self)
        self._staging = {}                   # (shape, dtype) -> [[pinned host array, event], ...]
        self._parts = {}                     # id(empty_parts' first view) -> its allocation, layout
        self._multiprocessors = None         # read once (``multiprocessors``)

    def activate(self):
        return _Activation(self.gpu_id)

    def _alloc(self, make, nbytes):
        self._check_fits(nbytes)
        cuda = numba_cuda()
        try:
            with self.activate():
                buf = make(cuda)
        except cuda.cudadrv.driver.CudaAPIError as err:
            raise ResourceExhaustedError(
                f"OOM on {self.name} (physical GPU {self.gpu_id}): the card could not "
                f"allocate {nbytes:,} bytes ({err}). Free tensors, or use a smaller batch.") from err
        return self._account(buf, nbytes)

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self._alloc(lambda cuda: cuda.device_array(shape, dtype, stream=self.stream), nbytes)

    def from_numpy(self, array):
        array = np.asarray(array, order="C")
        return self._alloc(lambda cuda: cuda.to_device(array, stream=self.stream), array.nbytes)

    def to_numpy(self, buf):
        with self.activate():
            host = buf.copy_to_host(stream=self.stream)
            self.stream.synchronize()
        return host

    def _download_into(self, host, buf):
        with self.activate():
            buf.copy_to_host(host, stream=self.stream)
            self.stream.synchronize()

    def mpi_buffer(self, buf):
        from kernels.launch import SIMULATOR
        # In the simulator "device memory" is a NumPy array inside the fake device
        # array (which has no __cuda_array_interface__): MPI gets that, so the tests
        # run the CUDA-aware path's logic with the wheel's MPI.
        return buf._ary if SIMULATOR else buf

    def copy_from(self, buf, src):
        if not isinstance(src, CudaDevice):
            return self.from_numpy(src.to_numpy(buf))
        out = self.empty(buf.shape, buf.dtype)
        wait_for(src, self)   # read after write: the copy sees every write queued on src
        self.copy_peer_into(out, buf, src)
        # Write after read: the copy is only queued on our stream; without this, the next
        # in-place write queued on src's stream (the next backward into a packed gradient,
        # an assign) could overtake it, and the replicas would silently diverge.
        wait_for(self, src)
        return out

    def copy_into(self, dst, src):
        with self.activate():
            dst.reshape(dst.size).copy_to_device(src.reshape(src.size), stream=self.stream)

    def copy_peer_into(self, dst, buf, src):
        if src.gpu_id == self.gpu_id:             # one context: an ordinary device-to-device copy
            self.copy_into(dst, buf)
            return
        # Two physical GPUs: cuMemcpyPeerAsync, the copy CUDA documents for memory of
        # two contexts (numba's copy_to_device would issue cuMemcpyDtoDAsync, which
        # only works between contexts by relying on unified addressing).
        nbytes = int(np.prod(dst.shape, dtype=np.int64)) * np.dtype(dst.dtype).itemsize
        src_bytes = int(np.prod(buf.shape, dtype=np.int64)) * np.dtype(buf.dtype).itemsize
        if src_bytes != nbytes:
            raise ValueError(f"copy_peer_into: {src_bytes:,} bytes on {src.name} do not fit "
                             f"{nbytes:,} bytes on {self.name}; pass arrays of one size.")
        if nbytes:
            _memcpy_peer(self, dst, src, buf, nbytes)

    def upload_into(self, dst, array):
        # A host-to-device copy queued on this device's stream, so it runs after
        # the kernels that still read ``dst`` from the previous step.
        # Why a pinned staging buffer: from pageable memory the driver may block the
        # host until the stream drains (it has to stage the bytes itself), which
        # would serialise the one host thread that feeds every replica. From pinned
        # (page-locked) memory the copy is truly asynchronous. We copy ``array``
        # into one of STAGING_BUFFERS pinned buffers of its shape (so the caller may
        # reuse ``array`` at once) after the copy that last read that buffer is done.
        #
        # The copy itself is one cuMemcpyHtoDAsync (numba's ``host_to_device``), not
        # ``dst.copy_to_device``: that method re-derives both arrays' layouts by slicing
        # them (~100 µs of Python per call on an H100's host, measured with cProfile in
        # session 7: three uploads a step made up most of a captured step's 0.6 ms).
        # Both sides are whole C-contiguous buffers of the same shape and dtype, checked
        # here, so the byte count is all the copy needs.
        array = np.asarray(array, order="C")       # (ascontiguousarray would make a 0-d array 1-d)
        if tuple(array.shape) != tuple(dst.shape) or array.dtype != np.dtype(dst.dtype):
            raise ValueError(f"upload_into: {array.dtype}{list(array.shape)} does not fit the "
                             f"device buffer {np.dtype(dst.dtype)}{list(dst.shape)}.")
        if not dst.flags["C_CONTIGUOUS"]:
            raise ValueError("upload_into: the device buffer is a strided view; pass a whole "
                             "(C-contiguous) buffer made by empty() or from_numpy().")
        with self.activate():
            host, copied = self._staging_slot(array.shape, array.dtype)
            copied.synchronize()          # its last copy has read it (normally long ago)
            np.copyto(host, array)
            copy_host_to_device(dst, host, self.stream)
            copied.record(self.stream)
        return dst

    def empty_parts(self, specs):
        # Views of ONE allocation, each at a multiple of PART_ALIGN bytes, so that
        # ``upload_parts`` fills them with one host-to-device copy from one pinned buffer:
        # a step's x, y and optimizer scalars (``engine.input_buffers``; the row numbers and
        # scalars of a resident batch, ``input_lib.ResidentRows.gather``) were three copies,
        # each with its own staging buffer and event (issue 40: a captured step's host time
        # is mostly such driver calls).
        offsets, end = [], 0
        for shape, dtype in specs:
            offsets.append(end)
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            end = -(-(end + nbytes) // PART_ALIGN) * PART_ALIGN
        base = self.empty((max(end, 1),), np.uint8)
        views = tuple(base[off:off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize]
                      .view(np.dtype(dtype)).reshape(shape)
                      for off, (shape, dtype) in zip(offsets, specs))
        # Keyed by the first view, forgotten with it (the entry holds no view strongly: it
        # would keep itself alive, and the allocation with it).
        key = id(views[0])
        self._parts[key] = (weakref.ref(views[0]), base, offsets,
                            [(tuple(v.shape), np.dtype(v.dtype)) for v in views])
        weakref.finalize(views[0], self._parts.pop, key, None)
        return views

    def upload_parts(self, dsts, arrays):
        first, base, offsets, specs = self._parts.get(id(dsts[0]), (None, None, (), ()))
        owner = memory_owner(base) if base is not None else None
        if (first is None or first() is not dsts[0] or len(dsts) != len(specs) or
                any((tuple(d.shape), np.dtype(d.dtype)) != spec or memory_owner(d) is not owner
                    for d, spec in zip(dsts, specs))):
            return super().upload_parts(dsts, arrays)        # not the views of one empty_parts
        arrays = [np.asarray(a, order="C") for a in arrays]        # (0-d stays 0-d)
        for dst, array in zip(dsts, arrays):
            if tuple(array.shape) != tuple(dst.shape) or array.dtype != np.dtype(dst.dtype):
                raise ValueError(f"upload_parts: {array.dtype}{list(array.shape)} does not fit "
                                 f"the device buffer {np.dtype(dst.dtype)}{list(dst.shape)}.")
        with self.activate():
            host, copied = self._staging_slot(base.shape, base.dtype)
            # Its last copy has read it (see upload_into). This wait is also all the
            # back-pressure a quiet fit (verbose=0, nothing read back) gets: the host runs at
            # most STAGING_BUFFERS steps ahead of the card, and waits on an event of a copy
            # queued that many steps ago, long done unless the card is behind; no stream or
            # device synchronize per step (tests/test_lean_host.py counts the waits).
            copied.synchronize()
            for off, array in zip(offsets, arrays):
                host[off:off + array.nbytes] = array.reshape(-1).view(np.uint8)
            copy_host_to_device(base, host, self.stream)
            copied.record(self.stream)

    @property
    def multiprocessors(self):
        """The streaming multiprocessors of this device's GPU (read once: asking the
        driver costs ~25 µs a call, and ``gemm`` chooses its version by it every call)."""
        if self._multiprocessors is None:
            gpu = numba_cuda().gpus[self.gpu_id]   # numba's device: its attributes are the driver's
            with gpu:
                self._multiprocessors = int(getattr(gpu, "MULTIPROCESSOR_COUNT", 1))
        return self._multiprocessors

    def _staging_slot(self, shape, dtype):
        """The next (pinned host buffer, event after its last copy) for (shape, dtype),
        made on first use (pinned memory is costly to allocate, cheap to reuse)."""
        key = (tuple(shape), np.dtype(dtype))
        slots = self._staging.get(key)
        if slots is None:
            cuda = numba_cuda()
            slots = self._staging[key] = [
                [cuda.pinned_array(key[0], key[1]),
                 cuda.event(timing=False) if cuda_mode() == "real" else cuda.event()]
                for _ in range(STAGING_BUFFERS)]
        slot = slots.pop(0)
        slots.append(slot)                # take turns
        return slot

    def synchronize(self):
        with self.activate():
            self.stream.synchronize()

    def memory_info(self):
        with self.activate():
            free, total = numba_cuda().current_context().get_memory_info()
        if self.memory_limit is not None:
            return max(0, self.memory_limit - self.bytes_in_use), self.memory_limit
        return free, total


# -- making a GPU's context current, once --------------------------------------------------

_current = threading.local()    # .gpu: the GPU whose context this thread's _Activation made current


class _Activation:
    """``CudaDevice.activate()``: make the GPU's primary context current in this thread for
    the block, unless an enclosing ``activate()`` of the same GPU already did.

    numba's ``with cuda.gpus[i]:`` pushes the context and pops it again, always: two
    driver calls and ~10 µs of Python each time. One step entered it six times (its input
    copy, x's and y's uploads inside it, the layers' buffers, the optimizer's scalars, the
    graph's launch), every time for the context already current. Now the step enters its
    device once around all of it (``program/passes.py``'s ``CapturedStep.train``) and the blocks inside
    find the context current and do nothing. Blocks nest lexically (``with``), so this
    thread's record of the innermost one is exact; a different GPU inside pushes its own
    context and puts the record back when it pops. Each thread has its own record, as
    CUDA has a current context per thread."""

    __slots__ = ("gpu_id", "outer")

    def __init__(self, gpu_id):
        self.gpu_id, self.outer = gpu_id, None

    def __enter__(self):
        self.outer = getattr(_current, "gpu", None)
        if self.outer != self.gpu_id:
            numba_cuda().gpus[self.gpu_id].__enter__()
            _current.gpu = self.gpu_id

    def __exit__(self, *exc):
        if self.outer != self.gpu_id:
            _current.gpu = self.outer
            numba_cuda().gpus[self.gpu_id].__exit__(*exc)
        return False


# -- the host thread's launches: to every device or to none ----------------------------------

_deferring = [0]        # how many every_device_or_none sections the main thread is inside


@contextlib.contextmanager
def every_device_or_none():
    """Run the block with Ctrl-C (SIGINT) held back; deliver it, once, when the block ends.

    One host thread drives every replica's device in turn, and Python runs a signal's
    handler between any two bytecodes of the main thread: a Ctrl-C that landed between
    device 0's update and device 1's would leave the replicas' copies of the weights
    different for ever after (``keras/optimizers.py``, ``Optimizer.update_buffers``), and
    one between two replica threads' hand-offs would leave one replica waiting at a merge
    point for the other (``mirrored_run.py``). Inside this block a SIGINT is only noted;
    when the block ends, the handler that was in force runs (Python's own raises
    ``KeyboardInterrupt``): the launches reach every device, then the program stops.
    TensorFlow gets this for free: its step is one call into C++, and Python sees the
    signal when that call returns. Keep the blocks short: the Ctrl-C waits for them.

    Only the main thread gets signals, and only it may install a handler: elsewhere the
    block runs as it is (replica threads never see a ``KeyboardInterrupt``). Blocks nest
    (the outermost defers). A handler installed outside Python (``getsignal`` is None)
    cannot be put back, so it is left alone."""
    if (threading.current_thread() is not threading.main_thread() or _deferring[0]
            or signal.getsignal(signal.SIGINT) is None):
        yield
        return
    caught = []                                   # (signum, frame) of a SIGINT during the block
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])                  # Python's default_int_handler raises KeyboardInterrupt
        elif caught and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)    # the default action: the process stops


def copy_host_to_device(dst, host, stream):
    """Queue a copy of the host array ``host`` into the device array ``dst`` on ``stream``:
    both whole C-contiguous buffers of the same bytes (``CudaDevice.upload_into`` checks).
    On a GPU it is one ``cuMemcpyHtoDAsync`` (numba's ``host_to_device``); the simulator's
    arrays have no device pointers and take numba's ``copy_to_device``."""
    from kernels.launch import SIMULATOR            # a CudaDevice is the simulator's or real
    if SIMULATOR:
        dst.copy_to_device(host, stream=stream)
        return
    from numba.cuda.cudadrv.driver import host_to_device
    if host.nbytes:
        host_to_device(dst, host, host.nbytes, stream=stream)


def _memcpy_peer(dst_dev, dst, src_dev, src, nbytes):
    """``cuMemcpyPeerAsync``: ``nbytes`` from ``src`` (GPU ``src_dev.gpu_id``) to ``dst``
    (GPU ``dst_dev.gpu_id``), queued on ``dst_dev``'s stream. Needs no peer access
    (the driver stages through the host where the GPUs cannot reach each other)."""
    cuda = numba_cuda()
    from numba.cuda.cudadrv.driver import device_pointer, driver
    dst_ctx = cuda.gpus[dst_dev.gpu_id].get_primary_context().handle
    src_ctx = cuda.gpus[src_dev.gpu_id].get_primary_context().handle
    with dst_dev.activate():
        driver.cuMemcpyPeerAsync(device_pointer(dst), dst_ctx, device_pointer(src), src_ctx,
                                 nbytes, dst_dev.stream.handle)


# Peer access is a property of a pair of CUDA contexts, so it is cached for the
# whole process: (reading GPU id, GPU id whose memory it reads) -> enabled?
_peer_access = {}
_peer_lock = threading.Lock()

#: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: someone in this process enabled it first.
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


def enable_peer_access(reader_gpu, owner_gpu):
    """Let kernels on GPU ``reader_gpu`` read memory of GPU ``owner_gpu``; False if impossible
    (the ring, ``ring.py``, then stages each chunk through a copy)."""
    key = (reader_gpu, owner_gpu)
    with _peer_lock:
        if key not in _peer_access:
            cuda = numba_cuda()
            ok = False
            with cuda.gpus[reader_gpu]:
                ctx = cuda.current_context()
                if ctx.can_access_peer(owner_gpu):
                    try:
                        ctx.enable_peer_access(cuda.gpus[owner_gpu].get_primary_context().handle)
                        ok = True
                    except cuda.cudadrv.driver.CudaAPIError as err:
                        # Already on is fine; any other failure: stage through copies.
                        ok = getattr(err, "code", None) == _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            _peer_access[key] = ok
        return _peer_access[key]


def wait_for(src, dst):
    """Make work queued on ``dst`` from now on wait for work queued on ``src``.

    CUDA streams are ordered only within themselves; between two streams we
    record an event on ``src`` and make ``dst`` wait on it (no host sync).
    On CPU devices everything is already ordered: nothing to do.
    A copy between streams needs it both ways: the reader waits for the writes
    before it (read after write), and the writer's later writes wait for the
    copy (write after read); see ``CudaDevice.copy_from``.
    """
    if src is dst or src.stream is None or dst.stream is None:
        return
    cuda = numba_cuda()
    with src.activate():
        event = cuda.event(timing=False) if cuda_mode() == "real" else cuda.event()
        src.record_event(event)
    with dst.activate():
        dst.wait_event(event)


# --- the registry: physical devices, logical configuration, logical devices ------

class _Registry:
    def __init__(self):
        self.lock = threading.RLock()
        self.physical = None          # list[PhysicalDevice]
        self.gpu_ids = {}             # physical GPU name -> CUDA device id
        self.configs = {}             # physical name -> [LogicalDeviceConfiguration]
        self.devices = None           # list[Device] once initialised (then frozen)
        self.stand_ins = []           # extra CpuDevices made by cpu_stand_ins (soft placement)


_registry = _Registry()


def physical_gpu_id(name):
    """The CUDA device id of the physical GPU named ``name`` (``list_physical()``'s names)."""
    return _registry.gpu_ids[name]


def list_physical():
    """Every physical device: the CPU first, then each CUDA GPU."""
    with _registry.lock:
        if _registry.physical is None:
            phys = [PhysicalDevice("/physical_device:CPU:0", "CPU")]
            if cuda_mode() != "none":
                for gpu in numba_cuda().gpus:
                    name = f"/physical_device:GPU:{gpu.id}"
                    phys.append(PhysicalDevice(name, "GPU"))
                    _registry.gpu_ids[name] = gpu.id
            _registry.physical = phys
        return list(_registry.physical)


def set_configuration(physical, configs):
    """Split ``physical`` into ``len(configs)`` logical devices (see config.py)."""
    if not isinstance(physical, PhysicalDevice) or physical not in list_physical():
        raise ValueError(f"{physical!r} is not a physical device here; pass one from "
                         f"mirrored.config.list_physical_devices(): {list_physical()}.")
    configs = list(configs) if configs is not None else None
    for c in configs or []:
        if not isinstance(c, LogicalDeviceConfiguration):
            raise TypeError(f"expected a list of LogicalDeviceConfiguration, got {c!r}.")
    if configs is not None and not configs:
        raise ValueError("the list of LogicalDeviceConfiguration is empty; give one per logical device.")
    with _registry.lock:
        if _registry.devices is not None:
            raise RuntimeError("Virtual devices cannot be modified after being initialized: "
                               "call set_logical_device_configuration before creating any "
                               "tensor, variable or strategy (e.g. at the top of the program, "
                               "or restart the notebook kernel).")
        if configs is None:
            _registry.configs.pop(physical.name, None)
        else:
            _registry.configs[physical.name] = configs


def get_configuration(physical):
    with _registry.lock:
        return _registry.configs.get(physical.name)


def logical_devices():
    """Every logical device, created (and the configuration frozen) on first call."""
    with _registry.lock:
        if _registry.devices is None:
            devices, counts = [], {"CPU": 0, "GPU": 0}
            for phys in list_physical():
                for cfg in _registry.configs.get(phys.name) or [LogicalDeviceConfiguration()]:
                    i = counts[phys.device_type]
                    counts[phys.device_type] += 1
                    if phys.device_type == "CPU":
                        devices.append(CpuDevice(i, phys, cfg.memory_limit))
                    else:
                        devices.append(CudaDevice(i, phys, _registry.gpu_ids[phys.name], cfg.memory_limit))
            _registry.devices = devices
        return list(_registry.devices)


def cpu_stand_ins(count):
    """``count`` CPU devices beyond the logical CPUs, for replicas that TensorFlow would
    soft-place on the CPU (``MirroredStrategy(devices=["/gpu:0", "/gpu:1"])`` on a machine
    without GPUs: each replica needs a device of its own here). They share the CPU like
    logical CPUs, are named after them (``CPU:<n>``, ``CPU:<n+1>``... past the last logical
    CPU), are made once and reused, and ``get_device`` finds them; ``list_logical_devices``
    does not list them (the configuration stays as the program set it)."""
    with _registry.lock:
        cpus = [d for d in logical_devices() if d.device_type == "CPU"]
        phys = next(p for p in list_physical() if p.device_type == "CPU")
        while len(_registry.stand_ins) < count:
            _registry.stand_ins.append(CpuDevice(len(cpus) + len(_registry.stand_ins), phys))
        return list(_registry.stand_ins[:count])


def _reset():
    """Forget the configuration and the logical devices (for tests only: a real
    program configures once, as in TensorFlow). Existing tensors keep working."""
    global _registry
    with _registry.lock:
        _registry = _Registry()
    _current.__dict__.clear()


def is_initialized():
    return _registry.devices is not None


_SPEC = re.compile(
    r"^(?:/job:localhost)?(?:/replica:0)?(?:/task:0)?/?(?:device:)?(?P<type>cpu|gpu):(?P<index>\d+)$",
    re.IGNORECASE)


def canonical_name(spec):
    """``"gpu:1"``, ``"/GPU:1"``, ``"/device:GPU:1"``... -> the long canonical name."""
    if isinstance(spec, Device):
        return spec.name
    if isinstance(spec, (LogicalDevice, PhysicalDevice)):
        spec = spec.name.replace("/physical_device:", "")
    if not isinstance(spec, str):
        raise TypeError(f"a device must be a string such as 'GPU:0' or '/cpu:0', got {spec!r}.")
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"cannot parse device string {spec!r}: expected a form such as 'GPU:0', "
                         f"'/gpu:0', '/device:GPU:0' or '{LONG_PREFIX}GPU:0'. Devices here: "
                         f"{[d.name for d in logical_devices()]}.")
    return f"{LONG_PREFIX}{m.group('type').upper()}:{int(m.group('index'))}"


def get_device(spec):
    """The logical ``Device`` named by ``spec`` (any TF spelling), or ValueError listing them."""
    if isinstance(spec, Device):
        return spec
    name = canonical_name(spec)
    for d in logical_devices() + list(_registry.stand_ins):
        if d.name == name:
            return d
    raise ValueError(f"there is no device {spec!r} ({name}). Devices here: "
                     f"{[d.name for d in logical_devices()]}.")


def default_device():
    """The first logical GPU if there is one, else CPU:0 (TensorFlow's placement)."""
    devices = logical_devices()
    gpus = [d for d in devices if d.device_type == "GPU"]
    return gpus[0] if gpus else devices[0]


# --- the current device of this thread: `with mirrored.device("GPU:1"):` ---------

_current = threading.local()


def current_device():
    stack = getattr(_current, "stack", None)
    return stack[-1] if stack else default_device()


@contextlib.contextmanager
def device_scope(spec):
    """Place new tensors on ``spec`` inside the block (TensorFlow's ``tf.device``)."""
    dev = get_device(spec)
    stack = _current.__dict__.setdefault("stack", [])
    stack.append(dev)
    try:
        with dev.activate():
            yield dev
    finally:
        stack.pop()
