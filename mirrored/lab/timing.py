"""How long does each part of a training step take, on each replica?

``PhaseTimer`` records named phases per replica on the right clock for each device;
``TimedStep`` is the model's own step (``keras/step.py``) with each phase method
wrapped in a timed block — timing wraps the step from outside, so a timed step
launches exactly what an untimed one does (a test checks the weights bitwise);
``step_breakdown`` times steps that way and returns a per-replica timeline
(``mirrored.lab.viz.timeline`` draws it), ``format_breakdown`` prints it.

Everything returns plain structures (lists of dicts, tuples, floats) so a notebook
can print them, a test can check them, and ``mirrored.lab.viz`` can draw them.

Clocks. On a real GPU a kernel launch returns long before the kernel has run, so
the host clock measures launches, not work. There the timer records a CUDA event
on the device's stream at each phase boundary (``numba.cuda.event()``,
``event.record(stream)``) and reads ``event_elapsed_time`` after synchronising.
On CPU devices the work is done when the call returns, so ``time.perf_counter``
is the truth; in Numba's CUDA simulator events do not time, so the host clock is
used there too.

Typical use (a notebook; see labs/05)::

    from mirrored.lab import timing
    bd = timing.step_breakdown(model, dataset, steps=20)
    print(timing.format_breakdown(bd))
    bd["timeline"]     # [(replica, phase, start_s, end_s), ...] for mirrored.lab.viz.timeline

Neighbours: ``keras/step.py`` (the step that ``TimedStep`` wraps), ``scaling.py``
(whole epochs under several strategies: ``compare``), ``perf_model.py`` (N GPUs
predicted from one replica's breakdown), ``viz.py`` (the drawings).
"""
import contextlib
import statistics
import threading
import time

import numpy as np

from mirrored import devices as _dev
from mirrored.keras.data_adapters import host_batch
from mirrored.keras.step import (ALL_REDUCE, FORWARD_BACKWARD, INPUT_COPY,  # noqa: F401 (timing's names)
                                  OPTIMIZER, STEP_PHASES, Step, check_compiled)


# ---------------------------------------------------------------------------------------
# The phase timer
# ---------------------------------------------------------------------------------------

def _uses_events(device):
    """True where the host clock would lie: a CUDA device on a real GPU."""
    return device is not None and device.device_type == "GPU" and _dev.cuda_mode() == "real"


#: A mark's time is its anchor's host time plus ``cuEventElapsedTime`` from the anchor,
#: which is a float32 count of milliseconds: its resolution falls with the distance
#: (about 8 µs at 100 s). So a mark made more than this long after its card's anchor
#: becomes the card's next anchor, timed from the previous one with no host sync.
ANCHOR_REFRESH_S = 1.0


class _Anchor:
    """Ties one GPU's event clock to the host clock (one chain of anchors per card).

    The first anchor of a card is an event recorded on an idle stream, then waited for:
    one host sync per card and timer. Every later anchor is a mark's own event, whose
    host time is the previous anchor's plus the elapsed time between the two, read when
    first needed (after the events have happened), never by syncing mid-step. Events
    of one card compare directly whichever stream recorded them, so all the logical
    devices of a card share its anchors: no skew between replicas of one card.
    """

    def __init__(self, device, event=None, previous=None):
        self.previous = previous
        if previous is None:
            from numba import cuda
            with device.activate():
                device.stream.synchronize()
                event = cuda.event(timing=True)
                event.record(device.stream)
                event.synchronize()
            self.host_s = time.perf_counter()      # the event happened (about) now
        else:
            self.host_s = None                     # previous.seconds() + elapsed, when asked
        self.event = event
        self.made_s = time.perf_counter()          # host time of creation, for the refresh rule

    def seconds(self):
        """This anchor's time on the host clock (perf_counter seconds)."""
        from numba import cuda
        chain = []
        anchor = self
        while anchor.host_s is None:               # walk back to a resolved anchor...
            chain.append(anchor)
            anchor = anchor.previous
        for later in reversed(chain):              # ... then forward, each hop short and precise
            later.event.synchronize()
            later.host_s = later.previous.host_s + cuda.event_elapsed_time(later.previous.event, later.event) / 1e3
            later.previous = None                  # resolved: the chain behind it can go
        return self.host_s


