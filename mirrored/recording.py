"""What a traced ``@mirrored.function`` call did on the devices, kept to be done again.

``traced_function.py`` runs a function's Python once per input signature inside a
``Recording``. While one is open, every call that crosses the *device boundary* is
written down, whichever part of the library made it (the layers, the tape, the ring,
the optimizer, a user's own tensor arithmetic):

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
                            user's line, and ``traced_function.py`` runs that function eagerly
==========================  =========================================================

Allocations (``empty``, ``scratch``) are not entries: the buffers a trace made are kept
by the entries that use them, and a replay writes into the same ones. State made on first
use (a model's packed weights, an optimizer's zeroed slots, Dropout's counter, a variable's
initial value) is made under ``initialization()``: done once, never replayed.

A call made *inside* a recorded call (an op asking its device for a scratch buffer,
``copy_from`` reading its source, a host callback's own uploads and reads) belongs
to that call: it runs again when the outer one does, so it is not written down twice.
``_local.depth`` tracks that, per thread (``strategy.run``'s replica threads record
into the same recording, each in its own program order; the merge points order them
between each other, and the list keeps the order the calls really happened in).

How the calls are caught: while a recording is open, the device classes' and the ops
classes' methods are wrapped (``_instrument``), and put back when it closes. The
classes, not the instances, so that code holding a device's ``ops`` object since
before (a layer program) is recorded too, and nothing in the engine needs to know.

Neighbours: ``traced_function.py`` (the tracer and the replay), ``devices.py`` and
``backends.py`` (the boundary), ``graphs.py`` (a replay's launches as a CUDA graph).
"""
import functools
import inspect
import os
import sys
import sysconfig
import threading
import traceback

import numpy as np

from mirrored import backends, devices

#: Device methods that write device memory from the host or from another device buffer.
DEVICE_WRITES = ("upload_into", "copy_into", "copy_peer_into", "synchronize")
#: Device methods that hand a device value to the host: a trace cannot replay them.
DEVICE_READS = {"to_numpy": "reads a device value on the host (.numpy(), float(), int(), "
                            "bool(), an `if` or `while` on a tensor, NumPy on a tensor)",
                "download_into": "reads a device value on the host",
                "mpi_buffer": "hands a device buffer to MPI (the ring across workers is driven "
                              "from the host)"}
#: Functions that order two GPU streams (an event recorded on one, waited for on the
#: other): recorded where a GPU is involved, so a replay keeps the ring's ordering.
STREAM_ORDERING = (("mirrored.ring", "record_event"), ("mirrored.ring", "wait_event"),
                   ("mirrored.devices", "wait_for"))
#: Ops methods that only answer a question (nothing to replay).
OPS_QUERIES = ("fuses_conv_relu_pool",)

_lock = threading.Lock()          # one recording at a time (opening, closing, adding)
_current = None                   # the open Recording, or None
_local = threading.local()        # .depth: > 0 inside a recorded call (see the docstring)


def active():
    """The open ``Recording``, or None (no trace is running)."""
    return _current


def in_host_code():
    """True inside a recorded call or a host callback on this thread (its reads are its own)."""
    return getattr(_local, "depth", 0) > 0


class Launch:
    """A device call to make again: ``getattr(target, name)(*args, **kwargs)``."""

    __slots__ = ("target", "name", "args", "kwargs")

    def __init__(self, target, name, args, kwargs):
        self.target, self.name, self.args, self.kwargs = target, name, args, kwargs

    def run(self):
        getattr(self.target, self.name)(*self.args, **self.kwargs)

    def buffers(self):
        return [a for a in list(self.args) + list(self.kwargs.values()) if _is_buffer(a)]

    def device(self):
        return getattr(self.target, "device", self.target)

    def __repr__(self):
        return f"Launch({self.name} on {getattr(self.device(), 'short_name', '?')})"


class Upload:
    """A host array the trace put on a device (a Python value: the same every replay)."""

    __slots__ = ("dev", "buf", "host")

    def __init__(self, dev, buf, host):
        self.dev, self.buf, self.host = dev, buf, host

    def run(self):
        self.dev.upload_into(self.buf, self.host)

    def buffers(self):
        return [self.buf]

    def device(self):
        return self.dev


