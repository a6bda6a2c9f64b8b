"""Test configuration: runs the CUDA code on every machine.

Numba chooses between real CUDA and its CUDA *simulator* once, when
``numba.cuda`` is first imported, from the environment variable
``NUMBA_ENABLE_CUDASIM``. So this file must decide before anything imports
numba: if the variable is unset we probe for a real GPU in a child process
(importing numba.cuda here would lock the choice in) and turn the simulator on
when there is none. Real and simulated CUDA cannot share one process.

    NUMBA_ENABLE_CUDASIM=1 python -m pytest   # force the simulator
    NUMBA_ENABLE_CUDASIM=0 python -m pytest   # force real CUDA (needs a GPU)
"""
import os
import pathlib
import signal
import subprocess
import sys


def _real_gpu_present():
    probe = "from numba import cuda; print(cuda.is_available())"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    try:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip().endswith("True")


if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if _real_gpu_present() else "1"

import pytest  # noqa: E402  (after the environment is settled)

SIMULATOR = os.environ["NUMBA_ENABLE_CUDASIM"] == "1"


def pytest_configure(config):
    # Added here, not in pytest.ini: naming a numba warning class there would make
    # pytest import numba before this file has chosen the simulator.
    config.addinivalue_line("filterwarnings", "ignore::numba.core.errors.NumbaPerformanceWarning")
    if SIMULATOR:
        _one_shared_array_per_block()


def _one_shared_array_per_block():
    """Make the simulator's ``cuda.shared.array`` hand every thread of a block the same array.

    numba-cuda's simulator (0.30.4, ``FakeCUDAShared.array``) looks the block's array up in
    a dict and, when it is missing, makes it and stores it, with no lock; each simulated
    thread is a Python thread. When Python switches threads between the look-up and the
    store (the tests that set the switch interval to 1 µs make that likely), two threads
    of one block get separate arrays and a reduction silently loses a thread's part: two
    identical models fitted one after the other in ONE thread then differed (loss 2.4086
    vs 2.3594, 1 run in 6; session 7). Real GPUs have no such race. Here the look-up and
    the store happen under one lock, keyed as the simulator keys them (the calling line).
    """
    import threading
    import traceback

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:      # dynamic shared memory; an error
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[-1])[0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


def summarise(request, line):
    """Add ``line`` to the ``mirrored`` section at the end of the run (e.g. how many kernels
    the real CUDA compiler compiled: tests/test_kernels_compile.py). It travels in the
    test's reports (``user_properties``), so it reaches the end of the run from a
    pytest-xdist worker process too."""
    request.node.user_properties.append((SUMMARY_PROPERTY, line))


SUMMARY_PROPERTY = "mirrored summary"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = {}                               # each (test, line) once: every phase reports it
    for reports in terminalreporter.stats.values():
        for r in reports:
            for name, value in getattr(r, "user_properties", ()):
                if name == SUMMARY_PROPERTY:
                    lines[(r.nodeid, value)] = value
    lines = list(lines.values())
    if lines:
        terminalreporter.section("mirrored")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest.ini): how many worker processes share the tests (pytest-xdist).

    Without a GPU, one per core, up to MAX_WORKERS: the simulator runs Python on one core
    per process, so two processes on the 2-core CI machine halve the suite's wall time.
    With a real GPU, one: the GPU tests then have the card to themselves, as they expect.
    ``python -m pytest -n 0`` runs everything in this process (one test, a debugger)."""
    if not SIMULATOR and _real_gpu_present():
        return 1
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


#: Most worker processes ``-n auto`` starts (memory: each holds its own numba and simulator).
MAX_WORKERS = 4


def pytest_report_header(config):
    mode = "Numba CUDA simulator (no GPU found)" if SIMULATOR else "real CUDA GPU"
    return f"mirrored tests: CUDA kernels run on the {mode}"


def pytest_collection_modifyitems(config, items):
    if not SIMULATOR:
        from numba import cuda
        n_gpus = len(cuda.gpus) if cuda.is_available() else 0
    else:
        n_gpus = 0
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA GPU; this run uses the CUDA simulator")
    skip_multi = pytest.mark.skip(
        reason=f"needs two physical CUDA GPUs; this machine has {n_gpus} real GPU(s)")
    for item in items:
        if item.get_closest_marker("gpu") and n_gpus < 1:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multigpu") and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def sigint_raises():
    """SIGINT raises ``KeyboardInterrupt`` in the main thread during the test, as in a Python
    started from a terminal; the disposition before is put back after. A Python started where
    SIGINT is ignored (``nohup``, some CI runners) keeps it ignored, and a test that sends
    SIGINT then sees nothing happen ("DID NOT RAISE KeyboardInterrupt", issue 51 item 8).
    Every test that sends SIGINT uses it (``tests/test_faults_round4_runtime.py``)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:             # None: set outside Python; nothing to put back
            signal.signal(signal.SIGINT, previous)


