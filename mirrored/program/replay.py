"""Replay: a recording's entries run again, in order, on the same buffers.

``recording.py`` writes down what one run of a step did at the device boundary as a list
of the entries defined here, each of which can run again: ``Launch`` (an op or a copy on
the same buffers), ``Upload`` (a host value the run saw, frozen), ``PeerCopy`` (a copy from
another device into the same buffer), ``HostCall`` (host work redone at every run: the
optimizer's step count and Adam's alpha, the count of updates done, ``tf.print``, a
metric). A ``Program`` is that list made runnable again::

    CPU devices, the simulator     the list, entry after entry (``run``): a launch calls
                                   the same op on the same buffers, a host call calls the
                                   same function again (the optimizer's step count, Adam's
                                   alpha, ``tf.print``, a metric)
    one GPU card                   the list cut at its host calls (``segments``, after
                                   ``reorder`` moved what host work it could to the ends):
                                   each run of launches captured once as a CUDA graph and
                                   replayed as one (``capture.StepGraphs``, handed in
                                   by the caller)

A replay that raises puts back the host numbers its host calls changed (each
``HostCall.run`` hands back its undo): the step ran, or it left nothing.

What a program returns lives in its own buffers, which the next replay rewrites; so a
returned tensor is copied out into an ``OutputPool`` (below) that the caller may keep.

Neighbours: ``recording.py`` (what the entries are, how they are written down),
``capture.py`` (the CUDA graphs), ``mirrored/traced_function.py`` (``@function``: a
``ConcreteFunction`` is a ``Program`` with input slots and outputs).
"""
import sys

import numpy as np

from mirrored import devices


# --- the entries: what a recording wrote down, each able to run again ---------------------------

class Launch:
    """A device call to make again: ``getattr(target, name)(*args, **kwargs)``."""

    __slots__ = ("target", "name", "args", "kwargs")

    def __init__(self, target, name, args, kwargs):
        self.target, self.name, self.args, self.kwargs = target, name, args, kwargs

    def run(self):
        getattr(self.target, self.name)(*self.args, **self.kwargs)

    def buffers(self):
        return [a for a in list(self.args) + list(self.kwargs.values()) if is_buffer(a)]

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
    (``upload_into``) while tracing; ``replay.reorder`` may move a call that only writes
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
        self.fn(*self.args, **self.kwargs)
        return undo

    def buffers(self):
        return self.reads + self.writes

    def __repr__(self):
        return f"HostCall({getattr(self.fn, '__qualname__', self.fn)})"


def restorer(name, owner, *args, **kwargs):
    """A ``HostCall``'s undo for host work that changes ``owner.<name>`` (``host_work``'s
    ``restores``): a function that sets it back to its value now."""
    value = getattr(owner, name)
    return lambda: setattr(owner, name, value)


def is_buffer(value):
    """A device buffer (a NumPy array on a CPU device, a CUDA array, the simulator's)."""
    return isinstance(value, np.ndarray) or hasattr(value, "__cuda_array_interface__") \
        or hasattr(value, "_ary")


# --- a program: the entries, run again ----------------------------------------------------------

class Program:
    """A recording's entries, to be run again (``run``): as a list on CPU devices and the
    simulator, as CUDA graphs between host calls on one GPU card (``graphs``, else None)."""

    def __init__(self, entries, graphs=None, key=None):
        """``graphs``: a ``capture.StepGraphs`` over the devices the entries use
        (``devices_of``), or None (a list run as it is); ``key``: this program's name among
        those graphs' keys (its first run of launches is ``key``, the next ``key + (1,)``...)."""
        self.entries = list(entries)
        self.graphs = graphs
        self.key = ("replay", id(self)) if key is None else key
        if self.graphs is None:
            self.segments = [self.entries]         # CPU (or no graphs): the list, in order
        else:
            self.segments = segments(reorder(self.entries))

    def buffers(self):
        """Every buffer an entry reads or writes."""
        return [b for e in self.entries for b in e.buffers()]

    def run(self):
        """Replay every entry once; a failure puts the host state back as it was."""
        undo, runs = [], 0
        try:
            for part in self.segments:
                if isinstance(part, list) and self.graphs is not None:
                    self.graphs.run(self.key + ((runs,) if runs else ()), _run_launches, part)
                    runs += 1
                else:
                    _run_entries(part if isinstance(part, list) else [part], undo)
        except BaseException:
            for restore in reversed(undo):     # the host state as before this run
                restore()
            raise


def touches(buf, buffers):
    """True if ``buf``'s bytes overlap any of ``buffers``' (by address range)."""
    return _overlaps([buf], [_Buffers(buffers)])


#: How many buffers an ``OutputPool`` keeps. Two take turns in ``loss = step(x)``; kept
#: results beyond this many are the caller's alone (the pool forgets them).
POOL_SIZE = 4


