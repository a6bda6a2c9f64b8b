"""Record: what a run of a step did on the devices, written down to be done again.

``mirrored/traced_function.py`` runs a ``@function``'s Python once per input signature
inside a ``Recording``, and ``passes.py`` a ``fit``/``evaluate``/``predict`` pass's device
part once per key (``record``). While one is open, every call that crosses the *device boundary* is
written down, whichever part of the library made it (the layers, the tape, the ring,
the optimizer, a user's own tensor arithmetic), as entries of ``replay.py`` (each entry
class there says what it does when it runs again):

==========================  =========================================================
the call                    what the record keeps (``Recording.entries``)
==========================  =========================================================
``dev.ops.<op>(...)``       ``Launch``: the op, its arguments (the same buffers)
``upload_into``,            ``Upload``: the destination and a copy of the host array
``from_numpy``              (a Python value the trace saw: frozen, as TensorFlow's
                            ``tf.function`` freezes the Python values it captures)
``copy_into``,              ``Launch`` / ``PeerCopy``: a device-to-device copy into
``copy_peer_into``,         the buffer the trace made
``copy_from``
a ``host_work`` function    ``HostCall``: the function and its arguments, called again
                            (the optimizer's per-step scalars, ``tf.print``, metrics)
``to_numpy``,               nothing: a *host read* of a device value during a trace
``download_into``           cannot be replayed (its value would steer Python once,
                            for ever). The recording is marked ``refused`` with the
                            user's line, and ``@function`` runs that function eagerly
==========================  =========================================================

Allocations (``empty``, ``scratch``) are not entries: the buffers a trace made are kept
by the entries that use them, and a replay writes into the same ones. State made on first
use (a model's packed weights, an optimizer's zeroed slots, Dropout's counter, a variable's
initial value) is made under ``initialization()``: done once, never replayed.

A call made *inside* a recorded call (an op asking its device for a scratch buffer,
``copy_from`` reading its source, a host callback's own uploads and reads) belongs
to that call: it runs again when the outer one does, so it is not written down twice.
``ThreadRecorder.depth`` tracks that.

Who records: the thread that traces, and nobody else. The boundary's methods (the ops
classes' in ``backends.py``, the devices' in ``devices.py``) are wrapped once, when their
classes are made; each wrapper asks the calling thread's slot (``backends.BOUNDARY``, a
``threading.local``) for its ``ThreadRecorder``. ``with Recording():`` fills that slot for
the calling thread only; ``strategy.run``'s replica threads join their caller's recording
explicitly (``joined``, from ``mirrored_run.py``), each in its own program order (the merge
points order them between each other, and the list keeps the order the calls really
happened in). A data loader, a timer or a second caller of the same function, on another
thread, is never recorded: TensorFlow's rule (another thread's ``v.assign_add(1)`` is not
part of the function). Two threads can trace two functions at once.

What a trace changed is kept to be put back (``Recording.roll_back``): a trace runs
eagerly, so unlike TensorFlow's symbolic one it has effects, and one that raises must
leave none.

A *dry* recording (``Recording(dry=True)``, ``dry_run``) is a plan: the same walk through
the step's Python, its kernel launches written down and none made (``kernels.launch.planned``
below the boundary), its host calls written down and not run. ``passes.py`` plans from it
before a key's first run on a GPU: ``kernels/compile_ahead.py`` compiles the kernels it names.

Neighbours: ``replay.py`` (the entries run again), ``capture.py`` (a replay's launches as
a CUDA graph), ``mirrored/traced_function.py`` (the tracer), ``mirrored/devices.py`` and
``mirrored/backends.py`` (the boundary); the package docstring tells the story.
"""
import contextlib
import functools
import inspect
import os
import sysconfig
import threading
import traceback

import numpy as np

from kernels import launch
from mirrored import backends, devices
from mirrored.program import replay

#: Device methods that hand a device value to the host: a trace cannot replay them.
DEVICE_READS = {"to_numpy": "reads a device value on the host (.numpy(), float(), int(), "
                            "bool(), an `if` or `while` on a tensor, NumPy on a tensor)",
                "download_into": "reads a device value on the host",
                "mpi_buffer": "hands a device buffer to MPI (the ring across workers is driven "
                              "from the host)"}
