"""Ring all-reduce: kernels/allreduce.py and RingAllReduce in mirrored/ring.py.

What is checked, and on what:
* the two step kernels against their NumPy references (simulator: tiny chunks);
* RingAllReduce on N = 1..8 logical CPU devices and N = 1..4 simulated logical
  GPUs, sizes 0, 1, N-1, N+1, primes (and one large buffer on CPU), float32 and
  int32: every device ends with *bitwise* the same result, equal to a float64
  NumPy sum within float32 rounding, and a rerun gives the same bits;
* the step record of a 4-device ring against the textbook schedule;
* the staged path (no peer access), fusion in batch_reduce, MEAN, agreement
  with ReductionToOneDevice, a property test over (N, size);
* bad input is refused before anything runs, every input left as it was.

    python -m pytest tests/test_ring_allreduce.py -q
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mirrored as tf
from kernels import allreduce
from mirrored.cross_device_ops import ReductionToOneDevice
from mirrored.ring import STAGING, RingAllReduce, RingStep, RingTransfer
from mirrored.values import PerReplica

#: float32 unit roundoff scale: a float32 sum of N terms is within
#: N * eps * sum|x_i| of the exact sum (each of the N-1 additions rounds once).
F32_EPS = float(np.finfo(np.float32).eps)

#: Buffer sizes every ring is tried on, besides 0, 1, N-1 and N+1 (primes: never divisible by N).
PRIMES = (7, 13)

#: One large buffer (CPU only; the simulator runs a Python thread per CUDA thread).
LARGE = (1 << 20) + 3


# --- helpers -----------------------------------------------------------------------

def sizes_for(n, extra=()):
    return sorted({0, 1, max(n - 1, 0), n + 1, *PRIMES, *extra})


def cpu_devices(devices, n):
    """N logical CPU devices (the fixture also lists the first GPU, if any: left out)."""
    return [d for d in devices(cpus=n) if d.device_type == "CPU"]


def gpu_devices(devices, n):
    """N logical GPUs carved from the first (real or simulated) GPU."""
    return [d for d in devices(cpus=1, gpus=n) if d.device_type == "GPU"]


def make_inputs(rng, n, size, dtype):
    """One random input per replica: float32 normals or small int32 (no overflow)."""
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(size).astype(dtype) for _ in range(n)]
    return [rng.integers(-1000, 1000, size).astype(dtype) for _ in range(n)]


def per_replica(xs, devs):
    return PerReplica([tf.constant(x, device=d) for x, d in zip(xs, devs)])


def results(mirrored_value):
    return [v.numpy() for v in mirrored_value.values]


def assert_bitwise_equal(arrays, what=""):
    first = arrays[0]
    for i, a in enumerate(arrays[1:], start=1):
        assert a.dtype == first.dtype and a.shape == first.shape, what
        if a.tobytes() != first.tobytes():
            bad = np.flatnonzero(a.reshape(-1) != first.reshape(-1))[:5]   # empty for -0.0 vs 0.0
            pytest.fail(f"{what}: replica {i} differs from replica 0 bitwise (flat indices {bad}: "
                        f"{a.reshape(-1)[bad]} vs {first.reshape(-1)[bad]}); shape {a.shape}")


def assert_matches_f64_sum(got, xs, what=""):
    """``got`` equals the float64 sum of ``xs`` (exactly for ints, to float32 rounding else)."""
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0).reshape(np.shape(got))
    assert got.dtype == xs[0].dtype, what
    if got.dtype.kind in "iu":
        np.testing.assert_array_equal(got, exact.astype(got.dtype), err_msg=what)
        return
    bound = len(xs) * F32_EPS * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    bound = bound.reshape(np.shape(got)) + 1e-30
    err = np.abs(got.astype(np.float64) - exact)
    if np.any(err > bound):
        i = int(np.flatnonzero(err.reshape(-1) > bound.reshape(-1))[0])
        rel = np.max(err / (np.abs(exact) + 1e-30))
        pytest.fail(f"{what}: max abs error {err.max():.3g} (rel {rel:.3g}); "
                    f"first bad flat index {i}: got {got.reshape(-1)[i]!r}, float64 sum "
                    f"{exact.reshape(-1)[i]!r}, bound {bound.reshape(-1)[i]:.3g}; shape {got.shape}")


def check_ring(devs, xs, ring=None, what=""):
    """Reduce ``xs`` (one per device) twice with the ring; check everything promised."""
    ring = ring or RingAllReduce()
    first = results(ring.reduce("SUM", per_replica(xs, devs)))
    assert_bitwise_equal(first, f"{what} replicas")
    assert_matches_f64_sum(first[0], xs, what)
    again = results(ring.reduce("SUM", per_replica(xs, devs)))
    assert_bitwise_equal([first[0], *again], f"{what} rerun")
    return first[0]


# --- the step kernels against their references (simulator on CPU-only machines) ---

@pytest.mark.parametrize("lo,hi", [(0, 1), (3, 9), (0, 40), (39, 40), (5, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_step_kernels_match_refs(lo, hi, dtype, rng):
    from numba import cuda
    size = 40
    own, peer = make_inputs(rng, 2, size, dtype)
    want_add = allreduce.ring_reduce_step_ref(own.copy(), peer, lo, hi)
    want_copy = allreduce.ring_gather_step_ref(own.copy(), peer, lo, hi)
    d_own, d_peer = cuda.to_device(own), cuda.to_device(peer)
    allreduce.ring_reduce_step(d_own, d_peer, lo, hi)
    np.testing.assert_array_equal(d_own.copy_to_host(), want_add)   # outside [lo, hi) untouched
    d_own = cuda.to_device(own)
    allreduce.ring_gather_step(d_own, d_peer, lo, hi)
    np.testing.assert_array_equal(d_own.copy_to_host(), want_copy)
    np.testing.assert_array_equal(d_peer.copy_to_host(), peer)       # the peer is only read


def test_step_launchers_refuse_bad_arguments():
    from numba import cuda
    own = cuda.to_device(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="not inside the buffer"):
        allreduce.ring_reduce_step(own, cuda.to_device(np.zeros(8, np.float32)), 3, 9)
    with pytest.raises(ValueError, match="not inside the buffer"):
        allreduce.ring_gather_step(own, cuda.to_device(np.zeros(8, np.float32)), 5, 4)
    with pytest.raises(TypeError, match="float32"):
        allreduce.ring_reduce_step(own, cuda.to_device(np.zeros(8, np.int32)), 0, 8)
    with pytest.raises(ValueError, match="shape"):
        allreduce.ring_reduce_step(own, cuda.to_device(np.zeros(9, np.float32)), 0, 8)


# --- the schedule as plain data --------------------------------------------------------

@pytest.mark.parametrize("size,n", [(0, 3), (2, 4), (7, 3), (10, 4), (12, 4), (13, 8)])
def test_chunk_bounds_cover_the_buffer_evenly(size, n):
    bounds = RingAllReduce.chunk_bounds(size, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))           # contiguous
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1                                  # balanced


def test_bytes_moved_ring_vs_reduce_to_one():
    moved = RingAllReduce.bytes_moved(size=1000, n=4, itemsize=4)            # 4000-byte buffer
    for dev in moved["ring"]:                                                # 2(N-1)/N of it
        assert dev == {"sent": 6000, "received": 6000}
    assert moved["reduce_to_one"][0] == {"sent": 12000, "received": 12000}  # the hub: N-1 buffers
    assert moved["reduce_to_one"][1:] == [{"sent": 4000, "received": 4000}] * 3
    uneven = RingAllReduce.bytes_moved(size=10, n=4, itemsize=1)
    assert sum(d["sent"] for d in uneven["ring"]) == 2 * 3 * 10              # every chunk, 2(N-1) hops


# The N = 4 schedule, written out by hand (the class docstring draws the same table):
# row = step, entry i = the chunk device i sends to device i+1.
TEXTBOOK_4 = [("reduce-scatter", 0, [0, 1, 2, 3]),
              ("reduce-scatter", 1, [3, 0, 1, 2]),
              ("reduce-scatter", 2, [2, 3, 0, 1]),
              ("all-gather", 0, [1, 2, 3, 0]),
              ("all-gather", 1, [0, 1, 2, 3]),
              ("all-gather", 2, [3, 0, 1, 2])]


def expected_holds(n, phase, step, d, c):
    """Replica ids in chunk c on device d after a step (derived by hand, not from the code).

    Chunk c starts on device c and, in reduce-scatter, moves one device on per
    step, picking up that device's contribution: after RS step s it has reached
    device c+s+1. A device k = (d - c) mod N hops after c got it at RS step k-1
    and keeps {c, c+1, ..., c+k} (= {c..d}) from then on. After RS, device c-1
    holds the full sum; AG step g copies it on to device c+g.
    """
    k = (d - c) % n
    reached = step + 1 if phase == "reduce-scatter" else n - 1
    partial = frozenset((c + j) % n for j in range(k + 1)) if 1 <= k <= reached else frozenset([d])
    if phase == "all-gather" and (k == n - 1 or k <= step):
        return frozenset(range(n))
    return partial


def test_trace_of_a_4_ring_is_the_textbook_schedule(devices, rng):
    devs = cpu_devices(devices, 4)
    size = 10                                            # chunks [0,2) [2,5) [5,7) [7,10)
    ring = RingAllReduce(keep_steps=True)
    ring.reduce("SUM", per_replica(make_inputs(rng, 4, size, np.float32), devs))
    assert len(ring.steps) == 2 * (4 - 1) and all(isinstance(s, RingStep) for s in ring.steps)
    bounds = [(0, 2), (2, 5), (5, 7), (7, 10)]
    for step, (phase, index, chunks) in zip(ring.steps, TEXTBOOK_4):
        assert (step.phase, step.step, step.size, step.dtype) == (phase, index, size, "float32")
        op = "add" if phase == "reduce-scatter" else "copy"
        assert step.transfers == tuple(RingTransfer(i, (i + 1) % 4, c, *bounds[c], op)
                                       for i, c in enumerate(chunks))
        for d in range(4):
            for c in range(4):
                assert step.holds[d][c] == expected_holds(4, phase, index, d, c), (phase, index, d, c)
    # Two states spelled out, to read along the class docstring:
    after_rs0 = ring.steps[0].holds
    assert [after_rs0[d][(d - 1) % 4] for d in range(4)] == [{3, 0}, {0, 1}, {1, 2}, {2, 3}]
    after_rs = ring.steps[2].holds                        # device i has all of chunk i+1
    assert [after_rs[d][(d + 1) % 4] for d in range(4)] == [frozenset(range(4))] * 4
    assert all(c == frozenset(range(4)) for dev in ring.steps[-1].holds for c in dev)
    as_dict = ring.steps[0].as_dict()                     # JSON-friendly form for notebooks
    assert as_dict["transfers"][0] == {"src": 0, "dst": 1, "chunk": 0, "lo": 0, "hi": 2, "op": "add"}
    assert as_dict["holds"][1][0] == [0, 1]


def test_trace_is_reset_per_call_and_covers_each_fused_buffer(devices, rng):
    devs = cpu_devices(devices, 3)
    ring = RingAllReduce(keep_steps=True)
    f, i = make_inputs(rng, 3, 5, np.float32), make_inputs(rng, 3, 4, np.int32)
    ring.batch_reduce("SUM", [(per_replica(f, devs), None), (per_replica(i, devs), None)])
    assert [(s.buffer, s.dtype) for s in ring.steps] == [(0, "float32")] * 4 + [(1, "int32")] * 4
    ring.reduce("SUM", per_replica(f, devs))
    assert len(ring.steps) == 4
    ring.reduce("SUM", per_replica(f[:1], devs[:1]))      # one replica: nothing to do, empty record
    assert ring.steps == []
    assert RingAllReduce().steps is None                  # no record by default
    flat = [np.full(6, i + 1, np.float32) for i in range(3)]   # already fused buffers
    for _ in range(2):
        ring.all_reduce_flat("SUM", flat, devs)
        assert len(ring.steps) == 4
    assert_bitwise_equal(flat, "all_reduce_flat")
    np.testing.assert_array_equal(flat[0], np.full(6, 6 * 3, np.float32))   # (1+2+3), then x3


# --- correctness on CPU devices (fast: every N and size) -------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("n", range(1, 9))
def test_ring_on_cpu_devices(n, dtype, devices, rng):
    devs = cpu_devices(devices, n)
    for size in sizes_for(n, extra=(LARGE,) if n in (2, 8) else ()):
        check_ring(devs, make_inputs(rng, n, size, dtype), what=f"N={n} size={size} {np.dtype(dtype)}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 8), size=st.integers(0, 300), seed=st.integers(0, 2 ** 32 - 1),
       dtype=st.sampled_from([np.float32, np.int32]))
def test_property_ring_equals_sum_on_every_replica(devices, n, size, seed, dtype):
    devs = cpu_devices(devices, n)
    xs = make_inputs(np.random.default_rng(seed), n, size, dtype)
    check_ring(devs, xs, what=f"N={n} size={size} seed={seed}")


# --- correctness on simulated logical GPUs (tiny: a Python thread per CUDA thread) -----

@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("n", range(1, 5))
def test_ring_on_logical_gpus(n, dtype, devices, rng):
    devs = gpu_devices(devices, n)
    for size in sorted({0, 1, max(n - 1, 1), n + 1, 7}):
        out = check_ring(devs, make_inputs(rng, n, size, dtype), what=f"GPU N={n} size={size}")
        assert out.shape == (size,)


def test_staged_path_gives_the_same_bits(devices, rng):
    """peer_access=False copies each chunk into a scratch buffer first: same order, same bits."""
    devs = gpu_devices(devices, 3)
    size = 37                                                # no other test stages this size

    def staged_buffers():
        return [key for dev in devs for key in dev.caches()[0] if key[:2] == (STAGING, (size,))]

    xs = make_inputs(rng, 3, size, np.float32)
    direct = RingAllReduce()
    by_direct = results(direct.reduce("SUM", per_replica(xs, devs)))[0]
    assert not staged_buffers(), "logical GPUs read each other directly: nothing to stage"
    got = check_ring(devs, xs, ring=RingAllReduce(peer_access=False), what="staged")
    assert staged_buffers(), "the staged path was not taken"
    assert_bitwise_equal([got, by_direct], "staged vs direct")


@pytest.mark.multigpu
def test_ring_across_physical_gpus_peer_and_staged(devices, rng):
    """Two or more physical GPUs (one logical device each): peer access and staged copies."""
    devs = [d for d in devices(cpus=1) if d.device_type == "GPU"]
    xs = make_inputs(rng, len(devs), 1 << 16, np.float32)
    peer = check_ring(devs, xs, what="peer access")
    staged = check_ring(devs, xs, ring=RingAllReduce(peer_access=False), what="staged")
    assert_bitwise_equal([peer, staged], "peer vs staged")


# --- fusion, MEAN, and the baseline ----------------------------------------------------

FUSED = [((3, 4), np.float32), ((5,), np.int32), ((2, 1, 3), np.float32), ((), np.float32),
         ((0,), np.float32), ((7,), np.int32)]


@pytest.mark.parametrize("kind,n", [("CPU", 3), ("GPU", 2)])
def test_batch_reduce_fuses_shapes_and_dtypes(kind, n, devices, rng):
    devs = cpu_devices(devices, n) if kind == "CPU" else gpu_devices(devices, n)
    values = [[x.reshape(shape) for x in make_inputs(rng, n, int(np.prod(shape)), dtype)]
              for shape, dtype in FUSED]
    ring = RingAllReduce(keep_steps=True)
    out = ring.batch_reduce("SUM", [(per_replica(xs, devs), None) for xs in values])
    assert len({s.buffer for s in ring.steps}) == 2          # one fused buffer per dtype
    for (shape, _), xs, mirrored_value in zip(FUSED, values, out):
        got = results(mirrored_value)
        assert got[0].shape == shape
        assert_bitwise_equal(got, f"{shape}")
        assert_matches_f64_sum(got[0], xs, f"{shape}")
    floats = [xs for (_, dt), xs in zip(FUSED, values) if dt == np.float32]
    means = ring.batch_reduce("MEAN", [(per_replica(xs, devs), None) for xs in floats])
    for xs, mirrored_value in zip(floats, means):
        got = results(mirrored_value)
        assert_bitwise_equal(got, "MEAN")
        exact = np.mean([x.astype(np.float64) for x in xs], axis=0)
        bound = (n + 1) * F32_EPS * np.mean([np.abs(x.astype(np.float64)) for x in xs], axis=0)
        assert np.all(np.abs(got[0] - exact) <= bound + 1e-30), "MEAN"


@pytest.mark.parametrize("kind,n,size", [("CPU", 5, 37), ("GPU", 3, 9)])
def test_same_values_as_reduction_to_one_device(kind, n, size, devices, rng):
    devs = cpu_devices(devices, n) if kind == "CPU" else gpu_devices(devices, n)
    xs = make_inputs(rng, n, size, np.float32)
    ring = results(RingAllReduce().reduce("SUM", per_replica(xs, devs)))
    hub = results(ReductionToOneDevice().reduce("SUM", per_replica(xs, devs)))
    # Different order of additions: equal to float32 rounding, not necessarily bitwise.
    bound = n * F32_EPS * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    assert np.all(np.abs(ring[0].astype(np.float64) - hub[0]) <= 2 * bound + 1e-30)
    assert_bitwise_equal(ring, "ring replicas")


# --- bad input: refused before anything runs, inputs untouched --------------------------

def _snapshot(pr):
    return [v.numpy().copy() for v in pr.values]


def _assert_untouched(pr, before):
    for v, b in zip(pr.values, before):
        np.testing.assert_array_equal(v.numpy(), b)
        assert v.numpy().dtype == b.dtype


def test_bad_input_is_refused_and_inputs_are_untouched(devices, rng):
    d0, d1, d2 = cpu_devices(devices, 3)
    x = make_inputs(rng, 3, 4, np.float32)
    cases = {   # name: (one input per replica, their devices, the error's message)
        "different shapes": ([x[0], np.ones(5, np.float32), x[2]], [d0, d1, d2], "different tensors"),
        "different dtypes": ([x[0], x[1].astype(np.int32), x[2]], [d0, d1, d2], "different tensors"),
        "device twice": ([x[0], x[1], x[2]], [d0, d1, d0], "listed twice"),
    }
    error = ValueError
    for name, (arrays, devs, message) in cases.items():
        pr = per_replica(arrays, devs)
        before = _snapshot(pr)
        with pytest.raises(error, match=message):
            RingAllReduce().reduce("SUM", pr)
        _assert_untouched(pr, before)
        good = per_replica(x, [d0, d1, d2])                  # a good value batched with a bad one
        good_before = _snapshot(good)
        with pytest.raises(error, match=message):
            RingAllReduce().batch_reduce("SUM", [(good, None), (pr, None)])
        _assert_untouched(good, good_before)
        _assert_untouched(pr, before)
    with pytest.raises(ValueError, match="empty"):
        RingAllReduce().reduce("SUM", PerReplica([]))
    with pytest.raises(TypeError, match="mirrored.Tensor"):
        RingAllReduce().reduce("SUM", PerReplica([np.ones(3), np.ones(3)]))


def test_mixed_cpu_and_gpu_ring_is_refused(devices, rng):
    devs = devices(cpus=1, gpus=1)                           # CPU:0 and (simulated) GPU:0
    pr = per_replica(make_inputs(rng, 2, 6, np.float32), devs)
    before = _snapshot(pr)
    with pytest.raises(ValueError, match="mixes CPU and GPU.*ReductionToOneDevice"):
        RingAllReduce().reduce("SUM", pr)
    _assert_untouched(pr, before)


def test_sum_in_place_refuses_mismatched_buffers_before_launching(devices):
    """The hook itself checks too (the base class validates tensors; benchmarks call the hook)."""
    d0, d1 = cpu_devices(devices, 2)
    a, b = np.ones(4, np.float32), np.ones(5, np.float32)
    with pytest.raises(ValueError, match="expected flat"):
        RingAllReduce()._sum_in_place([a, b], [d0, d1])
    np.testing.assert_array_equal(a, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="listed twice"):
        RingAllReduce()._sum_in_place([a, a.copy()], [d0, d0])
    with pytest.raises(ValueError, match="empty"):
        RingAllReduce()._sum_in_place([], [])