class OutputPool:
    """The buffers one returned tensor of a trace is copied into, each used again only
    when nothing else holds it.

    Why copy at all: a replay rewrites the record's own buffers, so a result must leave
    them. Why not one buffer, rewritten each call: the caller may keep a result
    (``losses.append(step(x))``, read after the loop), and in TensorFlow each call's
    tensors are its own. Why not a new buffer every call: that is an allocation per
    returned tensor per step (on a GPU, a cudaMalloc, and numba's deferred frees that
    synchronise the card).

    When is a buffer free? When no Tensor, view or NumPy array refers to its memory.
    Python counts references, so the pool asks (``_references``): ``sys.getrefcount`` of
    the buffer and of the object that owns its memory (``devices.memory_owner``: the
    array itself on a CPU, the simulator's NumPy array, the GPU allocation every view
    counts on), compared with the counts they had when the buffer was new, held by the
    pool alone. A returned Tensor holds the buffer; a reshape or slice of it holds the
    owner: either keeps the buffer theirs. (A weakref on the returned Tensor would miss
    a view that outlives it.)

    In ``loss = step(x)`` the previous result is still bound while the next call runs,
    so two buffers take turns: no allocation after the first two calls. When all
    ``POOL_SIZE`` are held, a new buffer is made and the oldest is forgotten (it is the
    caller's; Python frees it when they drop it). ``allocations`` counts what was made."""

    def __init__(self, tensor):
        self.dev, self.shape, self.dtype = tensor.dev, tensor.shape, tensor.dtype
        self.entries = []              # [buffer, its owner's reference count when held by the pool alone]
        self.oldest = 0                # the entry to forget next when all are held
        self.allocations = 0

    def copy_of(self, tensor):
        """A free buffer of the pool (on ``self.dev``) holding a copy of ``tensor``'s values."""
        buf = self._take()
        if tensor.buf.size:
            with self.dev.activate():
                self.dev.copy_into(buf, tensor.buf)
        return buf

    def _take(self):
        for entry in self.entries:
            if _references(entry) == entry[1]:      # as when the pool alone held it
                return entry[0]
        with self.dev.activate():
            entry = [self.dev.empty(self.shape, self.dtype), 0]
        entry[1] = _references(entry)          # the same way as the check above: the same count
        self.allocations += 1
        if len(self.entries) < POOL_SIZE:
            self.entries.append(entry)
        else:
            self.entries[self.oldest] = entry
            self.oldest = (self.oldest + 1) % POOL_SIZE
        return entry[0]


def _references(entry):
    """References to ``entry[0]`` (an ``OutputPool`` entry's buffer) and to the object
    owning its memory: a Tensor holds the buffer (a GPU array holds the owner, once,
    however many Tensors hold the array), a view holds the owner."""
    return sys.getrefcount(entry[0]), sys.getrefcount(devices.memory_owner(entry[0]))


class _Buffers:
    """A list of buffers where ``_overlaps`` expects entries."""

    def __init__(self, buffers):
        self._buffers = buffers

    def buffers(self):
        return self._buffers


def _run_entries(entries, undo):
    for entry in entries:
        restore = entry.run()
        if restore is not None:
            undo.append(restore)


def _run_launches(entries):
    for entry in entries:
        entry.run()


def devices_of(entries):
    """The devices the entries run on, each once, in order of first use."""
    found = {}
    for entry in entries:
        dev = entry.device() if hasattr(entry, "device") else None
        if hasattr(dev, "ops"):
            found.setdefault(dev.name, dev)
    return list(found.values())


def segments(entries):
    """The entries cut at each host callback: ``[launches...], HostCall, [launches...]``;
    each list of launches can be captured as one CUDA graph. Uploads go with the host
    calls (a copy from the host through a staging buffer is not captured)."""
    out, run = [], []
    for entry in entries:
        if isinstance(entry, (HostCall, Upload)) or (
                isinstance(entry, PeerCopy) and entry.src.device_type != entry.dev.device_type):
            if run:
                out.append(run)
                run = []
            out.append(entry)
        else:
            run.append(entry)
    if run:
        out.append(run)
    return out


def reorder(entries):
    """The entries with host work moved out of the launches where that changes nothing,
    so that the launches of a step form one run (one CUDA graph):

    * a host call that only writes device buffers (``begin_step``'s scalars), and an
      upload of a traced constant, go to the front when no launch before them touches
      what they write;
    * a host call that only reads (``tf.print``, a metric's ``update_state``) goes to
      the end when no launch after it touches what it read.

    Order among the moved calls is kept. "Touches" is judged by address ranges, so it
    is conservative (a launch that only reads a buffer still holds a write back); host
    state two moved calls share is not tracked (a ``tf.print`` of the step count placed
    before ``apply_gradients`` would show the count after it)."""
    front, middle, back = [], [], []
    for entry in entries:
        moves_front = (isinstance(entry, Upload) or
                       (isinstance(entry, HostCall) and not entry.reads and not entry.stays))
        if moves_front and not _overlaps(entry.buffers(), middle):
            front.append(entry)
        else:
            middle.append(entry)
    kept = []
    for entry in reversed(middle):
        moves_back = isinstance(entry, HostCall) and entry.reads and not entry.writes \
            and not entry.stays
        if moves_back and not _overlaps(entry.buffers(), kept):
            back.append(entry)
        else:
            kept.append(entry)
    return front + kept[::-1] + back[::-1]


def _overlaps(buffers, entries):
    spans = [_span(b) for b in buffers]
    for entry in entries:
        for other in entry.buffers():
            lo, hi = _span(other)
            if any(lo < b_hi and b_lo < hi for b_lo, b_hi in spans):
                return True
    return False


def _span(buf):
    """The address range ``[lo, hi)`` a buffer's bytes occupy."""
    buf = getattr(buf, "_ary", buf)                   # the simulator's array inside
    if isinstance(buf, np.ndarray):
        lo, hi = np.byte_bounds(buf) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(buf)
        return lo, max(hi, lo + 1)
    cai = buf.__cuda_array_interface__
    nbytes = int(np.prod(cai["shape"], dtype=np.int64)) * np.dtype(cai["typestr"]).itemsize
    return cai["data"][0], cai["data"][0] + max(nbytes, 1)


