"""Compile the kernels a step will launch before its first launch, several at once.

Why. Numba compiles a kernel at its first launch, for that launch's argument types. The
course lab's first step launches about 15 kernels never compiled on this machine, so they
compile one after the other, 0.3-0.5 s each (issue 40: 4.2 s of the first epoch's 4.9 s on
an H200). Two cannot compile at once in one process: numba-cuda holds its
``global_compiler_lock`` over a whole compile, and its front end is Python
(``benchmarks/compile_gil.py`` measured it: libnvvm releases the GIL, the lock does not).
Two processes can, and what one process compiles, another loads from numba's disk cache
in milliseconds (``kernels/disk_cache.py``). So, at a step's first run:

    1. plan       the caller runs the step's device part once as a dry recording, every
                  launch written down and none made (``mirrored/program/recording.py``'s
                  ``dry_run``, over ``kernels.launch.planned``): the (kernel, argument types)
                  its first real run will compile
    2. missing    keep those neither compiled in this process nor on disk (a kernel on disk
                  is loaded now, as its launch would load it)
    3. at once    start up to ``MAX_CHILDREN`` processes (one per free core, less one for this
                  one), ``python -P -m kernels.compile_ahead '<request, JSON>'`` (``-P``: not
                  the working directory's ``kernels``, ``child_command``); each compiles
                  its share into the disk cache, while this process compiles a share of its own
    4. run        the real run launches; each kernel is in memory or loaded from the disk

A kernel's share never splits: every kernel kept in one cache index file (one Python
function: a factory's kernels share one) goes to one process, as two processes writing one
index would each drop the other's entry. A kernel a factory made per layer shape
(``kernels/conv2d_v3.py``) is made again in the child from its ``KernelSpec.made_by``.

Why the plan run is safe. A device part is kernel launches only (``mirrored/keras/step.py``):
what a CUDA graph captures and replays without running its Python (``mirrored/program/capture.py``).
With no launch made, the memory the step computes with is not touched (the ring's peer
copies move gradient chunks the real run computes again), and the host calls a dry
recording writes down are not run (the optimizer's count of updates done is one). What its
Python does at a first run only is put back: the buffers made on first use (an optimizer's
slots, zeroed by a launch the plan does not make) are dropped (the dry run's ``undo``:
``Step.rolled_back_on_error``, from ``mirrored/program/passes.py``). It is planned only
where kernels compile and the device part sends nothing to another process: real GPUs (not
the simulator), one worker (between workers the ring sends MPI messages from the host), the
passes run through ``CapturedStep`` (not ``run_eagerly=True``, nor replicas on several
physical GPUs, which run eagerly: their kernels compile at launch, as before).

What it costs. Each child is a new Python that imports numba-cuda (1-1.5 s) and makes its
own CUDA context on the GPU; so it is used only where ``MIN_KERNELS`` or more kernels are
missing, there are two free cores or more, and the children's contexts fit in half the
device's free memory. A warm process (everything on disk) pays
the plan run (milliseconds) and loads each kernel from the disk a little earlier. A child
that fails or runs past ``CHILD_TIMEOUT_S`` costs only time: its kernels compile at their
launch, as before, and one ``RuntimeWarning`` says why. ``MIRRORED_COMPILE_AHEAD=0`` turns
it off. ``log`` lists what each first run did (``benchmarks/course_lab.py`` reports it).

Checked without a GPU: the plan finds exactly the launches of each first run, and the
weights are bitwise those of a run without it (``tests/test_compile_ahead.py``, in the
simulator); the lab step's 16 kernels, with the real compiler and the driver stubbed, are
compiled by two children and this process, and the run then compiles none
(``tests/test_kernel_disk_cache.py``). Timed the same way on the project's 2-core machine (a
process replaying the lab step's launches, an empty cache, 3 alternating runs): 10.8-12.3 s
compiling at the launches, 8.5-10.2 s with one child beside this process. What it saves on a
GPU host is measured there (``benchmarks/gpu_session.sh`` 40: the lab cold, with and without).

Neighbours: ``kernels/launch.py`` (``planned``), ``kernels/registry.py`` (``spec_of``,
``made_by``), ``kernels/disk_cache.py`` (where compiled kernels go, ``load``),
``mirrored/program/passes.py`` (``CapturedStep._run`` hands ``before_first_run`` the
dry run of fit's, evaluate's and predict's first run of each batch shape).
"""
import ast
import heapq
import importlib
import json
import os
import subprocess
import sys
import time
import warnings

