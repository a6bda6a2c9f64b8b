"""The registry of every kernel the library launches, with the signatures it is launched with.

Why. Numba compiles a kernel the first time it is launched, for the argument types of
that launch. A kernel that is never launched in a test is never compiled, and the CUDA
simulator (which runs kernels as Python) compiles nothing at all. So that the real CUDA
compiler sees every kernel on every machine, even one with no GPU, each kernel file
declares, right below its kernels, what its launcher passes them::

    register(gemm_v3, "gemm_v3", [SIGNATURE], block=(16, 16), variant="trans_a=False, trans_b=True")

``python -m kernels.report`` (``kernels/report.py``) compiles every registered
(kernel, signature) with ``cuda.compile_ptx`` and ``ptxas -v`` and prints registers,
shared memory, spills and stack; ``tests/test_kernels_compile.py`` runs it in CI and
fails on a compile error, a spill, a float64 instruction in a float32 kernel, or a
kernel that is defined in ``kernels/`` but not registered (``unregistered``): the
registry cannot fall behind the code.

What a signature is. Numba's type string for one launch, e.g.
``"void(float32[:, ::1], int64[::1], float32)"``: ``[::1]`` is a C-contiguous 1-D
array, ``[:, ::1]`` a C-contiguous 2-D one (every launcher checks contiguity and passes
flattened or 2-D C-order arrays), a bare dtype a scalar. ``vec``, ``mat``, ``arr3`` and
``arr4`` (NHWC images and HWIO conv kernels) below spell them. Compile-time variants (gemm's transposes and versions, softmax_xent's
``with_grad``, elementwise's operator) are separate kernel objects, each registered
with its ``variant`` written out.

``block``: the threads per block the launcher uses on a real GPU, taken from the
launcher's own grid function (never a second copy of the number), so the report can
compute the occupancy that launch gets.

Kept on disk. ``register`` also turns on numba-cuda's disk cache for the kernel (what
``@cuda.jit(cache=True)`` does, guarded, set up at first use: ``disk_cache.keep``): the
first process that launches it compiles it (0.3-0.5 s a kernel on the H100 machine: the course lab's 15
kernels took 3.5-7.4 s of its first epoch, ``benchmarks/RESULTS.md``) and writes the
machine code beside the source (``__pycache__``, or ``NUMBA_CACHE_DIR``); later processes
load it in milliseconds. Numba recompiles when the kernel's own file changes (its size
and time stamp), when the closure values a factory baked in differ, and when numba-cuda's
version does; it does not look at other files, so a kernel that calls a device function
of another file (``device_functions_from_other_files``: today the v1/v2 convs and pools,
through ``kernels/launch.py``'s index helpers) is not cached but compiled in each process
(``tests/test_kernel_cache.py``). ``MIRRORED_KERNEL_CACHE=0`` in the environment keeps
nothing on disk. The simulator compiles nothing, so caches nothing. Where the files go, what a
damaged one does (compiled again, with a warning) and what ``python -m mirrored info`` counts:
``kernels/disk_cache.py``; that a second process compiles none of the lab step's kernels:
``tests/test_kernel_disk_cache.py``.

Neighbours: every ``kernels/*.py`` calls ``register``; ``kernels/report.py`` compiles
what is here; ``kernels/launch.py`` holds the launch helpers the blocks come from.
"""
import gc
import importlib
import math
import os
import pkgutil
import re
from dataclasses import dataclass

import numpy as np

from kernels import disk_cache

#: The dtypes that Tensor arithmetic, fills, reductions and the ring all-reduce are
#: compiled for: the numeric dtypes ``mirrored`` creates (float32 by default, float64 and
#: the integer label and counter dtypes). A launch with another dtype compiles on the
#: fly, unchecked here: add the dtype to this tuple when the library starts using it.
TENSOR_DTYPES = ("float32", "float64", "int32", "int64")

#: Modules of this package that hold no kernels (skipped when importing them all).
_NOT_KERNEL_MODULES = ("registry", "report", "launch", "launch_cache", "disk_cache",
                       "compile_ahead")


def vec(dtype):
    """A C-contiguous 1-D array of ``dtype`` in Numba's signature syntax: ``float32[::1]``."""
    return f"{dtype}[::1]"


def mat(dtype):
    """A C-contiguous 2-D array: ``float32[:, ::1]``."""
    return f"{dtype}[:, ::1]"


def arr3(dtype):
    """A C-contiguous 3-D array: ``float32[:, :, ::1]``."""
    return f"{dtype}[:, :, ::1]"


def arr4(dtype):
    """A C-contiguous 4-D array: ``float32[:, :, :, ::1]`` (an NHWC batch, an HWIO kernel)."""
    return f"{dtype}[:, :, :, ::1]"


def sig(*args):
    """``void(<args>)``: kernels return nothing."""
    return f"void({', '.join(args)})"


