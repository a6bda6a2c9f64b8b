"""The ring all-reduce: how N replicas' gradients become one sum, each device talking
only to its neighbour (``RingAllReduce``, the default ``cross_device_ops`` of
``MirroredStrategy``; lab 03 steps through it).

Read top to bottom: ``RingAllReduce``, its schedule as plain functions (``chunk_bounds``,
``schedule``, ``bytes_moved``), the checks, and ``_run_ring``, which launches the steps
(``kernels/allreduce.py`` adds or copies one chunk) with one CUDA event between neighbours
per step.

Neighbours: ``cross_device_ops.py`` (``CrossDeviceOps``, the base class: packing,
MEAN, destinations; it calls this ring's ``_sum_in_place``), ``ring_steps.py`` (the
step record, ``RingStep`` and ``RingTransfer``, also importable from here),
``collective_all_reduce.py`` (the same ring across MPI workers), ``kernels/allreduce.py``
(the chunk kernels), ``devices.py`` (``enable_peer_access`` between two cards),
``lab/viz.py`` (the ring's pictures); ``distribute.py`` defines ``HierarchicalCopyAllReduce``,
TensorFlow's name that runs as this ring.
"""
import numpy as np

from mirrored import devices as _dev
from mirrored.cross_device_ops import CrossDeviceOps, check_distinct
from mirrored.ring_steps import RingStep, RingTransfer, bytes_moved, initial_holds, record_steps  # noqa: F401 (also found here)

#: The key of a device's staging buffer for chunks read from a peer (``Device.scratch``).
STAGING = "ring staging"


