"""Timing single- against multi-device training: a phase timer, a timed step, ``compare``.

The questions a student asks of MirroredStrategy, and where they are answered:

    How long does each part of a step take?        PhaseTimer, TimedStep (the model's
                                                   step with each phase timed),
                                                   step_breakdown, format_breakdown
    Is 2 or 4 devices faster than 1? By how much?  compare (EpochTimer per run),
                                                   format_table
    What would N real GPUs over PCIe or NVLink do? perf_model.py
    What does it look like?                        viz.py (timeline, scaling_plot,
                                                   plot_comparison, plot_performance_model)

Everything returns plain structures (lists of dicts, tuples, floats) so a notebook
can print them, a test can check them, and ``mirrored.viz`` can draw them.

Timing wraps the step from outside: ``TimedStep`` is the model's own step
(``keras/step.py``) with each phase method wrapped in a timed block, so a timed
step launches exactly what an untimed one does (a test checks the weights bitwise).

Clocks. On a real GPU a kernel launch returns long before the kernel has run, so
the host clock measures launches, not work. There the timer records a CUDA event
on the device's stream at each phase boundary (``numba.cuda.event()``,
``event.record(stream)``) and reads ``event_elapsed_time`` after synchronising.
On CPU devices the work is done when the call returns, so ``time.perf_counter``
is the truth; in Numba's CUDA simulator events do not time, so the host clock is
used there too.

Typical use (a notebook or ``python -m mirrored``; see mirrored/workflow.py)::

    from mirrored import timing
    rows = timing.compare(make_model, data_fn, timing.lab_strategies(devices, (1, 2, 4)),
                          epochs=3, batch_per_replica=64)
    print(timing.format_table(rows))
    bd = timing.step_breakdown(model, dataset, steps=20)
    bd["timeline"]     # [(replica, phase, start_s, end_s), ...] for mirrored.viz.timeline

Logical devices are configured once per process (``set_logical_device_configuration``
raises ``RuntimeError`` afterwards, as in TensorFlow): configure the largest number
you need first, then build strategies over subsets, e.g. ``MirroredStrategy(["CPU:0",
"CPU:1"])`` after splitting the CPU into 4. ``lab_strategies`` does that.

Neighbours: ``keras/step.py`` (the step that ``TimedStep`` wraps), ``perf_model.py``,
``viz.py`` (the drawings), ``workflow.py`` (the command-line lab).
"""
import contextlib
import math
import statistics
import threading
import time

import numpy as np

from mirrored import devices as _dev
from mirrored.keras.callbacks import Callback
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

    def load_share(self, program, part, load):
        with self.timer.phase(INPUT_COPY, program.r, program.dev):
            return super().load_share(program, part, load)

    def forward_backward(self, program, x, y, mode, scale):
        with self.timer.phase(FORWARD_BACKWARD, program.r, program.dev):
            super().forward_backward(program, x, y, mode, scale)

    def all_reduce(self):
        if len(self.devices) == 1:                # one replica: nothing is summed, no phase
            return super().all_reduce()
        with self.timer.collective(ALL_REDUCE, self.devices):
            super().all_reduce()

    def update(self):
        tokens = self.timer.begin_all(OPTIMIZER, self.devices)    # replica i on devices[i]
        super().update()
        self.timer.end_all(tokens)


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
# compare(): the same model under several strategies
# ---------------------------------------------------------------------------------------

