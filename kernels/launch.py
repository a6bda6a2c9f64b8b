"""Launch helpers shared by every kernel launcher in ``kernels/``.

One place decides three things for all kernels:

* ``ceil_div`` and the grid/block choice (``grid_1d``, ``grid_rows``),
  so every launcher sizes its grid the same way, within the GPU's limits
  (``check_launch``, which ``launch`` applies to every launch);
* whether we run on real CUDA or in Numba's CUDA simulator (``SIMULATOR``);
* how a configured kernel is launched (``launch``): numba's path,
  ``kernel[grid, block, stream](*args)``, until ``launch_cache.py`` holds a record
  of the launch, then one driver call;
* which argument checks need not run again (``check_array``, ``check_no_alias``
  remember what a device array passed: ``_facts``);
* a plan run (``planned``): the launches written down, not made: the part below the
  device boundary of a dry recording (``mirrored/program/recording.py``), from which
  ``compile_ahead.py`` compiles a step's kernels before their first launch.

Why ``launch`` exists: on a real GPU ``kernel[grid, block, stream]`` returns a
new *configured* kernel object, which is cheap to keep and call again. In the
simulator it returns the kernel itself, re-configured in place, so two replica
threads launching the same kernel at once would overwrite each other's grid.
Under the simulator we therefore serialise launches with one lock (the
simulator is single-device and synchronous anyway); on real CUDA there is no
lock and configured kernels are cached per (kernel, grid, block, stream).

Neighbours: ``elementwise.py``, ``reduction.py``, ``gemm.py`` ... all import
from here; ``launch_cache.py`` keeps the records ``launch`` replays;
``mirrored/backends.py`` calls the launchers; ``registry.py`` records, for the real
compiler's checks (``python -m kernels.report``), the block each launcher takes from here.
"""
import threading
import weakref
import warnings

from numba import config as _numba_config
from numba import cuda

from kernels import launch_cache

#: True when ``NUMBA_ENABLE_CUDASIM=1`` was set before numba.cuda was imported.
SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)

#: Threads per block for 1-D kernels: a multiple of the 32-thread warp, large
#: enough to hide memory latency, small enough for many blocks per SM.
#: (The simulator runs each CUDA thread as a Python thread: it gets fewer.)
THREADS_1D = 32 if SIMULATOR else 256

#: Upper bound on blocks for grid-stride 1-D kernels: about 31 blocks of 256 threads
#: per SM of an H100 (132 SMs), several full waves; larger arrays loop inside the
#: kernel. Measured on an H100, an add over 64 MB reached 0.65-0.69 of cudaMemcpy's
#: bandwidth with 65,535 blocks (one element per thread) and 0.81-0.90 with 1,056 to
#: 4,224 (a few elements per thread: the index arithmetic and the block start-up are
#: paid once for several loads).
MAX_BLOCKS_1D = 4096

#: In the simulator every CUDA thread is a Python thread: cap the block count so
#: a tiny test never spawns thousands of them (grid-stride loops cover the rest).
SIM_MAX_BLOCKS_1D = 4

#: Hardware limits on one launch (CUDA C Programming Guide, "Technical Specifications
#: per Compute Capability", the same on every GPU since compute capability 3.0): blocks
#: along x, along y and z; threads per block; threads along z of a block. Numba checks
#: none of them, the simulator ignores them, and a launch past one fails on a GPU with
#: CUDA_ERROR_INVALID_VALUE. Kernels with more rows than MAX_GRID_YZ blocks cover
#: loop over them in y (a grid-stride loop), as 1-D kernels loop in x.
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_Z = 64

_sim_lock = threading.Lock()
_plans = threading.local()       # .launches: a list while this thread runs a plan (``planned``)
#: [on?]: whether the simulator checks every launch's argument types against the kernel's
#: registered signatures (``check_signatures``; off by default, as it costs a look-up per
#: launch).
_check_types = [False]
_configure_lock = threading.Lock()
_configured = {}

#: The warning numba-cuda gives when a launch is configured with fewer than 128 blocks
#: ("Grid size N will likely result in GPU under-utilization due to low occupancy").
#: Our small grids are by design (MNIST-sized batches, one block per chunk of a ring
#: step, pass 2 of a reduction), and a notebook would print it at every first launch,
#: so ``launch`` silences exactly this message, for our kernels only. (Matched by its
#: text: numba-cuda raises its own ``numba.cuda.core.errors.NumbaPerformanceWarning``,
#: not a subclass of ``numba.core.errors.NumbaPerformanceWarning``. Where numba can
#: colour its messages, as on the H100 machine, the text starts with terminal escape
#: codes such as "\x1b[1m": the pattern allows them, since a filter matches from the start.)
LOW_OCCUPANCY_MESSAGE = r"(\x1b\[[0-9;]*m)*Grid size \d+ will likely result in GPU under-utilization"