@pytest.fixture
def rng(request):
    """A fresh random generator per test; its seed is printed if the test fails."""
    import numpy as np
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"[rng seed {seed}]")
    return np.random.default_rng(seed)


@pytest.fixture
def devices():
    """Configure logical devices for one test: ``devices(cpus=2, gpus=4)``.

    Resets mirrored's device registry before and after, so each test sees the
    layout it asks for (a real program configures once, as in TensorFlow).
    ``gpus`` splits the first GPU, real or simulated; the call skips the test
    when there is no GPU at all. Returns the list of logical ``Device`` objects.
    """
    from mirrored import devices as registry
    import mirrored as tf

    def configure(cpus=1, gpus=0):
        registry._reset()
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(cpus)])
        if gpus:
            phys = tf.config.list_physical_devices("GPU")
            if not phys:
                pytest.skip("needs a CUDA GPU or the CUDA simulator")
            tf.config.set_logical_device_configuration(
                phys[0], [tf.config.LogicalDeviceConfiguration() for _ in range(gpus)])
        return registry.logical_devices()

    yield configure
    registry._reset()


#: A float32 sum of n terms is within about n * 2^-24 * sum(|terms|) of the exact sum,
#: whatever the order of additions; relative to the result itself it can be far worse
#: (cancellation), so sums are checked against this bound, not an rtol on the result.
SUM_F32_REL_TO_ABS = 1e-6


def assert_sum_close(got, terms, axis=None, keepdims=False):
    """Check a float32 sum of ``terms`` against float64, scaled by sum(|terms|) and n."""
    import numpy as np
    terms = np.asarray(terms, np.float64)
    want = terms.sum(axis=axis, keepdims=keepdims)
    n = terms.size if axis is None else terms.shape[axis]
    bound = SUM_F32_REL_TO_ABS * max(n, 1) * np.abs(terms).sum(axis=axis, keepdims=keepdims) + 1e-30
    err = np.abs(np.asarray(got, np.float64) - want)
    bad = err > bound
    assert not np.any(bad), (f"sum off by {err.max():.3g} (bound {np.max(bound):.3g}) at "
                             f"{np.argwhere(bad)[:3].tolist()}; shape {terms.shape}, axis {axis}")


# --- helpers shared by the kernel tests -------------------------------------------------

def assert_close(name, got, want, rtol, atol=0.0):
    """Fail unless |got - want| <= atol + rtol * |want| elementwise (NaN fails), with
    the count, the worst errors and the first bad index in the message."""
    import numpy as np
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    err = np.abs(got - want)
    bad = ~(err <= atol + rtol * np.abs(want))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        rel = err / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.size} elements outside rtol={rtol}, "
            f"atol={atol} (shape {got.shape}); max abs err {np.nanmax(err):.3g}, max rel "
            f"err {np.nanmax(rel):.3g}; first bad index {idx}: got {got[idx]!r}, want "
            f"{want[idx]!r}. (The rng seed is printed above.)")


