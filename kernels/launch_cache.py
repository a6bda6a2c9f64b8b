"""The cached launch: after numba-cuda has launched a kernel once with some buffers, launch it
again with the same buffers in ONE driver call.

Why. ``kernel[grid, block, stream](*args)`` is the readable launch, and every launcher in
``kernels/`` still spells it (through ``kernels.launch.launch``). But each call walks numba-cuda's
dispatcher: it types every argument, picks the compiled overload, converts each array into the
eleven-odd numbers the kernel receives (its ``_prepare_args``), builds a launch configuration and
packs the parameters again. Measured on an H100's host, that is 24 µs for one array argument and
69 µs for eight (issue 24), while most of our kernels run for less. A training step launches the
same kernels on the same buffers every step (the layers make their buffers once per batch size),
so everything but the scalars is the same every time.

What this module does (on real CUDA; the simulator keeps numba's path)::

    first launch of (kernel, grid, block, stream, argument buffers)   numba's path, unchanged
    second launch of it       numba's path, and a record is kept:
                              the kernel's function handle (the one numba launched),
                              the parameters packed by numba's own ``_prepare_args``, in ctypes
                              storage, and an array of pointers to them (what cuLaunchKernel reads)
    every later launch        scalars written into their slots in place (a dropout key, a ring
                              chunk's bounds), then cuLaunchKernel(...) through the CUDA Python
                              bindings numba-cuda itself uses; its return code is checked

Why a record only on the second sighting: code that makes fresh arrays for every call (the
Tensor API's temporaries) would otherwise pay numba's packing twice per launch and never replay.

Safety. A record is keyed by the *identity* of each argument array, and holds a weak reference to
each, whose callback drops the record the moment the array goes: before its memory can be freed,
so a freed buffer's address is never launched with from a record, and an identity is never
reused under a live record. (Strong references would keep every temporary a step ever launched
with alive.) A replaced buffer is a different array: a different key, a fresh record. Only numba
``DeviceNDArray`` arguments and Python/NumPy scalars are recorded; anything else (host arrays,
which numba copies on every launch, foreign CUDA arrays), a debug or cooperative kernel, or the
default stream (whose kernel handle depends on the thread's current context) stays on numba's
path every time. A record belongs to one stream, and one stream is launched on from one thread
(each replica's thread has its own), so a slot is never written by two launches at once.

``MIRRORED_LAUNCH_CACHE=0`` in the environment turns the cache off (every launch takes numba's
path), for comparing the two or debugging. Numba-cuda's private names this relies on are listed
in ``NUMBA_NAMES``; ``missing_numba_names``
checks them, and where one is missing the cache turns itself off with a warning that names the
installed numba-cuda version (requirements.txt pins the tested range).

Neighbours: ``kernels/launch.py`` (``launch`` calls ``replay`` then ``launch_and_record``);
``benchmarks/launch.py`` (host µs per launch, numba's path vs this one, driver stubbed where
there is no GPU); ``tests/test_launch_cache.py`` (the packed bytes equal numba's for every
registered signature).
"""
import ctypes
import importlib
import os
import threading
import warnings
import weakref
from importlib import metadata

import numpy as np
from numba import config as _numba_config

#: True under Numba's CUDA simulator: there is no driver, and numba's path is kept.
SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)

#: numba-cuda's names this module reads, as (module, attribute path); ``missing_numba_names``
#: checks them. Also read, on objects numba makes: a launch configuration's
#: ``pre_launch_callbacks``, ``griddim``, ``blockdim`` and ``dispatcher.py_func``; an overload's ``debug``,
#: ``cooperative``, ``extensions`` and ``_codelibrary``; a cufunc's ``handle``. A missing one of
#: those turns the cache off at the first recording launch, with the same message.
NUMBA_NAMES = (
    ("numba.cuda.dispatcher", "_Kernel._prepare_args"),          # numba's own packing
    ("numba.cuda.dispatcher", "_Kernel.argument_types"),
    ("numba.cuda.dispatcher", "_LaunchConfiguration"),
    ("numba.cuda.codegen", "CUDACodeLibrary.get_cufunc"),
    ("numba.cuda.cudadrv.devicearray", "DeviceNDArray"),
    ("numba.cuda.cudadrv.driver", "Stream"),
    ("numba.cuda.cudadrv.driver", "binding.cuLaunchKernel"),   # cuda.bindings.driver
    ("numba.cuda.cudadrv.driver", "binding.CUfunction"),
    ("numba.cuda.cudadrv.driver", "binding.CUstream"),
)