class PeerCopy:
    """``out = dev.copy_from(buf, src)`` made again into the same ``out``."""

    __slots__ = ("dev", "out", "buf", "src")

    def __init__(self, dev, out, buf, src):
        self.dev, self.out, self.buf, self.src = dev, out, buf, src

    def run(self):
        if self.src.device_type == self.dev.device_type:
            devices.wait_for(self.src, self.dev)        # read after write (a no-op on CPUs)
            self.dev.copy_peer_into(self.out, self.buf, self.src)
            devices.wait_for(self.dev, self.src)        # write after read
        else:                                           # CPU <-> GPU: through the host
            self.dev.upload_into(self.out, np.ascontiguousarray(self.src.to_numpy(self.buf)))

    def buffers(self):
        return [self.out, self.buf]

    def device(self):
        return self.dev


class HostCall:
    """Host work to run again at every replay: ``fn(*args, **kwargs)``.

    ``reads``/``writes``: the device buffers it read (``to_numpy``) and wrote
    (``upload_into``) while tracing; ``traced_function.py`` may move a call that only writes
    to the start of the replay, and one that only reads to its end, so that the
    launches between them form one CUDA graph. ``stays``: never moved (it touches device
    memory in ways not noted here: MPI reading and writing CPU buffers in place).
    ``undo()``: what puts the host state back if the replay fails after this call ran
    (None: nothing to put back)."""

    __slots__ = ("fn", "args", "kwargs", "reads", "writes", "undo_with", "stays")

    def __init__(self, fn, args, kwargs, undo_with=None, stays=False):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.reads, self.writes = [], []
        self.undo_with = undo_with
        self.stays = stays

    def run(self):
        """Run it; returns a function that undoes its host-side effect (or None)."""
        undo = self.undo_with(*self.args, **self.kwargs) if self.undo_with is not None else None
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            self.fn(*self.args, **self.kwargs)
        finally:
            _local.depth -= 1
        return undo

    def buffers(self):
        return self.reads + self.writes

    def __repr__(self):
        return f"HostCall({getattr(self.fn, '__qualname__', self.fn)})"


class Recording:
    """The entries of one trace, in the order they ran; ``refused``: (why, where) of the
    first thing in it that cannot be replayed, or None.

    ``with Recording() as rec:`` opens it (the device classes' methods are wrapped while
    it is open); it closes whatever happens inside."""

    def __init__(self):
        self.entries = []
        self.refused = None           # (reason, (filename, line, text)) of the first refusal
        self._open_host_calls = []    # the HostCalls running now (their reads and writes)

    def __enter__(self):
        global _current
        _lock.acquire()
        if _current is not None:
            _lock.release()
            raise RuntimeError("a trace is already being recorded; a @function called inside "
                               "another one's trace runs inside it (traced_function.py checks first).")
        _instrument()
        _current = self
        _lock.release()
        return self

    def __exit__(self, *exc):
        global _current
        with _lock:
            _current = None
            _uninstrument()
        return False

    def add(self, entry):
        with _lock:
            self.entries.append(entry)

    def refuse(self, reason, where=None):
        """Mark the recording as one that cannot be replayed (the first reason is kept)."""
        with _lock:
            if self.refused is None:
                self.refused = (reason, where if where is not None else user_line())


def unrecordable(reason):
    """Called by library code that cannot be replayed (``next()`` on a data set's
    iterator inside a trace...): the open recording, if any, is refused with ``reason``
    and the user's line. Outside a trace it does nothing."""
    rec = _current
    if rec is not None and not in_host_code():
        rec.refuse(reason)


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
    undo_with = None if restores is None else functools.partial(_restorer, restores)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        rec = _current
        if rec is None or in_host_code():
            return fn(*args, **kwargs)
        call = HostCall(fn, args, kwargs, undo_with, stays)
        _local.depth = 1
        _local.call = call
        try:
            result = fn(*args, **kwargs)
        finally:
            _local.depth = 0
            _local.call = None
        rec.add(call)
        return result
    return run


class initialization:
    """``with recording.initialization():`` state made on first use, done now and never
    replayed: an optimizer's zeroed slots, Dropout's counter, a variable's initial value.

    A trace is often the first call of a step, so it is where such state is made; a
    replay that zeroed Adam's moments again every step would train something else.
    TensorFlow lifts variable creation out of a traced function the same way
    (``tf.init_scope``). Outside a trace it does nothing."""

    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _local.depth -= 1
        return False


_HOST_METHODS = []                # (class, method name, restores): see host_method


def host_method(cls, name, restores=None):
    """``host_work`` for a method on a hot path: ``cls.<name>`` is wrapped only while a
    recording is open (``_instrument``), so ``fit``'s every step calls the plain method
    and never passes through this file (``Optimizer.begin_step``)."""
    _HOST_METHODS.append((cls, name, restores))