@dataclass(frozen=True)
class KernelSpec:
    """One registered kernel: the Numba kernel object and how the library launches it.

    name       the kernel's name (``gemm_v3``, ``softmax_xent_kernel``)
    variant    its compile-time variant in words (``"trans_a=True, trans_b=False"``) or ""
    kernel     the ``@cuda.jit`` kernel object (``kernel.py_func`` is the Python source)
    signatures the Numba signature strings it is launched with
    block      threads per block its launcher uses on a GPU, as (x, y, z)
    module     the kernels/ module that defines it
    outputs_per_pass  outputs one pass through the kernel's code computes (a kernel that
               unrolls 4 outputs per loop trip has 4): the report divides the kernel's
               static SASS instructions by it (``sass_per_output``)
    made_by    for a kernel a factory made on first use (one per layer shape): (module,
               factory function, its arguments), so another process can make the same
               kernel again (``kernels/compile_ahead.py``); None for a kernel made at import
    """
    name: str
    variant: str
    kernel: object
    signatures: tuple
    block: tuple
    module: str
    outputs_per_pass: int = 1
    made_by: tuple = None

    @property
    def label(self):
        """``name[variant]``: unique across the registry, used in reports and errors."""
        return f"{self.name}[{self.variant}]" if self.variant else self.name

    @property
    def block_threads(self):
        return math.prod(self.block)


_REGISTRY = []
_LABELS = set()          # the labels in _REGISTRY (a look-up per register, not a scan)
_BY_KERNEL = {}          # id(kernel) -> its KernelSpec (registered kernels live for good)


def register(kernel, name, signatures, block, variant="", outputs_per_pass=1, made_by=None):
    """Declare that the library launches ``kernel`` with each of ``signatures`` and
    ``block`` threads per block (an int or a tuple). Returns ``kernel``.
    ``outputs_per_pass``: see ``KernelSpec``. A kernel factory that compiles per layer
    shape (kernels/conv2d_v3.py) registers each kernel it makes, with the shape as its
    variant and ``made_by=(factory, arguments)``: calling ``factory(*arguments)`` (plain
    numbers, strings and tuples of them) makes it again.

    Called at import time, right below the kernels, by every file in ``kernels/``.
    """
    if isinstance(signatures, str):
        signatures = (signatures,)
    if not signatures:
        raise ValueError(f"register({name!r}): give at least one signature the kernel is "
                         f"launched with, e.g. sig(vec('float32'), vec('float32')).")
    block = tuple(block) if isinstance(block, (tuple, list)) else (int(block),)
    if made_by is not None:
        factory, arguments = made_by
        made_by = (factory.__module__, factory.__qualname__, tuple(arguments))
    spec = KernelSpec(name, variant, kernel, tuple(signatures), block,
                      getattr(getattr(kernel, "py_func", None), "__module__", "?"),
                      int(outputs_per_pass), made_by)
    if spec.label in _LABELS:
        raise ValueError(f"register: {spec.label} is registered twice; give each compile-time "
                         f"variant its own variant string.")
    _REGISTRY.append(spec)
    _LABELS.add(spec.label)
    _BY_KERNEL[id(kernel)] = spec
    keep_on_disk(kernel)
    return kernel


def spec_of(kernel):
    """The ``KernelSpec`` ``kernel`` was registered with, or None (imports nothing)."""
    spec = _BY_KERNEL.get(id(kernel))
    return spec if spec is not None and spec.kernel is kernel else None


def by_label(label):
    """The registered ``KernelSpec`` labelled ``label`` (``KernelSpec.label``), or None
    (looks among the kernels registered so far: import their module first)."""
    return next((s for s in _REGISTRY if s.label == label), None)


#: ``MIRRORED_KERNEL_CACHE=0``: compile every kernel afresh in each process (read at each
#: ``register``, so at import). The disk cache itself: ``kernels/disk_cache.py``.
CACHE_VAR = disk_cache.CACHE_VAR


def keep_on_disk(kernel):
    """Turn on numba-cuda's disk cache for ``kernel`` where that is safe (guarded against
    damaged files: ``kernels/disk_cache.py``); returns True where it is on. Off:
    ``MIRRORED_KERNEL_CACHE=0``; the simulator's kernels (no compiled code to keep); a kernel
    that calls device functions of another file (numba would not notice an edit there,
    ``device_functions_from_other_files``): compiled afresh in each process instead."""
    if not disk_cache.wanted() or getattr(kernel, "enable_caching", None) is None:
        return False
    if device_functions_from_other_files(kernel):
        return False
    return disk_cache.keep(kernel)


def disk_cache_note():
    """One line for ``python -m mirrored info``: whether compiled kernels are kept on disk,
    where, for how many of the registered kernels, and how many compiled ones it holds."""
    specs = registered()
    kept = [s.kernel for s in specs if disk_cache.kept(s.kernel)]
    return disk_cache.note(specs, kept)


