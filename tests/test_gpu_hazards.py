"""GPU-only hazards, caught without a GPU.

Numba's CUDA simulator is synchronous, single-device and forgiving: no stream ordering,
no grid limits, no real allocations, no graph capture. Each test here catches one thing
that only goes wrong on hardware, by one of three means:

* a child process with ``NUMBA_ENABLE_CUDASIM=0`` that builds *real* numba-cuda objects
  over a fake device pointer (no driver is ever called);
* a monkeypatched launcher or driver object that records what would be sent to the GPU;
* the simulator itself, with the GPU's launch constants on small grids.

Each section names the hazard, and each test fails on the code before its fix.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import assert_close, poisoned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Seconds a child process may take to import numba-cuda and run a few lines.
CHILD_TIMEOUT = 120


def run_real_numba_cuda(code):
    """Run ``code`` in a child process with real (not simulated) numba-cuda and no GPU
    calls: ``ensure_context`` is replaced by a no-op, so array views can be made over a
    fake pointer. Returns stdout; fails the test with stderr if the child failed."""
    prelude = textwrap.dedent("""
        import contextlib, ctypes, gc, sys, weakref
        import numpy as np
        sys.path.insert(0, %r)
        from numba.cuda.cudadrv import devices as _devices
        from numba.cuda.cudadrv import driver as _driver
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        _devices._runtime.ensure_context = contextlib.nullcontext   # no driver, no context

        def fake_allocation(nbytes, freed, address=0x7f0000000000):
            '''What numba's memalloc returns (an OwnedPointer over an AutoFreePointer that
            the context's allocation table holds until the last view goes), over a fake
            address; ``freed`` records when cuMemFree would be queued.'''
            table = {}
            def free():
                table.pop(address, None)
                freed.append(nbytes)
            mem = _driver.AutoFreePointer(object(), ctypes.c_void_p(address), nbytes, finalizer=free)
            table[address] = mem
            return mem.own(), table
    """ % ROOT)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT, cwd=ROOT)
    assert out.returncode == 0, f"child process failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


# --- 1. memory accounting: refunded when the memory is freed, not before -----------------

def test_refund_waits_for_the_last_view_of_a_real_numba_cuda_allocation():
    # batch_reduce returns slices of a fused buffer and drops the buffer itself: with real
    # numba-cuda each slice holds its own OwnedPointer, so a refund hung on the base
    # array's pointer fired while the slices still held the memory.
    out = run_real_numba_cuda("""
        from mirrored.devices import Device, PhysicalDevice
        dev = Device(0, PhysicalDevice("/physical_device:GPU:0", "GPU"))
        freed = []
        pointer, table = fake_allocation(400, freed)
        base = DeviceNDArray((100,), (4,), np.dtype("float32"), gpu_data=pointer)
        del pointer
        dev._account(base, 400)
        view = base[10:20].reshape(2, 5)
        del base; gc.collect()
        print("with a view", dev.bytes_in_use, freed)
        del view; gc.collect()
        print("after it", dev.bytes_in_use, freed)
    """)
    assert "with a view 400 []" in out, f"refunded while a view still held the memory:\n{out}"
    assert "after it 0 [400]" in out, f"not refunded once the memory was freed:\n{out}"


def test_sum_all_scratch_is_charged_once_and_reused(devices, rng):
    gpu = devices(cpus=1, gpus=1)[1]
    from kernels import reduction
    x = rng.standard_normal(77).astype(np.float32)
    x_dev = gpu.from_numpy(x)
    out = gpu.empty((1,), np.float32)
    before = gpu.bytes_in_use
    for _ in range(3):
        gpu.ops.sum_all(x_dev, out)
    scratch = reduction.SUM_BLOCKS * 4
    assert gpu.bytes_in_use == before + scratch, (
        f"sum_all's partial buffer must be charged to the device once ({scratch} bytes) "
        f"and reused; bytes_in_use went from {before} to {gpu.bytes_in_use}")
    np.testing.assert_allclose(gpu.to_numpy(out)[0], x.astype(np.float64).sum(), rtol=1e-5)


# --- 2. grid limits: checked at every launch, and launchers tile past them ---------------

@pytest.mark.parametrize("grid,block,why", [
    ((1, 65536), (32, 8), "grid y"),
    ((2, 1, 65536), 32, "grid y, z"),
    (2**31, 256, "grid x"),
    (np.int64(2**31), 256, "grid x"),                 # NumPy integers count too
    (4, (32, 33), "threads per block"),
    (4, (1, 1, 65), "block z"),
    ((0, 1), 32, "at least 1"),
])
def test_launch_refuses_a_grid_past_the_hardware_limits(grid, block, why):
    from kernels import launch
    with pytest.raises(ValueError, match=why):
        launch.check_launch(launch.launch, grid, block)


def test_launch_checks_the_limits_before_launching(monkeypatch):
    from kernels import launch

    class Kernel:
        def __getitem__(self, config):
            raise AssertionError("configured a launch past the hardware's limits")

    with pytest.raises(ValueError, match="past the GPU's limits"):
        launch.launch(Kernel(), (1, 70000), (32, 8), None)


def record_launches(monkeypatch, *modules):
    """Replace ``launch`` in ``modules`` by a recorder: [(kernel, grid, block)], nothing runs."""
    launches = []
    for module in modules:
        monkeypatch.setattr(module, "launch", lambda k, g, b, s, *a: launches.append((k, g, b)))
    return launches


def test_launchers_keep_huge_shapes_within_the_limits(monkeypatch):
    # reduce_sum(x, axis=1) on (70000, 10) used grid y = 70000; GEMM v1/v2 used
    # grid y = ceil(M / 16), past 65,535 for M > 1,048,560. Real GPUs refuse both.
    from numba import cuda
    from kernels import gemm, launch, reduction
    launches = record_launches(monkeypatch, reduction, gemm)
    rows = 70000
    reduction.sum_axis(cuda.device_array((rows, 10, 1), np.float32),
                       cuda.device_array((rows, 1), np.float32))
    m = 16 * launch.MAX_GRID_YZ + 17          # 1,048,577 rows
    a = cuda.device_array((m, 1), np.float32)
    b = cuda.device_array((1, 3), np.float32)
    out = cuda.device_array((m, 3), np.float32)
    for version in gemm.VERSIONS:
        gemm.gemm(a, b, out, version=version)
    assert len(launches) == 1 + len(gemm.VERSIONS)
    for kernel, grid, block in launches:
        launch.check_launch(kernel, grid, block)


def test_kernels_loop_over_rows_past_the_grid_cap(monkeypatch, rng):
    # With the cap at 2 blocks in y, every kernel that tiles rows must loop over the rest.
    from numba import cuda
    from kernels import gemm, launch, reduction
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 2)
    x3 = rng.standard_normal((5, 3, 4)).astype(np.float32)          # 5 outer rows > 2
    out = poisoned((5, 4))
    reduction.sum_axis(cuda.to_device(x3), out)
    assert_close("sum_axis past the y cap", out.copy_to_host(), reduction.sum_axis_ref(x3), 1e-5, 1e-6)
    for version, m in (("v1", 37), ("v2", 37), ("v3", 2 * gemm.BM + 3)):   # 3 row tiles > 2
        a = rng.standard_normal((m, 2)).astype(np.float32)
        b = rng.standard_normal((2, 3)).astype(np.float32)
        out = poisoned((m, 3))
        gemm.gemm(cuda.to_device(a), cuda.to_device(b), out, version=version)
        assert_close(f"gemm {version} past the y cap", out.copy_to_host(), a.astype(np.float64) @ b, 1e-5, 1e-5)


# --- 3. the ring's staging buffer is never replaced under a captured graph ---------------

def test_ring_scratch_is_kept_per_size_and_dtype(devices, rng):
    # A graph captured over an all-reduce of size A keeps writing into A's scratch; a
    # reduce of size B in between (a scalar strategy.reduce during fit) used to free it
    # and put B's in its place.
    import mirrored as tf
    from mirrored.ring import STAGING, RingAllReduce
    from mirrored.values import PerReplica
    devs = [d for d in devices(cpus=1, gpus=2) if d.device_type == "GPU"]
    ring = RingAllReduce(peer_access=False)                 # the staged path has scratch

    def reduce(size, dtype):
        xs = [rng.standard_normal(size).astype(dtype) for _ in devs]
        comps = []
        for dev, x in zip(devs, xs):
            with tf.device(dev.name):
                comps.append(tf.constant(x))
        got = ring.reduce("SUM", PerReplica(comps)).values[0].numpy()
        np.testing.assert_allclose(got, sum(x.astype(np.float64) for x in xs), rtol=1e-5, atol=1e-5)

    def staging():
        return {(dev.name, key): buf for dev in devs for key, buf in dev.caches()[0].items()
                if key[0] == STAGING}

    reduce(11, np.float32)
    first = staging()
    assert any(key[1][1] == (11,) for key in first), "the staged path made no staging buffer"
    reduce(1, np.float32)
    reduce(11, np.float64)
    reduce(11, np.float32)
    now = staging()
    for key, buf in first.items():
        assert now[key] is buf, f"the scratch {key} was replaced by a reduce of another size"


# --- 4. a cross-device copy orders both ways ----------------------------------------------

def test_cross_device_copy_waits_both_ways(devices, monkeypatch, rng):
    # The destination must wait for the source's writes (read after write), and the
    # source's next in-place write must wait for the copy to have read (write after read).
    # The simulator is synchronous, so we record the waits the copy asks for.
    from mirrored import devices as registry
    gpu0, gpu1 = [d for d in devices(cpus=1, gpus=2) if d.device_type == "GPU"]
    x = rng.standard_normal(9).astype(np.float32)
    buf = gpu0.from_numpy(x)
    waits = []
    real_wait_for = registry.wait_for

    def recording(src, dst):
        waits.append((src.short_name, dst.short_name))
        return real_wait_for(src, dst)

    monkeypatch.setattr(registry, "wait_for", recording)
    out = gpu1.copy_from(buf, gpu0)
    assert waits == [("GPU:0", "GPU:1"), ("GPU:1", "GPU:0")], (
        f"a copy from GPU:0 to GPU:1 must make GPU:1 wait for GPU:0, then GPU:0 wait for "
        f"the copy; it asked for {waits}")
    np.testing.assert_array_equal(gpu1.to_numpy(out), x)


# --- 5. a failed capture rejoins the streams, ends the capture, falls back to eager -------

class FakeCapture:
    """numba.cuda, the driver and its bindings as program/capture.py uses them, logging every call:
    ("record", event, stream), ("wait", event, stream), ("begin", stream), ("end", stream),
    ("destroy", graph), ... The capture is on between "begin" and "end"."""

    def __init__(self):
        self.log = []
        self.capturing = False
        self.events = 0
        fake = self

        class Event:
            def __init__(self):
                fake.events += 1
                self.name = f"ev{fake.events}"

            def record(self, stream):
                fake.log.append(("record", self.name, stream.name))

            def wait(self, stream):
                fake.log.append(("wait", self.name, stream.name))

        self.event = lambda timing=True: Event()
        self.CUstreamCaptureMode = type("Mode", (), {"CU_STREAM_CAPTURE_MODE_THREAD_LOCAL": 2})

    def defer_cleanup(self):
        import contextlib
        return contextlib.nullcontext()

    def cuStreamBeginCapture(self, stream, mode):
        self.capturing = True
        self.log.append(("begin", stream))

    def cuStreamEndCapture(self, stream):
        self.capturing = False
        self.log.append(("end", stream))
        return "graph"

    def cuGraphDestroy(self, graph):
        self.log.append(("destroy", graph))

    def cuGraphInstantiate(self, graph, flags):
        self.log.append(("instantiate", graph))
        return "exe"

    def cuGraphLaunch(self, exe, stream):
        self.log.append(("launch", exe, stream))

    def cuGraphExecDestroy(self, exe):
        self.log.append(("exec-destroy", exe))


def fake_gpus(n):
    """Stand-ins for n logical GPUs of one card: a named stream with a handle each."""
    import contextlib
    from types import SimpleNamespace
    return [SimpleNamespace(name=f"GPU:{i}", device_type="GPU", gpu_id=0,
                            stream=SimpleNamespace(name=f"s{i}", handle=100 + i),
                            activate=contextlib.nullcontext) for i in range(n)]


def test_failed_capture_rejoins_every_stream_ends_it_and_falls_back_to_eager(monkeypatch):
    from mirrored.program import capture
    from mirrored.ring import RingAllReduce
    fake = FakeCapture()
    monkeypatch.setattr(capture, "_driver_api", lambda: (fake, fake, fake))
    monkeypatch.setattr(capture._dev, "cuda_mode", lambda: "real")
    devs = fake_gpus(3)
    steps = capture.StepGraphs(devs, RingAllReduce())
    assert steps.enabled, steps.reason
    ran = []

    def step(x):
        if fake.capturing:     # what numba raises when a step syncs or allocates mid-capture
            raise RuntimeError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        ran.append(x)

    step(1)                                                  # the key's first run: the caller's
    with pytest.warns(RuntimeWarning, match="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        steps.run("k", step, 2)
    assert steps.last == "eager"                             # capture fails: eager instead
    assert ran == [1, 2], "the step whose capture failed must still run, eagerly"
    end = fake.log.index(("end", 100))
    for d in devs[1:]:
        rejoined = [e[1] for e in fake.log[:end] if e[0] == "record" and e[2] == d.stream.name]
        assert rejoined and ("wait", rejoined[-1], "s0") in fake.log[:end], (
            f"{d.name}'s stream was not joined back to the origin before the capture ended: {fake.log}")
    assert ("destroy", "graph") in fake.log[end:], "the broken capture's graph must be destroyed"
    assert not fake.capturing
    assert "failed" in steps.reason and not steps.enabled
    steps.run("k", step, 3)
    assert steps.last == "eager" and ran == [1, 2, 3]        # and eager from then on
    assert steps.counts == {"eager": 2, "captured": 0, "replayed": 0}


def test_capture_that_works_still_replays_with_the_fake_driver(monkeypatch):
    # The same fakes on the good path: captured once, launched, every stream rejoined.
    from mirrored.program import capture
    from mirrored.ring import RingAllReduce
    fake = FakeCapture()
    monkeypatch.setattr(capture, "_driver_api", lambda: (fake, fake, fake))
    monkeypatch.setattr(capture._dev, "cuda_mode", lambda: "real")
    steps = capture.StepGraphs(fake_gpus(2), RingAllReduce())
    how = []
    for _ in range(3):                                       # (the key's first run was the caller's)
        steps.run("k", lambda: None)
        how.append(steps.last)
    assert how == ["replayed", "replayed", "replayed"]
    assert [e[0] for e in fake.log].count("launch") == 3
    assert ("instantiate", "graph") in fake.log
    steps.close()
    assert ("exec-destroy", "exe") in fake.log


# --- 6. uploads go through pinned staging buffers, reused per batch shape ----------------

def test_uploads_stage_through_reused_pinned_buffers(devices, monkeypatch, rng):
    # From pageable memory a real driver may block the host until the stream drains; the
    # simulator copies synchronously either way, so we check where the bytes come from.
    from numba import cuda
    from mirrored import devices as registry
    gpu = devices(cpus=1, gpus=1)[1]
    dst = gpu.empty((5, 3), np.float32)
    DeviceArray = type(dst)                   # the simulator's, or numba-cuda's on a GPU

    class Pinned(np.ndarray):
        """Marks the arrays that cuda.pinned_array made."""

    made, sources = [], []
    real_pinned, real_copy = cuda.pinned_array, registry.copy_host_to_device

    def pinned_array(shape, dtype=np.float64, **kw):
        made.append((tuple(shape), np.dtype(dtype)))
        return real_pinned(shape, dtype, **kw).view(Pinned)

    def copy_host_to_device(dst, host, stream):      # the one copy upload_into makes
        assert type(dst) is DeviceArray and stream is gpu.stream
        sources.append(host)
        return real_copy(dst, host, stream)

    monkeypatch.setattr(cuda, "pinned_array", pinned_array)
    monkeypatch.setattr(registry, "copy_host_to_device", copy_host_to_device)
    for step in range(4):
        x = rng.standard_normal((5, 3)).astype(np.float32)
        gpu.upload_into(dst, x)
        np.testing.assert_array_equal(gpu.to_numpy(dst), x)
    assert sources and all(isinstance(a, Pinned) for a in sources), \
        "upload_into must copy from a pinned host buffer, not from the caller's pageable array"
    assert made == [((5, 3), np.dtype(np.float32))] * registry.STAGING_BUFFERS, (
        f"expected {registry.STAGING_BUFFERS} pinned buffers for one batch shape, made once "
        f"and reused; made {made}")
    assert len({id(a.base if a.base is not None else a) for a in sources}) <= registry.STAGING_BUFFERS


# --- 7. no allocation per call for buffers nobody holds -----------------------------------

def test_custom_loop_loss_reuses_its_internal_buffers(devices, monkeypatch, rng):
    # Each allocation freed later joins numba's deferred frees, flushed with a device-wide
    # sync about every ten: a buffer nobody holds must be made once, not every step.
    import mirrored as tf
    dev = devices(cpus=1, gpus=1)[1]                          # a (simulated) GPU
    with tf.device(dev.name):
        model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.integers(0, 3, 5)
    made = []
    real_empty = type(dev).empty
    monkeypatch.setattr(type(dev), "empty", lambda self, shape, dtype: made.append(tuple(shape)) or real_empty(self, shape, dtype))
    steps = 3
    for _ in range(steps):
        with tf.device(dev.name), tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=5)
        assert loss.device == dev.name
        tape.gradient(loss, model.trainable_variables)
    # per step: the per-example losses and the scalar loss, which the caller holds;
    # once: the correct-prediction flags that nobody reads.
    assert made.count((5,)) == steps + 1, f"per-example-sized allocations in {steps} steps: {made}"


# --- 8. timing: one anchor per card, precise far from it, no sync after the first ----------

class FakeEventClock:
    """numba.cuda's events on a fake clock shared by host and GPU (the GPU runs work the
    moment it is queued), with cuEventElapsedTime's float32 milliseconds."""

    def __init__(self):
        self.now = 0.0
        self.syncs = []
        clock = self

        class Event:
            def record(self, stream=0):
                self.t = clock.now

            def synchronize(self):
                pass

        self.Event = Event

    def perf_counter(self):
        return self.now

    def event(self, timing=True):
        return self.Event()

    def event_elapsed_time(self, a, b):
        return float(np.float32((b.t - a.t) * 1e3))          # what the driver returns

    def device(self, name, gpu_id=0):
        import contextlib
        from types import SimpleNamespace
        stream = SimpleNamespace(synchronize=lambda: self.syncs.append(name))
        return SimpleNamespace(name=name, gpu_id=gpu_id, device_type="GPU", stream=stream,
                               activate=contextlib.nullcontext)