#: Device writes whose first argument is the only buffer they write.
WRITES_FIRST = ("upload_into", "copy_into", "copy_peer_into")
#: TensorFlow's words when a function makes a ``tf.Variable`` on a call where it may not.
SINGLETON_VARIABLES = ("tf.function only supports singleton tf.Variables created on the first call. "
                       "Make sure the tf.Variable is only created once or created outside tf.function "
                       "(e.g. `if self.v is None: self.v = mirrored.Variable(...)`, or make it before "
                       "the first call).")


def active():
    """The ``Recording`` the calling thread records into, or None (no trace on this thread)."""
    recorder = backends.BOUNDARY.recorder
    return None if recorder is None else recorder.recording


def in_host_code():
    """True inside a recorded call, a host callback or ``initialization()`` on a recording
    thread (its device calls and reads are its own)."""
    recorder = backends.BOUNDARY.recorder
    return recorder is not None and recorder.depth > 0


@contextlib.contextmanager
def joined(recording):
    """``with recording.joined(rec):`` the calling thread records into ``rec`` too (None:
    nothing changes). ``strategy.run``'s replica threads join their caller's trace this way
    (``mirrored_run.py``): each with its own depth, into the one list of entries."""
    if recording is None:
        yield
        return
    previous = backends.BOUNDARY.recorder
    backends.BOUNDARY.recorder = ThreadRecorder(recording)
    try:
        yield
    finally:
        backends.BOUNDARY.recorder = previous


