"""Helpers shared by every benchmark program in ``benchmarks/``.

The method: count the floor first, warm up, time
with CUDA events, repeat, quote the *median* and a ratio to a measured ceiling or a
peer, never a single time. This module holds the parts every program needs:

    choose_cuda(smoke)     decide real CUDA vs the simulator *before* numba is imported
    gpu_status()           (True, name) or (False, why not)
    no_gpu(program, instead)   say so and return True where there is no GPU to time on
    device_info()          device name, compute capability, driver and library versions
    time_gpu(fn)           CUDA events around a captured graph of ``number`` calls of fn(stream)
    time_launches(fn)      the old way: events around fn() called back to back (host-bound
                           once fn's kernels are shorter than its host call)
    time_host(fn)          the same with time.perf_counter (simulator smoke runs, CPU)
    copy_bandwidth(nbytes) measured device-to-device copy GB/s: the memory ceiling
    print_table(rows, columns), write_json(name, payload, info, out)

A benchmark never writes a number it did not measure: a peer that is missing, a check
that failed, a size that did not fit is listed under "skipped" with its reason, with
no number attached.

Typical program::

    from benchmarks import common
    common.choose_cuda(smoke=args.smoke)      # first, before anything imports numba
    ok, why = common.gpu_status()
    ...
    t = common.time_gpu(lambda s: kernel(..., stream=s))  # {"median_s": ..., ...}
    common.write_json("kernels", {"results": rows}, common.device_info())
"""
import datetime as _dt
import inspect
import json
import os
import platform
import re
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

#: Where recorded runs live: benchmarks/results/<name>-<device>-<date>.json in a checkout.
#: An installed copy (``pip install .``: site-packages has no results/) writes them into
#: benchmark-results/ under the folder it runs from, where the student will look.
RESULTS_DIR = Path(__file__).resolve().parent / "results"
if not RESULTS_DIR.is_dir():
    RESULTS_DIR = Path("benchmark-results")

#: Untimed calls before timing: the first call compiles the kernel and warms caches.
WARMUP = 3
#: Timed samples; the median of 20 shrugs off a few outliers (clock ramps, other jobs).
REPEAT = 20
#: Auto-calibrated samples last at least this long, so µs kernels are not dominated by
#: the event-recording overhead (~µs) and the timer's resolution.
MIN_SAMPLE_S = 1e-3
#: Cap on calls per sample when auto-calibrating.
MAX_NUMBER = 1000


# --- choosing real CUDA or the simulator -------------------------------------------------

def choose_cuda(smoke=False):
    """Set ``NUMBA_ENABLE_CUDASIM`` before numba is imported (numba reads it once).

    ``smoke=True``: the simulator, for checking that a benchmark program runs at all.
    Otherwise real CUDA, unless the caller's environment already forces the simulator
    (``gpu_status`` then reports that timings would be meaningless).
    """
    if "numba" in sys.modules and "numba.cuda" in sys.modules:
        from numba import config
        if bool(config.ENABLE_CUDASIM) != bool(smoke):
            raise RuntimeError("numba.cuda was imported before choose_cuda(); call it first.")
        return
    if smoke:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")


def simulator():
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def no_gpu(program, instead):
    """True, after saying so, where there is no real GPU to time on: the benchmark then
    returns 0 having measured and written nothing. ``program``: its name as run
    (``benchmarks.kernels``); ``instead``: what to run here instead, or where."""
    ok, why = gpu_status()
    if not ok:
        print(f"{program}: no real GPU to time on ({why}).\n"
              f"Nothing was timed and nothing was written. {instead}")
    return not ok


def gpu_status():
    """(True, device name) when a real CUDA GPU is usable, else (False, reason)."""
    if simulator():
        return False, ("NUMBA_ENABLE_CUDASIM=1 is set: kernels would run in the CUDA "
                       "simulator, whose timings mean nothing")
    from numba import cuda
    try:
        if not cuda.is_available():
            return False, "no CUDA GPU or driver found (numba.cuda.is_available() is False)"
        return True, _name(cuda.get_current_device())
    except Exception as exc:  # a broken driver install: report it, don't crash
        return False, f"CUDA initialisation failed: {exc}"