@pytest.fixture
def event_clock(monkeypatch):
    from types import SimpleNamespace
    from numba import cuda
    from mirrored.lab import timing
    clock = FakeEventClock()
    monkeypatch.setattr(timing, "_uses_events", lambda device: device is not None)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(cuda, "event", clock.event)
    monkeypatch.setattr(cuda, "event_elapsed_time", clock.event_elapsed_time, raising=False)  # not in the simulator
    return clock


def test_logical_gpus_of_one_card_share_one_anchor(event_clock):
    # One anchor (one host sync) per card: a second per logical device only adds skew.
    from mirrored.lab import timing
    gpu0, gpu1 = event_clock.device("GPU:0"), event_clock.device("GPU:1")
    timer = timing.PhaseTimer()
    event_clock.now = 0.5
    with timer.phase("forward", 0, gpu0):
        event_clock.now = 0.6
    with timer.phase("forward", 1, gpu1):
        event_clock.now = 0.7
    assert len(event_clock.syncs) == 1, f"host syncs to anchor two logical GPUs of one card: {event_clock.syncs}"
    starts = sorted(round(r[2], 9) for r in timer.records())
    assert starts == [0.5, 0.6]


def test_phase_times_stay_precise_long_after_the_first_mark(event_clock):
    # cuEventElapsedTime is float32 ms: measured from a 100 s old anchor, an 8 µs phase
    # came out as a multiple of 7.8 µs.
    from mirrored.lab import timing
    gpu0 = event_clock.device("GPU:0")
    timer = timing.PhaseTimer()
    with timer.phase("warm-up", 0, gpu0):
        event_clock.now = 0.001
    event_clock.now = 100.0
    with timer.phase("step", 0, gpu0):
        event_clock.now = 100.000008
    (_, _, start, end), = [r for r in timer.records() if r[1] == "step"]
    assert abs((end - start) - 8e-6) < 1e-7, f"an 8 µs phase measured as {(end - start) * 1e6:.3f} µs"
    assert abs(start - 100.0) < 1e-5
    assert len(event_clock.syncs) == 1, "only the card's first anchor may sync the host"


