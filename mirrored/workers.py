"""The workers of a ``MultiWorkerMirroredStrategy``: MPI ranks, messages with deadlines, abort.

One worker is one process. ``mpiexec -n N python train.py`` starts N of them;
MPI numbers them 0 .. N-1 (the *rank*; worker 0 is the chief) and carries the
bytes between them (over shared memory here, the network on a cluster). This
file is everything the library asks of MPI, in one place:

* ``world(timeout_s)``: this process's ``Workers`` — its rank, the world size, and
  the few messages the strategy sends (``sendrecv`` for the ring's hop between
  workers, ``allgather`` and ``bcast`` of small host values). A plain
  ``python train.py`` (no ``mpiexec``) is one worker and needs no MPI at all;
  started by a launcher, mpi4py must be importable, else a clear error.
* Who is who: ``introduce`` (once, when the strategy is made) gathers every worker's
  PID and host; the chief prints the table, so a launcher's "PID 4242 ... EXIT CODE: 9"
  names a rank, and every error below names its peers as "worker 1 (PID 4242 on host)".
* Every wait has a deadline. MPI's blocking calls wait for ever, so each message
  here is *nonblocking* (``Isendrecv``-style ``Isend`` + ``Irecv``, ``Iallgather``,
  ``Ibcast``) and then polled (``Testall``, which also drives MPI's progress) until
  it completes or the deadline passes; then ``DeadlineExceededError`` names the
  peers that never answered. The deadline (``deadline_s``) is counted in steps:
  ``step_done`` is called after each gradient all-reduce (``collective_all_reduce.py``);
  until ``WARMUP_STEPS`` steps are done (the first steps compile kernels) it is the
  generous ``FIRST_STEPS_TIMEOUT_S``, after that ``max(STEP_DEADLINE_FLOOR_S,
  STEP_DEADLINE_FACTOR x the slowest step so far)``: a peer that is a minute behind a
  step of 0.1 s is lost, not slow. A deadline the user sets
  (``CommunicationOptions(timeout_seconds=...)`` or ``MIRRORED_WORKER_TIMEOUT_S``) is
  kept as it is, for every wait. While waiting, a peer on this host whose process has
  ended (killed, crashed) is noticed within ``_LIVENESS_EVERY_S`` and named at once.
* Every ``allgather``/``bcast`` carries its ``what`` ("agreeing on an all-reduce's
  shape", "creating a variable", ...): workers that reach different collective calls
  (one built an extra layer, one has more batches) get an error naming each worker's
  call, instead of reading one message as another.
* A failing worker ends them all (``install_abort_hook``): an exception nobody
  caught is printed with this worker's rank, then ``MPI.Abort`` tells the launcher,
  which ends every other worker (they may be blocked in a message to us). So one
  worker's error never leaves the others hanging, and the launcher's own line
  ("... MPI_Abort(MPI_COMM_WORLD, 1) - process 1") names the rank too.

Neighbours: ``multi_worker.py`` (the strategy), ``collective_all_reduce.py``
(the ring whose hop between workers is ``sendrecv``).
"""
import contextlib
import functools
import os
import pickle
import socket
import sys
import threading
import time
import traceback

import numpy as np

from mirrored.errors import DeadlineExceededError

#: Environment variables launchers set in each process they start (MPICH/Hydra and
#: Intel MPI: PMI_*; Open MPI: OMPI_*; PMIx-based launchers and Slurm's srun: PMIX_*).
LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")

#: A fixed deadline for every cross-worker wait (seconds), when the environment sets one
#: (None: the deadline counted in steps, below). ``CommunicationOptions(timeout_seconds=)``
#: sets one per strategy.
DEFAULT_TIMEOUT_S = (float(os.environ["MIRRORED_WORKER_TIMEOUT_S"])
                     if os.environ.get("MIRRORED_WORKER_TIMEOUT_S") else None)

#: The deadline of a wait during the first ``WARMUP_STEPS`` steps (and of any wait before a
#: step was timed): the first steps compile kernels (tens of seconds on a GPU, minutes in
#: the CUDA simulator) while the peers already wait in the all-reduce, so it is generous.
FIRST_STEPS_TIMEOUT_S = 600.0
WARMUP_STEPS = 2
#: After the warm-up: a peer must answer within STEP_DEADLINE_FACTOR x the slowest step so
#: far (a step: from one gradient all-reduce to the next, waits included), and never less
#: than the floor (a chief's checkpoint, an epoch's validation, a busy shared machine).
STEP_DEADLINE_FACTOR = 10.0
STEP_DEADLINE_FLOOR_S = 60.0
#: How often a long wait checks that its peers' processes on this host still exist.
_LIVENESS_EVERY_S = 1.0