#: ``_seen`` is keyed by identities that may die and be reused: a stale entry only makes a
#: record one launch early, which is still correct. Cleared past this many entries.
SEEN_LIMIT = 65536

_records = {}            # key -> Record, or _Uncached (numba's path for this key, and why)
_seen = {}               # key -> True: launched once through numba
_numba_lock = threading.RLock()   # numba's path: one launch (and recording) at a time
_state = {"enabled": None, "why_not": None}    # enabled None: not checked yet

#: The driver call, resolved on first use (``cuda.bindings.driver.cuLaunchKernel``). Public so
#: that a benchmark or test with no GPU can put a stub here (``benchmarks/launch.py``).
cuLaunchKernel = None

_DeviceNDArray = None    # numba's DeviceNDArray class, once imported (real CUDA only)
_LaunchConfiguration = None   # what numba's kernel[grid, block, stream] returns


def numba_cuda_version():
    try:
        return metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return "unknown"


def missing_numba_names():
    """The entries of ``NUMBA_NAMES`` that the installed numba-cuda lacks, as "module.name"."""
    missing = []
    for module, path in NUMBA_NAMES:
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    return missing


def _version_message(what):
    return (f"numba-cuda {numba_cuda_version()} {what}; requirements.txt names the numba-cuda "
            f"versions this cache was tested with")


def disable(why):
    """Turn the cache off for this process (numba's path from now on), warning with ``why``."""
    _state["enabled"], _state["why_not"] = False, why
    _records.clear()
    warnings.warn(f"kernels.launch_cache is off, every launch takes numba-cuda's path: {why}",
                  RuntimeWarning, stacklevel=3)


def enabled():
    """True where launches are cached: real CUDA, and numba-cuda has the names we read."""
    global _DeviceNDArray, _LaunchConfiguration, cuLaunchKernel
    if _state["enabled"] is not None:
        return _state["enabled"]
    if SIMULATOR:
        _state["enabled"], _state["why_not"] = False, "Numba's CUDA simulator has no driver"
    elif os.environ.get("MIRRORED_LAUNCH_CACHE", "1").strip().lower() in ("0", "false", "no"):
        _state["enabled"], _state["why_not"] = False, "MIRRORED_LAUNCH_CACHE=0 is set"
    elif missing := missing_numba_names():
        disable(_version_message(f"lacks {', '.join(missing)}, which this cache reads"))
    else:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        from numba.cuda.cudadrv.driver import binding
        from numba.cuda.dispatcher import _LaunchConfiguration
        _DeviceNDArray = DeviceNDArray
        cuLaunchKernel = cuLaunchKernel or binding.cuLaunchKernel
        _state["enabled"] = True
    return _state["enabled"]


def key(kernel, grid, block, stream, args):
    """What a record is looked up by: the launch, each device array argument's identity, each
    other argument's type (a scalar's value goes into a slot). None where the cache is off."""
    if not (_state["enabled"] or (_state["enabled"] is None and enabled())):
        return None
    cls = _DeviceNDArray
    return (kernel, grid, block, stream,
            *[id(a) if a.__class__ is cls else a.__class__ for a in args])