# --- 9. kernel level: gather's row numbers checked on the host; the GPU's launch constants --

def test_resident_gather_checks_row_numbers_before_launching(devices, forbid_launches):
    # Out-of-range row numbers: the simulator raises inside the kernel, a GPU reads
    # other memory or loses its context. They must be refused on the host.
    from types import SimpleNamespace
    from kernels import gather
    from mirrored.input_lib import ResidentRows
    gpu = devices(cpus=1, gpus=1)[1]
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    resident = ResidentRows(SimpleNamespace(columns=(x,)), [gpu])
    out = gpu.empty((2, 2), np.float32)
    forbid_launches(gather)
    for bad in ([0, 6], [-1, 2]):
        with pytest.raises(IndexError, match=r"\[0, 6\)"):
            resident.gather(0, np.array(bad, np.int64), [(0, out)])


#: The launch constants a GPU uses (kernels/launch.py, kernels/reduction.py); the
#: simulator's defaults are smaller because each CUDA thread is a Python thread.
GPU_LAUNCH_CONSTANTS = {"launch": {"THREADS_1D": 256},
                        "reduction": {"SUM_THREADS": 256, "SUM_BLOCKS": 256,
                                      "AXIS_COLS": 32, "AXIS_ROWS": 8},
                        "softmax_xent": {"STAGE_ROWS": 256, "STAGE_FLOATS": 256 * 16}}