from kernels import disk_cache, launch, registry

#: ``MIRRORED_COMPILE_AHEAD=0``: compile each kernel at its first launch, in this process.
AHEAD_VAR = "MIRRORED_COMPILE_AHEAD"
#: Fewer missing kernels than this compile here at their launch: a child's start-up (a new
#: Python importing numba-cuda, 1-1.5 s) costs more than compiling two (0.3-0.5 s each).
MIN_KERNELS = 3
#: At most this many children: each holds a CUDA context (hundreds of MB of GPU memory).
MAX_CHILDREN = 8
#: GPU memory counted per child (its context: about 300-500 MiB on recent GPUs); children
#: take at most half of the device's free memory (a small laptop GPU gets fewer, or none).
CHILD_CONTEXT_BYTES = 512 * 2**20
#: A child still compiling after this long is stopped; its kernels compile at launch. A
#: child's share is a few kernels, seconds of work even on a busy 2-core machine.
CHILD_TIMEOUT_S = 120

#: What each ``before_first_run`` did, in order: planned launches, kernels missing, children,
#: kernels compiled here, seconds, errors.
log = []


def wanted():
    """False where ``MIRRORED_COMPILE_AHEAD=0``, the simulator runs the kernels (it compiles
    nothing) or nothing is kept on disk (a child's work would be lost)."""
    return (os.environ.get(AHEAD_VAR, "1") != "0" and not launch.SIMULATOR
            and disk_cache.wanted())


def note():
    """One line for ``python -m mirrored info``: whether a first run compiles ahead, and with
    how many child processes at most on this machine."""
    if os.environ.get(AHEAD_VAR, "1") == "0":
        return f"off ({AHEAD_VAR}=0): a first run compiles each kernel at its launch"
    if launch.SIMULATOR:
        return "off: the CUDA simulator compiles nothing"
    if not disk_cache.wanted():
        return f"off: nothing is kept on disk ({disk_cache.CACHE_VAR}=0) for a child to hand over"
    children = min(MAX_CHILDREN, _free_cores() - 1)
    if children < 1:
        return "off here: one free core (a child would only wait for it)"
    return (f"on: a pass's first run on GPUs compiles {MIN_KERNELS} or more missing kernels in up "
            f"to {children} child process(es) and this one; {AHEAD_VAR}=0 turns it off")


def before_first_run(plan, device_id=0, children=None):
    """Compile what a device part will launch, before it runs for the first time. ``plan()``:
    the launches it will make, [(kernel, args)], written down and none made (the caller's dry
    run: ``mirrored/program/recording.py``'s ``dry_run``, over ``launch.planned``; it puts
    back what the run made). ``device_id``: the CUDA device the children compile on (the
    first replica's). ``children``: how many child processes at most (default: the free
    cores less one, at most ``MAX_CHILDREN``, and as many contexts as fit in half the
    device's free memory: ``CHILD_CONTEXT_BYTES``). Never raises: what is not compiled here
    (a plan that raised included) compiles at its launch."""
    start = time.perf_counter()
    try:
        launches = plan()
        planned, jobs = len(launches), missing(launches)
        del launches
    except Exception as err:        # noqa: BLE001 - the real run raises it, in its words
        log.append({"planned": None, "error": f"the plan run raised {type(err).__name__}: {err}"})
        return log[-1]
    report = {"planned": planned, "missing": len(jobs), "children": 0, "here": 0, "errors": []}
    if len(jobs) >= MIN_KERNELS and children is None:   # (a warm run asks nothing more)
        children = min(MAX_CHILDREN, _free_cores() - 1, _fit_in_memory())
    if len(jobs) >= MIN_KERNELS and children >= 1:
        try:
            report.update(compile_all(jobs, device_id, children))
        except Exception as err:    # noqa: BLE001 - what is not compiled compiles at launch
            report["errors"].append(f"{type(err).__name__}: {err}")
    report["seconds"] = time.perf_counter() - start
    log.append(report)
    if report["errors"]:
        warnings.warn(f"compiling kernels ahead in {report['children']} process(es) failed for "
                      f"{len(report['errors'])} kernel(s) ({report['errors'][0]}); they compile at "
                      f"their first launch instead (same results, slower start). "
                      f"{AHEAD_VAR}=0 turns compiling ahead off.", RuntimeWarning, stacklevel=2)
    return report