class Record:
    """One recorded launch: everything ``cuLaunchKernel`` takes, ready. A scalar's slot keeps
    the C type numba chose at the record (a Python int: int64, as numba types ints below 2**63)."""
    __slots__ = ("name", "func", "dims", "stream", "params", "storage", "slots", "refs")

    def launch(self, args):
        for i, slot in self.slots:             # the scalars that may change: written in place
            slot.value = args[i]
        gx, gy, gz, bx, by, bz = self.dims
        err, = cuLaunchKernel(self.func, gx, gy, gz, bx, by, bz, 0, self.stream, self.params, 0)
        if err:
            raise RuntimeError(
                f"cuLaunchKernel returned {err!r} launching {self.name} (a cached launch, "
                f"kernels/launch_cache.py). An earlier kernel may have failed on this context: "
                f"run the step under compute-sanitizer, or with MIRRORED_LAUNCH_CACHE=0 to "
                f"launch through numba-cuda's path, which raises CudaAPIError for the same error.")


class _Uncached:
    """A key that stays on numba's path every time, and why."""
    __slots__ = ("why", "refs")

    def __init__(self, why):
        self.why = why


def replay(key, args):
    """Launch from the record for ``key`` in one driver call; False if there is none."""
    record = _records.get(key)
    if record is None or record.__class__ is not Record:
        return False
    record.launch(args)
    return True


def launch_and_record(key, configured, stream, args):
    """Numba's launch ``configured(*args)``; the second time a key is seen, also keep a record,
    so that later launches of it are one driver call (see the module docstring).

    Numba's path runs one launch at a time (``_numba_lock``): a kernel loaded from the disk
    cache (kernels/registry.py, ``keep_on_disk``) loads its machine code into the context at
    its first launch, and numba-cuda 0.30.4 does that without a lock, so two replicas'
    threads launching it at once both load it and the second fails ("key already in
    dictionary: <CUlibrary ...>", seen on the H100 with two logical GPUs). Only the first
    launches of a key take this path; the recorded launches after them do not lock. The
    lock is re-entrant, so a launch that numba's path makes on the same thread cannot wait
    on itself."""
    if key is None or key in _records or not isinstance(configured, _LaunchConfiguration):
        with _numba_lock:                         # cache off, numba's path for this key, or
            configured(*args)                     # not numba's kernel (a test's stand-in)
        return
    if key not in _seen:
        if len(_seen) >= SEEN_LIMIT:
            _seen.clear()
        _seen[key] = True
        with _numba_lock:
            configured(*args)
        return
    with _numba_lock:                             # one recording launch at a time
        launched = []                             # numba passes the overload it launches
        callback = lambda kernel, _config: launched.append(kernel)   # noqa: E731
        try:
            configured.pre_launch_callbacks.append(callback)
        except AttributeError as err:
            disable(_version_message(f"has no {err.name!r} on a launch configuration"))
            configured(*args)
            return
        try:
            configured(*args)
        finally:
            configured.pre_launch_callbacks.remove(callback)
        try:
            record = make_record(launched[-1], configured.griddim, configured.blockdim, stream,
                                 args, name=configured.dispatcher.py_func.__name__)
        except AttributeError as err:             # a numba-cuda name we read has gone
            disable(_version_message(f"has no {err.name!r}, which this cache reads"))
            return
        _store(key, record, args)


def _store(key, record, args):
    """Keep ``record`` under ``key`` until one of its argument arrays goes."""
    drop = lambda _ref, key=key: _records.pop(key, None)   # noqa: E731
    record.refs = [weakref.ref(a, drop) for a in args if a.__class__ is _DeviceNDArray]
    _records[key] = record


def _as_ctype(value):
    """One word of numba's packed argument list as ctypes storage holding the bytes cuda.core's
    launch sends for it: a Python int as intptr_t, a float as a double, a bool as a C bool, a
    ctypes scalar (numba's packing of a scalar argument) as itself."""
    if isinstance(value, ctypes._SimpleCData):
        return value
    if isinstance(value, bool):
        return ctypes.c_bool(value)
    if isinstance(value, int):
        return ctypes.c_ssize_t(value)
    if isinstance(value, float):
        return ctypes.c_double(value)
    raise TypeError(f"no ctypes storage for a packed kernel word of type {type(value).__name__}")