def poisoned_host(shape, dtype="float32"):
    """A NumPy array full of NaN (or -7 for integers): the CPU loops' outputs start so, and an
    element a loop forgets to write fails the comparison."""
    import numpy as np
    out = np.empty(shape, dtype)
    out[...] = np.nan if np.dtype(dtype).kind == "f" else -7
    return out


def poisoned(shape, dtype="float32"):
    """A device array full of NaN (or the most negative integer): unwritten elements fail."""
    import numpy as np
    from numba import cuda
    fill = np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min
    return cuda.to_device(np.full(shape, fill, dtype))


def device_zeros(shape, dtype="float32"):
    import numpy as np
    from numba import cuda
    return cuda.to_device(np.zeros(shape, dtype))


@pytest.fixture
def forbid_launches(monkeypatch):
    """``forbid_launches(module)``: any kernel launch from ``module`` fails the test
    (bad input must be refused before anything is launched)."""
    def forbid(module):
        def refuse(*args, **kwargs):
            raise AssertionError("the launcher launched a kernel despite bad input")
        monkeypatch.setattr(module, "launch", refuse)
    return forbid


# --- running the lab notebooks -----------------------------------------------------------

#: Seconds any one notebook cell may take (with MIRRORED_QUICK=1 the slowest takes ~10 s).
NOTEBOOK_CELL_TIMEOUT = 120


#: Where ``run_lab`` runs each lab, once in each (every test that uses it runs twice):
#: "devices" as a student's machine runs it (real CUDA where there is a GPU, CPU devices
#: where there is none), and "simulator", Numba's CUDA simulator, a machine WITH a GPU.
#: In the simulator ``labs.setup`` still trains on logical CPUs (simulated kernels are far
#: too slow), so a lab there exercises what a CPU-only run never does: CPU replicas beside
#: a GPU, data and models placed on one or the other (issue 51: lab 01's CPU model once
#: had its data uploaded to GPU:0 and could not train; the suite, CPU-only, stayed green).
#: Cost in quick mode, measured on the shared 2-core machine: 56 s for all six labs in the
#: simulator (lab 04's kernels 25 s, lab 06's two workers 12 s, each of the others 2-5 s),
#: against 63 s on CPU devices: no smaller settings were needed.
LAB_MACHINES = ("devices", "simulator")