def ceil_div(a, b):
    """Smallest integer >= a / b, for positive b: how many blocks cover a items."""
    return -(-a // b)


#: ``ceil_div`` compiled for kernels (an inline device function: see kernels/registry.py),
#: e.g. the first output window that covers an input row (kernels/conv2d.py, pooling.py).
#: Python's floor division, which Numba keeps, makes it right for negative ``a`` too.
ceil_div_device = cuda.jit(device=True, inline="always")(ceil_div)


@cuda.jit(device=True, inline="always")
def nhwc_index(i, h, w, c):
    """(n, y, x, ch) of element ``i`` of a C-contiguous NHWC array with H, W, C = h, w, c:
    the inverse of ``i = ((n * h + y) * w + x) * c + ch``. Channels vary fastest, so
    consecutive threads get consecutive channels (coalesced loads and stores)."""
    ch = i % c
    p = i // c
    x = p % w
    p //= w
    return p // h, p % h, x, ch


@cuda.jit(device=True, inline="always")
def windows_over(iy, ix, pad_top, pad_left, win_h, win_w, sh, sw, out_h, out_w):
    """The output windows that cover input pixel (iy, ix): rows [oy_lo, oy_hi] and
    columns [ox_lo, ox_hi] (empty where lo > hi). Window (oy, ox) starts at input
    (oy * sh - pad_top, ox * sw - pad_left) and is win_h x win_w. For the backward
    passes of conv2d (dx) and pooling, which gather instead of scattering."""
    oy_lo = max(ceil_div_device(iy + pad_top - win_h + 1, sh), 0)
    oy_hi = min((iy + pad_top) // sh, out_h - 1)
    ox_lo = max(ceil_div_device(ix + pad_left - win_w + 1, sw), 0)
    ox_hi = min((ix + pad_left) // sw, out_w - 1)
    return oy_lo, oy_hi, ox_lo, ox_hi


def grid_1d(n, threads=None):
    """(blocks, threads) covering ``n`` items with a grid-stride loop.

    The kernel must loop ``for i in range(cuda.grid(1), n, cuda.gridsize(1))``
    so that any block count is correct; we pick enough blocks to give every
    item its own thread up to ``MAX_BLOCKS_1D``. ``threads``: THREADS_1D unless
    given (read at each call, so a test can run the simulator with the GPU's).
    """
    threads = THREADS_1D if threads is None else threads
    cap = SIM_MAX_BLOCKS_1D if SIMULATOR else MAX_BLOCKS_1D
    return max(1, min(ceil_div(max(n, 1), threads), cap)), threads


#: array -> {shape: a view of it}, made once per array and shape (``view``, ``flat``);
#: an entry goes when its array does.
_views = weakref.WeakKeyDictionary()


def view(a, shape):
    """``a.reshape(shape)``, made once per array and shape and kept beside the array.

    Why not ``a.reshape(shape)`` at every launch: each call makes a new device-array
    object, and numba-cuda works out the type of every new object when it is launched
    with. Measured on an H100, a three-array ``binary`` cost 101 µs of host time per
    call with three fresh views, against 31 µs for the launch itself: more than the GPU
    needs to add two 64 MB arrays. A training step reuses its buffers, so its views are
    made once. (NumPy arrays cannot be weakly referenced by identity here: they get a
    plain reshape, which costs them nothing.)
    """
    shape = tuple(shape)
    if tuple(a.shape) == shape:
        return a
    try:
        views = _views.get(a)
        if views is None:
            views = _views[a] = {}
    except TypeError:            # an array type that cannot be a weak dictionary key
        return a.reshape(shape)
    v = views.get(shape)
    if v is None:
        v = views[shape] = a.reshape(shape)
    return v


def flat(a):
    """``a`` as a 1-D array, for a kernel that walks every element (see ``view``)."""
    return view(a, (a.size,))


def head(a, n):
    """``a[:n]`` of a 1-D array, made once per array and ``n`` (see ``view``): a launch with
    the same view is a launch with the same buffers, which ``launch_cache`` replays."""
    if n == a.shape[0]:
        return a
    try:
        views = _views.get(a)
        if views is None:
            views = _views[a] = {}
    except TypeError:
        return a[:n]
    v = views.get(("head", n))
    if v is None:
        v = views[("head", n)] = a[:n]
    return v


def grid_rows(rows):
    """Blocks along y for ``rows`` block-rows: all of them up to the hardware's
    ``MAX_GRID_YZ``; a kernel launched with it loops ``for r in range(blockIdx.y,
    rows, gridDim.y)`` so that any count is covered."""
    return max(1, min(rows, MAX_GRID_YZ))


def _dims(what, dims):
    """A grid or block as a 3-tuple (x, y, z) of ints (Numba accepts an int or 1-3 ints)."""
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)   # an int, NumPy's too
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"a launch {what} has 1 to 3 dimensions, got {dims}.")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def check_launch(kernel, grid, block):
    """Raise a clear error unless ``grid`` and ``block`` are within the GPU's limits
    (the constants above): a real GPU refuses such a launch with an opaque
    CUDA_ERROR_INVALID_VALUE, and the simulator would run it anyway."""
    gx, gy, gz = _dims("grid", grid)
    bx, by, bz = _dims("block", block)
    name = getattr(getattr(kernel, "py_func", kernel), "__name__", repr(kernel))
    problems = []
    if min(gx, gy, gz, bx, by, bz) < 1:
        problems.append("every grid and block dimension must be at least 1")
    if gx > MAX_GRID_X:
        problems.append(f"grid x = {gx:,} > {MAX_GRID_X:,}")
    if gy > MAX_GRID_YZ or gz > MAX_GRID_YZ:
        problems.append(f"grid y, z = {gy:,}, {gz:,}: each must be <= {MAX_GRID_YZ:,}")
    if bx * by * bz > MAX_THREADS_PER_BLOCK:
        problems.append(f"{bx * by * bz:,} threads per block > {MAX_THREADS_PER_BLOCK:,}")
    if bz > MAX_BLOCK_Z:
        problems.append(f"block z = {bz} > {MAX_BLOCK_Z}")
    if problems:
        raise ValueError(f"launch of {name} with grid {grid} and block {block} is past the "
                         f"GPU's limits: {'; '.join(problems)}. The launcher must cap the grid "
                         f"(grid_1d, grid_rows) and let the kernel loop over the rest.")


def launch(kernel, grid, block, stream, *args):
    """Run ``kernel[grid, block, stream](*args)``, after ``check_launch``.

    Real CUDA: the configured kernel is cached, so repeated launches skip
    Numba's configuration step (and the limits check, done when it is cached);
    and from the third launch with the same buffers on the same stream, the launch
    is one driver call from ``kernels/launch_cache.py``'s record (numba's path,
    ``configured(*args)``, is what runs until then, and what the record equals).
    Simulator: launches are serialised (see the module docstring), checked every
    time, and ``stream`` may be ``None`` or a simulated stream.
    """
    plan = getattr(_plans, "launches", None)
    if plan is not None:                  # a plan run (``planned``): written down, not made
        plan.append((kernel, args))
        return
    if SIMULATOR:
        check_launch(kernel, grid, block)
        if _check_types[0]:
            from kernels.registry import check_launch_types
            check_launch_types(kernel, args)
        with _sim_lock:
            _configure(kernel, grid, block, stream)(*args)
        return
    cache_key = launch_cache.key(kernel, grid, block, stream, args)
    if launch_cache.replay(cache_key, args):      # the fast path: one driver call
        return
    key = (kernel, grid, block, stream)
    configured = _configured.get(key)
    if configured is None:
        check_launch(kernel, grid, block)
        with _configure_lock:             # warnings.catch_warnings is process-wide state
            configured = _configured[key] = _configure(kernel, grid, block, stream)
    launch_cache.launch_and_record(cache_key, configured, stream, args)   # configured(*args)


class planned:
    """Context manager: inside it, this thread's launches are written down, not made:
    ``with planned() as launches: device_part()`` leaves ``launches`` a list of
    (kernel, args), in launch order, with nothing run and nothing compiled.

    Why: a step's kernels compile at their first launch, one after the other (numba-cuda's
    compiler lock). A dry recording (``mirrored/program/recording.py``, ``dry_run``) runs the
    step's device part once inside this to learn which kernels, for which argument types, its
    first real run will launch; ``kernels/compile_ahead.py`` compiles them ahead, in several
    processes at once. Other threads launch as usual."""

    def __enter__(self):
        self.before = getattr(_plans, "launches", None)
        _plans.launches = launches = []
        return launches

    def __exit__(self, *exc):
        _plans.launches = self.before
        return False


class check_signatures:
    """Context manager: inside it, every simulated launch must match one of its kernel's
    registered signatures (``kernels.registry.check_launch_types``), else TypeError.

    Why: a real GPU compiles a kernel for any argument types, and a launcher may refuse a
    type only there; the simulator runs whatever it is given. With this on, a simulator
    test sees exactly the types the real compiler was asked to check. No effect on real CUDA."""

    def __enter__(self):
        self.before = _check_types[0]
        _check_types[0] = True
        return self

    def __exit__(self, *exc):
        _check_types[0] = self.before
        return False


def _configure(kernel, grid, block, stream):
    """``kernel[grid, block, stream]`` without numba's low-occupancy warning (see
    ``LOW_OCCUPANCY_MESSAGE``); every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LOW_OCCUPANCY_MESSAGE)
        return kernel[grid, block, stream]


# --- argument checks shared by every launcher ------------------------------
# A launcher validates its arguments *before* launching, so bad input gets a
# clear Python error instead of silent garbage or a crashed context.

def _is_c_contiguous(arr):
    flags = getattr(arr, "flags", None)
    if flags is not None:  # NumPy
        return bool(flags["C_CONTIGUOUS"])
    return bool(arr.is_c_contiguous())


def _data_range(arr):
    """(first byte address, one past the last) of an array's memory (kept in ``_facts``
    for a device array)."""
    facts = _facts.get(id(arr))          # an entry is there only while its array lives
    if facts is not None and facts.range is not None:
        return facts.range
    facts = _facts_of(arr)
    if facts is None:
        return _read_range(arr)
    facts.range = _read_range(arr)
    return facts.range


def _read_range(arr):
    if hasattr(arr, "_ary"):  # simulator's FakeCUDAArray wraps a NumPy array
        arr = arr._ary
    iface = getattr(arr, "__cuda_array_interface__", None) or arr.__array_interface__
    start = iface["data"][0]
    return start, start + arr.nbytes


#: The class of numba's device arrays on real CUDA (None in the simulator). Their shape, dtype,
#: strides and memory never change, so a check they passed need not run again: see ``_facts``.
_DEVICE_ARRAY = None
if not SIMULATOR:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _DEVICE_ARRAY


class _Facts:
    """What the checks learnt about one device array: the checks it passed, its memory range."""
    __slots__ = ("passed", "range", "ref")


#: id(device array) -> _Facts, dropped by a weak reference's callback when the array goes
#: (before its id can be reused). Why: a launcher's checks ran on every call, and
#: ``__cuda_array_interface__`` builds a dictionary each time it is read (``check_no_alias``
#: read it about 22 times per conv2d_backward call). A training step checks the same buffers
#: every step, so each check now runs once per array and shape.
_facts = {}


def _facts_of(arr):
    """The ``_Facts`` of a device array (made on first sight), or None for any other array."""
    if _DEVICE_ARRAY is None or arr.__class__ is not _DEVICE_ARRAY:
        return None
    facts = _facts.get(id(arr))
    if facts is None:
        facts = _Facts()
        facts.passed, facts.range = set(), None
        facts.ref = weakref.ref(arr, lambda _ref, i=id(arr): _facts.pop(i, None))
        _facts[id(arr)] = facts
    return facts


def check_array(what, arr, dtype, ndim=None, shape=None, contiguous=True):
    """Raise a clear error unless ``arr`` has ``dtype`` (and ndim/shape), C order.

    ``what`` names the argument in the message, e.g. ``"gemm: A"``. A device array that
    passed the same check before is not checked again (``_facts``).
    """
    facts = _facts.get(id(arr))          # an entry is there only while its array lives
    spec = (dtype, ndim, shape if shape is None or shape.__class__ is tuple else tuple(shape),
            contiguous)
    if facts is not None and spec in facts.passed:
        return
    _check_array(what, arr, dtype, ndim, shape, contiguous)
    facts = _facts_of(arr)
    if facts is not None:
        facts.passed.add(spec)


def _check_array(what, arr, dtype, ndim, shape, contiguous):
    import numpy as np

    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"{what} must be {np.dtype(dtype)}, got {arr.dtype}; "
                        f"convert it first (e.g. mirrored.cast or .astype).")
    if ndim is not None and len(arr.shape) != ndim:
        raise ValueError(f"{what} must be {ndim}-D, got shape {tuple(arr.shape)}.")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(arr.shape)}, expected {tuple(shape)}.")
    if contiguous and not _is_c_contiguous(arr):
        raise ValueError(f"{what} must be C-contiguous (row-major, no gaps); "
                         f"pass a contiguous copy.")


def check_no_alias(what, out, *inputs):
    """Raise if ``out`` shares memory with any of ``inputs`` (unsafe in-place)."""
    o0, o1 = _data_range(out)
    for x in inputs:
        if x is None:
            continue
        x0, x1 = _data_range(x)
        if o0 < x1 and x0 < o1:
            raise ValueError(f"{what}: the output shares memory with an input; "
                             f"this kernel reads inputs after writing outputs, so "
                             f"pass a separate output array.")


def check_out(what, out, same_ok, others):
    """``out`` may be exactly one of ``same_ok`` (in place, safe for elementwise
    work) but must not partly overlap it, nor overlap any of ``others``."""
    for x in same_ok:
        if _data_range(out) != _data_range(x):
            check_no_alias(what, out, x)
    check_no_alias(what, out, *others)
