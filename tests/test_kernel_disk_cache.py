"""A second process finds every kernel of the course lab's step on disk and compiles none.

Issue 40: compiling the lab's kernels was 4.2 s of a 4.9 s first epoch on an H200; numba-cuda's
disk cache (``kernels/disk_cache.py``) should leave a second process nothing to compile. No
GPU is needed to check that, in three steps, each a fresh process:

1. **Which kernels the lab's step launches.** The lab's ConvNet is built and fitted (two
   batches: 64 rows, then the 32 of an epoch's last batch, as 60,000 % 64 leaves) and
   evaluated (64, then 16) on a simulated GPU, with every simulated kernel made a no-op (a
   launch costs nothing; the launchers, their checks and the per-shape factories run as
   they do). Every call the layers make into ``mirrored/backends.py``'s ``CudaOps`` is
   written down: its method and its arguments (arrays as shape and dtype).
2. **A first process with the real compiler.** The calls are made again on a ``CudaOps`` of
   a stand-in device, with numba-cuda's driver stubbed (``benchmarks.launch.stub_driver``:
   the compiler runs for real, NVVM and the linker included, and the launch stops at the
   driver call), and an empty ``NUMBA_CACHE_DIR``. It compiles, and writes the cache.
3. **A second process**, the same calls and the same folder: it must load every kernel and
   compile none. Compiles are counted three ways: numba's typed kernels made (``_Kernel``),
   NVVM runs, cubins linked.

The same is checked for a plain install (the packages copied into a read-only folder, as
site-packages is, with no ``NUMBA_CACHE_DIR``: numba then keeps the files in the user's cache
folder), and that a damaged index or data file is compiled again with a warning, never a
crash, and the next process loads what that one rewrote.

What waits for a GPU (``tests/test_kernel_cache.py``, ``@pytest.mark.gpu``): that a kernel
loaded from the disk runs and gives the compiled one's result.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Seconds a child may take: the first compiles the lab's kernels with the real NVVM
#: (about 0.3 s each on a free core, several times that on a busy 2-core runner).
CHILD_S = 600

RECORD = """
import inspect, json, threading
import numpy as np
from numba.cuda.simulator.kernel import FakeCUDAKernel
FakeCUDAKernel.__call__ = lambda self, *args: None      # a launch runs nothing
import mirrored as tf
from mirrored import backends
from mirrored.lab import workflow

calls, depth = [], threading.local()

def describe(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"tuple": [describe(e) for e in v]}
    if isinstance(v, np.generic):
        return {"scalar": v.dtype.str, "value": v.item()}
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return {"array": [int(s) for s in v.shape], "dtype": np.dtype(v.dtype).str}
    raise TypeError(f"cannot describe an argument of type {type(v).__name__}")