def test_kernels_compute_the_same_with_the_gpu_launch_constants(monkeypatch, rng):
    # The simulator normally runs 32-thread blocks, a 4-block sum_all and an 8 x 4
    # sum_axis block: the shared-memory trees at the GPU's sizes (256; 32 x 8) never ran.
    # Small grids keep it quick: a few blocks of 256 threads each.
    import importlib
    from numba import cuda
    from kernels import elementwise, reduction, softmax_xent
    from conftest import assert_sum_close
    for module, constants in GPU_LAUNCH_CONSTANTS.items():
        mod = importlib.import_module(f"kernels.{module}")
        for name, value in constants.items():
            monkeypatch.setattr(mod, name, value)
    from kernels.launch import grid_1d
    assert grid_1d(300)[1] == 256, "the launchers must read THREADS_1D when they launch"
    x = rng.standard_normal(700).astype(np.float32)              # 3 blocks of 256
    out = poisoned((1,))
    reduction.sum_all(cuda.to_device(x), out)
    assert_sum_close(out.copy_to_host()[0], x)
    x3 = rng.standard_normal((2, 19, 33)).astype(np.float32)     # 2 x 2 blocks of 32 x 8
    out = poisoned((2, 33))
    reduction.sum_axis(cuda.to_device(x3), out)
    assert_sum_close(out.copy_to_host(), x3, axis=1)
    y = rng.standard_normal(300).astype(np.float32)
    out = poisoned((300,))
    elementwise.binary("add", cuda.to_device(x[:300]), cuda.to_device(y), out)
    assert_close("add with 256-thread blocks", out.copy_to_host(), x[:300].astype(np.float64) + y, 1e-6)
    logits = rng.standard_normal((260, 3)).astype(np.float32)    # one row per thread: 2 blocks
    labels = rng.integers(0, 3, 260).astype(np.int64)
    loss, grad, correct = poisoned((260,)), poisoned((260, 3)), poisoned((260,))
    softmax_xent.softmax_xent(cuda.to_device(logits), cuda.to_device(labels), loss, grad, correct)
    want = np.zeros(260), np.zeros((260, 3)), np.zeros(260)
    softmax_xent.softmax_xent_ref(logits.astype(np.float64), labels, *want)
    assert_close("softmax_xent loss with 256-thread blocks", loss.copy_to_host(), want[0], 1e-5, 1e-6)
    assert_close("softmax_xent grad with 256-thread blocks", grad.copy_to_host(), want[1], 1e-5, 1e-6)