class EpochTimer(Callback):
    """A Keras callback: wall time, steps and examples of every epoch.

        clock = timing.EpochTimer()
        model.fit(train_dataset, epochs=12, callbacks=[clock])
        clock.epochs                                  # [(seconds, steps, examples), ...]
        clock.row("MirroredStrategy ×2", replicas=2)  # a row like compare()'s

    ``fit`` reads the metrics from the devices before ``on_epoch_end`` (a
    synchronisation), so the epoch's GPU work is finished when the clock stops.
    """

    def __init__(self):
        super().__init__()
        self.epochs = []            # [(seconds, steps, examples)]

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        examples = self.model.step.examples_seen()          # counted on the devices
        self.epochs.append((seconds, self._steps, examples))
        self.last_logs = dict(logs or {})

    def row(self, name, replicas=None, global_batch=None, warmup_epochs=1):
        """The timing columns of a ``compare`` row from the epochs seen so far.

        The first ``warmup_epochs`` are left out of the median (unless nothing else
        is left). ``replicas`` defaults to the model's; ``global_batch`` to the
        largest examples-per-step seen.
        """
        if not self.epochs:
            raise ValueError("EpochTimer.row: no epoch has been timed yet; pass the timer to fit().")
        timed = self.epochs[warmup_epochs:] or self.epochs
        epoch_s = statistics.median(e[0] for e in timed)
        steps = statistics.median(e[1] for e in timed)
        examples = statistics.median(e[2] for e in timed)
        devices = self.model.step.devices
        logs = getattr(self, "last_logs", {})
        if global_batch is None and steps:
            global_batch = int(math.ceil(examples / steps))
        return {
            "name": name, "devices": [d.short_name for d in devices],
            "replicas": replicas or len(devices),
            "global_batch": global_batch,
            "steps_per_epoch": int(steps), "epochs_timed": len(timed),
            "epoch_time_s": float(epoch_s), "epoch_times_s": [float(e[0]) for e in self.epochs],
            "ms_per_step": float(epoch_s / steps * 1e3) if steps else float("nan"),
            "samples_per_s": float(examples / epoch_s) if epoch_s else float("nan"),
            "loss": float(logs.get("loss", float("nan"))),
            "accuracy": float(logs.get("accuracy", float("nan"))),
        }


def strategy_name(strategy):
    """"no strategy" or "MirroredStrategy ×N"."""
    if strategy is None:
        return "no strategy"
    return f"{type(strategy).__name__} ×{strategy.num_replicas_in_sync}"


def lab_strategies(devices, counts=(1, 2, 4), include_default=True):
    """``[(name, strategy)]``: no strategy, then MirroredStrategy over the first k devices.

    ``devices``: device names (e.g. the logical GPUs, or the logical CPUs on a
    machine with none); counts larger than ``len(devices)`` are skipped.
    """
    from mirrored.strategy import MirroredStrategy
    entries = [("no strategy", None)] if include_default else []
    for k in sorted(set(counts)):
        if 1 <= k <= len(devices):
            entries.append((f"MirroredStrategy ×{k}", MirroredStrategy(list(devices[:k]))))
    return entries


def _entries(strategies):
    out = []
    for item in strategies:
        if isinstance(item, tuple):
            name, strategy = item
        else:
            name, strategy = strategy_name(item), item
        out.append((name, strategy))
    return out


def _data_for(data, global_batch):
    """(fit args, evaluate args) for one global batch, from a data function or arrays."""
    if callable(data):
        train, test = data(global_batch)
        return (train, None, None), ((test, None, None) if test is not None else None)
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], (tuple, list)):
        (x, y), test = data
        test_args = (test[0], test[1], global_batch) if test is not None else None
        return (x, y, global_batch), test_args
    if isinstance(data, (tuple, list)) and len(data) in (2, 4):
        x, y = data[0], data[1]
        test_args = (data[2], data[3], global_batch) if len(data) == 4 else None
        return (x, y, global_batch), test_args
    raise TypeError("compare: data must be a function global_batch -> (train_ds, test_ds), or arrays "
                    "(x_train, y_train[, x_test, y_test]) or ((x_train, y_train), (x_test, y_test)).")


