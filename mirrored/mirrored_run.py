"""How ``strategy.run`` runs a function on every replica: threads and merge points.

TensorFlow's design (its ``mirrored_run.py``), kept: ``strategy.run(fn)`` hands
``fn`` to one long-lived thread per replica device (``ReplicaWorkers``; starting
threads every step would cost more than a small step), each thread bound to its
device. Inside ``fn``, a *merge point* (``ReplicaContext.merge_call``: an
``all_reduce``, an optimizer's ``apply_gradients``) stops every replica thread
until all have arrived (``MergePoint``); the last to arrive runs the merge function
once, in cross-replica context, and every replica continues with its own part of
the result.

Failure is handled so that nothing is left waiting: a replica that raises releases
the others from any merge point (they see ``Aborted``), and ``raise_first`` hands
the caller the first real error with the replica id added.

A Ctrl-C is handled the same way. Only the main thread sees it (Python delivers
signals there), while it hands the job out or waits for the replicas: the hand-out is
all or nothing (``devices.every_device_or_none``), and the wait breaks the merge point and
lets every replica finish before the ``KeyboardInterrupt`` goes on (``hand_out``),
so the next ``run`` finds every replica thread idle.

Nothing waits for ever: concurrent ``run`` calls on one strategy take turns (one
lock per worker pool: interleaved jobs would send replica 0 to one call's merge
point and replica 1 to another's), and a replica waits at a merge point at most
``MERGE_TIMEOUT_S`` before the merge point is broken with an error naming the
replicas that arrived and those that did not.

Inside a ``@function``'s trace the replica threads record into their caller's recording
(``recording.joined``): the recorder is per thread, so it is handed on explicitly.

The worker threads hold no reference to their strategy (only to their job queue),
so a strategy that goes out of use is freed, and a finalizer then ends its threads.

Neighbours: ``strategy.py`` (``Strategy.run``, ``ReplicaContext``), ``context.py``
(which strategy/replica this thread is in), ``values.py`` (``select_replica``).
"""
import os
import queue
import threading
import weakref

from mirrored import context
from mirrored.program import recording
from mirrored import devices as _dev
from mirrored.errors import DeadlineExceededError
from mirrored.values import select_replica

#: How long a replica waits at a merge point for the others (seconds). Far above any
#: step of ours (the CUDA simulator's first step included), far below "for ever":
#: a replica that never arrives is a bug to report, not to wait out.
MERGE_TIMEOUT_S = float(os.environ.get("MIRRORED_MERGE_TIMEOUT_S", 600))


class MergePoint:
    """Where replica threads meet in ``merge_call``.

    A barrier built on one Condition so that every decision (arrive, finish,
    abort) happens under one lock: a replica that *returns* while others wait
    at a merge point (the replicas made different numbers of merge calls) is
    detected, and the waiting replicas are released with an error, never hung.
    """

    def __init__(self, n):
        self.n = n
        self.cond = threading.Condition()
        self.arrived = {}          # replica id -> (merge_fn, args, kwargs)
        self.generation = 0
        self.result = None         # (value, exception) of the last merge
        self.finished = 0
        self.broken = None         # an Exception once aborted

    def abort(self, reason):
        with self.cond:
            if self.broken is None:
                self.broken = reason
            self.cond.notify_all()

    def finish(self, replica_id):
        with self.cond:
            self.finished += 1
            if self.arrived and self.broken is None:
                self.broken = RuntimeError(
                    f"replica {replica_id} returned from the replica function while other replicas "
                    f"wait in merge_call: every replica must make the same merge calls (all_reduce, "
                    f"apply_gradients...) in the same order.")
                self.cond.notify_all()

    def arrive(self, replica_id, call, merge):
        """Deposit this replica's call; the last to arrive runs ``merge(calls)``."""
        with self.cond:
            if self.broken is not None:
                raise Aborted(self.broken)
            if self.finished:
                self.broken = RuntimeError(
                    f"replica {replica_id} called merge_call after another replica had already "
                    f"returned: every replica must make the same merge calls.")
                self.cond.notify_all()
                raise Aborted(self.broken)
            gen = self.generation
            self.arrived[replica_id] = call
            if len(self.arrived) == self.n:
                calls = [self.arrived[i] for i in range(self.n)]
                self.arrived = {}
                try:
                    self.result = (merge(calls), None)
                except BaseException as err:    # noqa: BLE001 (given to every replica)
                    self.result = (None, err)
                self.generation += 1
                self.cond.notify_all()
            else:
                if not self.cond.wait_for(lambda: self.generation != gen or self.broken is not None,
                                          timeout=MERGE_TIMEOUT_S):
                    self.broken = self._timed_out(replica_id)
                    self.cond.notify_all()
                    raise self.broken
                if self.generation == gen:
                    raise Aborted(self.broken)
            value, err = self.result
        if err is not None:
            raise err
        return value


    def _timed_out(self, replica_id):
        """The error for a merge point that waited ``MERGE_TIMEOUT_S`` (called under the lock)."""
        arrived = sorted(self.arrived)
        missing = [i for i in range(self.n) if i not in self.arrived]
        return DeadlineExceededError(
            f"replica {replica_id} waited {MERGE_TIMEOUT_S:g} s at a merge point (all_reduce, "
            f"merge_call, apply_gradients): replicas {arrived} arrived, replicas {missing} did "
            f"not. Every replica must reach the same merge calls; look for a replica stuck in "
            f"its own code or skipping a merge call (or raise mirrored.mirrored_run."
            f"MERGE_TIMEOUT_S / MIRRORED_MERGE_TIMEOUT_S for a step slower than that).")