class Recording:
    """The entries of one trace, in the order they ran; ``refused``: (why, where) of the
    first thing in it that cannot be replayed, or None.

    ``with Recording() as rec:`` makes the calling thread record into it (and only that
    thread: ``joined`` adds a replica thread); it stops whatever happens inside.

    What the trace changed can be put back (``roll_back``): before the first call that may
    write a buffer the trace did not make, a host copy of that buffer is kept; the host
    state of its host calls (the optimizer's step count, a metric's sums: numbers on the
    object) too. A trace that raises leaves no effect, as TensorFlow's symbolic trace has
    none. ``forget`` drops the copies once the trace has succeeded.

    ``variables_made``: how many ``Variable``s the function's own code made while tracing
    (not the library's first-use state); ``no_variables``: making one raises TensorFlow's
    ``ValueError`` (``traced_function.py``: variables on the first call only).

    ``dry``: a *dry* recording (a plan, ``dry_run``): the kernel launches are written down
    (``launches``: [(kernel, args)], by ``kernels.launch.planned``, the dry mode's half below
    the boundary) and none is made, host calls are written down and not run (the update
    count, a metric), and nothing is kept for a roll-back (nothing it could change changed).
    ``undoable=False``: nothing kept either (``record``'s callers do not roll a run back)."""

    def __init__(self, no_variables=False, dry=False, undoable=True):
        self.dry = dry
        self.undoable = undoable and not dry    # False: nothing kept for a roll-back
        self.launches = None          # dry: the kernel launches, written down, not made
        self._plan = self._outer = None
        self.entries = []
        self.refused = None           # (reason, (filename, line, text)) of the first refusal
        self.variables_made = 0
        self.no_variables = no_variables
        self._lock = threading.Lock()  # the replica threads add to one recording
        self._made = {}                # id(memory owner) -> owner: buffers made by this trace
        self._kept = {}                # id(buffer) -> (buffer, its host copy before the trace wrote it)
        self._undo = []                # host state to put back, in order
        self.not_kept = []             # buffers whose copy failed: a roll-back cannot restore them
        # True: a metric's result() read in this trace is read again by the caller after every
        # replay (fit's traced train_step: keras/traced_step.py), so it refuses nothing
        self.results_read_after = False

    def __enter__(self):
        self._outer = backends.BOUNDARY.recorder       # a dry run may plan inside a trace
        if self._outer is not None and not self.dry:
            raise RuntimeError("this thread is already recording a trace; a @function called inside "
                               "another one's trace runs inside it (traced_function.py checks first).")
        if self.dry:
            self._plan = launch.planned()
            self.launches = self._plan.__enter__()
        backends.BOUNDARY.recorder = ThreadRecorder(self)
        return self

    def __exit__(self, *exc):
        backends.BOUNDARY.recorder = self._outer
        if self._plan is not None:
            self._plan.__exit__(*exc)
            self._plan = None
        return False

    def add(self, entry):
        with self._lock:
            self.entries.append(entry)

    def refuse(self, reason, where=None):
        """Mark the recording as one that cannot be replayed (the first reason is kept)."""
        with self._lock:
            if self.refused is None:
                self.refused = (reason, where if where is not None else user_line())

    # -- what the trace changed, and putting it back
    def made(self, bufs):
        """Note buffers this trace made: their old contents are nobody's, nothing to keep."""
        for buf in (bufs if isinstance(bufs, (tuple, list)) else (bufs,)):
            if replay.is_buffer(buf):
                owner = devices.memory_owner(buf)
                with self._lock:
                    self._made[id(owner)] = owner

    def unmade(self, values):
        """``values`` hold state from now on (first-use state filled inside the trace):
        a later write in the trace keeps a copy of them first, as of buffers from before."""
        if self._made:
            for buf in values:
                if replay.is_buffer(buf):
                    with self._lock:
                        self._made.pop(id(devices.memory_owner(buf)), None)

    def keep_before(self, values):
        """Before a call that may write ``values``: a host copy of each buffer among them
        that the trace did not make and has not kept yet."""
        for buf in values:
            if not replay.is_buffer(buf):
                continue
            with self._lock:
                if id(buf) in self._kept or id(devices.memory_owner(buf)) in self._made:
                    continue
                try:
                    self._kept[id(buf)] = (buf, _host_copy(buf))
                except Exception as err:  # noqa: BLE001 (a view numba cannot copy: the trace goes on)
                    self.not_kept.append((type(buf).__name__, tuple(getattr(buf, "shape", ())), repr(err)))

    def keep_host_state(self, owner):
        """Before a host call: the numbers ``owner`` holds (its step count, its sums)."""
        state = getattr(owner, "__dict__", None)
        if state:
            numbers = {k: v for k, v in state.items() if isinstance(v, (int, float, np.number))}
            with self._lock:
                self._undo.append(lambda: state.update(numbers))

    def roll_back(self):
        """Put back every buffer and host number the trace changed (latest copies first, so
        where two kept buffers overlap, the earlier copy, from before the trace, wins)."""
        with self._lock:
            kept, undo = list(self._kept.values()), list(self._undo)
        for buf, host in reversed(kept):
            _put_back(buf, host)
        for restore in reversed(undo):
            restore()
        self.forget()

    def forget(self):
        with self._lock:
            self._kept, self._made, self._undo = {}, {}, []