def missing(launches):
    """The (kernel, argument types) among ``launches`` (kernel, args) that would compile at
    their launch: not in memory, not on disk (those on disk are loaded now), each once. Only
    registered kernels kept on disk in a folder that may be read (``disk_cache.trusted``:
    a child's work could not be handed over through any other) whose types have a signature
    string; the rest compile at launch as ever."""
    jobs, seen = [], set()
    for kernel, args in launches:
        types = tuple(kernel.typeof_pyval(a) for a in args)
        if (id(kernel), types) in seen:
            continue
        seen.add((id(kernel), types))
        if types in kernel.overloads or not disk_cache.trusted(kernel) or signature_of(types) is None:
            continue
        if registry.spec_of(kernel) is None or recipe(kernel) is None:
            continue
        if not disk_cache.load(kernel, types):
            jobs.append((kernel, types))
    return jobs


def compile_all(jobs, device_id, children, command=None):
    """Compile ``jobs`` [(kernel, types)]: shares of whole index files to ``children`` child
    processes and one to this process, at once. ``command``: how to start a child (default
    ``child_command()``; tests start one with a stubbed driver). Returns
    {"children", "here", "errors"}."""
    shares = _shares(jobs, children + 1)
    mine, theirs = shares[0], [s for s in shares[1:] if s]
    procs, errors = [], []
    for share in theirs:
        request = {"device": device_id, "jobs": [job(kernel, types) for kernel, types in share]}
        try:
            proc = subprocess.Popen((command or child_command()) + [json.dumps(request)],
                                    stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=_child_env())
        except OSError as err:
            errors.append(f"a child could not start: {err}")
            continue
        procs.append(proc)
    try:
        for kernel, types in mine:                    # this process's share, meanwhile
            try:
                kernel.compile(types)
            except Exception as err:  # noqa: BLE001 - its launch compiles it again, and raises
                errors.append(f"{getattr(registry.spec_of(kernel), 'label', kernel)}: "
                              f"{type(err).__name__}: {err}")
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        for proc in procs:
            errors += _outcome(proc, deadline)
    finally:                                          # a Ctrl-C while waiting: no child left behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return {"children": len(procs), "here": len(mine), "errors": errors}


def child_command():
    """``python -P -m kernels.compile_ahead``: ``-P`` keeps the working directory off the
    child's ``sys.path``, where ``-m`` would put it first, so that a folder named ``kernels``
    (or ``mirrored``) there, planted or a student's own, is never imported in place of ours
    (issue 51, item 2). Ours is found through ``PYTHONPATH``, which ``_child_env`` starts with
    the folder holding this package. (Not ``-I``: it also drops ``PYTHONPATH`` and the user's
    site-packages, where a venv or an editable install may have put numba or us.)"""
    return [sys.executable, "-P", "-m", "kernels.compile_ahead"]


def job(kernel, types):
    """What a child needs to compile ``kernel`` for ``types``, as JSON."""
    spec = registry.spec_of(kernel)
    return {"label": spec.label, "module": spec.module, "made_by": recipe(kernel),
            "signature": signature_of(types)}


def recipe(kernel):
    """[module, factory, repr(arguments)] for a factory's kernel; [] for one made at import;
    None where the arguments are not plain literals (the child could not make it again)."""
    made_by = registry.spec_of(kernel).made_by
    if made_by is None:
        return []
    module, factory, arguments = made_by
    text = repr(arguments)
    if not _plain(arguments) or ast.literal_eval(text) != arguments:
        return None
    return [module, factory, text]


def _plain(value):
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)


def signature_of(types):
    """Numba's signature string for argument ``types`` ("void(float32[::1], uint32)"), or
    None for a type it does not spell (the kernel then compiles at its launch)."""
    from numba.core import types as nt
    parts = []
    for t in types:
        if isinstance(t, nt.Array) and t.mutable and t.aligned and t.ndim >= 1:
            dims = {"C": [":"] * (t.ndim - 1) + ["::1"], "F": ["::1"] + [":"] * (t.ndim - 1),
                    "A": [":"] * t.ndim}[t.layout]
            parts.append(f"{t.dtype}[{', '.join(dims)}]")
        elif isinstance(t, (nt.Integer, nt.Float, nt.Boolean)):
            parts.append(str(t))
        else:
            return None
    text = f"void({', '.join(parts)})"
    return text if parse(text) == tuple(types) else None


