"""Is 2 or 4 devices faster than 1, and by how much? ``compare`` answers with a table.

The same model is trained under several strategies (no strategy, MirroredStrategy
on 1, 2, 4 devices), each from the same initial weights, with the course lab's
rule for the global batch (``batch_per_replica × replicas``), and every epoch is
timed by a Keras callback (``EpochTimer``). The rows' epochs are interleaved (round
after round, every row once per round: ``timing.interleaved_rounds``) and a row whose
epochs spread more than 2x, or whose reference drifted, is flagged (``timing_flags``).
The rows say epoch time, ms/step,
samples/s and the scaling efficiency against one replica; ``format_table`` prints
them and ``mirrored.lab.viz.plot_comparison`` / ``scaling_plot`` draw them.

Logical devices are configured once per process (``set_logical_device_configuration``
raises ``RuntimeError`` afterwards, as in TensorFlow): configure the largest number
you need first, then build strategies over subsets, e.g. ``MirroredStrategy(["CPU:0",
"CPU:1"])`` after splitting the CPU into 4. ``lab_strategies`` does that.

Neighbours: ``timing.py`` (what each phase of ONE step costs), ``perf_model.py`` (what
N real GPUs would do), ``viz.py`` (the drawings), ``workflow.py`` (``python -m mirrored``
prints this table).
"""
import contextlib
import math
import statistics
import time

from mirrored.lab import timing
from mirrored.keras.callbacks import Callback

#: Fewer timed steps than this (over the timed epochs), or no epoch left after the
#: warm-up, and a row's epoch time, ms/step, samples/s and efficiency are marked too short
#: to compare: per-epoch fixed costs, the warm-up and a busy machine's jitter outweigh the
#: steps (``python -m mirrored --quick`` once timed one epoch of 8-16 steps and printed
#: efficiencies of 149-330%).
MIN_TIMED_STEPS = 50


class StopAfterOneEpoch(Callback):
    """A Keras callback that ends ``fit`` after the epoch it starts in (``stop_training``,
    as EarlyStopping does): ``compare`` interleaves the rows' epochs one at a time."""

    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True