def _name(dev):
    name = dev.name
    return name.decode() if isinstance(name, bytes) else str(name)


def _version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_info():
    """What ran the benchmark: device, versions, date. Goes into every JSON file."""
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"),
        "cupy": _version("cupy-cuda12x") or _version("cupy-cuda13x") or _version("cupy"),
        "torch": _version("torch"),
        "simulator": simulator(),
    }
    if info["simulator"]:
        info["device"] = "Numba CUDA simulator"
        return info
    ok, why = gpu_status()
    if not ok:
        info["device"] = "none"
        info["device_note"] = why
        return info
    from numba import cuda
    dev = cuda.get_current_device()
    info["device"] = _name(dev)
    fields = {
        "compute_capability": lambda: ".".join(map(str, dev.compute_capability)),
        "multiprocessors": lambda: int(dev.MULTIPROCESSOR_COUNT),
        "memory_bytes": lambda: int(cuda.current_context().get_memory_info()[1]),
        "driver_version": lambda: ".".join(map(str, cuda.cudadrv.driver.driver.get_version())),
        "runtime_version": lambda: ".".join(map(str, cuda.runtime.get_version())),
        "numba_cuda_implementation": lambda: getattr(cuda, "implementation", None),
    }
    for key, read in fields.items():  # one unreadable field must not lose the run
        try:
            info[key] = read()
        except Exception as exc:
            info[key] = None
            info.setdefault("unreadable", {})[key] = str(exc)[:200]
    return info