class ThreadRecorder:
    """One thread's side of a ``Recording``: the boundary's wrappers (``backends.at_boundary``)
    hand it every device call this thread makes while it records.

    ``depth`` > 0 inside a recorded call, a host callback or ``initialization()``: a call
    made there belongs to the outer one (an op asking its device for a scratch buffer,
    ``copy_from`` reading its source, a host callback's own uploads and reads) and runs
    again when the outer one does, so it is not written down twice. ``call``: the host
    callback running now (its reads and writes are noted on it)."""

    __slots__ = ("recording", "depth", "call")

    def __init__(self, recording):
        self.recording, self.depth, self.call = recording, 0, None

    def device_call(self, kind, target, name, method, args, kwargs, info=None):
        """``method(target, *args, **kwargs)``, a boundary call of ``kind``, run and written down."""
        if self.depth:
            if kind in ("op", "write"):
                # state the trace made and now fills (an optimizer's slots zeroed under
                # ``initialization()``): kept from here on, like state from before the trace
                self.recording.unmade(list(args) + list(kwargs.values()))
            if self.call is not None and args:
                if kind == "write" and name == "upload_into":
                    _note(self.call.writes, args[0])            # a host callback's upload
                elif kind == "read":
                    _note(self.call.reads, args[-1] if name == "download_into" else args[0])
            return method(target, *args, **kwargs)
        rec = self.recording
        if kind == "read":
            rec.refuse(f"it {DEVICE_READS[name]}")
            return method(target, *args, **kwargs)
        if kind == "made":
            made = method(target, *args, **kwargs)
            rec.made(made)
            return made
        if kind == "ordering":                        # (event): recorded where it orders GPU streams
            method(target, *args, **kwargs)
            if args[0] is not None and getattr(target, "stream", None) is not None:
                rec.add(replay.Launch(target, name, args, {}))
            return None
        if kind == "host":
            return self.host_call(method, (target,) + tuple(args), kwargs,
                                  None if info is None else functools.partial(replay.restorer, info))
        if not rec.undoable:
            pass                                      # a plan changes nothing it must put back
        elif kind == "op":
            rec.keep_before(list(args) + list(kwargs.values()))
        elif kind == "write" and name in WRITES_FIRST:
            rec.keep_before(args[:1])
        self.depth = 1
        try:
            result = method(target, *args, **kwargs)
        finally:
            self.depth = 0
        if name == "upload_into":                     # a host value: keep a copy of it
            rec.add(replay.Upload(target, args[0], np.array(args[1], copy=True)))
        elif kind == "from_numpy":
            rec.add(replay.Upload(target, result, np.array(args[0], copy=True, order="C")))
            rec.made(result)
        elif kind == "copy_from":
            rec.add(replay.PeerCopy(target, result, args[0], args[1]))
            rec.made(result)
        else:
            rec.add(replay.Launch(target, name, args, kwargs))
        return result

    def host_call(self, fn, args, kwargs, undo_with=None, stays=False):
        """Run host work now and write it down as a ``HostCall`` (see ``host_work``); in a
        dry recording, written down only."""
        call = replay.HostCall(fn, args, kwargs, undo_with, stays)
        if self.recording.dry:
            self.recording.add(call)
            return None
        if args and self.recording.undoable:
            self.recording.keep_host_state(args[0])
        self.depth, self.call = 1, call
        try:
            result = fn(*args, **kwargs)
        finally:
            self.depth, self.call = 0, None
        self.recording.add(call)
        return result


def record(fn, graphs=None, key=None):
    """``fn()`` run once with its device calls written down: ``(its result, a
    replay.Program of them)``, or ``(its result, None)`` where the run cannot be replayed (it
    read a device value on the host: the caller runs ``fn`` eagerly from then on). ``graphs``
    and ``key``: the program's CUDA graphs and its key among them (``replay.Program``). What
    ``fit``'s passes keep per key (``passes.py``), and ``fit``'s call-layers and a loss
    written in ops (``keras/call_layers.py``). An ``fn`` that raises leaves what it changed, as its eager
    run would (nothing is kept for a roll-back)."""
    rec = Recording(undoable=False)
    with rec:
        result = fn()
    return result, (replay.Program(rec.entries, graphs, key) if rec.refused is None else None)


class _Planned(Exception):
    """Leaves a dry run's ``undo`` block by an exception, so that it drops what the run made."""


def dry_run(fn, args, undo):
    """The kernel launches ``fn(*args)`` (a device part) would make, written down by a dry
    ``Recording`` and none made: [(kernel, args)] in launch order. What the compile-ahead
    plan is made from (``passes.CapturedStep._run``, ``kernels/compile_ahead.py``).

    ``undo()``: a context manager that drops what a block made when an exception leaves it
    (``Step.rolled_back_on_error``): the buffers a first run makes on first use (an
    optimizer's slots, filled by a launch the dry run does not make) must not stay. The
    host effects need no undo: host calls (the update count) are not run dry. Raises what
    ``fn`` raised."""
    rec = Recording(dry=True)
    try:
        with undo(), rec:
            fn(*args)
            raise _Planned
    except _Planned:
        pass
    return rec.launches