def pack(overload, args, stream=0):
    """Numba's own packing of ``args`` for ``overload`` (a ``_Kernel``), as ctypes storage.

    Returns (words, slots): ``words`` the ctypes objects in parameter order (one per word numba
    sends: an array is meminfo, parent, size, itemsize, data pointer, shape..., strides...),
    ``slots`` (argument index, ctypes object) for each scalar argument, to be written in place
    by later launches. Raises ``ValueError`` for what the cache does not take: anything but
    numba device arrays and scalars (checked before numba sees them: it would copy a host
    array), and argument extensions.
    """
    for i, value in enumerate(args):
        if value.__class__ is not _DeviceNDArray and not is_scalar(value):
            raise ValueError(f"argument {i} is a {type(value).__name__}, not a numba device "
                             f"array or a scalar")
    if overload.extensions:
        raise ValueError("the kernel has argument extensions, which may change every launch")
    words, retr, scalars = [], [], []
    for i, (ty, value) in enumerate(zip(overload.argument_types, args)):
        start = len(words)
        overload._prepare_args(ty, value, stream, retr, words)
        if value.__class__ is not _DeviceNDArray:
            if len(words) - start != 1:
                raise ValueError(f"argument {i} ({ty}) packs to {len(words) - start} words")
            scalars.append((i, start))
    if retr:
        raise ValueError("numba copies an argument to or from the host on every launch")
    words = [_as_ctype(w) for w in words]
    return words, [(i, words[at]) for i, at in scalars]


def is_scalar(value):
    """A Python int, float or bool, or a NumPy scalar: what a slot holds."""
    return isinstance(value, (int, float, np.generic))


def make_record(overload, griddim, blockdim, stream, args, name=None):
    """A ``Record`` for launching ``overload`` (the ``_Kernel`` numba launched) again with
    ``args``' buffers, or an ``_Uncached`` saying why not. ``name``: the kernel's, for
    errors (an overload loaded from the disk cache has no ``py_func`` to read it from)."""
    from numba.cuda.cudadrv.driver import Stream, binding
    if not enabled():
        return _Uncached(_state["why_not"])
    if overload.debug or overload.cooperative:
        return _Uncached("a debug or cooperative kernel: numba's launch makes more than one call")
    if not isinstance(stream, Stream) or not int(stream.handle or 0):
        return _Uncached("the default stream: the kernel handle would depend on the thread's "
                         "current context")
    try:
        words, slots = pack(overload, args, stream)
    except (ValueError, TypeError) as err:
        return _Uncached(str(err))
    pointers = (ctypes.c_void_p * max(len(words), 1))(*[ctypes.addressof(w) for w in words])
    record = Record()
    record.name = name or getattr(getattr(overload, "py_func", None), "__name__", "a kernel")
    cufunc = overload._codelibrary.get_cufunc()        # the handle numba launched, this device
    record.func = binding.CUfunction(int(cufunc.handle))
    record.dims = tuple(int(d) for d in (*griddim, *blockdim))
    record.stream = binding.CUstream(int(stream.handle))
    record.params = ctypes.addressof(pointers)         # the void** cuLaunchKernel reads
    record.storage = (words, pointers)                 # ... kept alive with the record
    record.slots = slots
    return record


def explain(key):
    """Why ``key`` is on numba's path, or "cached" (for labs and tests)."""
    record = _records.get(key)
    if record is not None:
        return "cached" if record.__class__ is Record else record.why
    if key is None:
        return _state["why_not"]
    return "seen once: recorded at its next launch" if key in _seen else "not launched yet"


def clear():
    """Forget every record (a test, or a benchmark timing numba's path)."""
    _records.clear()
    _seen.clear()