def device_functions_from_other_files(kernel):
    """The CUDA device functions ``kernel`` calls, directly or through device functions of
    its own file, that are defined in another file, as "name (file)". A disk-cached kernel
    is recompiled when its own file changes, not theirs (see the module docstring), so
    ``keep_on_disk`` caches only kernels for which this is empty. Reads the names each
    function's code uses, in its module's globals and its closure."""
    func = getattr(kernel, "py_func", None)
    if func is None:
        return []
    here, found, seen, todo = func.__code__.co_filename, set(), set(), [func]
    while todo:
        func = todo.pop()
        code = func.__code__
        names = dict(zip(code.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
        names.update((n, func.__globals__[n]) for n in code.co_names if n in func.__globals__)
        for name, value in names.items():
            inner = getattr(value, "py_func", None)
            if inner is None or inner in seen:
                continue
            seen.add(inner)
            if inner.__code__.co_filename != here:
                found.add(f"{name} ({os.path.basename(inner.__code__.co_filename)})")
            else:
                todo.append(inner)
    return sorted(found)


# --- does a launch match what the compiler checked? ----------------------------------------
# On a real GPU numba compiles a kernel for whatever argument types it is launched with, so
# a launch with an unregistered type (uint8 labels where int64 was registered) compiles a
# kernel the compile test never saw, or meets a launcher's own refusal only on the GPU. The
# simulator compiles nothing and would run it. ``check_launch_types`` makes the simulator
# say so: ``kernels.launch.check_signatures()`` turns it on (tests/test_label_dtypes.py).

_SIG_ARG = re.compile(r"(\w+)(\[[^\]]*\])?")


def _signature_types(signature):
    """``"void(float32[:, ::1], int64[::1], float32)"`` -> (("float32", 2), ("int64", 1),
    ("float32", None)): each argument's dtype and number of dimensions (None: a scalar)."""
    inside = signature[signature.index("(") + 1:signature.rindex(")")]
    return tuple((m.group(1), m.group(2).count(",") + 1 if m.group(2) else None)
                 for m in _SIG_ARG.finditer(inside))


def _argument_type(arg):
    """The (dtype, ndim) numba types a launch argument as (ndim None: a scalar)."""
    if isinstance(arg, bool):
        return "bool", None
    if isinstance(arg, int):
        return "int64", None
    if isinstance(arg, float):
        return "float64", None
    if isinstance(arg, np.generic):           # a NumPy scalar: np.float32(0.5)
        return arg.dtype.name, None
    return str(arg.dtype), len(arg.shape)     # a device (or host) array


def check_launch_types(kernel, args):
    """Raise TypeError unless ``args`` match one of the signatures ``kernel`` is registered
    with (dtype and number of dimensions of each argument). A kernel registered nowhere is
    not checked here (``unregistered`` finds those)."""
    spec = next((s for s in _REGISTRY if s.kernel is kernel), None)
    if spec is None:
        return
    got = tuple(_argument_type(a) for a in args)
    wanted = [_signature_types(s) for s in spec.signatures]
    normal = lambda types: tuple(("bool" if t == "boolean" else t, n) for t, n in types)  # noqa: E731
    if any(normal(w) == got for w in wanted):
        return
    show = lambda types: ", ".join(t if n is None else f"{t}[{n}d]" for t, n in types)  # noqa: E731
    raise TypeError(f"{spec.label} ({spec.module}) launched with ({show(got)}), a type it is not "
                    f"registered (compile-checked) for; registered: "
                    f"{'; '.join('(' + show(w) + ')' for w in wanted)}. Convert the data where the "
                    f"batch is staged (one type per kernel), or register the new signature.")


def import_all():
    """Import every kernel module of this package (registration happens at import)."""
    import kernels
    for info in pkgutil.iter_modules(kernels.__path__):
        if info.name not in _NOT_KERNEL_MODULES and not info.name.startswith("_"):
            importlib.import_module(f"kernels.{info.name}")


def registered():
    """Every registered ``KernelSpec``, in module order (imports the kernel modules first)."""
    import_all()
    return list(_REGISTRY)


def _kernel_class():
    """(the class of a ``@cuda.jit`` object, a test "is a kernel, not a device function"),
    for real numba-cuda or the CUDA simulator, whichever this process uses."""
    from numba import config
    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.kernel import FakeCUDAKernel
        return FakeCUDAKernel, lambda k: not k._device
    from numba.cuda.dispatcher import CUDADispatcher
    return CUDADispatcher, lambda k: not k.targetoptions.get("device", False)


def unregistered(module_prefix="kernels."):
    """Kernel objects defined in modules named ``module_prefix*`` that are not registered.

    Walks every live object (``gc.get_objects``), so a kernel made by a factory and kept
    only in a dict or a closure is found too. Returns a sorted list of
    ``"module.function"`` names (a factory's kernels share one name: fix them all).
    """
    import_all()
    known = {id(s.kernel) for s in _REGISTRY}
    cls, is_kernel = _kernel_class()
    found = []
    for obj in gc.get_objects():
        if not isinstance(obj, cls) or not is_kernel(obj):
            continue
        module = getattr(obj.py_func, "__module__", "") or ""
        if module.startswith(module_prefix) and id(obj) not in known:
            found.append(f"{module}.{obj.py_func.__qualname__}")
    return sorted(found)