class EpochTimer(Callback):
    """A Keras callback: wall time, steps and examples of every epoch.

        clock = scaling.EpochTimer()
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
        if self._steps == 1:            # the first batch is a whole global batch (the last may not be)
            self.first_batch = self.model.step.examples_seen()   # one device read per epoch

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        examples = self.model.step.examples_seen()          # counted on the devices
        self.epochs.append((seconds, self._steps, examples))
        self.last_logs = dict(logs or {})

    def row(self, name, replicas=None, global_batch=None, warmup_epochs=1):
        """The timing columns of a ``compare`` row from the epochs seen so far.

        The first ``warmup_epochs`` are left out of the median (unless nothing else
        is left). ``replicas`` defaults to the model's; ``global_batch`` to the
        examples of an epoch's first step (a whole global batch: 8,000 examples in 63 steps of
        128 are not ceil(8000 / 63) = 127 per step, the last step has 64).
        """
        if not self.epochs:
            raise ValueError("EpochTimer.row: no epoch has been timed yet; pass the timer to fit().")
        timed = self.epochs[warmup_epochs:] or self.epochs
        warmup_only = not self.epochs[warmup_epochs:] and warmup_epochs > 0
        timed_steps = sum(e[1] for e in timed)
        epoch_s = statistics.median(e[0] for e in timed)
        steps = statistics.median(e[1] for e in timed)
        examples = statistics.median(e[2] for e in timed)
        devices = self.model.step.devices
        logs = getattr(self, "last_logs", {})
        if global_batch is None and steps:
            global_batch = int(getattr(self, "first_batch", 0)) or int(math.ceil(examples / steps))
        return {
            "name": name, "devices": [d.short_name for d in devices],
            "replicas": replicas or len(devices),
            "global_batch": global_batch,
            "steps_per_epoch": int(steps), "epochs_timed": len(self.epochs[warmup_epochs:]),
            "timed_steps": int(timed_steps),
            "too_short": warmup_only or timed_steps < MIN_TIMED_STEPS,
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
    runs, first_weights = [], None
    for name, strategy in _entries(strategies):          # build every row first
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
        fit_args, test_args = _data_for(data, global_batch)
        initial_loss = _evaluate(model, test_args)[0] if test_args is not None else float("nan")
        runs.append(dict(name=name, strategy=strategy, replicas=replicas, global_batch=global_batch,
                         model=model, fit_args=fit_args, test_args=test_args,
                         initial_loss=initial_loss, clock=EpochTimer()))

    def run_epoch(k, epoch):                               # one epoch of row k
        run = runs[k]
        if verbose:
            devices = ", ".join(d.short_name for d in run["model"].step.devices)
            how = ""
            if run["replicas"] > 1:          # what a second replica adds: the split, the sum
                ops = type(run["strategy"].extended.cross_device_ops).__name__
                how = f" split {run['replicas']} × {batch_per_replica}, gradients summed by {ops}"
            log(f"--- {run['name']} (epoch {epoch + 1}/{epochs}): {run['replicas']} replica(s) on "
                f"{devices}, global batch {run['global_batch']}{how} ---")
        x, y, batch_size = run["fit_args"]
        # Keras's way to run epoch k of E and no more: fit(epochs=E, initial_epoch=k) stopped
        # at the epoch's end, so its progress line reads "Epoch k+1/E" as the header does
        run["model"].fit(x, y, batch_size=batch_size, epochs=epochs, initial_epoch=epoch,
                         verbose=verbose, callbacks=[run["clock"], StopAfterOneEpoch()])

    # Epochs interleaved: every row's epoch 1, then every row's epoch 2, ... (timing.py)
    timing.interleaved_rounds(len(runs), epochs, run_epoch)
    rows = []
    for run in runs:
        row = run["clock"].row(run["name"], run["replicas"], run["global_batch"], warmup_epochs)
        test_loss = test_acc = float("nan")
        if run["test_args"] is not None:
            test_loss, test_acc = _evaluate(run["model"], run["test_args"])
        row.update(initial_loss=run["initial_loss"], test_loss=test_loss, test_accuracy=test_acc)
        rows.append(row)
    add_efficiency(rows, baseline)
    add_timing_flags(rows, warmup_epochs)
    return rows


def one_device_verdict(rows, single="no strategy", one="MirroredStrategy ×1"):
    """Was MirroredStrategy on one device slower than no strategy, in THESE rows? One
    sentence computed from the numbers (lab 01 prints it under its table): the ratio of
    samples/s, set against the rows' own epoch-to-epoch spread (a difference inside it is
    noise, and the sentence says so); a row too short to compare, or flagged, gives no
    verdict. Either order can come out: the strategy's fixed per-step costs are a few
    percent of a CPU step, and about the size of a GPU step."""
    by_name = {r["name"]: r for r in rows}
    a, b = by_name[single], by_name[one]
    if a.get("too_short") or b.get("too_short") or a.get("timing_flags") or b.get("timing_flags"):
        return (f"No verdict: '{one}' against '{single}' was too short or too noisy to compare "
                f"(see the marks under the table); run more epochs on a quiet machine.")
    ratio = b["samples_per_s"] / a["samples_per_s"]
    noise = max(timing.epoch_spread(r["epoch_times_s"][1:] or r["epoch_times_s"]) for r in (a, b)) - 1
    if abs(ratio - 1) <= noise:
        return (f"Here '{one}' ran at {ratio:.0%} of '{single}''s samples/s, inside the epochs' own "
                f"spread ({noise:.0%}): on this machine the strategy's fixed costs are too small to "
                f"tell from the noise.")
    if ratio < 1:
        return (f"Here '{one}' was slower: {ratio:.0%} of '{single}''s samples/s (the epochs "
                f"spread {noise:.0%}): the fixed per-step costs below showed.")
    return (f"Here '{one}' was faster: {ratio:.0%} of '{single}''s samples/s (the epochs spread "
            f"{noise:.0%}). The strategy adds work, never removes it: its fixed costs were smaller "
            f"than what else differed between the runs (the machine's load, caches), not a speed-up.")


#: Throughputs within this factor of each other are "about the same" (scaling_verdict).
SAME_WITHIN = 1.1


def scaling_verdict(rows, cores, single="no strategy"):
    """The largest replica count's throughput against no strategy, in one sentence computed
    from the rows, beside the machine's ``cores`` (lab 05 prints it under its table):
    logical devices share one machine, so they gain only what the single run left idle."""
    base = next(r for r in rows if r["name"] == single)
    top = max((r for r in rows if r["name"] != single), key=lambda r: r["replicas"])
    gain = top["samples_per_s"] / base["samples_per_s"]
    if gain > SAME_WITHIN:
        why = (f"more than '{single}': that run left part of the machine idle (on a CPU, cores "
               f"its work did not use) and the replicas' work filled it; logical devices cannot "
               f"add more than the machine has ({cores} CPU core(s) here)")
    elif gain < 1 / SAME_WITHIN:
        why = ("less: the replicas share the machine, and every step's coordination (the "
               "replicas in turn, the merge point, the ring) comes on top")
    else:
        why = "about the same: the replicas share the machine, so the compute did not grow"
    marks = (" (the row is flagged or too short to compare: a rough figure)"
             if top.get("too_short") or top.get("timing_flags") else "")
    return f"Here '{top['name']}' gave {gain:.2f}× the samples/s of '{single}'{marks}: {why}."


def add_timing_flags(rows, warmup_epochs=1):
    """Set each row's ``timing_flags`` (``timing.timing_flags``: its timed epochs spread
    more than 2x, or the reference row, the efficiency's baseline, drifted)."""
    timed = [r["epoch_times_s"][warmup_epochs:] or r["epoch_times_s"] for r in rows]
    names = [r["name"] for r in rows]
    base = rows[0].get("baseline") if rows else None
    flags = timing.timing_flags(timed, names.index(base) if base in names else None)
    for row, f in zip(rows, flags):
        row["timing_flags"] = f
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
    marked = {"epoch_time_s", "ms_per_step", "samples_per_s", "efficiency"}   # timing columns
    cells = [[cell(r, key, fmt) + ("*" if r.get("too_short") and key in marked else "")
              + ("!" if r.get("timing_flags") and key == "ms_per_step" else "")
              for _, key, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    line = lambda items: "  ".join(s.ljust(w) if i == 0 else s.rjust(w)   # noqa: E731
                                   for i, (s, w) in enumerate(zip(items, widths)))
    out = [title] if title else []
    out += [line([h for h, _, _ in cols]), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    if rows and rows[0].get("baseline"):
        timed = rows[0].get("epochs_timed", "?")
        what = (f"epoch s = median of {timed} timed epoch(s) after warm-up" if timed != 0 else
                "epoch s = the warm-up epoch itself (no epoch was timed after it: run more epochs)")
        out.append(f"efficiency = samples/s ÷ (replicas × samples/s of '{rows[0]['baseline']}'); {what}")
    for r in rows:
        if r.get("timing_flags"):
            out.append(f"! {r['name']}: {'; '.join(r['timing_flags'])}: the machine was busy, "
                       f"compare with care (run again)")
    if any(r.get("too_short") for r in rows):
        out.append(f"* too short to compare: fewer than {MIN_TIMED_STEPS} timed steps, or none after "
                   f"the warm-up; time more epochs or more data")
    return "\n".join(out)
