"""Capture: a step's launches held once as a CUDA graph, replayed with one driver call.

Why. One step of the lab model is about twenty small kernels. Launching a kernel
from Python costs several microseconds of host time, more than many of these
kernels take to run, so an eager step is bound by the host, not by the GPU.
CUDA can *record* a sequence of launches, copies and cross-stream waits once,
as a graph, and then replay the whole sequence with one call: the driver then
does per replay what Python did per kernel. (PyTorch offers the same through
``torch.cuda.CUDAGraph``.)

How, with the CUDA driver API that numba-cuda itself calls (``cuda.bindings``)::

    cuStreamBeginCapture(s0)          work queued on stream s0 is now recorded, not run
    fork.record(s0); fork.wait(s_i)   every other replica's stream joins the capture
    launches(...)                     a recorded program's launches, run again (replay.py)
    join_i.record(s_i); join_i.wait(s0)   ... and joins back
    graph = cuStreamEndCapture(s0)
    exe = cuGraphInstantiate(graph, 0)
    cuGraphLaunch(exe, s0)            one call per step from then on

What a captured step must not do, and how the training step (``keras/step.py``) avoids it:

* Take numbers from the host that change from step to step: launch arguments are
  frozen into the graph. The optimizer's per-step scalars (Adam's alpha) live in
  a device buffer that the host part of each step writes (``keras/optimizers.py``,
  ``begin_step``); the metrics count examples on the device (``keras/engine.py``);
  Dropout's step counter and key live on the device, advanced by a kernel in the step.
* Allocate, free or synchronise. Buffers are made during the first, eager step
  of each batch size and reused: the layers' buffers, gradients, the ring's events.
* Read other buffers than the ones it was captured with. Each replica's slice is
  copied (outside the graph, in the host part) into the same per-batch-size
  input buffers every step, so a graph is keyed by those buffers' addresses.

If a capture fails (the step did something a graph cannot hold, or the driver refused
it), ``_Graph.capture`` rejoins every replica's stream to the origin and ends the
capture, so no stream is left inside a broken capture, and ``StepGraphs.run`` warns
with the error and runs this step, and every later one, eagerly. Nothing queued during
a capture has run, so running the step eagerly then is a complete step.

``StepGraphs.run(key, fn)`` captures ``fn``'s launches the first time ``key`` is asked and
replays them from then on. What it captures is a recorded program's run of launches
(``replay.Program``): the key's first run was that recording, eager (it compiled the kernels
and made every buffer), so the first replay can be captured (``recording.record``, the one
first-run rule, for ``fit``'s passes in ``passes.py`` and a ``@function``'s trace alike).
Where there is nothing to capture (CPU devices, Numba's CUDA simulator, replicas on several
physical GPUs) nobody asks it (``reason`` says why).

So Dropout draws a new mask at every replay, the eager one for the same counter
(``kernels/dropout.py``, ``keras/layers.py``).

Neighbours: ``replay.py`` (a recorded program, whose runs of launches these graphs hold),
``recording.py`` (``record``: a key's first run, recorded), ``passes.py`` (fit's passes),
``ring.py`` (the ring: events between neighbours, captured as graph edges); the package
docstring tells the story.
"""
import warnings

from mirrored import devices as _dev


