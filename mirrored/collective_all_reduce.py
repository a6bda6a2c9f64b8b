"""``CollectiveAllReduce``: the ring all-reduce of ``RingAllReduce``, stretched across workers.

TensorFlow's ``MultiWorkerMirroredStrategy`` sums gradients with a *collective*
all-reduce over every replica of every worker; ours is the same ring as on one
machine (``ring.RingAllReduce``), with more devices in it.

With W workers of L local replicas each, the ring has N = W*L positions in one
fixed order: global replica g = rank*L + l (worker ``rank``, its local replica
l). The schedule (``RingAllReduce.schedule(N)``), the chunks
(``chunk_bounds(size, N)``) and therefore the order in which every chunk's sum is
formed are exactly those of one machine with N devices. Only the hops differ:

    worker 0                       worker 1
    GPU0 --peer read--> GPU1 ==MPI==> GPU0 --peer read--> GPU1 ==MPI==> (worker 0's GPU0)

* a hop between two replicas of one worker (l-1 -> l) is the one-machine step:
  peer-memory read, or a staged device copy, ordered by CUDA events;
* the hop into a worker's first replica comes from the previous worker's last
  replica: the sender copies its chunk to host memory, and the two workers
  exchange chunks with one ``Sendrecv`` per step (each worker sends its last
  replica's chunk to the next worker while receiving the previous worker's);
  the receiver uploads it into a scratch buffer and adds it (reduce-scatter) or
  copies it into place (all-gather), the kernels of the staged path. On CPU
  devices the buffers are host memory already: MPI sends straight from the
  buffer and receives straight into the scratch buffer (or, all-gather, into
  place), no copies.

With a CUDA-aware MPI (one that reads and writes GPU memory itself: asked once,
``Workers.cuda_aware``), GPU chunks skip the host: MPI sends straight from the last
replica's buffer and receives straight into the first replica's scratch buffer (or,
all-gather, into place), after the worker's streams have drained (MPI touches the
memory from the host thread, outside any stream's order).

Same schedule, same fixed summation order, so every replica of every worker ends
bitwise equal (and equal to one machine's ring with the same N and inputs), staged or
direct. A chunk staged through the host costs a device-to-host and a host-to-device
copy per step.

The step record (``keep_steps=True``) is the one-machine record over the N global replicas,
each ``RingTransfer`` naming its two workers (``src_worker``, ``dst_worker``).

Neighbours: ``ring.py`` (the ring, its schedule and step record; this class
only replaces ``_run_ring``'s hops), ``workers.py`` (``sendrecv`` with a deadline),
``multi_worker.py`` (the strategy that makes one). Each all-reduce ends with
``workers.step_done()``: the steps it times set the deadline of every wait for a peer
(``workers.Workers.deadline_s``).
"""
import dataclasses

import numpy as np

from mirrored.program import recording
from mirrored.ring import RingAllReduce, record_event, wait_event


@dataclasses.dataclass(frozen=True)
class _Step:
    """Step ``t`` of the global ring as one worker sees it (``CollectiveAllReduce._plan``):
    the (lo, hi) chunk bounds its last replica sends out, its first replica takes in, and
    each hop l-1 -> l inside it moves (``inside[l-1]``)."""
    t: int
    phase: str                  # "reduce-scatter" or "all-gather"
    out: tuple
    into: tuple
    inside: tuple
    what: str                   # how a deadline error names this step