def compare(model_fn, data, strategies, epochs=3, batch_per_replica=64, warmup_epochs=1,
            verbose=1, baseline=None, log=print):
    """Train the same model under each strategy; one row of timings per strategy.

    ``model_fn()``: returns a compiled ``Sequential`` with known input shape; it is
      called inside each strategy's scope (bare for "no strategy"), so its weights
      are mirrored there. Every model starts from the FIRST model's weights
      (``get_weights``/``set_weights``): same start, same work, different devices.
    ``data``: ``data_fn(global_batch) -> (train_ds, test_ds)`` (datasets batched by
      that global batch, test may be None), or arrays ``(x_train, y_train, x_test,
      y_test)``.
    ``strategies``: a list of ``None`` (no strategy), strategies, or ``(name,
      strategy)`` pairs (see ``lab_strategies``).
    The global batch is ``batch_per_replica × replicas`` (the course lab's rule), so
    more replicas mean fewer, bigger steps per epoch: compare samples/s.
    ``epochs``: the first ``warmup_epochs`` (compilation, caches, the dataset's
    ``cache()`` filling) are trained but not timed, unless nothing else is left.
    ``baseline``: the row name for the scaling efficiency; default the first
    single-replica row.

    Returns a list of dicts, one per strategy: ``name, devices, replicas,
    global_batch, steps_per_epoch, epoch_time_s`` (median of the timed epochs),
    ``epoch_times_s, ms_per_step, samples_per_s, efficiency`` (samples/s over
    replicas × the baseline's), ``initial_loss`` (the untrained model's test loss:
    equal in every row when the start is the same), ``loss, accuracy`` (last
    training epoch), ``test_loss, test_accuracy``.
    """
    rows, first_weights = [], None
    for name, strategy in _entries(strategies):
        replicas = 1 if strategy is None else strategy.num_replicas_in_sync
        global_batch = batch_per_replica * replicas
        with (strategy.scope() if strategy is not None else contextlib.nullcontext()):
            model = model_fn()
        if not model.built:
            raise ValueError("compare: model_fn must return a built model (give the first layer "
                             "input_shape=...), so that every strategy starts from the same weights.")
        if first_weights is None:
            first_weights = model.get_weights()
        else:
            model.set_weights(first_weights)
        devices = [d.short_name for d in model.step.devices]
        fit_args, test_args = _data_for(data, global_batch)
        initial_loss = float("nan")
        if test_args is not None:
            initial_loss = _evaluate(model, test_args)[0]
        if verbose:
            log(f"--- {name}: {replicas} replica(s) on {', '.join(devices)}, "
                f"global batch {global_batch} ---")
        clock = EpochTimer()
        model.fit(fit_args[0], fit_args[1], batch_size=fit_args[2], epochs=epochs,
                  verbose=verbose, callbacks=[clock])
        row = clock.row(name, replicas, global_batch, warmup_epochs)
        test_loss = test_acc = float("nan")
        if test_args is not None:
            test_loss, test_acc = _evaluate(model, test_args)
        row.update(initial_loss=initial_loss, test_loss=test_loss, test_accuracy=test_acc)
        rows.append(row)
    add_efficiency(rows, baseline)
    return rows


def _evaluate(model, test_args):
    x, y, bs = test_args
    logs = model.evaluate(x, y, batch_size=bs, verbose=0, return_dict=True)
    return float(logs["loss"]), float(logs.get("accuracy", float("nan")))


def add_efficiency(rows, baseline=None):
    """Set each row's ``efficiency``: samples/s ÷ (replicas × the baseline row's samples/s).

    1.0 is perfect scaling; the baseline is the row named ``baseline``, else the
    first single-replica row.
    """
    base = next((r for r in rows if r["name"] == baseline), None) if baseline else None
    base = base or next((r for r in rows if r["replicas"] == 1), None)
    for r in rows:
        r["efficiency"] = (r["samples_per_s"] / (r["replicas"] * base["samples_per_s"])
                           if base and base["samples_per_s"] else float("nan"))
        r["baseline"] = base["name"] if base else None
    return rows


def format_table(rows, title=None):
    """The comparison as a fixed-width text table (what ``python -m mirrored`` prints)."""
    cols = [("strategy", "name", "{}"), ("replicas", "replicas", "{:d}"),
            ("batch", "global_batch", "{:d}"), ("steps", "steps_per_epoch", "{:d}"),
            ("epoch s", "epoch_time_s", "{:.3f}"), ("ms/step", "ms_per_step", "{:.2f}"),
            ("samples/s", "samples_per_s", "{:,.0f}"), ("efficiency", "efficiency", "{:.0%}"),
            ("test acc", "test_accuracy", "{:.4f}")]
    def cell(row, key, fmt):
        value = row.get(key)
        if value is None or isinstance(value, float) and math.isnan(value):
            return "-"
        return fmt.format(value)
    cells = [[cell(r, key, fmt) for _, key, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    line = lambda items: "  ".join(s.ljust(w) if i == 0 else s.rjust(w)   # noqa: E731
                                   for i, (s, w) in enumerate(zip(items, widths)))
    out = [title] if title else []
    out += [line([h for h, _, _ in cols]), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    if rows and rows[0].get("baseline"):
        out.append(f"efficiency = samples/s ÷ (replicas × samples/s of '{rows[0]['baseline']}'); "
                   f"epoch s = median of {rows[0].get('epochs_timed', '?')} timed epoch(s) after warm-up")
    return "\n".join(out)