class RingAllReduce(CrossDeviceOps):
    """Ring all-reduce: reduce-scatter, then all-gather, each device talking only to its neighbour.

    The N devices form a ring 0 -> 1 -> ... -> N-1 -> 0, and every device's flat
    buffer is cut into N chunks (chunk c = elements [c*size//N, (c+1)*size//N):
    sizes differ by at most one; with size < N some chunks are empty). In each
    of 2(N-1) steps every device sends ONE chunk to the next device:

    * reduce-scatter step s (s = 0 .. N-2): device i sends chunk (i - s) mod N to
      device i+1, which adds it into its own copy of that chunk. After N-1 steps
      device i holds the full sum of chunk (i + 1) mod N.
    * all-gather step g (g = 0 .. N-2): device i sends chunk (i + 1 - g) mod N,
      fully reduced, to device i+1, which overwrites its own copy with it.

    The schedule for N = 4 (cK = chunk K; RS adds, AG copies)::

                    GPU0->GPU1   GPU1->GPU2   GPU2->GPU3   GPU3->GPU0
        RS step 0      c0           c1           c2           c3
        RS step 1      c3           c0           c1           c2
        RS step 2      c2           c3           c0           c1
                    now GPU0 has all of c1, GPU1 of c2, GPU2 of c3, GPU3 of c0
        AG step 0      c1           c2           c3           c0
        AG step 1      c0           c1           c2           c3
        AG step 2      c3           c0           c1           c2

    The life of chunk 0 (the replicas whose contributions it holds)::

        GPU0 {0} -RS0-> GPU1 {0,1} -RS1-> GPU2 {0,1,2} -RS2-> GPU3 {0,1,2,3}
                 -AG0-> GPU0 -AG1-> GPU1 -AG2-> GPU2          (all four have the sum)

    Why a ring: every device sends and receives 2(N-1)/N of the buffer, no matter
    how large N is, and all links are busy at once; reduce-to-one-device pushes
    (N-1) whole buffers through one device. (``bytes_moved`` counts both.)

    Bitwise determinism, by construction: each chunk's sum is formed on one path
    around the ring in a fixed order (chunk c: replica c, then c+1, c+2, ...),
    then *copied* to everyone. So every device ends with the same bits, and a
    rerun adds in the same order. (ReductionToOneDevice adds in another order:
    the two agree to float32 rounding, not bitwise.)

    Where the bytes go:
    * logical GPUs on one card: the receiving device's kernel reads the sender's
      allocation directly (one address space);
    * physical GPUs: peer access is enabled where ``can_access_peer`` allows it
      (once per ordered pair, cached) and the kernel reads over NVLink/PCIe;
      where it is impossible, or with ``peer_access=False`` (to test this path
      on one card), each chunk is first copied device-to-device into a scratch
      buffer on the receiving device (``Device.copy_peer_into``: cuMemcpyPeerAsync
      between two cards), then added from there. Same algorithm,
      same order of additions, so the same bits;
    * CPU devices: the same schedule over NumPy slices (``CpuOps``: the refs).
    * CPU and GPU devices in one ring: refused (use ``ReductionToOneDevice``).

    Ordering without any device-wide synchronisation: each device works on its own
    stream; after its step t device i records an event, and device i+1's step
    t+1 waits on it — nothing else. (See ``_run_ring`` for why that suffices.)

    ``keep_steps=True``: after each reduction ``self.steps`` is a list with one
    ``RingStep`` per step (per fused buffer; the list is reset on every call):
    ``phase``, ``step``, ``transfers`` (for each device: ``RingTransfer(src,
    dst, chunk, lo, hi, op)``) and ``holds`` (after the step, ``holds[d][c]`` =
    frozenset of the replica ids whose contributions chunk c on device d
    holds). The state before the first step is ``RingAllReduce.initial_holds(N)``.
    ``step.as_dict()`` gives lists and dicts for JSON. With ``keep_steps=False`` (the
    default, nothing recorded) ``self.steps`` is None.
    """

    PHASES = ("reduce-scatter", "all-gather")

    def __init__(self, peer_access=True, keep_steps=False):
        self.peer_access = bool(peer_access)
        self.steps = [] if keep_steps else None
        self._events = {}      # device name -> [CUDA events, one per step], reused call after call
        self._buffer_index = 0

    # -- the schedule, as plain functions (the step record, the tests and the lab use them)
    @staticmethod
    def chunk_bounds(size, n):
        """[(lo, hi)] of the N chunks of a buffer of ``size`` elements (balanced, maybe empty)."""
        return [(c * size // n, (c + 1) * size // n) for c in range(n)]

    @staticmethod
    def schedule(n):
        """[(phase, step, [(src, dst, chunk) for every device src])] for a ring of ``n``."""
        steps = []
        for s in range(n - 1):
            steps.append(("reduce-scatter", s, [(i, (i + 1) % n, (i - s) % n) for i in range(n)]))
        for g in range(n - 1):
            steps.append(("all-gather", g, [(i, (i + 1) % n, (i + 1 - g) % n) for i in range(n)]))
        return steps

    initial_holds = staticmethod(initial_holds)     # the state before the first step (ring_steps.py)

    @staticmethod
    def bytes_moved(size, n, itemsize=4):
        """Bytes each device sends and receives, ring against reduce-to-one (``ring_steps.bytes_moved``)."""
        return bytes_moved(RingAllReduce.schedule(n), RingAllReduce.chunk_bounds(size, n), size, itemsize)

    # -- CrossDeviceOps
    def all_reduce_components(self, reduce_op, values):
        # One reduce/batch_reduce call = one fresh step record (also when N == 1 or
        # every tensor is empty and the hook below is never called).
        self._start_call()
        return super().all_reduce_components(reduce_op, values)

    def all_reduce_flat(self, reduce_op, buffers, devices):
        self._start_call()
        return super().all_reduce_flat(reduce_op, buffers, devices)

    def _start_call(self):
        if self.steps is not None:
            self.steps = []
        self._buffer_index = 0

    def _sum_in_place(self, buffers, devices):
        n = len(devices)
        size = int(buffers[0].shape[0]) if n else 0
        self._check(buffers, devices)               # refuse before anything is launched
        buffer_index, self._buffer_index = self._buffer_index, self._buffer_index + 1
        if n < 2 or size == 0:
            return
        links = [self._link(devices[(i - 1) % n], devices[i]) for i in range(n)]
        self._run_ring(buffers, devices, links)
        if self.steps is not None:
            self.steps.extend(self._record_steps(n, size, buffer_index, np.dtype(buffers[0].dtype)))

    # -- checks and links
    def _check(self, buffers, devices):
        if not devices:
            raise ValueError("RingAllReduce: no devices to reduce over (the device list is empty).")
        names = [d.name for d in devices]
        check_distinct(devices, "RingAllReduce", "a ring needs N distinct devices")
        kinds = {d.device_type for d in devices}
        if len(kinds) > 1:
            raise ValueError(
                f"RingAllReduce: the ring mixes CPU and GPU devices ({names}). Its steps read the "
                f"neighbour's memory from a kernel (or a NumPy slice), which a GPU cannot do for "
                f"host memory nor a CPU for device memory. Put every replica on the same kind of "
                f"device, or use cross_device_ops=mirrored.distribute.ReductionToOneDevice(), "
                f"which copies through the host.")
        first = buffers[0]
        for buf, dev in zip(buffers, devices):
            if tuple(buf.shape) != (first.shape[0],) or np.dtype(buf.dtype) != np.dtype(first.dtype):
                raise ValueError(f"RingAllReduce: buffer on {dev.name} is {tuple(buf.shape)} "
                                 f"{buf.dtype}, expected flat ({first.shape[0]},) {first.dtype} "
                                 f"like every other device.")

    def _link(self, sender, receiver):
        """How ``receiver`` reads ``sender``'s memory: "host", "direct", "peer" or "staged"."""
        if receiver.device_type == "CPU":
            return "host"                            # NumPy: one address space
        if not self.peer_access:
            return "staged"                          # forced (tests the staged path on one card)
        if sender.gpu_id == receiver.gpu_id:
            return "direct"                          # logical GPUs of one card: one context
        return "peer" if _dev.enable_peer_access(receiver.gpu_id, sender.gpu_id) else "staged"

    def _step_events(self, dev, count):
        """``count`` reusable events on ``dev`` (None on a CPU device, which needs none).

        Reusing an event across calls is safe: ``event.wait(stream)`` captures the
        event's *latest record at the time of the call*; re-recording it later
        does not affect waits already queued.
        """
        if dev.stream is None:
            return [None] * count
        events = self._events.setdefault(dev.name, [])
        if len(events) < count:
            cuda = _dev.numba_cuda()
            with dev.activate():
                while len(events) < count:
                    # timing=False: cheaper events, we only order streams with them.
                    events.append(cuda.event(timing=False) if _dev.cuda_mode() == "real" else cuda.event())
        return events[:count]

    # -- the ring itself
    def _run_ring(self, buffers, devices, links):
        """Issue the 2(N-1) steps on every device's stream, ordered only by events.

        Events: ``done[i][t]`` is recorded on device i's stream after its step t
        (``done[i][0]`` = "inputs ready", before step 1; steps are numbered
        1 .. 2(N-1) here). Device i's step t waits on ``done[i-1][t-1]`` and on
        nothing else — its own earlier steps are ordered by its own stream.

        Why that is enough (the data hazards):
        * Read after write. At step t device i reads the chunk that device i-1
          sends; device i-1 finished it at step t-1 (or it is i-1's input, at
          t = 1), so waiting on done[i-1][t-1] is exactly what is needed.
        * Write after read, reduce-scatter. Device i writes chunk (i-1-s) at RS
          step s, and device i+1 reads device i's chunk (i-s') at RS step s'.
          They are the same chunk only when s' = s+1: the neighbour reads a
          chunk *after* it was written, never before, and no chunk is written
          twice in this phase. So device i may race ahead into another chunk
          while device i+1 still reads: no conflict.
        * Write after read, across phases. Device i overwrites chunk (i-g) at
          AG step g — the very chunk device i+1 read from it at RS step g. Is
          device i+1 done reading? Device i's AG step g (step N-1+g+1 here)
          waits, through the chain i-1, i-2, ... around the ring, on device i+1's
          step g+1 = RS step g: N-1 hops back, exactly the read in question.
          The ring's own dependency chain protects it; no extra event needed.
        * Write after read, at the end. Device i+1 reads device i's memory in the
          last step, after which the caller may overwrite device i's buffer on
          device i's stream (MEAN divides in place). So, last, every device
          waits on its successor's last step: a device's buffer is handed back
          only when nobody reads it any more.
        On CPU devices everything runs in host order and the events are None.
        """
        n = len(devices)
        size = int(buffers[0].shape[0])
        dtype = buffers[0].dtype
        bounds = self.chunk_bounds(size, n)
        total = 2 * (n - 1)
        done = [self._step_events(dev, total + 1) for dev in devices]
        for i, dev in enumerate(devices):
            with dev.activate():
                record_event(dev, done[i][0])             # inputs ready (packed on this stream)
        for t, (phase, _, sends) in enumerate(self.schedule(n), start=1):
            for src, dst, c in sends:
                recv, send = devices[dst], devices[src]
                with recv.activate():
                    wait_event(recv, done[src][t - 1])    # the sender finished this chunk at step t-1
                    lo, hi = bounds[c]
                    if hi > lo:
                        self._step(phase, recv, buffers[dst], send, buffers[src], lo, hi, links[dst], dtype)
                    record_event(recv, done[dst][t])
        for i, dev in enumerate(devices):            # nobody reads device i any more
            with dev.activate():
                wait_event(dev, done[(i + 1) % n][total])

    def _step(self, phase, recv, own, send, peer, lo, hi, link, dtype):
        """One device's part of one step: receive chunk [lo, hi) from ``send``."""
        if link == "staged":
            if phase == "reduce-scatter":
                # Copy the peer's chunk into our scratch at the same offsets, on our
                # stream, then add from there: the kernel only reads local memory. One
                # scratch per (size, dtype), never replaced (a CUDA graph captured over
                # this ring keeps writing into the one it was captured with).
                scratch = recv.scratch(STAGING, (own.shape[0],), dtype)
                recv.copy_peer_into(scratch[lo:hi], peer[lo:hi], send)
                recv.ops.ring_reduce_step(own, scratch, lo, hi)
            else:
                # All-gather is a plain copy: the device-to-device copy *is* the step.
                recv.copy_peer_into(own[lo:hi], peer[lo:hi], send)
        elif phase == "reduce-scatter":
            recv.ops.ring_reduce_step(own, peer, lo, hi)
        else:
            recv.ops.ring_gather_step(own, peer, lo, hi)

    def _record_steps(self, n, size, buffer_index, dtype):
        """The step record of one reduction (``ring_steps.record_steps``)."""
        return record_steps(self.schedule(n), self.chunk_bounds(size, n), buffer_index, dtype, size)


def record_event(dev, event):
    """Mark ``event`` done once ``dev``'s stream reaches this point (None: a CPU, nothing to do)."""
    if event is not None:
        dev.record_event(event)                   # a device call: a @function's trace sees it


def wait_event(dev, event):
    """Make ``dev``'s stream wait, on the GPU, for ``event`` (None: a CPU, nothing to do)."""
    if event is not None:
        dev.wait_event(event)