def unrecordable(reason):
    """Called by library code that cannot be replayed (``next()`` on a data set's
    iterator inside a trace...): the calling thread's recording, if any, is refused with
    ``reason`` and the user's line. Outside a trace it does nothing."""
    recorder = backends.BOUNDARY.recorder
    if recorder is not None and not recorder.depth:
        recorder.recording.refuse(reason)


def host_work(fn=None, *, restores=None, stays=False):
    """Decorator: ``fn`` is host work that a replay must do again, every call.

    Outside a trace ``fn`` just runs. Inside one it runs now and is recorded as a
    ``HostCall`` (the device calls it makes are its own, not recorded separately), so
    each replay calls it again: the optimizer's ``begin_step`` (the step count, Adam's
    alpha for this step), ``tf.print`` (reads the value this replay computed), a metric's
    ``update_state``. Its return value is used by the trace only: work whose result
    steers the device work cannot be a callback. ``restores``: the name of an attribute
    of ``fn``'s first argument that a replay puts back if it fails after this call
    (``Optimizer.begin_step``: ``"step_count"``, so a failed step is not counted).
    ``stays``: the replay runs it exactly where the trace did, between the same launches
    (``HostCall.stays``: the all-reduce across workers, ``collective_all_reduce.py``)."""
    if fn is None:
        return lambda f: host_work(f, restores=restores, stays=stays)
    undo_with = None if restores is None else functools.partial(replay.restorer, restores)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        recorder = backends.BOUNDARY.recorder
        if recorder is None or recorder.depth:
            return fn(*args, **kwargs)
        return recorder.host_call(fn, args, kwargs, undo_with, stays)
    return run


class initialization:
    """``with recording.initialization():`` state made on first use, done now and never
    replayed: an optimizer's zeroed slots, Dropout's counter, a variable's initial value.

    A trace is often the first call of a step, so it is where such state is made; a
    replay that zeroed Adam's moments again every step would train something else.
    TensorFlow lifts variable creation out of a traced function the same way
    (``tf.init_scope``). Outside a trace it does nothing.

    ``variable``: a ``Variable`` is being made. Made by the function's own code (not
    inside the library's first-use state) it is counted on the recording, or refused
    with TensorFlow's ``ValueError`` where the recording allows none."""

    def __init__(self, variable=False):
        self.variable = variable
        self.recorder = None

    def __enter__(self):
        recorder = self.recorder = backends.BOUNDARY.recorder
        if recorder is not None:
            if self.variable and not recorder.depth:
                if recorder.recording.no_variables:
                    raise ValueError(SINGLETON_VARIABLES)
                recorder.recording.variables_made += 1
            recorder.depth += 1
        return self

    def __exit__(self, *exc):
        if self.recorder is not None:
            self.recorder.depth -= 1
        return False


def host_method(cls, name, restores=None):
    """``host_work`` for a method on a hot path (``Optimizer.begin_step``): wrapped once,
    now, at the device boundary (``backends.at_boundary``), so ``fit``'s every step calls
    it through one plain wrapper there and never passes through this file."""
    setattr(cls, name, backends.at_boundary("host", vars(cls)[name], restores))


def _note(where, buf):
    if replay.is_buffer(buf):
        where.append(buf)


def _host_copy(buf):
    """A host copy of a device buffer's values (waits for the work queued on it)."""
    if isinstance(buf, np.ndarray):
        return np.array(buf, copy=True)
    return buf.copy_to_host()


def _put_back(buf, host):
    if isinstance(buf, np.ndarray):
        np.copyto(buf, host)
    else:
        buf.copy_to_device(host)


# --- where in the user's code ----------------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # above mirrored/
_LIBRARY = tuple(os.path.join(_ROOT, p) + os.sep for p in ("mirrored", "kernels"))
_PYTHON = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})


def user_line():
    """``(filename, line number, source text)`` of the innermost frame of the calling
    thread that is the user's (not this library's, not Python's or an installed
    package's), or None."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_LIBRARY) and not name.startswith(_PYTHON) and not name.startswith("<frozen"):
            text = (traceback.extract_stack(frame, limit=1)[-1].line or "").strip()
            return name, frame.f_lineno, text
        frame = frame.f_back
    return None
