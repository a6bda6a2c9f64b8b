"""``benchmarks.common.time_gpu`` times the GPU, not the host: shown with no GPU.

A stand-in for numba.cuda and the driver (``FakeGPU``) keeps a host clock and one stream's GPU
timeline. A launch from Python costs the host ``host_us``; its kernel runs ``kernel_us`` on the
GPU, after the kernel before it and not before it was launched. Events stamp the moment the GPU
reaches them. Stream capture records launches instead of running them; a graph replay runs them
back to back for one host call. With a slow host (launch dearer than kernel), events around
back-to-back launches (``time_launches``, the old ``time_gpu``) measure the host; events around a
captured graph (``time_gpu``) measure the kernel.
"""
import contextlib
import types

import numpy as np
import pytest

from benchmarks import common

#: Host time of one graph replay call (the driver's cost for the whole graph), µs.
GRAPH_LAUNCH_US = 5.0


class FakeGPU:
    """numba.cuda, numba-cuda's driver and the CUDA bindings as ``time_gpu`` uses them."""

    def __init__(self, host_us, kernel_us):
        self.host_us, self.kernel_us = host_us, kernel_us
        self.host = 0.0              # µs, the host's clock
        self.gpu_free = 0.0          # µs, when the GPU has finished everything queued
        self.capturing = None        # the kernels recorded by a capture in progress
        self.calls = []              # driver calls, by name
        gpu = self

        class Event:
            def __init__(self, timing=True):
                self.t = None

            def record(self, stream=0):
                self.t = max(gpu.gpu_free, gpu.host)

            def synchronize(self):
                gpu.host = max(gpu.host, self.t)

        class Stream:
            handle = 7

            def synchronize(self):
                gpu.host = max(gpu.host, gpu.gpu_free)

        self.cuda = types.SimpleNamespace(
            event=Event, stream=Stream, defer_cleanup=contextlib.nullcontext,
            synchronize=lambda: Stream().synchronize(),
            event_elapsed_time=lambda a, b: (b.t - a.t) / 1e3)          # ms, as numba's
        self.binding = types.SimpleNamespace(CUstreamCaptureMode=types.SimpleNamespace(
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1))
        self.driver = types.SimpleNamespace(
            cuStreamBeginCapture=self._begin, cuStreamEndCapture=self._end,
            cuGraphInstantiate=lambda graph, flags: list(graph),
            cuGraphLaunch=self._replay, cuGraphExecDestroy=lambda exe: self.calls.append("exe-"),
            cuGraphDestroy=lambda graph: self.calls.append("graph-"))

    def _run(self, duration):
        self.gpu_free = max(self.gpu_free, self.host) + duration

    def launch(self, stream=0):
        """What a launcher does: one kernel, queued (or recorded, during a capture)."""
        self.host += self.host_us
        if self.capturing is not None:
            self.capturing.append(self.kernel_us)
        else:
            self._run(self.kernel_us)

    def _begin(self, handle, mode):
        self.calls.append("begin")
        self.capturing = []

    def _end(self, handle):
        self.calls.append("end")
        graph, self.capturing = self.capturing, None
        return graph

    def _replay(self, exe, handle):
        self.host += GRAPH_LAUNCH_US
        start = max(self.gpu_free, self.host)
        self.gpu_free = start + sum(exe)


@pytest.fixture
def rng():
    return np.random.default_rng()


def install(monkeypatch, gpu):
    monkeypatch.setattr(common, "_gpu_api", lambda: (gpu.cuda, gpu.driver, gpu.binding))


def test_a_slow_host_old_method_reports_host_time_graph_reports_kernel_time(monkeypatch, rng):
    host_us = float(rng.uniform(20, 80))           # a launch: dearer than its kernel
    kernel_us = float(rng.uniform(1, 10))
    gpu = FakeGPU(host_us, kernel_us)
    install(monkeypatch, gpu)
    old = common.time_launches(lambda: gpu.launch(), repeat=5)
    new = common.time_gpu(lambda s: gpu.launch(s), repeat=5)
    assert old["method"] == "back-to-back launches" and new["method"] == "graph"
    # The old method times the host (one launch per call), the new one the kernel; the graph's
    # own launch (the GPU waits for it once a sample) is spread over its calls: for a 1 µs
    # kernel that is ~3 % of the answer, so it is part of what is expected.
    assert old["median_s"] * 1e6 == pytest.approx(host_us, rel=0.02)
    spread = GRAPH_LAUNCH_US / new["calls_per_sample"]
    assert new["median_s"] * 1e6 == pytest.approx(kernel_us + spread, rel=0.005)
    assert spread < 0.05 * kernel_us
    assert new["calls_per_sample"] > 1
    assert gpu.calls.count("begin") == gpu.calls.count("end") == gpu.calls.count("graph-") == 2


def test_a_busy_gpu_both_methods_agree(monkeypatch, rng):
    kernel_us = float(rng.uniform(200, 400))       # the kernel outlasts its launch
    gpu = FakeGPU(float(rng.uniform(5, 50)), kernel_us)
    install(monkeypatch, gpu)
    # 50 calls per sample: the first launch's host cost, before the GPU is busy, is 1/50th.
    old = common.time_launches(lambda: gpu.launch(), repeat=3, number=50)
    new = common.time_gpu(lambda s: gpu.launch(s), repeat=3, number=50)
    assert old["median_s"] * 1e6 == pytest.approx(kernel_us, rel=0.02)
    assert new["median_s"] * 1e6 == pytest.approx(kernel_us, rel=0.02)


def test_a_function_without_a_stream_is_timed_the_old_way_and_says_so(monkeypatch, rng):
    gpu = FakeGPU(30.0, 2.0)
    install(monkeypatch, gpu)
    result = common.time_gpu(lambda: gpu.launch(), repeat=2)
    assert result["method"] == "back-to-back launches"
    assert "begin" not in gpu.calls


def test_a_failing_call_during_capture_ends_the_capture(monkeypatch):
    gpu = FakeGPU(30.0, 2.0)
    install(monkeypatch, gpu)
    calls = []

    def fn(stream):
        calls.append(gpu.capturing is not None)
        if gpu.capturing is not None:
            raise RuntimeError("an allocation inside the capture")
        gpu.launch(stream)

    with pytest.raises(RuntimeError, match="allocation"):
        common.time_gpu(fn, warmup=1, repeat=2, number=3)
    assert gpu.capturing is None and gpu.calls == ["begin", "end", "graph-"]
    assert calls == [False, True]


def test_a_run_with_a_stream_keyword_is_timed_on_the_stream():
    """``lambda stream=None: launcher(..., stream=stream)`` (benchmarks.kernels' conv and pooling
    cases) can be called plainly, to check it, and is still handed the stream to be captured."""
    from benchmarks import common
    assert common._takes_stream(lambda stream=None: stream)
    assert common._takes_stream(lambda s: s)
    assert not common._takes_stream(lambda: None)
    assert not common._takes_stream(lambda other=None: other)
