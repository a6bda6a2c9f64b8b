"""Compiled kernels kept on disk: numba-cuda's cache, made safe to find damaged, and counted.

Why. Compiling a kernel takes 0.3-0.5 s (NVVM, then the linker); the course lab's step
launches about 15, so a first process spends seconds compiling (issue 40: 4.2 of epoch 1's
4.9 s on an H200). numba-cuda can keep each compiled kernel in a file and load it in the
next process in milliseconds (``@cuda.jit(cache=True)``; ``kernels/registry.py``'s
``keep_on_disk`` turns it on for every registered kernel that is safe to keep). Where the
files go, numba decides, first that applies::

    NUMBA_CACHE_DIR set                a folder per source folder under it
    the source's __pycache__ writable  there (an editable install, a clone)
    else                               the user's cache, ~/.cache/numba (XDG_CACHE_HOME)
                                       (a plain install into a read-only site-packages)

A kernel is one index file ``<module>.<function>-<line>.py<version>.nbi`` (what is kept, by
signature, numba-cuda's version, the hashes of the bytecode and of the closure's values, and
the source file's time stamp and size) and one data file ``....<n>.nbc`` per compiled
signature (the PTX and the cubin, pickled). The source's path picks the folder, not the
key: an editable and a plain install keep separate files, and neither reads the other's.

Loading without the compiler. numba-cuda's ``Cache.load_overload`` first calls
``target_context.refresh()``: it imports and installs every typing and lowering registry of
numba-cuda (fp16, cffi, pycparser ...), which only compiling needs (numba's compiler calls
``refresh()`` itself before it compiles). Measured here (no GPU, the driver stubbed, a warm
cache, a busy 2-core machine, 5 interleaved pairs, medians), a process's first kernel launch
took 2.20 s (1.52-3.25) through numba's load, 0.042 s (0.037-0.076) through this one; the
next kernel 0.01-0.02 s either way. The lab pays it at its first launch, a ``fill`` while the
model is built. ``GuardedCache`` loads without it: a warm process imports numba-cuda's
compiler only when a kernel must compile. (That the kernels so loaded run right is checked
on a GPU: ``tests/test_kernel_cache.py``'s ``gpu`` tests.)

What numba does with a damaged file: an index or data file that is truncated or garbage
raises out of the launch (``pickle`` errors; numba-cuda 0.30.4 guards only against a data
file that has gone). ``GuardedCache`` catches that, warns with the kernel, the folder and what
to do (``KernelCacheWarning``) and compiles the kernel again, as if nothing were kept; saving
it then rewrites the damaged data file, or, where the index itself cannot be read, starts the
index afresh (numba's ``flush``: the other signatures it listed are compiled again when next
launched). A stale entry (the source edited, numba-cuda upgraded) numba itself recompiles,
silently: its key or stamp no longer matches.

Compiling ahead of time (for ``fit``, where it builds its step): what a first process can
gain by compiling the kernels it will launch before the first launch, in threads. Measured
(``benchmarks/compile_gil.py``, no GPU): libnvvm releases the GIL, but numba-cuda holds its
``global_compiler_lock`` over a whole compile (typing, lowering, NVVM, link) and its front end
is Python, so two kernels never compile at once in one process (1.21 s one after the other,
1.18 s in two threads). A thread can overlap compiling with other host work; two compiles
would need two processes. A second process compiles nothing: this cache.

Whose folder. numba's files are pickles: loading one runs whatever it was made to run. So
the cache is read only from a folder that this process's user owns and no one else can write
(group and other write bits off, as OpenSSH treats ``~/.ssh``), and only files there that are
the user's own and writable by no one else (``distrust``). Anywhere else, a planted index would
run its payload as the next user to launch a kernel (issue 51, item 1). An untrusted folder is
named once (``KernelCacheWarning``, with the fix) and neither read nor written: kernels compile
in memory, as with ``MIRRORED_KERNEL_CACHE=0``. It is checked at every read (``load``,
``compile_ahead.missing`` and numba's own load at a kernel's first launch all go through
``GuardedCache.load_overload``), and by ``trusted_for`` for numba's CPU loops
(``@njit(cache=True)`` in ``kernels/cpu_*.py``, ``kernels/optimizers.py``), which keep their
files in the same folder. ``python -m mirrored info`` says which (``note``).

Neighbours: ``kernels/registry.py`` (``keep_on_disk``: which kernels are kept, calls
``keep``), ``mirrored/info.py`` (``python -m mirrored info`` prints ``note()``),
``tests/test_kernel_disk_cache.py`` (a second process compiles none of the lab's kernels;
damaged files are rebuilt), ``tests/test_kernel_cache.py`` (which kernels may be kept).
"""
import os
import stat
import types
import warnings