def _restorer(name, owner, *args, **kwargs):
    """A function that sets ``owner.<name>`` back to its value now."""
    value = getattr(owner, name)
    return lambda: setattr(owner, name, value)


# --- catching the device calls ---------------------------------------------------------

_patched = []                     # (class, name, what its __dict__ held or _MISSING)
_MISSING = object()


def _device_classes():
    found, todo = [], [devices.Device]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def _ops_methods(cls):
    return [name for name, value in vars(cls).items()
            if not name.startswith("_") and callable(value) and name not in OPS_QUERIES
            and not isinstance(value, (staticmethod, classmethod))]


def _instrument():
    """Wrap the boundary's methods (called with ``_lock`` held)."""
    for cls in (backends.CpuOps, backends.CudaOps):
        for name in _ops_methods(cls):
            _patch(cls, name, _recorded)
    for cls in _device_classes():
        for name in DEVICE_WRITES:
            _patch(cls, name, _recorded)
        for name in DEVICE_READS:
            _patch(cls, name, _read)
        _patch(cls, "from_numpy", _from_numpy)
        _patch(cls, "copy_from", _copy_from)
    for cls, name, restores in _HOST_METHODS:
        _patch(cls, name, lambda _, original, r=restores: host_work(original, restores=r))
    for module, name in STREAM_ORDERING:       # the ring's events, if the ring is loaded
        if module in sys.modules:
            _patch(sys.modules[module], name, _ordering)


def _uninstrument():
    while _patched:
        cls, name, before = _patched.pop()
        if before is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, before)


def _patch(cls, name, wrapper):
    original = getattr(cls, name, None)
    if original is None:
        return
    _patched.append((cls, name, vars(cls).get(name, _MISSING)))
    setattr(cls, name, wrapper(name, original))


def _recorded(name, original):
    """An op or a device write: run it, then (outermost calls only) write it down."""
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        rec = _current
        if rec is None or in_host_code():
            if rec is not None and name == "upload_into":
                _note(rec, "writes", args[0])        # a host callback's upload
            return original(self, *args, **kwargs)
        _local.depth = 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _local.depth = 0
        if name == "upload_into":                    # a host value: keep a copy of it
            rec.add(Upload(self, args[0], np.array(args[1], copy=True)))
        else:
            rec.add(Launch(self, name, args, kwargs))
        return result
    return call


def _read(name, original):
    """A host read: allowed inside host code, refuses the recording anywhere else."""
    @functools.wraps(original)
    def read(self, *args, **kwargs):
        rec = _current
        if rec is not None:
            if in_host_code():
                if args:
                    _note(rec, "reads", args[-1] if name == "download_into" else args[0])
            else:
                rec.refuse(f"it {DEVICE_READS[name]}")
        return original(self, *args, **kwargs)
    return read


def _from_numpy(name, original):
    @functools.wraps(original)
    def from_numpy(self, array):
        rec = _current
        if rec is None or in_host_code():
            return original(self, array)
        _local.depth = 1
        try:
            buf = original(self, array)
        finally:
            _local.depth = 0
        rec.add(Upload(self, buf, np.array(array, copy=True, order="C")))
        return buf
    return from_numpy


def _copy_from(name, original):
    @functools.wraps(original)
    def copy_from(self, buf, src):
        rec = _current
        if rec is None or in_host_code():
            return original(self, buf, src)
        _local.depth = 1
        try:
            out = original(self, buf, src)
        finally:
            _local.depth = 0
        rec.add(PeerCopy(self, out, buf, src))
        return out
    return copy_from


def _ordering(name, original):
    """``record_event(dev, event)``, ``wait_event(dev, event)``, ``wait_for(src, dst)``:
    recorded (as a ``Launch`` on their module) only where they do something, on GPUs."""
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def order(*args):
        original(*args)
        rec = _current
        if rec is not None and not in_host_code() and all(
                getattr(a, "stream", 0) is not None for a in args) and None not in args:
            rec.add(Launch(module, name, args, {}))
    return order


def _note(rec, which, buf):
    call = getattr(_local, "call", None)
    if call is not None and _is_buffer(buf):
        getattr(call, which).append(buf)


def _is_buffer(value):
    return isinstance(value, np.ndarray) or hasattr(value, "__cuda_array_interface__") \
        or hasattr(value, "_ary")


# --- where in the user's code ----------------------------------------------------------

_LIBRARY = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), p) + os.sep
                 for p in ("mirrored", "kernels"))
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