def device_slug(info):
    """File-name-safe device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", str(info.get("device", "unknown")).lower()).strip("-")


# --- timers ------------------------------------------------------------------------------

def _summary(per_call, number):
    return {
        "median_s": statistics.median(per_call),
        "min_s": min(per_call),
        "max_s": max(per_call),
        "samples": len(per_call),
        "calls_per_sample": number,
    }


def _gpu_api():
    """(numba.cuda, numba-cuda's driver, the CUDA bindings): one place, so that a test can put
    stand-ins here (tests/test_benchmarks_time_gpu.py)."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import binding, driver
    return cuda, driver, binding


def _takes_stream(fn):
    """True if ``fn`` takes the stream to launch on: one positional argument, or one named
    ``stream`` with a default (``lambda stream=None: launcher(..., stream=stream)`` serves
    both a plain call, as a check or the simulator's host timer makes it, and ``time_gpu``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and (p.default is p.empty or p.name == "stream") for p in params)


def time_gpu(fn, warmup=WARMUP, repeat=REPEAT, number=None, stream=None):
    """Time the GPU work of ``fn(stream)``: CUDA events around a CUDA graph of ``number`` calls.

    Why a graph. Calling ``fn`` back to back from Python and reading events around the calls
    (``time_launches``) measures the host whenever one call's kernels take less time than the
    call itself: the GPU then waits for each launch, and the events bracket the waits. Measured
    on an H100, every conv and pooling kernel at batch 64 was in that regime. Here ``fn``'s
    launches on ``stream`` are captured once as a graph of ``number`` calls
    (``cuStreamBeginCapture`` ... ``cuStreamEndCapture``, as ``mirrored/program/capture.py`` captures a
    step) and the graph is replayed between two events: the GPU runs the kernels back to back,
    whatever Python costs.

    ``fn(stream)`` must queue its work on ``stream`` only (a capture records that stream), and
    must not allocate, free or synchronise (run it ``warmup`` times first, uncaptured: the first
    call compiles and allocates). ``stream``: a non-default stream (default: a new one).
    ``number=None`` calibrates it so a sample lasts >= MIN_SAMPLE_S. A ``fn`` that takes no
    argument cannot be put on our stream: it is timed the old way, ``time_launches``, and the
    result's ``method`` says so. Returns a dict of seconds per call: median_s, min_s, max_s,
    samples, calls_per_sample, method ("graph" or "back-to-back launches").
    """
    if not _takes_stream(fn):
        return time_launches(fn, warmup, repeat, number, stream or 0)
    cuda, driver, binding = _gpu_api()
    stream = stream or cuda.stream()
    handle = int(stream.handle)
    for _ in range(warmup):
        fn(stream)
    stream.synchronize()
    start, end = cuda.event(timing=True), cuda.event(timing=True)

    def graph_of(n):
        """(graph, executable) of ``n`` calls of fn, captured on ``stream``."""
        with cuda.defer_cleanup():                  # a free during a capture would sync
            driver.cuStreamBeginCapture(
                handle, binding.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            try:
                for _ in range(n):
                    fn(stream)
            except BaseException:                   # end the capture, drop what it held
                _end_failed_capture(driver, handle)
                raise
            graph = driver.cuStreamEndCapture(handle)
        try:
            return graph, driver.cuGraphInstantiate(graph, 0)
        except BaseException:
            driver.cuGraphDestroy(graph)
            raise

    def sample(exe, n):
        start.record(stream)
        driver.cuGraphLaunch(exe, handle)
        end.record(stream)
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / 1e3 / n     # ms -> s, per call

    def samples(n, count):
        graph, exe = graph_of(n)
        try:
            sample(exe, n)                          # the first replay uploads the graph
            return [sample(exe, n) for _ in range(count)]
        finally:
            driver.cuGraphExecDestroy(exe)
            driver.cuGraphDestroy(graph)

    if number is None:
        once = max(samples(1, 1)[0], 1e-7)
        number = int(min(MAX_NUMBER, max(1, MIN_SAMPLE_S // once)))
    return dict(_summary(samples(number, repeat), number), method="graph")


def _end_failed_capture(driver, handle):
    """End a capture that a failed call broke; its error is the one to see, not ours."""
    try:
        graph = driver.cuStreamEndCapture(handle)
    except Exception:                               # noqa: BLE001 (an invalidated capture)
        return
    try:
        driver.cuGraphDestroy(graph)
    except Exception:                               # noqa: BLE001
        pass


def time_launches(fn, warmup=WARMUP, repeat=REPEAT, number=None, stream=0):
    """The old ``time_gpu``: events around ``number`` calls of ``fn()`` made back to back from
    Python. Right only while the GPU is busier than the host: once ``fn``'s kernels take less
    time than the call, it reports host time (see ``time_gpu``). Kept for work that cannot be
    put on one stream of ours (a peer library's default stream) and for the test that shows
    the difference. ``stream=0`` is the legacy default stream, which also orders CuPy's and
    PyTorch's default-stream work. Returns ``time_gpu``'s dict.
    """
    cuda, _, _ = _gpu_api()
    start, end = cuda.event(timing=True), cuda.event(timing=True)

    def sample(n):
        start.record(stream)
        for _ in range(n):
            fn()
        end.record(stream)
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / 1e3 / n  # ms -> s, per call

    for _ in range(warmup):
        fn()
    cuda.synchronize()
    if number is None:
        once = max(sample(1), 1e-7)
        number = int(min(MAX_NUMBER, max(1, MIN_SAMPLE_S // once)))
    return dict(_summary([sample(number) for _ in range(repeat)], number),
                method="back-to-back launches")


def time_host(fn, warmup=WARMUP, repeat=REPEAT, number=1, sync=None):
    """Time ``fn()`` with time.perf_counter; ``sync()`` (if given) runs before each clock
    read, e.g. ``cuda.synchronize``. For smoke runs in the simulator and CPU code."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    per_call = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        if sync:
            sync()
        per_call.append((time.perf_counter() - t0) / number)
    return _summary(per_call, number)


def copy_bandwidth(nbytes, timer=None):
    """Measured device-to-device copy bandwidth, the practical memory ceiling.

    A copy reads and writes every byte, so bytes moved = 2 * nbytes. Measured three
    ways where possible, and the fastest is the ceiling:

    * the driver's asynchronous copy (cudaMemcpyAsync) through CuPy or PyTorch;
    * our own grid-stride copy kernel (``kernels.elementwise.cast``, float32 to float32):
      what a Numba kernel with the library's 1-D launch can reach;
    * Numba's ``copy_to_device``, which is host-bound below a few hundred MB: on an H100
      it spent ~150 µs of Python per call on a 64 MB copy that the GPU does in ~50 µs,
      so it measured 755 GB/s where the driver moves 2,760. Kept for the record only.

    Returns (GB/s, timing dict of the fastest); the dict's ``copy_methods`` lists every
    method's GB/s and ``copy_method`` names the one used. ``timer`` defaults to ``time_gpu``.
    """
    from numba import cuda
    timer = timer or time_gpu
    n = max(1, nbytes // 4)
    moved = 2 * n * 4
    src = cuda.device_array(n, "float32")
    dst = cuda.device_array(n, "float32")
    ways = {}
    try:
        import cupy as cp
        csrc, cdst = cp.empty(n, cp.float32), cp.empty(n, cp.float32)
        ways["cudaMemcpyAsync via CuPy"] = lambda: cdst.__setitem__(Ellipsis, csrc)
    except Exception:                     # no CuPy, or no CUDA for it: try PyTorch
        try:
            import torch
            tsrc = torch.empty(n, device="cuda")
            tdst = torch.empty(n, device="cuda")
            ways["cudaMemcpyAsync via PyTorch"] = lambda: tdst.copy_(tsrc)
        except Exception:
            pass
    from kernels.elementwise import cast
    ways["our copy kernel (elementwise.cast)"] = lambda: cast(src, dst, stream=0)
    ways["numba copy_to_device"] = lambda: dst.copy_to_device(src)
    timings = {name: timer(fn) for name, fn in ways.items()}
    gbps = {name: moved / t["median_s"] / 1e9 for name, t in timings.items()}
    best = max(gbps, key=gbps.get)
    return gbps[best], dict(timings[best], copy_method=best, copy_methods=gbps)


# --- output ------------------------------------------------------------------------------

def print_table(rows, columns, file=None):
    """Print ``rows`` (dicts) as an aligned table; ``columns`` = [(key, header, fmt)],
    fmt a format spec such as ".1f"; missing values print as '-'."""
    file = file or sys.stdout

    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        return format(value, fmt) if fmt else str(value)

    table = [[header for _, header, _ in columns]]
    table += [[cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for n, line in enumerate(table):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(line, widths))), file=file)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=file)


def results_path(name, info):
    """benchmarks/results/<name>-<device>-<YYYY-MM-DD>.json (``RESULTS_DIR``)"""
    date = info.get("date_utc", _dt.datetime.now(_dt.timezone.utc).isoformat())[:10]
    return RESULTS_DIR / f"{name}-{device_slug(info)}-{date}.json"


def write_json(name, payload, info, out=None):
    """Write ``{"benchmark": name, "device": info, **payload}`` to ``out`` (default
    ``results_path(name, info)``), atomically (temp file, then rename). Returns the path."""
    path = Path(out) if out else results_path(name, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "device": info, **payload}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def save_results(name, payload, info, smoke, out=None):
    """The end of every benchmark's main(): write the JSON (``write_json``) and say where.

    A smoke run (tiny sizes, no GPU) writes only where ``--out`` points, never into
    benchmarks/results/, which keeps measured runs only. Returns the exit status, 0.
    """
    if smoke and not out:
        print("\n(smoke run: no --out given, nothing written)")
        return 0
    path = write_json(name, payload, info, out=out)
    print(f"\nwrote {path}")
    return 0