#: ``MIRRORED_KERNEL_CACHE=0``: compile every kernel afresh in each process (read at each
#: ``register``, so at import).
CACHE_VAR = "MIRRORED_KERNEL_CACHE"


class KernelCacheWarning(RuntimeWarning):
    """A kernel's file in numba's disk cache could not be read or written, or its folder is not
    trusted (``distrust``): compiled instead."""


def wanted():
    """False where ``MIRRORED_KERNEL_CACHE=0`` asks to keep nothing on disk."""
    return os.environ.get(CACHE_VAR, "1") != "0"


_guarded_class = []      # GuardedCache, made on first use (it subclasses numba-cuda's class)


def _guarded():
    if _guarded_class:
        return _guarded_class[0]
    from numba.cuda.dispatcher import CUDACache
    from numba.cuda.utils import numba_target_override

    class GuardedCache(CUDACache):
        """numba-cuda's ``CUDACache``; a file it cannot read or write is reported and
        rebuilt instead of failing the launch (see the module docstring). Set up when first
        used, not at import: numba's set-up finds the folder and probes that it can write
        there (a file made and removed), 3-5 ms a kernel, 80 kernels at ``import mirrored``."""

        def __init__(self, py_func):           # numba's own __init__ waits: see _set_up
            self._py_func = py_func
            self._ready = False

        def _set_up(self):
            if not self._ready:
                self._ready = True
                CUDACache.__init__(self, self._py_func)

        def __getattr__(self, name):            # an attribute numba's __init__ makes
            if name.startswith("__") or self.__dict__.get("_ready", True):
                raise AttributeError(name)
            self._set_up()
            return getattr(self, name)

        def set_launch_config_key(self, key):   # a setter: numba's __init__ must run first
            self._set_up()
            super().set_launch_config_key(key)

        def disable(self):
            self._set_up()
            super().disable()

        def trusted(self):
            """False (warned once) where the folder or this kernel's files are not only this
            user's (``distrust``): then nothing of them is unpickled, nor written."""
            self._set_up()
            return _trusted(self.cache_path, _prefix(self._py_func))

        def load_overload(self, sig, target_context):
            if not self.trusted():                 # a pickle from there could run anything
                return None
            try:
                with numba_target_override():      # as CUDACache.load_overload, but ...
                    return self._load_overload(sig, target_context)   # ... no refresh()
            except Exception as err:       # noqa: BLE001 - any damage means: compile again
                _warn(self._py_func, self.cache_path, "could not be read", err,
                      "compiling it again and rewriting its entry")
                return None

        def save_overload(self, sig, data):
            if not self.trusted():                 # kept in memory only
                return
            try:
                super().save_overload(sig, data)
                return
            except Exception:              # noqa: BLE001 - most likely a damaged index:
                pass
            try:                           # numba's own flush rewrites it, empty; once more
                self.flush()
                super().save_overload(sig, data)
            except Exception as err:       # noqa: BLE001 - the kernel works, only unkept
                _warn(self._py_func, self.cache_path, "could not be written", err,
                      "the next process compiles it again")

    _guarded_class.append(GuardedCache)
    return GuardedCache