# --- 10. copies between physical GPUs use the peer copy --------------------------------------

def test_copies_between_physical_gpus_use_the_peer_copy(devices, monkeypatch, rng):
    # numba's copy_to_device between two contexts issues cuMemcpyDtoDAsync, which only
    # works through unified addressing; CUDA names cuMemcpyPeerAsync for it. The
    # simulator has one GPU, so the second logical GPU pretends to be on card 1 and the
    # peer copy is recorded (and done with a plain copy).
    from mirrored import devices as registry
    from mirrored.ring import RingAllReduce
    from mirrored.values import PerReplica
    import mirrored as tf
    gpu0, gpu1 = [d for d in devices(cpus=1, gpus=2) if d.device_type == "GPU"]
    monkeypatch.setattr(gpu1, "gpu_id", 1)
    monkeypatch.setattr(gpu1, "activate", gpu0.activate)      # the simulator's one card
    peer = []

    def memcpy_peer(dst_dev, dst, src_dev, src, nbytes):
        peer.append((src_dev.gpu_id, dst_dev.gpu_id, nbytes))
        dst.reshape(dst.size).copy_to_device(src.reshape(src.size))

    monkeypatch.setattr(registry, "_memcpy_peer", memcpy_peer)
    x = rng.standard_normal(10).astype(np.float32)
    out = gpu1.copy_from(gpu0.from_numpy(x), gpu0)
    np.testing.assert_array_equal(gpu1.to_numpy(out), x)
    assert peer == [(0, 1, 40)], f"copy_from across cards must be one peer copy: {peer}"
    peer.clear()
    gpu0.copy_from(gpu0.from_numpy(x), gpu0)                  # same card: no peer copy
    assert peer == []
    xs = [rng.standard_normal(11).astype(np.float32) for _ in range(2)]
    comps = []
    for dev, xi in zip((gpu0, gpu1), xs):
        with tf.device(dev.name):
            comps.append(tf.constant(xi))
    got = RingAllReduce(peer_access=False).reduce("SUM", PerReplica(comps))
    for value in got.values:
        np.testing.assert_allclose(value.numpy(), xs[0].astype(np.float64) + xs[1], rtol=1e-6)
    # a 2-ring moves each of its 2 chunks once per phase per device: 4 copies, all peer copies
    assert len(peer) == 4 and {p[:2] for p in peer} == {(0, 1), (1, 0)}, peer