class Aborted(Exception):
    """A replica released from a merge point because another replica failed."""


class ReplicaWorkers:
    """One long-lived thread per replica device, each bound to its device.

    The pool keeps only a weak reference to its strategy, and the threads only their
    queues: a strategy in a worker's frame would never be freed. When the strategy is
    collected, ``weakref.finalize`` puts the stop signal on every queue.
    """

    def __init__(self, strategy):
        self._strategy = weakref.ref(strategy)
        self._run_lock = threading.Lock()     # one run at a time: see the module docstring
        self.jobs = []
        self.threads = []
        for i, dev in enumerate(strategy.extended.devices):
            q = queue.SimpleQueue()
            t = threading.Thread(target=_worker_loop, args=(i, dev, q), daemon=True,
                                 name=f"mirrored-replica-{i}")
            t.start()
            self.jobs.append(q)
            self.threads.append(t)
        self._finalizer = weakref.finalize(strategy, _stop, list(self.jobs))

    def run(self, fn, args, kwargs, outer_stack, replica_context):
        """Call ``fn`` once per replica, each on its own thread, inside
        ``replica_context(strategy, i, merge_point)``; the results in replica order.
        A second caller waits here until the first call is done."""
        if threading.current_thread() in self.threads:
            # a merge function (cross-replica context, but on a replica thread) calling run:
            # it would wait for its own thread for ever
            raise RuntimeError("strategy.run was called from a merge function (merge_call, "
                               "all_reduce...) of the same strategy: its replicas are busy "
                               "waiting for that merge. Return from the merge function and call "
                               "run from the outer code.")
        with self._run_lock:
            return self._run(fn, args, kwargs, outer_stack, replica_context)

    def _run(self, fn, args, kwargs, outer_stack, replica_context):
        n = len(self.jobs)
        merge_point = MergePoint(n)
        results, errors = [None] * n, [None] * n
        done = Countdown(n)
        strategy = self._strategy()
        trace = recording.active()           # a @function's trace on the caller: the replicas join it

        def job(i):
            dev = strategy.extended.devices[i]
            context.set_stack(outer_stack + [(strategy, replica_context(strategy, i, merge_point))])
            try:
                with _dev.device_scope(dev), recording.joined(trace):
                    results[i] = fn(*select_replica(i, args), **select_replica(i, kwargs))
                merge_point.finish(i)
            except BaseException as err:  # noqa: BLE001 (handed to the caller)
                errors[i] = err
                merge_point.abort(err)
            finally:
                context.set_stack([])
                done.count_down()

        hand_out(job, self.jobs, done, merge_point)
        raise_first(errors, strategy)
        return results

    def close(self):
        self._finalizer()


class Countdown:
    """Done when every replica has counted down once. Waiting changes nothing (unlike a
    semaphore's acquire, which a ``KeyboardInterrupt`` could cut short after taking its
    count), so the caller may be interrupted and wait again."""

    def __init__(self, n):
        self.left, self.lock, self.zero = n, threading.Lock(), threading.Event()

    def count_down(self):
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.zero.set()

    def wait(self):
        self.zero.wait()


def hand_out(job, queues, done, merge_point):
    """Put ``job`` on every replica's queue and wait until every replica has ended it
    (``done``), whatever a Ctrl-C does meanwhile.

    Python raises ``KeyboardInterrupt`` in this thread, the main one; the replica threads
    never see it. The hand-out is all or nothing (``devices.every_device_or_none``): replica 0
    with a job and replica 1 without would wait at the merge point for ever. A Ctrl-C
    while the replicas run breaks the merge point, so that every replica stops at its
    next merge call (``Aborted``) or returns, and once they all have, the
    ``KeyboardInterrupt`` goes on. Leaving at once instead would leave the replicas
    running: the caller would read weights they are still changing. A merge already under way (an ``apply_gradients``) finishes first, on
    every copy: ``abort`` waits for the merge point's lock, which the merge holds. A
    second Ctrl-C leaves without waiting (a replica stuck in its own code)."""
    handed_out = False
    try:
        with _dev.every_device_or_none():
            for q in queues:
                q.put(job)
            handed_out = True
        done.wait()
    except KeyboardInterrupt:
        if handed_out:
            merge_point.abort(KeyboardInterrupt("strategy.run was interrupted (Ctrl-C)"))
            done.wait()
        raise


def _worker_loop(replica_id, dev, jobs):
    """A replica thread: run jobs until the stop signal (``None``). A module function,
    not a method, so that the thread holds no reference to the pool or the strategy."""
    with dev.activate():
        while True:
            job = jobs.get()
            if job is None:
                return
            job(replica_id)
            del job                           # the job's closure holds the strategy


def _stop(job_queues):
    for q in job_queues:
        q.put(None)


def raise_first(errors, strategy):
    """Re-raise the first real replica error (not a released waiter), naming the replica."""
    real = [(i, e) for i, e in enumerate(errors) if e is not None and not isinstance(e, Aborted)]
    if not real:
        aborted = [(i, e) for i, e in enumerate(errors) if e is not None]
        if not aborted:
            return
        i, e = aborted[0]
        real = [(i, e.args[0] if e.args and isinstance(e.args[0], BaseException) else e)]
    i, err = real[0]
    dev = strategy.extended.devices[i]
    if hasattr(err, "add_note"):
        err.add_note(f"(raised in replica {i} of {len(errors)}, on {dev.name})")
    raise err