def _warn(func, folder, what, err, then):
    warnings.warn(
        f"the kernel cache entry of {func.__module__}.{func.__qualname__} in {folder} {what} "
        f"({type(err).__name__}: {err}); {then}. If this repeats, delete that folder's "
        f"*.nbi and *.nbc files, or set {CACHE_VAR}=0 to keep nothing on disk.",
        KernelCacheWarning, stacklevel=3)


#: Permission bits that let someone other than the owner change a file or a folder's entries.
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_warned_folders = set()      # each untrusted folder is named once per process


def distrust(folder, prefix=None):
    """Why numba's cache ``folder`` must not be read: "" where it may. It must be owned by this
    process's user and writable by no one else, and so must each file in it whose name starts
    with ``prefix`` (a kernel's ``file_prefix``; every file where None) and ends ``.nbi`` or
    ``.nbc`` (what numba unpickles). A folder not made yet holds nothing to read: ""."""
    if not hasattr(os, "geteuid"):               # no POSIX owners (Windows): numba's behaviour
        return ""
    try:
        why = _not_own("the folder", os.stat(folder))
        if why:
            return why
        for name in sorted(os.listdir(folder)):
            if name.endswith((".nbi", ".nbc")) and name.startswith(prefix or ""):
                info = os.lstat(os.path.join(folder, name))
                if stat.S_ISLNK(info.st_mode):
                    return f"its file {name} is a symbolic link"
                why = _not_own(f"its file {name}", info)
                if why:
                    return why
    except FileNotFoundError:
        return ""
    except OSError as err:
        return f"could not be checked ({type(err).__name__}: {err})"
    return ""


def _not_own(what, info):
    if info.st_uid != os.geteuid():
        return f"{what} is owned by user id {info.st_uid}, not by this process's user ({os.geteuid()})"
    if info.st_mode & OTHERS_WRITE:
        who = " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "everyone"))
                           if info.st_mode & bit)
        return f"{what} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


def _trusted(folder, prefix=None):
    """True where ``distrust`` finds nothing; else False, and a warning the first time
    ``folder`` is refused in this process."""
    why = distrust(folder, prefix)
    if why and folder not in _warned_folders:
        _warned_folders.add(folder)
        warnings.warn(
            f"the kernel cache folder {folder} is not trusted: {why}. numba's cache files are "
            f"pickles, and anyone who can write them can make this process run their code, so "
            f"nothing there is read or written: kernels compile in memory instead (seconds at a "
            f"first launch). The folder and its files must be yours and writable by you alone: "
            f"chmod go-w {folder} (and chown it, or delete it so that it is made again), or set "
            f"NUMBA_CACHE_DIR to a folder of your own; {CACHE_VAR}=0 keeps nothing on disk.",
            KernelCacheWarning, stacklevel=4)
    return not why


def trusted_for(module_file):
    """For numba's CPU loops: what to pass as ``cache=`` to ``@njit`` in ``module_file`` (a
    module's ``__file__``). True where numba's cache folder for that file, and each file of
    that module's loops there, are this user's alone (``distrust``); else False (warned once):
    the loops compile in memory and nothing is unpickled. numba is asked where the files go
    (its ``FunctionCache`` of a stand-in function of that file: a few ms, once a module)."""
    from numba.core.caching import FunctionCache
    stem = os.path.splitext(os.path.basename(module_file))[0]
    stand_in = types.FunctionType(compile("", module_file, "exec"), {"__name__": stem}, "stand_in")
    try:
        folder = FunctionCache(stand_in).cache_path
    except RuntimeError:                # numba finds no folder it can write: it caches nothing
        return True
    return _trusted(folder, stem + ".")


def keep(kernel):
    """Keep ``kernel``'s compiled code on disk, guarded (what ``enable_caching()`` does, with
    ``GuardedCache`` for numba's ``CUDACache``). False for an object with no disk cache (the
    simulator's kernels)."""
    if getattr(kernel, "enable_caching", None) is None:
        return False
    kernel._cache = _guarded()(kernel.py_func)    # what enable_caching() sets, guarded
    return True