class CollectiveAllReduce(RingAllReduce):
    """The ring over every replica of every worker (``workers``: a ``workers.Workers``).

    Every worker must call it with the same number of local devices and buffers of
    the same size and dtype, in the same order (checked once per size and dtype).
    """

    def __init__(self, workers, peer_access=True, keep_steps=False, cuda_aware=None):
        """``cuda_aware``: hand GPU buffers to MPI directly (True), stage them through
        host memory (False), or ask the MPI library (None: ``workers.cuda_aware``)."""
        super().__init__(peer_access=peer_access, keep_steps=keep_steps)
        self.workers = workers
        self._cuda_aware = cuda_aware
        self._agreed = set()        # (local devices, size, dtype) every worker has confirmed
        self._host = {}             # (size, dtype) -> (send, receive) host staging arrays
        self._plans = {}            # (size, local replicas) -> this worker's steps (``_plan``)

    def _group_size(self, devices):
        return len(devices) * self.workers.size

    def _sum_in_place(self, buffers, devices):
        if self.workers.size == 1:
            return super()._sum_in_place(buffers, devices)
        self._across_workers(buffers, devices)

    @recording.host_work(stays=True)
    def _across_workers(self, buffers, devices):
        """The all-reduce over every worker's replicas, in place. Host work for a
        ``@function``'s trace (``recording.host_work``): the MPI exchanges are driven from
        the host (and read device chunks on the host), so the trace keeps this whole call
        as one host callback, run again at each replay on the same buffers, at the same
        point of the step."""
        self._check(buffers, devices)                     # refuse before anything moves
        size, dtype = int(buffers[0].shape[0]), np.dtype(buffers[0].dtype)
        self._agree(len(devices), size, dtype)
        buffer_index, self._buffer_index = self._buffer_index, self._buffer_index + 1
        local, n = len(devices), len(devices) * self.workers.size
        if size == 0:
            return
        self._run_global_ring(buffers, devices, size, dtype)
        self.workers.step_done()        # a step's gradients summed: the clock of the deadline
        if self.steps is not None:
            steps = self._record_steps(n, size, buffer_index, dtype)
            self.steps.extend(dataclasses.replace(
                s, transfers=tuple(dataclasses.replace(t, src_worker=t.src // local, dst_worker=t.dst // local)
                                   for t in s.transfers)) for s in steps)

    def _agree(self, local, size, dtype):
        """Every worker reduces the same thing (else the ring would add unrelated bytes)."""
        key = (local, size, dtype.str)
        if key in self._agreed:
            return
        seen = self.workers.allgather(key, "agreeing on an all-reduce's shape")
        if any(other != key for other in seen):
            named = "; ".join(f"worker {r}: {l} replica(s), {s} x {np.dtype(d).name}"
                              for r, (l, s, d) in enumerate(seen))
            raise ValueError(f"CollectiveAllReduce: the workers reduce different buffers ({named}). "
                             f"Every worker must build the same model and have the same number of "
                             f"local devices, and make the same collective calls in the same order.")
        self._agreed.add(key)

    def _host_stage(self, size, dtype, n):
        """Host arrays for the chunk sent and the chunk received (the largest chunk)."""
        key = (size, dtype.str)
        if key not in self._host:
            most = -(-size // n)
            self._host[key] = (np.empty(most, dtype), np.empty(most, dtype))
        return self._host[key]

    def _plan(self, size, local):
        """This worker's part of the ring's schedule, worked out once per (size, L).

        One ``_Step`` per step t = 1 .. 2(N-1) of ``RingAllReduce.schedule(N)``: the
        chunk our last replica sends to the next worker, the chunk our first replica
        receives from the previous worker, and the chunk each hop l-1 -> l inside this
        worker moves, as (lo, hi) element bounds from ``chunk_bounds(size, N)``.
        Kept (a model reduces the same packed size every step): working it out again
        every call cost as much Python as the rest of a small all-reduce.
        """
        key = (size, local)
        if key not in self._plans:
            n = local * self.workers.size
            first_g = self.workers.rank * local          # our first position in the ring
            last_g = first_g + local - 1
            bounds = self.chunk_bounds(size, n)
            self._plans[key] = tuple(
                _Step(t, phase, out=bounds[sends[last_g][2]], into=bounds[sends[(first_g - 1) % n][2]],
                      inside=tuple(bounds[sends[first_g + l - 1][2]] for l in range(1, local)),
                      what=f"{phase} step {t} of the ring")
                for t, (phase, _, sends) in enumerate(self.schedule(n), start=1))
        return self._plans[key]

    def _run_global_ring(self, buffers, devices, size, dtype):
        """The 2(N-1) steps of the N-position ring, for this worker's L positions.

        Per step t: first the hop between workers (our last replica's chunk to the
        next worker, the previous worker's chunk into our first replica), then the
        hops inside this worker, exactly as ``RingAllReduce._run_ring`` issues them
        (events ``done[l][t]`` order the local streams).

        Ordering of the hop between workers: ``download_into`` waits for the last
        replica's stream, so the chunk sent is the one finished at step t-1; the
        upload and the add are queued on the first replica's stream, and
        ``done[0][t]`` is recorded after them. Nobody reads a buffer of ours from
        another worker after the ``Sendrecv`` returns (the bytes were copied to the
        host), so no event crosses processes.
        """
        workers = self.workers
        local = len(devices)
        plan = self._plan(size, local)
        total = len(plan)                                # 2(N-1)
        prev_worker, next_worker = (workers.rank - 1) % workers.size, (workers.rank + 1) % workers.size
        links = [None] + [self._link(devices[l - 1], devices[l]) for l in range(1, local)]
        done = [self._step_events(dev, total + 1) for dev in devices]
        first = devices[0]
        scratch = first.scratch("chunks from the previous worker", (size,), dtype)
        on_host = first.device_type == "CPU"             # (a ring is all CPU or all GPU)
        direct = not on_host and (workers.cuda_aware if self._cuda_aware is None else self._cuda_aware)
        staged = not on_host and not direct
        send_host, recv_host = self._host_stage(size, dtype, local * workers.size) if staged else (None, None)
        for l, dev in enumerate(devices):
            with dev.activate():
                record_event(dev, done[l][0])                 # inputs ready
        for step in plan:
            t, reduce = step.t, step.phase == "reduce-scatter"
            # 1. between workers: our last replica -> next worker; previous worker -> our first
            (lo_out, hi_out), (lo_in, hi_in) = step.out, step.into
            if on_host:
                # CPU devices: their memory IS host memory; MPI reads and writes it in place
                out = buffers[-1][lo_out:hi_out]
                into = (scratch if reduce else buffers[0])[lo_in:hi_in]
            elif direct:
                # CUDA-aware MPI: device memory in place, once no queued kernel still
                # writes the chunk we send or reads the one we receive into
                for dev in devices:
                    dev.synchronize()
                out = devices[-1].mpi_buffer(buffers[-1][lo_out:hi_out])
                into = first.mpi_buffer((scratch if reduce else buffers[0])[lo_in:hi_in])
            else:
                out = devices[-1].download_into(send_host[:hi_out - lo_out],      # waits for
                                                buffers[-1][lo_out:hi_out])       # step t-1
                into = recv_host[:hi_in - lo_in]
            incoming = workers.sendrecv(out, next_worker, into, prev_worker, tag=t, what=step.what)
            with first.activate():
                if hi_in > lo_in:
                    if staged:                           # host -> the first replica's memory
                        first.upload_into((scratch if reduce else buffers[0])[lo_in:hi_in], incoming)
                    if reduce:
                        first.ops.ring_reduce_step(buffers[0], scratch, lo_in, hi_in)
                record_event(first, done[0][t])
            # 2. inside this worker: replica l-1 -> l, as on one machine
            for l, (lo, hi) in enumerate(step.inside, start=1):
                recv, send = devices[l], devices[l - 1]
                with recv.activate():
                    wait_event(recv, done[l - 1][t - 1])
                    if hi > lo:
                        self._step(step.phase, recv, buffers[l], send, buffers[l - 1], lo, hi, links[l], dtype)
                    record_event(recv, done[l][t])
        for l in range(local - 1):                       # nobody reads replica l any more
            with devices[l].activate():
                wait_event(devices[l], done[l + 1][total])