def _driver_api():
    """(numba.cuda, the CUDA driver, its bindings): one place, so tests can put fakes here."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import binding, driver
    return cuda, driver, binding


class CaptureError(RuntimeError):
    """Capturing a step as a CUDA graph failed; the step can still run eagerly."""


def why_not_capturable(devices, cross_device_ops=None):
    """None if a step over ``devices`` (summed by ``cross_device_ops``) can be captured
    as one graph, else the reason."""
    if any(d.device_type != "GPU" for d in devices):
        return "the step runs on CPU devices: there are no kernel launches to capture"
    if getattr(getattr(cross_device_ops, "workers", None), "size", 1) > 1:
        return ("the gradients are summed across workers: the ring's hops between workers are MPI "
                "messages sent from the host, which a CUDA graph cannot hold")
    if len(devices) > 1:
        from mirrored.ring import RingAllReduce
        if not isinstance(cross_device_ops, RingAllReduce):
            return (f"the gradients are summed by {type(cross_device_ops).__name__}; only "
                    f"RingAllReduce keeps its buffers and events from one call to the next")
        if cross_device_ops.steps is not None:
            return "the ring keeps a step record on every call (keep_steps=True), which a replay would skip"
        if len({d.gpu_id for d in devices}) > 1:
            return ("the replicas sit on several physical GPUs; this capture covers one GPU "
                    "(logical GPUs of one card)")
    if _dev.cuda_mode() != "real":
        return "Numba's CUDA simulator has no CUDA graphs"
    return None


class StepGraphs:
    """The CUDA graphs of recorded programs' runs of launches, one graph per key (see the
    module docstring). A key's first run is its recording (``recording.record``), made by
    the caller; ``run`` captures the key the first time it is asked and replays it after."""

    def __init__(self, devices, cross_device_ops=None, checked=False):
        """``checked``: the caller has found the launches capturable over ``devices``
        (``for_program``), else ``why_not_capturable``."""
        self.devices = list(devices)
        self.reason = None if checked else why_not_capturable(self.devices, cross_device_ops)
        self._graphs = {}          # key -> _Graph
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}
        self.last = None           # how the last run ran: "eager" or "replayed"

    @classmethod
    def for_program(cls, devices):
        """The graphs of a ``@function``'s program over ``devices``, or None where nothing can
        be captured (CPU devices, the simulator, several physical GPUs: the list is replayed)."""
        # the launches are recorded, not summed by a cross-device op: only the card matters
        if not devices or why_not_capturable(devices[:1]) is not None:
            return None
        if len({getattr(d, "gpu_id", None) for d in devices}) > 1:
            return None
        return cls(devices, checked=True)      # every replica's stream joins the capture

    @property
    def enabled(self):
        return self.reason is None

    def ran_eagerly(self):
        """Count a run the caller made eagerly itself: a key's first run, recorded
        (``passes.CapturedStep._run``, a ``@function``'s trace)."""
        self.last = "eager"
        self.counts["eager"] += 1

    def run(self, key, fn, *args):
        """Replay the launches ``fn(*args)`` makes, as one graph: captured the first time
        ``key`` is asked (the key's first run, its recording, compiled every kernel and made
        every buffer), replayed from then on. ``key`` must name everything the launches
        depend on (a program and its run of launches). ``self.last``: "replayed", or "eager"
        where the graph cannot be captured (``fn`` then runs as it is)."""
        graph = self._graphs.get(key) if self.enabled else None
        if graph is None and self.enabled:
            try:
                graph = _Graph.capture(self.devices, fn, args)
            except CaptureError as err:
                # Nothing of the step ran during the capture: run it eagerly, now and from
                # now on (a step that cannot be captured once will not be the next time).
                self.reason = f"capturing the step as a CUDA graph failed ({err})"
                warnings.warn(f"CUDA graphs (compile(run_eagerly=False)): {self.reason}; this and "
                              f"every later step runs eagerly (same results, more launch overhead).",
                              RuntimeWarning, stacklevel=4)
            else:
                self._graphs[key] = graph
                self.counts["captured"] += 1
        if graph is None:
            fn(*args)
            self.ran_eagerly()
            return
        graph.launch()
        self.last = "replayed"
        self.counts["replayed"] += 1

    def close(self):
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()


class _Graph:
    """One instantiated graph over the streams of ``devices`` (``devices[0]``'s is the origin)."""

    def __init__(self, devices, graph, exe, events):
        self.devices, self.graph, self.exe = devices, graph, exe
        self.before, self.after = events

    @classmethod
    def capture(cls, devices, fn, args):
        """Record ``fn(*args)`` over the streams of ``devices`` as one instantiated graph.

        Raises ``CaptureError`` (after ending the capture, every stream rejoined) if the
        step or the driver fails; other exceptions (KeyboardInterrupt) pass through after
        the same clean-up.
        """
        cuda, driver, binding = _driver_api()
        origin, others = devices[0], devices[1:]
        s0 = int(origin.stream.handle)
        with origin.activate(), cuda.defer_cleanup():     # no frees (they would sync) while capturing
            fork = cuda.event(timing=False)                # every event made before the capture
            joins = [cuda.event(timing=False) for _ in others]
            before = [cuda.event(timing=False) for _ in others]
            after = cuda.event(timing=False)
            # THREAD_LOCAL: an unsafe call from this thread (an allocation, a sync) fails
            # loudly instead of being recorded or silently breaking the capture.
            driver.cuStreamBeginCapture(s0, binding.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            try:
                fork.record(origin.stream)
                for d in others:
                    fork.wait(d.stream)                    # d's stream joins the capture
                fn(*args)
            except BaseException as err:
                cls._abandon(driver, origin, others, joins, s0)
                if isinstance(err, Exception):
                    raise CaptureError(f"{type(err).__name__}: {err}") from err
                raise
            problems = cls._rejoin(origin, others, joins)  # ... and join back before the end
            try:
                graph = driver.cuStreamEndCapture(s0)
            except Exception as err:                       # noqa: BLE001 (reported below)
                raise CaptureError(f"cuStreamEndCapture failed: {type(err).__name__}: {err}"
                                   + "".join(f"; {p}" for p in problems)) from err
            if problems:                                   # a stream did not rejoin: unusable
                driver.cuGraphDestroy(graph)
                raise CaptureError("; ".join(problems))
            try:
                exe = driver.cuGraphInstantiate(graph, 0)
            except Exception as err:                       # noqa: BLE001
                driver.cuGraphDestroy(graph)
                raise CaptureError(f"cuGraphInstantiate failed: {type(err).__name__}: {err}") from err
        return cls(devices, graph, exe, (before, after))

    @staticmethod
    def _rejoin(origin, others, joins):
        """Join every other replica's stream back into the origin's; the errors, as text.

        The capture can only end once every stream forked into it has joined back; a
        stream left behind stays in capture mode and fails its next launch."""
        problems = []
        for d, join in zip(others, joins):
            try:
                join.record(d.stream)
                join.wait(origin.stream)
            except Exception as err:                       # noqa: BLE001 (each one is reported)
                problems.append(f"rejoining {getattr(d, 'name', d)}: {type(err).__name__}: {err}")
        return problems

    @classmethod
    def _abandon(cls, driver, origin, others, joins, s0):
        """After a failure mid-capture: rejoin every stream, end the capture, drop the graph.

        Errors here are secondary (the capture is already broken by the first one) and
        are not raised: the first error is the one to see."""
        cls._rejoin(origin, others, joins)
        try:
            graph = driver.cuStreamEndCapture(s0)
        except Exception:                                  # noqa: BLE001 (invalidated capture)
            return
        try:
            driver.cuGraphDestroy(graph)
        except Exception:                                  # noqa: BLE001
            pass

    def launch(self):
        """Replay: after the work already queued on every replica's stream (this step's
        inputs), and before whatever is queued on them next."""
        _, driver, _ = _driver_api()
        origin, others = self.devices[0], self.devices[1:]
        with origin.activate():
            for d, ev in zip(others, self.before):
                ev.record(d.stream)
                ev.wait(origin.stream)
            driver.cuGraphLaunch(self.exe, int(origin.stream.handle))
            self.after.record(origin.stream)
            for d in others:
                self.after.wait(d.stream)

    def close(self):
        _, driver, _ = _driver_api()
        if self.exe is not None:
            driver.cuGraphExecDestroy(self.exe)
            driver.cuGraphDestroy(self.graph)
            self.exe = self.graph = None