def recording(name, method):
    def call(self, *args, **kwargs):
        if getattr(depth, "n", 0) == 0:           # the layers' calls, not CudaOps' own
            entry = [name, [describe(a) for a in args],
                     {k: describe(v) for k, v in kwargs.items()}]
            if entry not in calls:
                calls.append(entry)
        depth.n = getattr(depth, "n", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            depth.n -= 1
    return call

for name, method in list(vars(backends.CudaOps).items()):
    if inspect.isfunction(method) and not name.startswith("_"):
        setattr(backends.CudaOps, name, recording(name, method))

strategy = tf.distribute.MirroredStrategy()
with strategy.scope():
    model = workflow.make_model("conv")
rng = np.random.default_rng()
x = rng.random((96, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, 96)
model.fit(x, y, batch_size=64, epochs=1, verbose=0)
model.evaluate(x[:80], y[:80], batch_size=64, verbose=0)
print(json.dumps(calls))
"""

#: A compile-ahead child with the driver stubbed as in REPLAY (``kernels/compile_ahead.py``).
AHEAD_CHILD = """
from benchmarks.launch import stub_driver
stub_driver()
from numba.cuda import codegen
stub_cufunc, link = codegen.CUDACodeLibrary.get_cufunc, codegen.CUDACodeLibrary.get_cubin
def get_cubin(library, cc=None):  # REPLAY's: the cubin kept under the stand-in's (9, 0)
    return link(library, cc or (9, 0))
def get_cufunc(library):          # as numba's: the cubin (linked once, then kept), then loaded
    library.get_cubin()
    return stub_cufunc(library)
codegen.CUDACodeLibrary.get_cubin, codegen.CUDACodeLibrary.get_cufunc = get_cubin, get_cufunc
from kernels import compile_ahead
compile_ahead.child_main(select_device=lambda i: None)
"""

REPLAY = r"""
import hashlib, json, os, sys, warnings
import numpy as np
from benchmarks.launch import fake_array, fake_stream, stub_driver
stub = stub_driver()
from numba.cuda import codegen
from numba.cuda.cudadrv import nvvm
from numba.cuda.dispatcher import _Kernel

counts = {"typed": 0, "nvvm": 0, "linked": 0}
def counting(what, fn):
    def counted(*args, **kwargs):
        counts[what] += 1
        return fn(*args, **kwargs)
    return counted
_Kernel.__init__ = counting("typed", _Kernel.__init__)
nvvm.compile_ir = counting("nvvm", nvvm.compile_ir)
stub_cufunc, link = codegen.CUDACodeLibrary.get_cufunc, codegen.CUDACodeLibrary.get_cubin
def get_cubin(library, cc=None):
    cc = cc or (9, 0)
    if cc not in library._cubin_cache:
        counts["linked"] += 1
    return link(library, cc)
def get_cufunc(library):          # as numba's: the cubin (linked once, then kept), then loaded
    library.get_cubin()
    return stub_cufunc(library)
codegen.CUDACodeLibrary.get_cubin, codegen.CUDACodeLibrary.get_cufunc = get_cubin, get_cufunc

calls = json.load(open(sys.argv[1]))
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from kernels import disk_cache, registry
    from mirrored import backends

    class StandIn:
        '''The device a CudaOps launches on: its stream, its SMs, its scratch buffers.'''
        stream, multiprocessors, kept = fake_stream(), 132, {}
        def scratch(self, key, shape, dtype):
            full = (key, tuple(shape), np.dtype(dtype).str)
            if full not in self.kept:
                self.kept[full] = fake_array(shape, dtype)
            return self.kept[full]

    def make(v):
        if isinstance(v, dict) and "array" in v:
            return fake_array(v["array"], v["dtype"])
        if isinstance(v, dict) and "tuple" in v:
            return tuple(make(e) for e in v["tuple"])
        if isinstance(v, dict) and "scalar" in v:
            return np.dtype(v["scalar"]).type(v["value"])
        return v

    ops = backends.CudaOps(StandIn())

    def replay():
        for name, args, kwargs in calls:
            getattr(ops, name)(*[make(a) for a in args], **{k: make(v) for k, v in kwargs.items()})

    ahead = None
    if os.environ.get("AHEAD_CHILDREN"):          # kernels/compile_ahead.py, children stubbed too
        from kernels import compile_ahead, launch
        with launch.planned() as launches:
            replay()
        jobs = compile_ahead.missing(launches)
        before = dict(counts)
        ahead = compile_ahead.compile_all(jobs, 0, int(os.environ["AHEAD_CHILDREN"]),
                                          command=[sys.executable, "-c", AHEAD_CHILD])
        ahead.update(planned=len(launches), jobs=len(jobs),
                     typed_here=counts["typed"] - before["typed"])
    before = dict(counts)
    replay()
    replayed = {k: counts[k] - before[k] for k in counts}

launched, kept = {}, {}
for spec in registry.registered():
    stats = spec.kernel.stats
    for sig in set(stats.cache_hits) | set(stats.cache_misses):
        label = f"{spec.label} {sig}"
        cubin = spec.kernel.overloads[sig].library.get_cubin()   # what the GPU would load
        cubin = getattr(cubin, "code", cubin)                     # cuda.core's ObjectCode
        launched[label] = [stats.cache_hits[sig], stats.cache_misses[sig],
                           hashlib.sha256(bytes(cubin)).hexdigest()]
        kept[label] = stats.cache_path is not None
print(json.dumps({"counts": counts, "launched": launched, "kept": kept, "ahead": ahead,
                  "replayed": replayed,
                  "held": sum(n for n, _ in disk_cache.contents(
                      [s.kernel for s in registry.registered()]).values()),
                  "warnings": [str(w.message) for w in caught
                               if issubclass(w.category, disk_cache.KernelCacheWarning)]}))
"""


def _run(code, args=(), sim=False, path=ROOT, **env):
    """``code`` in a fresh Python (the simulator on or off), packages from ``path``; the JSON
    it prints last."""
    environ = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",)}
    environ.update(env, NUMBA_ENABLE_CUDASIM="1" if sim else "0", MIRRORED_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(dict.fromkeys([str(path), str(ROOT)])))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                         cwd=path, env=environ, capture_output=True, text=True, timeout=CHILD_S)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def lab_calls(tmp_path_factory):
    """The lab step's calls into CudaOps (step 1 of the module docstring), as a JSON file."""
    calls = _run(RECORD, sim=True)
    names = {name for name, _, _ in calls}
    # the lab's ConvNet, trained with Adam and evaluated: the fused conv, the dense stack
    assert {"conv2d_relu_pool", "conv2d_relu_pool_backward", "gemm", "bias_relu",
            "softmax_xent", "adam"} <= names, sorted(names)
    path = tmp_path_factory.mktemp("lab") / "calls.json"
    path.write_text(json.dumps(calls))
    return path


def _replay(calls, path=ROOT, **env):
    return _run(f"AHEAD_CHILD = {AHEAD_CHILD!r}\n" + textwrap.dedent(REPLAY), [calls], path=path, **env)


@pytest.fixture(scope="module")
def first_process(lab_calls, tmp_path_factory):
    """Step 2: a first process with an empty cache; (the cache folder, what it reported)."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    return cache, _replay(lab_calls, NUMBA_CACHE_DIR=str(cache))


def test_a_second_process_compiles_none_of_the_lab_steps_kernels(lab_calls, first_process):
    cache, first = first_process
    second = _replay(lab_calls, NUMBA_CACHE_DIR=str(cache))
    launched = first["launched"]
    # the lab's step launches its kernels, per-shape ones among them, each kept on disk
    assert len(launched) >= 10, launched
    assert any("conv2d_relu_pool[28x28x1" in label for label in launched), sorted(launched)
    assert any("conv2d_dw_partial_v2[" in label for label in launched), sorted(launched)
    assert all(first["kept"].values()), [k for k, v in first["kept"].items() if not v]
    # the first process compiled each once, and wrote each to the cache
    assert all(hits == 0 and misses == 1 for hits, misses, _ in launched.values()), launched
    assert first["counts"]["typed"] == len(launched) and first["counts"]["nvvm"] >= len(launched)
    assert first["held"] >= len(launched)
    # the second: the same kernels, every one loaded, nothing compiled, the same machine code
    assert sorted(second["launched"]) == sorted(launched)
    assert second["counts"] == {"typed": 0, "nvvm": 0, "linked": 0}, second["counts"]
    assert all(hits == 1 and misses == 0 for hits, misses, _ in second["launched"].values())
    assert {k: v[2] for k, v in second["launched"].items()} == {k: v[2] for k, v in launched.items()}
    assert first["warnings"] == second["warnings"] == []
    # python -m mirrored info's line counts them: one data file per compiled kernel
    line = _run("""
        import json
        from kernels import registry
        print(json.dumps(registry.disk_cache_note()))
    """, NUMBA_CACHE_DIR=str(cache))
    held = len(list(Path(cache).rglob("*.nbc")))
    assert held >= len(launched) and f"it holds {held} compiled kernel(s)" in line, line
    assert str(cache) in line


def test_a_plain_install_keeps_its_own_files_and_finds_them_again(lab_calls, tmp_path):
    """The packages copied into a read-only folder (site-packages, as ``pip install`` leaves
    it for a user who cannot write there), no NUMBA_CACHE_DIR: numba keeps the kernels in
    the user's cache folder (XDG_CACHE_HOME; beside the copy where the user may write there
    anyway, as root may), keyed by the copy's path, and the second process loads them. The
    source path picks the folder, so the checkout's files are never read for the copy's
    kernels (they would be stale if the copy differed). A per-shape kernel and a plain one."""
    calls = [c for c in json.loads(Path(lab_calls).read_text())
             if c[0] in ("conv2d_relu_pool", "fill")]
    (tmp_path / "small.json").write_text(json.dumps(calls))
    site = tmp_path / "site-packages"
    for package in ("kernels", "mirrored"):
        shutil.copytree(ROOT / package, site / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    writable = [Path(folder) for folder, _, _ in os.walk(site)]
    for folder in writable:
        folder.chmod(0o555)
    user_cache = tmp_path / "user-cache"
    env = dict(XDG_CACHE_HOME=str(user_cache), PYTHONDONTWRITEBYTECODE="1")
    try:
        first = _replay(tmp_path / "small.json", path=site, **env)
        second = _replay(tmp_path / "small.json", path=site, **env)
    finally:
        for folder in writable:
            folder.chmod(0o755)
    assert len(first["launched"]) == 2 and all(v[:2] == [0, 1] for v in first["launched"].values())
    assert second["counts"] == {"typed": 0, "nvvm": 0, "linked": 0}, second["counts"]
    assert all(v[:2] == [1, 0] for v in second["launched"].values()), second["launched"]
    in_user_cache, beside = list(user_cache.rglob("*.nbc")), list(site.rglob("*.nbc"))
    assert len(in_user_cache) + len(beside) == 2, (in_user_cache, beside)
    if os.geteuid() != 0:                          # root writes into a read-only folder
        assert len(in_user_cache) == 2, beside


def test_damaged_cache_files_are_compiled_again_with_a_warning(lab_calls, first_process,
                                                               tmp_path):
    """Garbage in one kernel's index file and in another's data file (a disk that filled up
    mid-write, a copy gone wrong): each is compiled again with a warning naming it and what
    to do, the rest are loaded, nothing crashes, and the next process loads what this one
    rewrote."""
    warm, first = first_process
    cache = tmp_path / "cache"
    shutil.copytree(warm, cache)
    index = [p for p in cache.rglob("*.nbi") if p.name.startswith("conv2d_v3.")]
    data = [p for p in cache.rglob("*.nbc") if p.name.startswith("gemm.")]
    assert len(index) == 1 and data, sorted(p.name for p in cache.rglob("*"))
    index[0].write_bytes(os.urandom(64))            # garbage where a pickle was
    data[0].write_bytes(os.urandom(64))
    second = _replay(lab_calls, NUMBA_CACHE_DIR=str(cache))
    third = _replay(lab_calls, NUMBA_CACHE_DIR=str(cache))
    compiled = sorted(k for k, v in second["launched"].items() if v[1])
    assert len(compiled) == 2, compiled
    assert compiled[0].startswith("conv2d_relu_pool[") and compiled[1].startswith("gemm_")
    assert second["counts"]["typed"] == 2
    assert sorted(second["launched"]) == sorted(first["launched"])
    assert len(second["warnings"]) == 2, second["warnings"]
    for message, name in zip(sorted(second["warnings"]), ("conv2d_relu_pool", "gemm")):
        assert name in message and "could not be read" in message, message
        assert "compiling it again" in message and "MIRRORED_KERNEL_CACHE=0" in message
    # the kernels not damaged are the same machine code as the first process compiled
    assert all(v[2] == first["launched"][k][2] for k, v in second["launched"].items()
               if k not in compiled)
    # what the second process rewrote, the third loads: nothing compiled, no warning
    assert third["counts"] == {"typed": 0, "nvvm": 0, "linked": 0}, third["counts"]
    assert third["warnings"] == []
    assert all(v[:2] == [1, 0] for v in third["launched"].values())
    # ... the very machine code the second compiled (a recompile links a different cubin)
    assert {k: v[2] for k, v in third["launched"].items()} == \
        {k: v[2] for k, v in second["launched"].items()}


def test_children_compile_the_lab_steps_kernels_ahead_and_the_run_compiles_none(lab_calls,
                                                                              first_process,
                                                                              tmp_path):
    """``kernels/compile_ahead.py`` on the lab's step, with the real compiler (no GPU: the driver
    stubbed in this process and in its children): the plan run finds every kernel the run
    launches; two child processes and this one compile them at once into an empty disk cache;
    the run itself then compiles nothing, loading the children's kernels from the disk. With
    every kernel on disk already, nothing is missing and no child starts."""
    _, first = first_process
    cache = tmp_path / "cache"
    ahead = _replay(lab_calls, NUMBA_CACHE_DIR=str(cache), AHEAD_CHILDREN="2")
    report = ahead["ahead"]
    assert report["errors"] == [], report["errors"]
    assert report["jobs"] == len(first["launched"]) and report["children"] == 2, report
    assert 0 < report["here"] < report["jobs"] and report["typed_here"] == report["here"]
    assert ahead["replayed"] == {"typed": 0, "nvvm": 0, "linked": 0}, ahead["replayed"]
    assert sorted(ahead["launched"]) == sorted(first["launched"])
    hits = sum(v[0] for v in ahead["launched"].values())
    assert hits == report["jobs"] - report["here"]               # the children's, from the disk
    # (the machine code is not compared with the first process's: two compiles of a kernel
    # differ in the unique names numba mangles into it)
    warm = _replay(lab_calls, NUMBA_CACHE_DIR=str(cache), AHEAD_CHILDREN="2")
    assert warm["ahead"]["jobs"] == 0 and warm["ahead"]["children"] == 0, warm["ahead"]
    assert warm["counts"] == {"typed": 0, "nvvm": 0, "linked": 0}