class PhaseTimer:
    """Named phases, per replica, on the right clock for each device.

    ``with timer.phase("forward", replica=0, device=dev): ...`` times the block;
    ``device=None`` (or a CPU device) uses the host clock. Several threads may
    time phases at once (replicas run in their own threads).

    ``records()``: ``[(replica, phase, start_s, end_s)]``, seconds since the timer
    was created (or ``reset``), sorted by start. ``summary()``: per phase
    ``{"count", "total_s", "median_s", "mean_s", "min_s", "max_s"}``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._anchors = {}
        self.reset()

    def reset(self):
        """Forget every record; times restart from now."""
        with self._lock:
            self._t0 = time.perf_counter()
            self._raw = []        # (replica, phase, start mark, end mark)

    # -- marks: a host time (float) or (anchor, CUDA event)
    def _mark(self, device):
        if not _uses_events(device):
            return time.perf_counter()
        from numba import cuda
        card = device.gpu_id                       # one anchor chain per physical GPU
        anchor = self._anchors.get(card)
        if anchor is None:
            with self._lock:
                anchor = self._anchors.get(card)
                if anchor is None:
                    anchor = self._anchors[card] = _Anchor(device)
        with device.activate():
            event = cuda.event(timing=True)
            event.record(device.stream)
        if time.perf_counter() - anchor.made_s > ANCHOR_REFRESH_S:
            with self._lock:
                if self._anchors[card] is anchor:  # this mark is the card's next anchor
                    anchor = self._anchors[card] = _Anchor(device, event, previous=anchor)
        return anchor, event

    def _seconds(self, mark):
        if isinstance(mark, float):
            return mark - self._t0
        from numba import cuda
        anchor, event = mark
        event.synchronize()
        return anchor.seconds() - self._t0 + cuda.event_elapsed_time(anchor.event, event) / 1e3

    # -- recording
    def begin(self, name, replica=0, device=None):
        """Start phase ``name``; returns a token for ``end``."""
        return (name, replica, device, self._mark(device))

    def end(self, token):
        name, replica, device, start = token
        stop = self._mark(device)
        with self._lock:
            self._raw.append((replica, name, start, stop))

    @contextlib.contextmanager
    def phase(self, name, replica=0, device=None):
        """Time the block as phase ``name`` of ``replica`` (on ``device``'s clock)."""
        token = self.begin(name, replica, device)
        try:
            yield
        finally:
            self.end(token)

    def begin_all(self, name, devices):
        """Start ``name`` on every device at once (a collective: replica i on devices[i])."""
        return [self.begin(name, i, d) for i, d in enumerate(devices)]

    def end_all(self, tokens):
        for t in tokens:
            self.end(t)

    @contextlib.contextmanager
    def collective(self, name, devices):
        """Time the block as phase ``name`` of every replica (e.g. the all-reduce)."""
        tokens = self.begin_all(name, devices)
        try:
            yield
        finally:
            self.end_all(tokens)

    # -- results
    def records(self):
        """``[(replica, phase, start_s, end_s)]`` sorted by start (waits for GPU events)."""
        with self._lock:
            raw = list(self._raw)
        out = [(r, name, self._seconds(a), self._seconds(b)) for r, name, a, b in raw]
        return sorted(out, key=lambda rec: (rec[2], rec[0]))

    def summary(self, by_replica=False):
        """Per phase (first-seen order): count, total, median, mean, min, max seconds.

        ``by_replica=True``: ``{replica: {phase: {...}}}`` instead.
        """
        recs = self.records()
        if by_replica:
            return {r: _summarise([x for x in recs if x[0] == r])
                    for r in sorted({x[0] for x in recs})}
        return _summarise(recs)


def _summarise(records):
    durations = {}
    for _, name, start, end in records:
        durations.setdefault(name, []).append(end - start)
    return {name: {"count": len(d), "total_s": float(sum(d)), "median_s": float(statistics.median(d)),
                   "mean_s": float(sum(d) / len(d)), "min_s": float(min(d)), "max_s": float(max(d))}
            for name, d in durations.items()}


class TimedStep(Step):
    """A model's training step with each phase recorded by a ``PhaseTimer``.

    The very same step (it shares the model's programs, buffers and optimizer, and
    launches the same kernels in the same order): each phase method is wrapped in
    a timed block and calls the step's own. A timed step always runs eagerly.
    """

    def __init__(self, step, timer):
        vars(self).update(vars(step))
        self.timer = timer

    def load_share(self, program, part, load, scalars=None):
        with self.timer.phase(INPUT_COPY, program.r, program.dev):
            return super().load_share(program, part, load, scalars)

    def forward_backward(self, program, x, y, mode, scale):
        with self.timer.phase(FORWARD_BACKWARD, program.r, program.dev):
            super().forward_backward(program, x, y, mode, scale)

    def all_reduce(self):
        if len(self.devices) == 1:                # one replica: nothing is summed, no phase
            return super().all_reduce()
        with self.timer.collective(ALL_REDUCE, self.devices):
            super().all_reduce()

    def update(self, optimizer):
        # Each replica's own launch, timed on its own clock (not the whole loop over the
        # devices on every replica's row): on CPU devices they run one after the other.
        optimizer.update(self.pack, around=lambda r, dev: self.timer.phase(OPTIMIZER, r, dev))


def timed_train_step(model, x, y, timer):
    """``model.train_step(x, y)`` with every phase of every replica recorded by ``timer``."""
    check_compiled(model, "timing training steps")
    batch = host_batch(model, (x, y))              # x (B, in) float32, y (B,); builds the model
    TimedStep(model.step, timer).train(batch)


def _synchronize(model):
    for device in model.step.devices:
        device.synchronize()


def _host_batches(data, batch_size=None):
    """Host (x, y) batches from a batched Dataset, an iterable of pairs, or (x, y) arrays."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], np.ndarray):
        x, y = data
        bs = batch_size or 32
        while True:
            for i in range(0, len(x), bs):
                yield x[i:i + bs], y[i:i + bs]
    else:
        while True:
            empty = True
            for batch in data:
                empty = False
                yield batch
            if empty:
                raise ValueError("step_breakdown: the data gave no batches.")


def step_breakdown(model, data, steps=20, warmup=3, batch_size=None, timeline_steps=1):
    """Time ``steps`` training steps phase by phase, per replica (after ``warmup`` steps).

    ``model``: a compiled Sequential (built inside a strategy's scope for N replicas).
    ``data``: a Dataset batched by the GLOBAL batch, or ``(x, y)`` arrays with
    ``batch_size``. The steps really train the model (they are ``train_step``s).
    Each step ends with a device synchronisation, so steps do not overlap.

    Returns a plain dict::

        {"replicas": N, "steps": steps, "global_batch": B,
         "step_s": median seconds per step (wall clock, synchronised),
         "phases": {phase: {"count", "total_s", "median_s", ...}},      # over all replicas
         "per_replica": {replica: {phase: median_s}},
         "timeline": [(replica, phase, start_s, end_s)],   # the last `timeline_steps`
         "timeline_step_s": [(start_s, end_s)] of those steps}           # steps, from 0
    """
    check_compiled(model, "timing training steps")
    if steps < 1 or warmup < 0:
        raise ValueError(f"step_breakdown: need steps >= 1 and warmup >= 0, got {steps} and {warmup}.")
    timeline_steps = min(max(int(timeline_steps), 1), steps)
    timer = PhaseTimer()
    batches = _host_batches(data, batch_size)
    step_times, step_spans, global_batch = [], [], 0
    for k in range(warmup + steps):
        xb, yb = next(batches)
        if k == warmup:
            timer.reset()
        t0 = time.perf_counter() - timer._t0
        timed_train_step(model, xb, yb, timer)
        _synchronize(model)
        t1 = time.perf_counter() - timer._t0
        if k >= warmup:
            step_times.append(t1 - t0)
            step_spans.append((t0, t1))
            global_batch = max(global_batch, xb.shape[0])
    records = timer.records()
    first = step_spans[-timeline_steps][0] if step_spans else 0.0
    timeline = [(r, name, s - first, e - first) for r, name, s, e in records if s >= first - 1e-9]
    per_replica = {r: {name: stats["median_s"] for name, stats in phases.items()}
                   for r, phases in timer.summary(by_replica=True).items()}
    return {"replicas": len(model.step.programs), "steps": steps, "global_batch": int(global_batch),
            "step_s": float(statistics.median(step_times)) if step_times else float("nan"),
            "phases": _summarise(records), "per_replica": per_replica, "timeline": timeline,
            "timeline_step_s": [(a - first, b - first) for a, b in step_spans[-timeline_steps:]]}


def format_breakdown(breakdown):
    """A text table of the median time per phase and replica (milliseconds)."""
    phases = [p for p in STEP_PHASES if p in breakdown["phases"]] + \
             [p for p in breakdown["phases"] if p not in STEP_PHASES]
    head = f"{'replica':<8}" + "".join(f"{p:>18}" for p in phases)
    lines = [f"{breakdown['replicas']} replica(s), global batch {breakdown['global_batch']}, "
             f"median step {breakdown['step_s'] * 1e3:.2f} ms (ms per phase, median of "
             f"{breakdown['steps']} steps)", head, "-" * len(head)]
    for r, medians in sorted(breakdown["per_replica"].items()):
        lines.append(f"{r:<8}" + "".join(f"{medians.get(p, float('nan')) * 1e3:>18.3f}" for p in phases))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Whole epochs of several configurations, interleaved (scaling.compare, benchmarks.training)
# ---------------------------------------------------------------------------------------

#: A row whose timed epochs spread more than this (slowest / fastest) is flagged: on a
#: shared machine something else ran during some of its epochs, and its median may not
#: compare with the other rows'.
SPREAD_LIMIT = 2.0
#: The reference row (no strategy) drifted when its slowest timed epoch took this much
#: longer than its fastest: the machine's speed changed during the run, so every ratio
#: to the reference is in doubt, and every row says so.
DRIFT_LIMIT = 1.5
#: The rows' order in each round: a fixed shuffle (the same on every run).
ROUND_ORDER_SEED = 0


def interleaved_rounds(n_rows, rounds, run_epoch, seed=ROUND_ORDER_SEED):
    """Call ``run_epoch(k, r)`` for every row k in every round r: each round runs every
    row once, in a fresh random order (a fixed shuffle of ``seed``).

    Timing rows one after another lets a slow spell of a shared machine (another job
    starting) land on one row and not the others; interleaved, it lands on one round of
    every row, and the medians stay comparable. A fresh order each round stops what a
    row leaves behind (spinning threads, a cold cache) from always landing on the same
    next row. Used by ``scaling.compare`` (``python -m mirrored``, the labs' tables) and
    ``benchmarks.training``."""
    order = np.random.default_rng(seed)
    for r in range(rounds):
        for k in order.permutation(n_rows):
            run_epoch(int(k), r)


def epoch_spread(seconds):
    """Slowest / fastest of some epoch times (1.0 for one epoch; nan for none)."""
    seconds = [s for s in seconds if s > 0]
    return max(seconds) / min(seconds) if seconds else float("nan")


def timing_flags(timed_seconds, reference=None):
    """One list of warnings per row, from each row's timed epoch seconds: the row's own
    spread above ``SPREAD_LIMIT``, and on every row the reference row's (index
    ``reference``) drift above ``DRIFT_LIMIT``. Empty lists: nothing to say."""
    flags = []
    # Rounded to the 2 digits printed before comparing: a flag never reads "1.50x (over 1.5x)"
    drift = round(epoch_spread(timed_seconds[reference]), 2) if reference is not None else float("nan")
    for seconds in timed_seconds:
        spread = round(epoch_spread(seconds), 2)
        row = []
        if spread > SPREAD_LIMIT:
            row.append(f"epoch times spread {spread:.2f}x (over {SPREAD_LIMIT:g}x)")
        if drift > DRIFT_LIMIT:
            row.append(f"the reference drifted {drift:.2f}x during the run (over {DRIFT_LIMIT:g}x)")
        flags.append(row)
    return flags