# --- 11. numba's low-occupancy warning is silenced for our (small by design) launches -------

@pytest.mark.parametrize("simulator", [True, False])
def test_launch_silences_only_the_low_occupancy_warning(monkeypatch, simulator):
    # numba-cuda warns when a launch is configured with fewer than 128 blocks; the
    # simulator never does, so a fake kernel warns as numba-cuda's configuration does.
    import warnings
    from kernels import launch
    monkeypatch.setattr(launch, "SIMULATOR", simulator)
    monkeypatch.setattr(launch, "_configured", {})

    class Kernel:
        def __init__(self, message):
            self.message, self.calls = message, 0

        def __getitem__(self, config):
            warnings.warn(self.message, UserWarning)    # the category differs by numba version
            return self

        def __call__(self, *args):
            self.calls += 1

    quiet = Kernel("Grid size 1 will likely result in GPU under-utilization due to low occupancy.")
    # As numba-cuda printed it on the H100 machine, where numba colours its messages:
    bold = Kernel("\x1b[1m\x1b[1mGrid size 10 will likely result in GPU under-utilization due "
                  "to low occupancy.\x1b[0m\x1b[0m")
    other = Kernel("something else about this kernel")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch.launch(quiet, 1, 32, None)
        launch.launch(bold, 1, 32, None)
        launch.launch(other, 1, 32, None)
    assert quiet.calls == bold.calls == other.calls == 1
    assert [str(w.message) for w in caught] == ["something else about this kernel"]
