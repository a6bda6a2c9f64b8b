"""The ring's step record: what moved in each step and what every chunk holds after it.

``RingAllReduce(keep_steps=True)`` (``ring.py``) records, after each reduction, one ``RingStep``
per step of its schedule: the ``RingTransfer`` of every device and the set of replicas
whose contributions each chunk holds. Lab 03 steps through them and ``mirrored.lab.viz``
draws them. Nothing here computes the sum: ``record_steps`` replays the ring's schedule
with sets of replica ids instead of numbers. Frozen dataclasses, so that a notebook can
keep, compare and draw them.

Neighbours: ``ring.py`` (the ring, its ``schedule`` and ``chunk_bounds``),
``collective_all_reduce.py`` (the same record across workers), ``lab/viz.py``.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class RingTransfer:
    """One chunk moving one hop along the ring in one step.

    ``src`` sends chunk ``chunk`` (elements ``[lo, hi)`` of the flat buffer) to
    ``dst = (src + 1) % N``; ``op`` is ``"add"`` (reduce-scatter: dst's chunk +=
    src's chunk) or ``"copy"`` (all-gather: dst's chunk = src's chunk). Device
    numbers are positions in the ring (replica ids), not CUDA device ids.
    ``src_worker``/``dst_worker``: the worker holding each end (0 on one machine;
    under ``MultiWorkerMirroredStrategy`` a transfer whose workers differ is an MPI
    message between processes).
    """

    src: int
    dst: int
    chunk: int
    lo: int
    hi: int
    op: str
    src_worker: int = 0     # the worker (MPI rank) of each end: a transfer between
    dst_worker: int = 0     # two workers is an MPI message (MultiWorkerMirroredStrategy)


@dataclasses.dataclass(frozen=True)
class RingStep:
    """One step of the ring, for every device at once.

    phase      "reduce-scatter" or "all-gather"
    step       index within the phase, 0 .. N-2
    transfers  one ``RingTransfer`` per device, ordered by sender (``transfers[i].src == i``)
    holds      after the step: ``holds[d][c]`` is the frozenset of replica ids whose
               contributions chunk ``c`` on device ``d`` now holds
    buffer     which fused buffer (``batch_reduce`` fuses one per dtype), 0, 1, ...
    dtype      that buffer's dtype name; ``size`` its number of elements
    """

    phase: str
    step: int
    transfers: tuple
    holds: tuple
    buffer: int = 0
    dtype: str = "float32"
    size: int = 0

    def as_dict(self):
        """JSON-friendly: dicts and lists, contribution sets as sorted lists. A transfer's
        ``src_worker``/``dst_worker`` appear only in a ring that spans workers."""
        across = any(t.src_worker or t.dst_worker for t in self.transfers)
        transfers = [dataclasses.asdict(t) for t in self.transfers]
        if not across:
            for t in transfers:
                del t["src_worker"], t["dst_worker"]
        return {"phase": self.phase, "step": self.step, "buffer": self.buffer,
                "dtype": self.dtype, "size": self.size,
                "transfers": transfers,
                "holds": [[sorted(c) for c in dev] for dev in self.holds]}


def initial_holds(n):
    """Before the first step every device's chunks hold only its own contribution."""
    return tuple(tuple(frozenset([d]) for _ in range(n)) for d in range(n))


def record_steps(schedule, bounds, buffer_index, dtype, size):
    """Replay a ring's ``schedule`` (``RingAllReduce.schedule(n)``) over chunks of
    ``bounds`` symbolically: sets of replica ids instead of numbers; one ``RingStep`` each."""
    holds = [list(row) for row in initial_holds(len(bounds))]
    steps = []
    for phase, step, sends in schedule:
        before = [list(row) for row in holds]    # every device acts at once
        op = "add" if phase == "reduce-scatter" else "copy"
        transfers = []
        for src, dst, c in sends:
            transfers.append(RingTransfer(src, dst, c, bounds[c][0], bounds[c][1], op))
            holds[dst][c] = before[dst][c] | before[src][c] if op == "add" else before[src][c]
        steps.append(RingStep(phase, step, tuple(transfers), tuple(tuple(r) for r in holds),
                              buffer_index, dtype.name, size))
    return steps


def bytes_moved(schedule, bounds, size, itemsize=4):
    """Bytes each device sends and receives to all-reduce ``size`` elements, given the ring's
    ``schedule`` and ``chunk_bounds`` (``RingAllReduce.bytes_moved`` passes them).

    Returns ``{"ring": [{"sent": .., "received": ..} per device],
    "reduce_to_one": [...]}``. Ring: each device sends and receives about
    2(N-1)/N of the buffer (exactly, from the chunk sizes). Reduce to one
    (device 0, as ``ReductionToOneDevice``): device 0 receives N-1 buffers and
    sends N-1 sums back; every other device sends 1 and receives 1.
    """
    n = len(bounds)
    ring = [{"sent": 0, "received": 0} for _ in range(n)]
    for _, _, sends in schedule:
        for src, dst, c in sends:
            nbytes = (bounds[c][1] - bounds[c][0]) * itemsize
            ring[src]["sent"] += nbytes
            ring[dst]["received"] += nbytes
    whole = size * itemsize
    to_one = [{"sent": (n - 1) * whole, "received": (n - 1) * whole}]
    to_one += [{"sent": whole, "received": whole} for _ in range(n - 1)]
    return {"ring": ring, "reduce_to_one": to_one if n > 1 else [{"sent": 0, "received": 0}]}