def parse(signature):
    """The argument types of a signature string (what ``kernel.compile`` is given: the
    types, not the string, so the disk cache's key is the one a launch looks up)."""
    from numba.core import sigutils
    return tuple(sigutils.normalize_signature(signature)[0])


def _shares(jobs, n):
    """``jobs`` in ``n`` shares of about equal count, each index file's jobs in one share;
    the largest group first, each to the share with the fewest jobs so far."""
    groups = {}
    for kernel, types in jobs:
        groups.setdefault((kernel.stats.cache_path, disk_cache.file_prefix(kernel)), []).append(
            (kernel, types))
    shares = [[] for _ in range(n)]
    heap = [(0, i) for i in range(n)]
    for group in sorted(groups.values(), key=len, reverse=True):
        size, i = heapq.heappop(heap)
        shares[i] += group
        heapq.heappush(heap, (size + len(group), i))
    return shares


def _fit_in_memory():
    """How many children's CUDA contexts fit in half the current device's free memory (no
    limit where the driver cannot say)."""
    try:
        from numba import cuda
        free, _ = cuda.current_context().get_memory_info()
        return int(free // 2 // CHILD_CONTEXT_BYTES)
    except Exception:                      # noqa: BLE001 - a stand-in driver (no context, NaN)
        return MAX_CHILDREN


def _free_cores():
    from kernels.cpu_loops import usable_cores      # (numba's CPU side: not at a child's start)
    return usable_cores()


def _child_env():
    """This process's environment, with the folder holding ``kernels`` first on the path and
    numba's cache folder as this process read it (where the children's kernels must go)."""
    from numba.core import config
    env = dict(os.environ)
    if config.CACHE_DIR:
        env["NUMBA_CACHE_DIR"] = config.CACHE_DIR
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return env


def _outcome(proc, deadline):
    """The errors a child reported, or why it gave no report."""
    try:
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return [f"a child was still compiling after {CHILD_TIMEOUT_S} s and was stopped"]
    try:
        report = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = err.strip().splitlines()[-1:] or ["no output"]
        return [f"a child exited with code {proc.returncode}: {tail[0]}"]
    return [f"{r['label']} {r['signature']}: {r['error']}" for r in report if r["error"]]


# --- the child: python -P -m kernels.compile_ahead '{"device": 0, "jobs": [...]}' -------------

def make(request_job):
    """The kernel a job names: its factory called again, or the registered one."""
    made_by = request_job["made_by"]
    if made_by:
        module, factory, arguments = made_by
        kernel = getattr(importlib.import_module(module), factory)(*ast.literal_eval(arguments))
    else:
        importlib.import_module(request_job["module"])
        spec = registry.by_label(request_job["label"])
        if spec is None:
            raise LookupError(f"no kernel labelled {request_job['label']} in {request_job['module']}")
        kernel = spec.kernel
    spec = registry.spec_of(kernel)
    if spec is None or spec.label != request_job["label"]:
        raise LookupError(f"made {spec and spec.label}, expected {request_job['label']}")
    return kernel


def child_main(request=None, stdout=None, select_device=None):
    """Compile the kernels of ``request`` (JSON text; default: the last command-line
    argument) into the disk cache; print a JSON list [{label, signature, seconds, error}] as
    the last line of ``stdout``. ``select_device``: how to make the request's device
    current (default numba's ``cuda.select_device``; tests with no GPU pass a stand-in)."""
    request = json.loads(request if request is not None else sys.argv[-1])
    if select_device is None:
        from numba import cuda
        select_device = cuda.select_device
    select_device(request["device"])
    report = []
    for request_job in request["jobs"]:
        start, error = time.perf_counter(), None
        try:
            make(request_job).compile(parse(request_job["signature"]))
        except Exception as err:           # noqa: BLE001 - reported; the parent compiles it
            error = f"{type(err).__name__}: {err}"
        report.append({"label": request_job["label"], "signature": request_job["signature"],
                       "seconds": round(time.perf_counter() - start, 3), "error": error})
    print(json.dumps(report), file=stdout or sys.stdout, flush=True)


if __name__ == "__main__":
    child_main()