@pytest.fixture(params=LAB_MACHINES)
def run_lab(request, monkeypatch, tmp_path):
    """``run_lab("01_....ipynb")`` executes labs/<name> top to bottom; returns (text, images).

    The notebook runs with nbclient in a fresh Jupyter kernel, a child process that
    inherits this process's environment, so the environment is set first:
    ``MIRRORED_QUICK=1`` (small settings), ``MIRRORED_OFFLINE=1`` (bundled MNIST),
    ``MPLBACKEND=Agg``, the repository root on ``PYTHONPATH``, and, by the fixture's
    parameter (``LAB_MACHINES``): NO ``NUMBA_ENABLE_CUDASIM`` ("devices": a lab runs as
    a student's would, real CUDA where there is a GPU and CPU devices where there is
    none) or ``NUMBA_ENABLE_CUDASIM=1`` ("simulator": a machine with a GPU, even here).
    The kernel's working directory is labs/. Notebooks must be committed without
    outputs; the executed copy is written to tmp_path for a look after a failure.
    """
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root = pathlib.Path(__file__).resolve().parent.parent
    labs = root / "labs"

    def run(name):
        nb = nbformat.read(labs / name, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, \
                    f"{name}: commit the notebook without outputs (clear them first)"
        monkeypatch.setenv("MIRRORED_QUICK", "1")
        monkeypatch.setenv("MIRRORED_OFFLINE", "1")
        monkeypatch.setenv("MPLBACKEND", "Agg")
        if request.param == "simulator":
            monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
        else:
            monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
        path = os.environ.get("PYTHONPATH", "")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(root), path) if p))
        client = nbclient.NotebookClient(nb, timeout=NOTEBOOK_CELL_TIMEOUT, kernel_name="python3",
                                         resources={"metadata": {"path": str(labs)}})
        try:
            client.execute()
        finally:
            nbformat.write(nb, tmp_path / name)
        errors = [(i, cell.source.splitlines()[0] if cell.source else "",
                   f"{o.get('ename')}: {o.get('evalue')}")
                  for i, cell in enumerate(nb.cells) for o in cell.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, errors
        texts, images = [], 0
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    # stdout as printed: one print may arrive split over several stream
                    # outputs (the kernel flushes when it likes, more often on a busy
                    # machine), so these are joined as they are, with no separator
                    texts.append(out.get("text", ""))
                else:
                    texts.append("\n" + out.get("data", {}).get("text/plain", "") + "\n")
                images += "image/png" in out.get("data", {})
        return "".join(texts), images

    return run


# --- the benchmarks' --smoke runs ---------------------------------------------------------

#: Every benchmark's ``--smoke`` must end within this (issue 37: the README says each one
#: checks the program; breakdown's once ran 200 steps x 5 rounds in the simulator).
SMOKE_LIMIT_S = 60
#: Wall-clock guard against a hang, wide enough for a machine shared with other jobs.
SMOKE_HANG_S = 300


def run_smoke(module, *args, env=None, cwd=None):
    """``python -m benchmarks.<module> --smoke *args`` in a child, as the README states it
    (pass only what the README's form needs, e.g. ``--out``), checked against
    ``SMOKE_LIMIT_S``: the child's CPU seconds (its own and its children's: mpiexec's
    workers) always, and its wall seconds where the machine is quiet (load average below
    the core count): a busy shared machine stretches wall time, not CPU time. Returns the
    CompletedProcess with ``cpu_s`` and ``wall_s`` set; the caller checks returncode."""
    import resource
    import time

    def cpu():
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    quiet = os.getloadavg()[0] < (os.cpu_count() or 1)
    c0, t0 = cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", *args],
                          cwd=cwd or root, env=env, capture_output=True, text=True, timeout=SMOKE_HANG_S)
    proc.cpu_s, proc.wall_s = cpu() - c0, time.perf_counter() - t0
    quiet = quiet and os.getloadavg()[0] < (os.cpu_count() or 1)
    assert proc.cpu_s < SMOKE_LIMIT_S, (
        f"benchmarks.{module} --smoke used {proc.cpu_s:.0f} CPU seconds (limit {SMOKE_LIMIT_S}): "
        f"make its smoke settings smaller")
    assert not quiet or proc.wall_s < SMOKE_LIMIT_S, (
        f"benchmarks.{module} --smoke took {proc.wall_s:.0f} s on a quiet machine (limit {SMOKE_LIMIT_S})")
    return proc


def tutorial_train_step(model, global_batch_size, loss_object=None):
    """TensorFlow's MirroredStrategy tutorial's ``train_step``, written once for the tests
    that run it (tests/test_function_replay.py, tests/test_faults_round4_runtime.py): the
    forward pass under a tape, the per-example loss (``loss_object``, by default sparse
    categorical cross-entropy on logits) averaged over ``global_batch_size``, the gradients
    applied by ``model.optimizer``. Returns this replica's loss."""
    import mirrored as tf
    if loss_object is None:
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(labels, model(images, training=True)),
                                              global_batch_size=global_batch_size)
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return train_step


class ReplayByRerun:
    """A stand-in for ``capture._Graph`` where nothing can be captured: 'replaying' runs the
    device part again from Python (the same launches a graph holds), so the step's own host
    calls are counted as a captured step makes them."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    @classmethod
    def capture(cls, devices, fn, args):
        return cls(fn, args)

    def launch(self):
        self.fn(*self.args)

    def close(self):
        pass


def replica_strategy(devices, n, kind="CPU"):
    """A MirroredStrategy over ``n`` logical CPUs, or ``n`` simulated logical GPUs (``kind``
    "GPU": the CUDA path end to end), configured by the ``devices`` fixture."""
    import mirrored as tf
    if kind == "GPU":
        devices(cpus=1, gpus=n)
    else:
        devices(cpus=n)
    return tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)])