#: A failing worker waits this long between printing its error and aborting, so that
#: the launcher forwards the message before it ends the processes.
ABORT_GRACE_S = 0.5

#: Polling. A short wait (a ring step: microseconds to milliseconds) polls and gives the
#: core away between polls (``os.sched_yield``): when several workers share the cores,
#: the peer we wait for runs at once; with a core to ourselves the yield returns at once
#: and the poll is as quick as spinning. Measured, 4 workers on 2 cores, 1 MB: spinning
#: 200 polls before sleeping 50 µs gave 0.21x MPI_Allreduce's bandwidth, yielding 0.74x
#: (README, "Beyond one machine"). A wait longer than ``_YIELD_FOR_S`` (a peer still
#: compiling its kernels, or stuck) sleeps ``_SLEEP_S`` between polls instead, so it
#: leaves the core alone.
_YIELD_FOR_S = 0.05
_SLEEP_S = 1e-3
#: Polls between two looks at the clock.
_POLLS_PER_CLOCK = 16


def launched_size():
    """The world size a launcher announced in the environment, or None (plain ``python``)."""
    for var in LAUNCHER_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


class Workers:
    """This process's place among the workers, and the messages between them.

    ``comm`` is mpi4py's ``MPI.COMM_WORLD`` (None for a lone worker that never
    loaded MPI). ``rank``: this worker, 0 .. ``size``-1; the chief is rank 0.
    """

    def __init__(self, comm, timeout_s=DEFAULT_TIMEOUT_S):
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.timeout_s = None if timeout_s is None else float(timeout_s)   # None: counted in steps
        self.pids = self.hosts = self.pid_namespaces = None   # per rank, once ``introduce`` has run
        self.steps_done = 0                        # ``step_done`` calls so far
        self.slowest_step_s = 0.0                  # the longest step after the warm-up
        self._last_step_end = None
        self._testall = None                       # MPI.Request.Testall, once MPI is needed

    def __repr__(self):
        return f"<Workers: worker {self.rank} of {self.size}, deadline {self.deadline_s:g} s>"

    # -- who is who ------------------------------------------------------------------------
    def introduce(self, value=None, what="introducing the workers"):
        """Gather every worker's PID and host (kept in ``pids``/``hosts``, by rank) with
        a picklable ``value`` of each; returns the values, in rank order."""
        seen = self.allgather((os.getpid(), socket.gethostname(), _pid_namespace(), value), what)
        self.pids = [pid for pid, *_ in seen]
        self.hosts = [host for _, host, *_ in seen]
        self.pid_namespaces = [space for _, _, space, _ in seen]
        return [v for *_, v in seen]

    def table(self):
        """The start-up table the chief prints: one line per worker, rank, PID and host."""
        return "\n".join([f"mirrored: {self.size} workers (rank: PID on host):"] +
                          [f"mirrored:   worker {r}: PID {pid} on {host}{' (chief)' if r == 0 else ''}"
                           for r, (pid, host) in enumerate(zip(self.pids, self.hosts))])

    def name(self, rank):
        """'worker 1 (PID 4242 on host)', or 'worker 1' before ``introduce``."""
        if self.pids is None:
            return f"worker {rank}"
        return f"worker {rank} (PID {self.pids[rank]} on {self.hosts[rank]})"

    # -- the deadline, counted in steps ------------------------------------------------------
    def step_done(self):
        """Mark the end of a training step (``CollectiveAllReduce`` calls it after each
        gradient all-reduce); the time from the previous mark is that step's length."""
        now = time.monotonic()
        if self._last_step_end is not None and self.steps_done >= WARMUP_STEPS:
            self.slowest_step_s = max(self.slowest_step_s, now - self._last_step_end)
        self._last_step_end = now
        self.steps_done += 1

    @property
    def deadline_s(self):
        """How long a wait for a peer may take now (see the module docstring)."""
        if self.timeout_s is not None:
            return self.timeout_s
        if self.steps_done <= WARMUP_STEPS:
            return FIRST_STEPS_TIMEOUT_S
        return max(STEP_DEADLINE_FLOOR_S, STEP_DEADLINE_FACTOR * self.slowest_step_s)

    def _deadline_rule(self):
        if self.timeout_s is not None:
            return "the deadline set by CommunicationOptions(timeout_seconds=...) or MIRRORED_WORKER_TIMEOUT_S"
        if self.steps_done <= WARMUP_STEPS:
            return f"the deadline of the first {WARMUP_STEPS} steps, which compile kernels"
        return (f"the deadline: {STEP_DEADLINE_FACTOR:g} x the slowest step so far "
                f"({self.slowest_step_s:.3g} s), at least {STEP_DEADLINE_FLOOR_S:g} s")

    def _gone(self, peers):
        """The peers on this host whose processes no longer exist (killed, crashed). Only
        peers whose PIDs this process can see: the same host name and PID namespace (two
        containers may share a host name, not their PIDs)."""
        if self.pids is None:
            return []
        here, gone = (self.hosts[self.rank], self.pid_namespaces[self.rank]), []
        for r in peers:
            if r != self.rank and here[1] is not None and (self.hosts[r], self.pid_namespaces[r]) == here:
                try:
                    os.kill(self.pids[r], 0)          # signal 0: only asks whether it exists
                except ProcessLookupError:
                    gone.append(r)
                except OSError:                       # exists, owned by someone else
                    pass
        return gone

    @functools.cached_property
    def cuda_aware(self):
        """Whether this MPI reads and writes GPU memory itself (a CUDA-aware MPI), so the
        ring hands it device buffers instead of staging them through host memory.

        ``MIRRORED_CUDA_AWARE_MPI=1`` / ``0`` decides; else the library is asked:
        ``MPIX_Query_cuda_support()``, which MPICH and Open MPI export (1 when the build
        and the run-time settings allow it, e.g. Cray MPICH's
        ``MPICH_GPU_SUPPORT_ENABLED=1``). No answer (an MPI without it): not aware.
        The mpich wheel of requirements.txt answers 0.
        """
        forced = os.environ.get("MIRRORED_CUDA_AWARE_MPI", "").strip()
        if forced in ("0", "1"):
            return forced == "1"
        if forced:
            raise ValueError(f"MIRRORED_CUDA_AWARE_MPI={forced!r}: expected 1 (hand GPU buffers "
                             f"to MPI), 0 (stage them through host memory) or unset (ask MPI).")
        if self.comm is None:
            return False
        try:
            import ctypes
            from mpi4py import MPI
            return bool(ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support())
        except (AttributeError, OSError):
            return False

    # -- waiting, with a deadline -------------------------------------------------------
    def _wait(self, requests, what, peers):
        """Poll ``requests`` until all complete; past the deadline, raise."""
        if self._testall is None:                  # looked up once: a ring step is microseconds
            from mpi4py import MPI
            self._testall = MPI.Request.Testall
        testall = self._testall
        start = time.monotonic()
        deadline = self.deadline_s
        patient, polls, looked = False, 0, 0.0
        while not testall(requests):
            if patient:
                time.sleep(_SLEEP_S)
            else:
                os.sched_yield()
            polls += 1
            if polls % _POLLS_PER_CLOCK == 0:
                waited = time.monotonic() - start
                patient = waited > _YIELD_FOR_S
                others = sorted(set(peers) - {self.rank})
                if waited - looked >= _LIVENESS_EVERY_S:
                    looked = waited
                    gone = self._gone(others)
                    if gone:
                        raise DeadlineExceededError(
                            f"worker {self.rank} of {self.size} lost {', '.join(map(self.name, gone))} "
                            f"while waiting {waited:.3g} s for {what}: its process has ended (killed, "
                            f"or crashed without a word: its own error, if any, is above). The job "
                            f"cannot go on without it; restart it (from the last checkpoint).")
                if waited > deadline:
                    raise DeadlineExceededError(
                        f"worker {self.rank} of {self.size} waited {deadline:g} s for {what} with "
                        f"worker(s) {others}, which never answered ({', '.join(map(self.name, others))}"
                        f"; {self._deadline_rule()}). A worker is stuck in its own code, "
                        f"was started with a different script or data, or makes different collective "
                        f"calls (every worker must run the same steps). Set CommunicationOptions("
                        f"timeout_seconds=...) or MIRRORED_WORKER_TIMEOUT_S for a fixed deadline if "
                        f"a worker is really slower than that.")

    # -- the messages ------------------------------------------------------------------------
    def sendrecv(self, send, dest, recv, source, tag, what="a ring step"):
        """Send the host array ``send`` to worker ``dest`` while receiving ``recv`` (filled
        in place) from worker ``source``: MPI's ``Sendrecv``, with a deadline."""
        requests = [self.comm.Irecv(recv, source=source, tag=tag),
                    self.comm.Isend(send, dest=dest, tag=tag)]
        self._wait(requests, what, [dest, source])
        return recv

    def allgather(self, value, what="an allgather", detail=None):
        """Every worker's picklable ``value``, in rank order (a list), on every worker.

        ``what`` names the call and must be the same on every worker (else a RuntimeError
        naming each worker's call, and its ``detail``: a short text such as which variable)."""
        if self.size == 1:
            return [value]
        payload = np.frombuffer(pickle.dumps((what, detail, value)), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self._wait([self.comm.Iallgather(np.array([payload.size], np.int64), sizes)],
                   what, range(self.size))
        out = np.empty(int(sizes.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self._wait([self.comm.Iallgatherv(payload, [out, sizes, offsets, _mpi_byte()])],
                   what, range(self.size))
        got = [pickle.loads(out[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]
        if any(w != what for w, _, _ in got):
            calls = "; ".join(f"{self.name(r)}: {w}{f' ({d})' if d else ''}"
                              for r, (w, d, _) in enumerate(got))
            raise RuntimeError(
                f"the workers reached different collective calls ({calls}). Every worker must "
                f"run the same program on the same data: the same model (the same layers in the "
                f"same order), the same number of examples and batches, the same steps.")
        return [v for _, _, v in got]

    def bcast(self, value, root=0, what="a broadcast"):
        """Worker ``root``'s picklable ``value``, on every worker."""
        if self.size == 1:
            return value
        return self.allgather(value if self.rank == root else None, what)[root]

    def barrier(self, what="a barrier"):
        if self.size > 1:
            self._wait([self.comm.Ibarrier()], what, range(self.size))

    def abort(self, code=1):
        """End every worker now (the launcher kills the others)."""
        if self.comm is not None and self.size > 1:
            self.comm.Abort(code)
        os._exit(code)


def _pid_namespace():
    """This process's PID namespace ('pid:[4026531836]' on Linux; None where unknown)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _mpi_byte():
    from mpi4py import MPI
    return MPI.BYTE


_world = None
_world_lock = threading.Lock()


def world(timeout_s=None):
    """This process's ``Workers`` (made once; ``timeout_s`` None keeps the current deadline,
    a number fixes it).

    Under a launcher (``mpiexec``, ``srun``) MPI is initialised through mpi4py; with
    a plain ``python`` and no mpi4py installed, this is a lone worker without MPI.
    """
    global _world
    with _world_lock:
        if _world is None:
            size = launched_size()
            try:
                from mpi4py import MPI
            except ImportError as err:
                if size not in (None, 1):
                    raise ImportError(
                        f"MultiWorkerMirroredStrategy: this process was started by an MPI launcher "
                        f"as one of {size} workers, but mpi4py cannot be imported ({err}). Install "
                        f"it into this Python (python -m pip install mpi4py mpich, or build mpi4py "
                        f"against the cluster's MPI: README, 'Beyond one machine').") from err
                _world = Workers(None)
            else:
                _world = Workers(MPI.COMM_WORLD)
        if timeout_s is not None:
            _world.timeout_s = float(timeout_s)      # a fixed deadline, as the user asked
        return _world


_hook_installed = False


def install_abort_hook(workers):
    """Make an uncaught exception in any thread of this worker end every worker.

    The error is printed first, naming this worker ("worker 1 of 2 failed"), then
    ``MPI.Abort``: the launcher ends the other workers, which would otherwise
    wait for this one until their deadline. A lone worker keeps Python's hooks.
    """
    global _hook_installed
    if workers.size == 1 or _hook_installed:
        return
    _hook_installed = True

    def report_and_abort(exc_type, exc, tb, thread=None):
        where = f" (thread {thread.name})" if thread is not None else ""
        # the error itself first, in one write: the launcher may stop forwarding our
        # output once the abort reaches it, and a long traceback could be cut short
        head = (f"mirrored: worker {workers.rank} of {workers.size} failed{where}: "
                f"{exc_type.__name__}: {exc}\nmirrored: ending every worker (MPI.Abort); "
                f"the traceback of worker {workers.rank} (PID {os.getpid()}):\n")
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            os.write(2, head.encode())
            os.write(2, "".join(traceback.format_exception(exc_type, exc, tb)).encode())
        time.sleep(ABORT_GRACE_S)
        workers.abort(1)

    sys.excepthook = report_and_abort
    threading.excepthook = lambda args: report_and_abort(args.exc_type, args.exc_value,
                                                         args.exc_traceback, args.thread)