def kept(kernel):
    """True where ``keep`` put ``kernel``'s compiled code on disk (guarded)."""
    return bool(_guarded_class) and isinstance(getattr(kernel, "_cache", None), _guarded_class[0])


def trusted(kernel):
    """True where ``kept(kernel)`` and its folder and files may be read (``distrust``; an
    untrusted folder is warned about once)."""
    return kept(kernel) and kernel._cache.trusted()


def load(kernel, types):
    """Load ``kernel``'s compiled code for argument ``types`` from the disk if it is kept
    there, as its launch would first try (numba's ``compile``, without compiling on a miss);
    True if it is in memory now. For ``kernels/compile_ahead.py``: what is on disk needs no
    other process."""
    if types in kernel.overloads:
        return True
    if not kept(kernel):
        return False
    loaded = kernel._cache.load_overload(types, kernel.targetctx)
    if loaded is None:
        return False
    kernel._cache_hits[types] += 1                # numba's count, as its compile keeps it
    kernel.add_overload(loaded, types)
    return True


def file_prefix(kernel):
    """The start of the names of ``kernel``'s files in its cache folder: numba names them
    ``<module file stem>.<qualified name without '<' '>'>-<line>.``."""
    return _prefix(kernel.py_func)


def _prefix(func):
    stem = os.path.splitext(os.path.basename(func.__code__.co_filename))[0]
    qualname = func.__qualname__.replace("<", "").replace(">", "")
    return f"{stem}.{qualname}-{func.__code__.co_firstlineno}."


def contents(kernels):
    """What the cache holds for ``kernels`` (those kept on disk): {folder: (compiled kernels,
    bytes)}, a compiled kernel being one data file (one kernel, signature and closure)."""
    by_folder = {}
    for kernel in kernels:
        folder = getattr(getattr(kernel, "stats", None), "cache_path", None)
        if folder:
            by_folder.setdefault(folder, set()).add(file_prefix(kernel))
    held = {}
    for folder, prefixes in by_folder.items():
        try:
            names = os.listdir(folder)
        except OSError:
            names = []
        files = [n for n in names if n.endswith(".nbc") and n.startswith(tuple(prefixes))]
        held[folder] = (len(files), sum(_size(os.path.join(folder, n)) for n in files))
    return held


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def note(kernels, kept):
    """One line for ``python -m mirrored info``: whether compiled kernels are kept on disk,
    for how many of ``kernels`` (``kept`` of them), where, and how many compiled kernels the
    folder holds now; or that the folder is not trusted, why, and the fix (``distrust``)."""
    if not wanted():
        return f"off ({CACHE_VAR}=0): every process compiles the kernels it launches"
    if not kept:
        return "nothing to keep: the CUDA simulator compiles nothing"
    held = contents(kept)
    folders = sorted(held)
    where = folders[0] if len(folders) == 1 else f"{folders[0]} and {len(folders) - 1} more"
    refused = [(f, distrust(f)) for f in folders if distrust(f)]
    if refused:
        folder, why = refused[0]
        return (f"off, folder not trusted: {folder}: {why}; every process compiles the kernels "
                f"it launches (numba's files are pickles: run only if yours alone). Fix: chmod "
                f"go-w {folder} (and chown it to you), or set NUMBA_CACHE_DIR to a folder of "
                f"your own; {CACHE_VAR}=0 turns the cache off")
    count = sum(n for n, _ in held.values())
    size = sum(b for _, b in held.values())
    return (f"on for {len(kept)} of {len(kernels)} kernels (the rest call device functions of "
            f"another file), in {where}; it holds {count} compiled kernel(s), "
            f"{size / 2**20:.1f} MiB (the first process compiles, later ones load); "
            f"{CACHE_VAR}=0 turns it off")
