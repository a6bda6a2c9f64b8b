"""Pictures of what MirroredStrategy does: ring steps, timelines, scaling, batch sharding.

The labs draw with these functions so that a notebook cell stays one line and
every lab draws the same thing the same way. Each function

* takes plain data the library already produces (a ``RingAllReduce(keep_steps=True)``
  step record, a list of timed events, benchmark rows, a batch size),
* draws on the matplotlib ``ax`` you pass, or on a new figure when ``ax`` is None,
* returns the matplotlib ``Figure`` (never calls ``plt.show()``: a notebook shows a
  returned figure by itself, a script calls ``fig.savefig(...)``), and
* works with the non-interactive Agg backend (``MPLBACKEND=Agg``, as the tests run).

What is here:

    ring_step(step, n_devices)   one step of a ring all-reduce: a devices x chunks grid,
                                 each cell coloured by how many replicas' gradients the
                                 chunk holds, arrows for the chunks that move this step
    ring_diagram(steps)          every step of a reduction, one panel each (2(N-1) panels)
    timeline(events)             Gantt chart: one lane per replica, one colour per phase
    scaling_plot(rows)           samples/s against the number of replicas, ideal line,
                                 scaling efficiency written at each point
    sharding(global_batch, n)    which rows of a global batch each replica gets under
                                 TensorFlow's rebatching rule (empty slices included)
    gemm_mapping(version)        GEMM v1/v2/v3: which outputs a block and a thread compute,
                                 which tiles they stage in shared memory, what they read
    conv2d_mapping(version)      Conv2D v1/v2: which outputs a warp (v1) or a block (v2)
                                 computes, which input pixels it reads or stages
    plot_comparison(rows)        epoch time and samples/s per strategy (``scaling.compare``)
    plot_performance_model(...)  measured samples/s beside the model's lines per link
                                 (``perf_model.predict_throughput``)

One file of independent drawings: each function stands alone, so its length is a
gallery's, not a tangle's.

Returning a bare ``Figure`` (not a pyplot one) means nothing piles up in pyplot's
registry; Jupyter displays it once the inline backend is active (``%matplotlib
inline``, the first line of every lab).

Neighbours: ``ring.py`` and ``ring_steps.py`` (``RingAllReduce``: ``steps``, ``RingStep``,
``initial_holds``, ``schedule``), ``input_lib.py`` (``rebatch_bounds``), the timing
helpers that produce events and rows (``timing.py``, ``scaling.py``, ``perf_model.py``),
``kernels/gemm.py`` (the tile sizes ``gemm_mapping`` draws), and ``labs/`` (which call
everything here).
"""
import math
import numbers

import numpy as np

from kernels.launch import ceil_div

# --- shared helpers ------------------------------------------------------------------

#: Colour of a chunk that holds every replica's contribution (the finished sum):
#: a saturated green, distinct from the blue ramp of partial sums.
FULL_SUM_COLOR = "#1a9850"

#: Colours of the phases of a training step, so every timeline reads the same.
#: Phases not listed here get the next colour of matplotlib's "tab10" cycle.
PHASE_COLORS = {
    "input copy": "#9e9e9e",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "forward+backward": "#4c72b0",
    "all-reduce": "#dd8452",
    "optimizer": "#8172b2",
    "idle": "#eeeeee",
}


def _figure_and_ax(ax, figsize):
    """(fig, ax): the figure that owns ``ax``, or a fresh figure with one axes."""
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure
    # A bare Figure (no pyplot): nothing is registered with a GUI, so nothing leaks
    # when a test makes hundreds; a notebook still displays it when it is returned.
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _plain_numbers(axis):
    """Tick labels as plain numbers with thousands separators (2,000,000), never with a
    "1e6" offset in the corner that a reader has to multiply in."""
    from matplotlib.ticker import StrMethodFormatter
    axis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))


def efficiency_text(baseline_name):
    """The one definition of scaling efficiency, as the figures and tables write it."""
    return f"efficiency = samples/s ÷ (replicas × samples/s of '{baseline_name}')"


# --- ring all-reduce -----------------------------------------------------------------

def _step_fields(step):
    """(phase, index, transfers as (src, dst, chunk, op), holds as sets) of a RingStep or dict."""
    if isinstance(step, dict):
        try:
            phase, index = step["phase"], step["step"]
            transfers, holds = step["transfers"], step["holds"]
        except KeyError as err:
            raise ValueError(f"ring_step: a step given as a dict needs the keys phase, step, "
                             f"transfers and holds (RingStep.as_dict() makes one); {err} is "
                             f"missing.") from None
        transfers = [(t["src"], t["dst"], t["chunk"], t.get("op", "add")) for t in transfers]
    else:
        try:
            phase, index, transfers, holds = step.phase, step.step, step.transfers, step.holds
        except AttributeError:
            raise TypeError(f"ring_step: expected one step of a RingAllReduce(keep_steps=True) record "
                            f"(a RingStep, or its .as_dict()), got {type(step).__name__}. "
                            f"Reduce something with ring = RingAllReduce(keep_steps=True), then "
                            f"draw ring.steps[0].") from None
        transfers = [(t.src, t.dst, t.chunk, t.op) for t in transfers]
    holds = [[frozenset(c) for c in dev] for dev in holds]
    return phase, index, transfers, holds


def _check_holds(holds, n_devices, what):
    n = len(holds)
    if n_devices is None:
        n_devices = n
    if not isinstance(n_devices, numbers.Integral) or n_devices < 2:
        raise ValueError(f"{what}: n_devices must be an integer >= 2 (a ring needs two devices), "
                         f"got {n_devices!r}.")
    if n != n_devices or any(len(dev) != n_devices for dev in holds):
        raise ValueError(f"{what}: the step describes {n} devices x "
                         f"{len(holds[0]) if holds else 0} chunks but n_devices={n_devices}; a ring "
                         f"of N devices cuts every buffer into N chunks. Pass the N the record "
                         f"was made with (or leave n_devices out).")
    return n_devices


def _contribution_colors(n):
    """Colour for a chunk holding k = 1 .. n contributions (k = n: the full sum)."""
    from matplotlib import colormaps
    ramp = colormaps["Blues"]
    colors = {k: ramp(0.18 + 0.55 * (k - 1) / max(n - 2, 1)) for k in range(1, n)}
    colors[n] = FULL_SUM_COLOR
    return colors


def _holds_label(ids, n):
    if len(ids) == n:
        return "SUM"
    return "+".join(f"g{i}" for i in sorted(ids))


def _draw_ring_grid(ax, holds, transfers, title, device_names=None):
    """Draw one state of the ring (after a step) with that step's transfers as arrows."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    n = len(holds)
    colors = _contribution_colors(n)
    names = device_names or [f"device {d}" for d in range(n)]
    received = {(dst, c) for _, dst, c, _ in transfers}
    sent = {(src, c) for src, _, c, _ in transfers}
    fontsize = 9 if n <= 4 else max(5, 9 - (n - 4))
    # Devices are rows (device 0 on top), chunks are columns; cell (d, c) spans
    # x in [c, c+1], y in [d, d+1] with the y axis inverted.
    for d in range(n):
        for c in range(n):
            ids = holds[d][c]
            full = len(ids) == n
            edge, width, dash = "white", 0.5, "solid"
            if (d, c) in received:
                edge, width = "black", 2.2
            elif (d, c) in sent:
                edge, width, dash = "#d62728", 1.6, (0, (3, 2))
            ax.add_patch(Rectangle((c + 0.06, d + 0.12), 0.88, 0.76, facecolor=colors[len(ids)],
                                   edgecolor=edge, linewidth=width, linestyle=dash))
            ax.text(c + 0.5, d + 0.5, _holds_label(ids, n), ha="center", va="center",
                    fontsize=fontsize, fontweight="bold" if full else "normal",
                    color="white" if full or len(ids) > 0.7 * n else "black")
    for src, dst, c, op in transfers:
        sign = "+=" if op == "add" else "="
        style = dict(arrowstyle="-|>", mutation_scale=14, color="#d62728", linewidth=1.8,
                     shrinkA=0, shrinkB=0, zorder=5)
        x = c + 0.5 + 0.32                     # right of the label, inside the column
        # Labels sit beside the shaft, 6 points to its right and clear of the arrowhead
        # (about 3 points wide each side, at the arrow's lower end), at any figure size.
        beside = dict(textcoords="offset points", xytext=(6, 0), ha="left", va="center",
                      color="#d62728")
        if dst == src + 1:                     # straight down to the next device
            ax.add_patch(FancyArrowPatch((x, src + 0.8), (x, dst + 0.2), **style))
            ax.annotate(sign, (x, src + 1.0), fontsize=fontsize - 1, fontweight="bold", **beside)
        else:                                   # the ring wraps: last device -> device 0
            ax.add_patch(FancyArrowPatch((x, src + 0.8), (x, n + 0.28),
                                         linestyle="--", **style))
            ax.add_patch(FancyArrowPatch((x, -0.28), (x, dst + 0.2), linestyle="--", **style))
            ax.annotate(f"to {dst}", (x, n - 0.02), fontsize=fontsize - 2, **beside)
            ax.annotate(f"{sign} from {src}", (x, -0.22), fontsize=fontsize - 2, **beside)
    ax.set_xlim(0, n + 0.35)
    ax.set_ylim(n + 0.45, -0.45)
    ax.set_xticks([c + 0.5 for c in range(n)], [f"chunk {c}" for c in range(n)],
                  fontsize=fontsize)
    ax.set_yticks([d + 0.5 for d in range(n)], names, fontsize=fontsize)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=fontsize + 2)


def _ring_legend(fig_or_ax, n, **kwargs):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    colors = _contribution_colors(n)
    handles = [Patch(facecolor=colors[k],
                     label=("own gradient only (g_d)" if k == 1 else f"sum of {k} replicas' gradients"))
               for k in range(1, n)]
    handles.append(Patch(facecolor=FULL_SUM_COLOR, label=f"SUM: all {n} replicas (finished)"))
    handles.append(Line2D([], [], color="#d62728", marker=">", linewidth=1.8,
                          label="chunk sent to the next device this step (+= add, = copy)"))
    handles.append(Patch(facecolor="white", edgecolor="#d62728", linewidth=1.5, linestyle="--",
                         label="chunk sent this step (unchanged on the sender)"))
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=2,
                         label="chunk received this step"))
    return fig_or_ax.legend(handles=handles, **kwargs)


def _step_title(phase, index):
    return f"{phase} step {index}"


def ring_step(step, n_devices=None, ax=None, device_names=None, legend=True):
    """Draw one step of a ring all-reduce; returns the Figure.

    ``step`` is one element of ``RingAllReduce(keep_steps=True).steps`` (a ``RingStep``,
    or its ``.as_dict()``), or ``None`` for the state before the first step.
    Rows are devices, columns are chunks of the flat gradient buffer; cell
    (d, c) shows whose gradients chunk c on device d holds *after* the step
    ("g0+g1" = replicas 0 and 1 added; "SUM" = all of them, in green). Red
    arrows are this step's transfers: device i's chunk goes to device i+1
    (dashed where the ring wraps from the last device back to device 0), which
    adds it in (``+=``, reduce-scatter) or overwrites its copy (``=``,
    all-gather); a black border marks each chunk that was just received.

    ``n_devices``: the ring size; inferred from the step when left out (needed
    when ``step`` is None). ``device_names``: row labels (default "device 0" ...).
    ``legend``: draw the colour legend under the grid.
    """
    from mirrored.ring import RingAllReduce

    if step is None:
        if n_devices is None:
            raise ValueError("ring_step(None, n_devices): the state before the first step needs "
                             "n_devices, the ring size.")
        _check_holds([[()] * n_devices] * n_devices, n_devices, "ring_step")
        holds, transfers = RingAllReduce.initial_holds(n_devices), []
        title = "before step 0: each device holds only its own gradient"
    else:
        phase, index, transfers, holds = _step_fields(step)
        title = _step_title(phase, index)
    n = _check_holds(holds, n_devices, "ring_step")
    if device_names is not None and len(device_names) != n:
        raise ValueError(f"ring_step: {len(device_names)} device_names for a ring of {n} devices.")
    fig, ax = _figure_and_ax(ax, (1.4 * n + 2.2, 1.0 * n + 2.4))
    _draw_ring_grid(ax, holds, transfers, title, device_names)
    if legend:
        _ring_legend(ax, n, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=2,
                     fontsize=8, frameon=False)
    return fig


def ring_diagram(record, n_devices=None, initial=False, ncols=None, device_names=None,
                 buffer=None, fig=None):
    """Every step of a ring all-reduce's step record, one panel per step; returns the Figure.

    ``record``: ``RingAllReduce(keep_steps=True).steps`` after a reduction (or a list of
    ``RingStep.as_dict()``s). A ring of N devices has 2(N-1) steps: N-1 of
    reduce-scatter (first row of panels) then N-1 of all-gather (second row).
    ``initial=True`` adds a first panel with the state before step 0.
    ``buffer``: which fused buffer to draw when the record covers several (a
    ``batch_reduce`` of several dtypes); default the first. ``ncols``: panels
    per row (default N-1, so each phase gets its own row). ``fig``: draw into
    this (empty) figure instead of a new one. One shared legend at the bottom.
    """
    steps = list(record or [])
    if not steps:
        raise ValueError("ring_diagram: the step record is empty. Make one with ring = "
                         "RingAllReduce(keep_steps=True); ring.reduce('SUM', per_replica_value) over "
                         "2 or more devices; then pass ring.steps (one replica, or an empty "
                         "buffer, has no steps to draw).")
    fields = [_step_fields(s) for s in steps]
    buffers = [s.get("buffer", 0) if isinstance(s, dict) else getattr(s, "buffer", 0) for s in steps]
    chosen = buffers[0] if buffer is None else buffer
    if chosen not in buffers:
        raise ValueError(f"ring_diagram: the record has buffers {sorted(set(buffers))}, not {buffer!r}.")
    fields = [f for f, b in zip(fields, buffers) if b == chosen]
    n = _check_holds(fields[0][3], n_devices, "ring_diagram")
    for f in fields:
        _check_holds(f[3], n, "ring_diagram")
    panels = [(_step_title(phase, index), transfers, holds)
              for phase, index, transfers, holds in fields]
    if ncols is None:
        # One row per phase (reduce-scatter above, all-gather below); with
        # ``initial`` the first column holds the starting state, above a blank.
        ncols = n - 1 + (1 if initial else 0)
        slots = list(range(len(panels)))
        if initial:
            slots = [1 + k + (1 if k >= n - 1 else 0) for k in range(len(panels))]
    else:
        slots = [k + (1 if initial else 0) for k in range(len(panels))]
    if initial:
        panels = [("before step 0: own gradients only", [],
                   [[frozenset([d])] * n for d in range(n)])] + panels
        slots = [0] + slots
    nrows = math.ceil((max(slots) + 1) / ncols)
    if fig is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(ncols * (1.25 * n + 1.6), nrows * (1.0 * n + 1.2) + 1.4),
                     layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for slot, (title, transfers, holds) in zip(slots, panels):
        _draw_ring_grid(axes.flat[slot], holds, transfers, title, device_names)
    for k, ax in enumerate(axes.flat):
        if k in slots:
            continue
        if initial and k == ncols and ncols == n:      # the blank under the first panel
            ax.set_axis_off()
            ax.text(0.0, 0.5, "After reduce-scatter,\ndevice d holds the SUM\nof chunk d+1 (green).\n\n"
                    "All-gather copies each\nfinished chunk around\nthe ring: N-1 more steps.",
                    transform=ax.transAxes, ha="left", va="center", fontsize=10)
        else:
            fig.delaxes(ax)
    _ring_legend(fig, n, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"Ring all-reduce over {n} devices: reduce-scatter (adds), then all-gather "
                 f"(copies); {2 * (n - 1)} steps")
    return fig


# --- timeline ----------------------------------------------------------------------------

_EVENT_KEYS = ("replica", "phase", "start_s", "end_s")


def _event_tuple(k, event):
    if isinstance(event, dict):
        try:
            start = event["start_s"] if "start_s" in event else event["start"]
            end = event["end_s"] if "end_s" in event else event["end"]
            return event["replica"], event["phase"], float(start), float(end)
        except KeyError as err:
            raise ValueError(f"timeline: event {k} ({event!r:.80}) lacks the key {err}; each "
                             f"event needs replica, phase, start_s and end_s (seconds).") from None
    try:
        replica, phase, start, end = event
    except (TypeError, ValueError):
        raise ValueError(f"timeline: event {k} is {event!r:.80}; expected a tuple "
                         f"(replica, phase, start_s, end_s) or a dict with those keys.") from None
    return replica, phase, float(start), float(end)


def _time_unit(span):
    if span >= 1.0:
        return "s", 1.0
    if span >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def timeline(events, ax=None, title=None, phase_colors=None):
    """Gantt chart of a training step (or several): one lane per replica; returns the Figure.

    ``events``: a list of ``(replica, phase, start_s, end_s)`` tuples, or dicts with
    the keys ``replica``, ``phase``, ``start_s``, ``end_s`` (``start``/``end`` are
    accepted too). ``replica`` is an int (drawn as "replica 0") or any label (e.g. a
    device name); times are seconds on any common clock (``time.perf_counter()``):
    the chart starts at the earliest start and picks s, ms or µs. Each event is one
    bar, coloured by its phase (``PHASE_COLORS``: input copy, forward+backward,
    all-reduce, optimizer...; unknown phases get further colours); the legend lists
    the phases in order of first appearance. ``phase_colors`` overrides colours.
    """
    rows = [_event_tuple(k, e) for k, e in enumerate(list(events or []))]
    if not rows:
        raise ValueError("timeline: no events to draw; pass a list of (replica, phase, "
                         "start_s, end_s) tuples.")
    for k, (_, phase, start, end) in enumerate(rows):
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"timeline: event {k} ({phase!r}) runs from {start} to {end}; "
                             f"times must be finite seconds with end_s >= start_s.")
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    colors = dict(PHASE_COLORS, **(phase_colors or {}))
    spare = iter(colormaps["tab10"].colors[5:] + colormaps["tab10"].colors[:5] +
                 colormaps["Set3"].colors)
    phases = []
    for _, phase, _, _ in rows:
        if phase not in phases:
            phases.append(phase)
            if phase not in colors:
                colors[phase] = next(spare, "#777777")
    replicas = []
    for replica, _, _, _ in rows:
        if replica not in replicas:
            replicas.append(replica)
    try:
        replicas.sort()
    except TypeError:
        pass                                       # mixed labels: order of appearance
    t0 = min(r[2] for r in rows)
    unit, scale = _time_unit(max(r[3] for r in rows) - t0)
    fig, ax = _figure_and_ax(ax, (9, 0.6 * len(replicas) + 1.8))
    lane = {r: i for i, r in enumerate(replicas)}
    for replica, phase, start, end in rows:
        ax.barh(lane[replica], (end - start) * scale, left=(start - t0) * scale, height=0.6,
                color=colors[phase], edgecolor="black", linewidth=0.4)
    ax.set_yticks(range(len(replicas)),
                  [f"replica {r}" if isinstance(r, numbers.Integral) else str(r) for r in replicas])
    ax.set_ylim(len(replicas) - 0.5, -0.5)          # replica 0 on top
    ax.set_xlabel(f"time ({unit}) since the first event")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(facecolor=colors[p], edgecolor="black", label=p) for p in phases],
              loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(replicas) < 4 else -0.1),
              ncol=min(len(phases), 5), frameon=False, fontsize=9)
    ax.set_title(title or f"What each of {len(replicas)} replica(s) does, and when")
    return fig


# --- scaling -----------------------------------------------------------------------------

def scaling_plot(rows, ax=None, title=None, baseline=None):
    """Throughput against the number of replicas; returns the Figure.

    ``rows``: a list of dicts, one per measurement, with the keys

    ==============  ==================================================================
    replicas        number of replicas (int >= 1)
    samples_per_s   measured training throughput, examples per second
    predicted       optional: a model's prediction of samples_per_s (dotted line)
    label           optional: which series the row belongs to (e.g. "logical GPUs",
                    "CPU"); one line per label, default one unnamed series
    ==============  ==================================================================

    Draws each series' measurements, the ideal line (perfect linear scaling) and
    writes the scaling efficiency at each point: 100% is perfect, 50% means every
    extra replica buys half its share. The reference is ``baseline`` when given — a
    row (a dict with ``name`` and ``samples_per_s``, e.g. ``scaling.compare``'s "no
    strategy" row, the table's own baseline) — so the percentages are the table's:
    ``samples_per_s / (r × baseline samples_per_s)``. Without it, each series' smallest
    replica count r0: ``(samples_per_s / r) / (samples_per_s(r0) / r0)``. The
    definition used is written under the plot.
    """
    rows = list(rows or [])
    if not rows:
        raise ValueError("scaling_plot: no rows; pass a list of dicts with the keys replicas "
                         "and samples_per_s (optionally predicted and label).")
    series = {}
    for k, row in enumerate(rows):
        if not isinstance(row, dict) or "replicas" not in row or "samples_per_s" not in row:
            raise ValueError(f"scaling_plot: row {k} ({row!r:.80}) needs the keys replicas and "
                             f"samples_per_s (optionally predicted and label).")
        r, s = row["replicas"], row["samples_per_s"]
        if not isinstance(r, numbers.Integral) or r < 1:
            raise ValueError(f"scaling_plot: row {k} has replicas={r!r}; expected an integer >= 1.")
        if not isinstance(s, numbers.Real) or not s > 0:
            raise ValueError(f"scaling_plot: row {k} has samples_per_s={s!r}; expected a positive "
                             f"number (examples per second).")
        series.setdefault(row.get("label"), []).append(row)
    if baseline is not None and not (isinstance(baseline, dict) and baseline.get("samples_per_s", 0) > 0):
        raise ValueError(f"scaling_plot: baseline must be a row with a positive samples_per_s "
                         f"(and a name), e.g. the 'no strategy' row of scaling.compare; got "
                         f"{baseline!r:.80}.")
    fig, ax = _figure_and_ax(ax, (7, 4.5))
    color_cycle = iter(["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"])
    max_r = max(row["replicas"] for row in rows)
    for label, group in series.items():
        group = sorted(group, key=lambda row: row["replicas"])
        color = next(color_cycle, "#333333")
        r = np.array([row["replicas"] for row in group], dtype=float)
        s = np.array([row["samples_per_s"] for row in group], dtype=float)
        name = label if label is not None else "measured"
        ax.plot(r, s, "o-", color=color, linewidth=2, label=name)
        if baseline is not None:      # per replica, the baseline's throughput
            r0, s0, ref = 1.0, float(baseline["samples_per_s"]), f"replicas × '{baseline.get('name', 'baseline')}'"
        else:
            r0, s0 = r[0], s[0]
            ref = f"linear from {int(r0)} replica{'s' if r0 != 1 else ''}"
        ideal_r = np.array([min(r0, r[0]), max_r], dtype=float)
        ax.plot(ideal_r, ideal_r / r0 * s0, "--", color=color, alpha=0.5, linewidth=1,
                label=f"ideal ({ref})" + (f", {label}" if label is not None else ""))
        for ri, si in zip(r, s):
            eff = (si / ri) / (s0 / r0)
            ax.annotate(f"{eff:.0%}", (ri, si), textcoords="offset points", xytext=(0, -14),
                        ha="center", fontsize=8, color=color)
        pred = [(row["replicas"], row["predicted"]) for row in group if row.get("predicted") is not None]
        if pred:
            pr, ps = zip(*pred)
            ax.plot(pr, ps, ":", marker="x", color=color, linewidth=1.5,
                    label="predicted" + (f", {label}" if label is not None else ""))
    if baseline is not None:
        note = "% at each point: " + efficiency_text(baseline.get("name", "baseline"))
    else:
        note = "% at each point: efficiency = (samples/s ÷ replicas) ÷ (the same at the fewest replicas)"
    ax.set_xlabel("replicas (devices in sync)\n" + note)
    ax.set_ylabel("training throughput (samples/s)")
    _plain_numbers(ax.yaxis)
    ax.set_xticks(sorted({row["replicas"] for row in rows}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "Scaling: throughput vs replicas")
    return fig


# --- batch sharding -------------------------------------------------------------------

def sharding(global_batch, num_replicas, ax=None, title=None):
    """Which rows of one global batch each replica gets; returns the Figure.

    TensorFlow's rebatching rule (``mirrored.input_lib.rebatch_bounds``): every
    replica takes ``k = ceil(global_batch / num_replicas)`` consecutive rows, in
    replica order, until the batch runs out — so 6 rows over 4 replicas give
    2, 2, 2, 0. One horizontal bar per replica spans the rows it got (an empty
    slice is a zero-width bar, labelled "empty"); vertical lines mark the rows.
    Use it for the full batches and for the uneven last batch of an epoch.
    """
    from mirrored.input_lib import rebatch_bounds

    if isinstance(global_batch, bool) or not isinstance(global_batch, numbers.Integral) \
            or global_batch < 0:
        raise ValueError(f"sharding: global_batch must be an integer >= 0 (rows in one global "
                         f"batch), got {global_batch!r}.")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, numbers.Integral) \
            or num_replicas < 1:
        raise ValueError(f"sharding: num_replicas must be an integer >= 1, got {num_replicas!r}.")
    bounds = rebatch_bounds(int(global_batch), int(num_replicas))
    from matplotlib import colormaps
    palette = colormaps["tab10"].colors
    fig, ax = _figure_and_ax(ax, (min(10.0, max(6.0, 0.3 * global_batch + 2.5)),
                                  0.5 * num_replicas + 1.8))
    lanes = range(num_replicas)
    widths = [hi - lo for lo, hi in bounds]
    ax.barh(list(lanes), widths, left=[lo for lo, _ in bounds], height=0.6,
            color=[palette[r % 10] for r in lanes], edgecolor="black", linewidth=0.6)
    for r, (lo, hi) in enumerate(bounds):
        if hi > lo:
            text = f"rows {lo}..{hi - 1} ({hi - lo})" if hi - lo > 1 else f"row {lo} (1)"
            ax.text((lo + hi) / 2, r, text, ha="center", va="center", fontsize=8,
                    color="white")
        else:
            ax.text(lo + 0.1, r, "empty slice (0 rows)", ha="left", va="center",
                    fontsize=8, color="#c0392b", style="italic")
    if global_batch <= 64:                       # a line between rows, while they are readable
        for row in range(global_batch + 1):
            ax.axvline(row, color="#bbbbbb", linewidth=0.5, zorder=0)
    ax.set_yticks(list(lanes), [f"replica {r}" for r in lanes])
    ax.set_ylim(num_replicas - 0.5, -0.5)
    ax.set_xlim(0, max(global_batch, 1) + (3 if 0 in widths else 0))
    ax.set_xlabel("row of the global batch")
    if global_batch <= 40:
        ax.set_xticks([row + 0.5 for row in range(global_batch)],
                      [str(row) for row in range(global_batch)], fontsize=7)
    per = ceil_div(global_batch, num_replicas) if global_batch else 0
    sizes = ", ".join(str(w) for w in widths) if num_replicas <= 16 else "..."
    rows_each = f"{per} row{'' if per == 1 else 's'} per replica"
    ax.set_title(title or f"global batch of {global_batch} over {num_replicas} replicas\n"
                 f"ceil({global_batch}/{num_replicas}) = {rows_each}, "
                 f"in replica order -> "
                 f"{sizes}", fontsize=10)
    return fig


# --- GEMM thread -> data mapping ------------------------------------------------------

#: (m, n, k) drawn by default: 3 x 3 blocks for v1 and v2, 2 x 2 blocks for v3.
_GEMM_DEFAULT_SHAPES = {"v1": (48, 48, 40), "v2": (48, 48, 40), "v3": (256, 256, 24)}

_GEMM_STORY = {
    "v1": ("v1, naive: one thread per output.\n"
           "Thread (tx, ty) of block (bx, by) computes\n"
           "out[i, j], i = 16 by + ty, j = 16 bx + tx.\n"
           "It reads all of row i of A and column j\n"
           "of B from global memory: 2K loads for\n"
           "K multiply-adds, and its neighbours\n"
           "load the same values again."),
    "v2": ("v2, shared-memory tiles: still one output\n"
           "per thread, but the 16 x 16 block walks K\n"
           "16 at a time. Per k-step it stages a 16 x 16\n"
           "tile of A and of B in shared memory (light\n"
           "blue); each thread loads ONE element of each\n"
           "(x), syncthreads, then reads its row / column\n"
           "of the tiles (orange) from shared memory.\n"
           "Each global value is loaded once per block."),
    "v3": ("v3, register tiles: the 16 x 16 threads of a\n"
           "block compute a 128 x 64 tile of out; each\n"
           "thread owns 8 x 4 outputs, 16 apart (orange).\n"
           "Per k-step of 8 the block stages a 128 x 8\n"
           "A tile and an 8 x 64 B tile (light blue);\n"
           "each thread loads 4 and 2 elements (x).\n"
           "For every k it copies 8 A and 4 B values\n"
           "into registers and does 32 multiply-adds."),
}


def _rect(rows, cols):
    """Set of (row, col) cells: every pair from two ranges."""
    return {(r, c) for r in rows for c in cols}


def _gemm_sets(version, m, n, k, block, thread, k_step):
    """Index sets of the picture: what the block/thread computes, stages, loads, reads."""
    from kernels import gemm as g

    bx, by = block
    tx, ty = thread
    out_block, out_thread = set(), set()
    a_staged, b_staged, a_loads, b_loads, a_reads, b_reads = set(), set(), set(), set(), set(), set()
    if version in ("v1", "v2"):
        t = g.TILE
        row0, col0 = by * t, bx * t
        out_block = _rect(range(row0, min(row0 + t, m)), range(col0, min(col0 + t, n)))
        i, j = row0 + ty, col0 + tx
        if i < m and j < n:
            out_thread = {(i, j)}
        if version == "v1":
            # the block's threads read these rows of A and columns of B: each value
            # from global memory, 16 times (once by every thread in its row / column)
            a_staged = _rect(range(row0, min(row0 + t, m)), range(k))
            b_staged = _rect(range(k), range(col0, min(col0 + t, n)))
            a_reads = {(i, kk) for kk in range(k)} if i < m else set()
            b_reads = {(kk, j) for kk in range(k)} if j < n else set()
        else:
            k0 = k_step * t
            a_staged = _rect(range(row0, min(row0 + t, m)), range(k0, min(k0 + t, k)))
            b_staged = _rect(range(k0, min(k0 + t, k)), range(col0, min(col0 + t, n)))
            a_loads = {(row0 + ty, k0 + tx)} & a_staged        # sa[ty, tx] = A[row0 + ty, k0 + tx]
            b_loads = {(k0 + ty, col0 + tx)} & b_staged        # sb[ty, tx] = B[k0 + ty, col0 + tx]
            a_reads = {(i, kk) for kk in range(k0, min(k0 + t, k))} & a_staged
            b_reads = {(kk, j) for kk in range(k0, min(k0 + t, k))} & b_staged
    else:
        row0, col0, k0 = by * g.BM, bx * g.BN, k_step * g.BK
        out_block = _rect(range(row0, min(row0 + g.BM, m)), range(col0, min(col0 + g.BN, n)))
        rows = [row0 + ty + p * g.V3_THREADS_Y for p in range(g.TM)]
        cols = [col0 + tx + q * g.V3_THREADS_X for q in range(g.TN)]
        out_thread = {(r, c) for r in rows for c in cols if r < m and c < n}
        a_staged = _rect(range(row0, min(row0 + g.BM, m)), range(k0, min(k0 + g.BK, k)))
        b_staged = _rect(range(k0, min(k0 + g.BK, k)), range(col0, min(col0 + g.BN, n)))
        tid = ty * g.V3_THREADS_X + tx
        for l in range(g.A_LOADS):                             # as_[k, r] = A[row0 + r, k0 + k]
            e = tid + l * g.V3_THREADS
            a_loads.add((row0 + e // g.BK, k0 + e % g.BK))
        for l in range(g.B_LOADS):                             # bs[k, c] = B[k0 + k, col0 + c]
            e = tid + l * g.V3_THREADS
            b_loads.add((k0 + e // g.BN, col0 + e % g.BN))
        a_loads &= a_staged
        b_loads &= b_staged
        a_reads = {(r, kk) for r in rows for kk in range(k0, min(k0 + g.BK, k))} & a_staged
        b_reads = {(kk, c) for kk in range(k0, min(k0 + g.BK, k)) for c in cols} & b_staged
    return dict(out_block=out_block, out_thread=out_thread, a_staged=a_staged, b_staged=b_staged,
                a_loads=a_loads, b_loads=b_loads, a_reads=a_reads, b_reads=b_reads)


def _paint_cells(ax, shape, light, dark):
    """Draw a ``shape`` (rows, cols) grid of cells: grey, light blue at the (row, col)
    pairs in ``light``, orange at those in ``dark`` (drawn over light); cell (r, c)
    covers [c, c+1] x [r, r+1], row 0 at the top. For gemm_mapping and conv2d_mapping."""
    from matplotlib.colors import ListedColormap
    img = np.zeros(shape, dtype=np.int8)
    for r, c in light:
        img[r, c] = 1
    for r, c in dark:
        img[r, c] = 2
    ax.imshow(img, cmap=ListedColormap(["#f2f2f2", "#c6dbef", "#fd8d3c"]), vmin=0, vmax=2,
              interpolation="nearest", extent=(0, shape[1], shape[0], 0))


def gemm_mapping(version, m=None, n=None, k=None, block=(0, 0), thread=(0, 0), k_step=0,
                 fig=None):
    """Which data one block and one thread of GEMM ``version`` touch; returns the Figure.

    Drawn like the product itself: op(B) above ``out``, op(A) to its left, one
    square per matrix element (``trans_a = trans_b = False``). Light blue: the
    outputs the block computes, and (v2, v3) the tiles of A and B the block
    stages in shared memory at k-step ``k_step``; orange: the outputs this thread
    computes and the A and B values it reads to do so (v1: from global memory,
    v2 and v3: from shared memory); x: the elements this thread itself copies
    from global into shared memory. Grey lines are block-tile and k-tile
    boundaries. ``block`` and ``thread`` are in CUDA order ``(x, y)``: x runs
    over columns of ``out``, y over rows. Sizes come from ``kernels/gemm.py``
    (TILE = 16; v3: BM = 128, BN = 64, BK = 8, 8 x 4 outputs per thread).
    Default shapes: 48 x 48 x 40 for v1 and v2 (3 x 3 blocks), 256 x 256 x 24 for v3.
    """
    from kernels import gemm as g

    if version not in _GEMM_STORY:
        raise ValueError(f"gemm_mapping: unknown version {version!r}; expected one of "
                         f"{tuple(_GEMM_STORY)} (the kernels in kernels/gemm.py).")
    dm, dn, dk = _GEMM_DEFAULT_SHAPES[version]
    m, n, k = (dm if m is None else m), (dn if n is None else n), (dk if k is None else k)
    for name, v in (("m", m), ("n", n), ("k", k)):
        if not isinstance(v, numbers.Integral) or v < 1 or v > 1024:
            raise ValueError(f"gemm_mapping: {name}={v!r}; expected an integer in 1..1024 (one "
                             f"square per element is drawn).")
    tile_m, tile_n = (g.BM, g.BN) if version == "v3" else (g.TILE, g.TILE)
    tile_k = g.BK if version == "v3" else g.TILE
    threads = (g.V3_THREADS_X, g.V3_THREADS_Y) if version == "v3" else (g.TILE, g.TILE)
    grid = (ceil_div(n, tile_n), ceil_div(m, tile_m))
    for what, value, limit in (("block", block, grid), ("thread", thread, threads)):
        if (len(value) != 2 or not all(isinstance(v, numbers.Integral) for v in value)
                or not (0 <= value[0] < limit[0] and 0 <= value[1] < limit[1])):
            raise ValueError(f"gemm_mapping: {what}={tuple(value)!r} is outside the {version} "
                             f"launch: {what} indices (x, y) run over {limit[0]} x {limit[1]} "
                             f"for out of shape ({m}, {n}).")
    steps = ceil_div(k, tile_k)
    if not isinstance(k_step, numbers.Integral) or not 0 <= k_step < steps:
        raise ValueError(f"gemm_mapping: k_step={k_step!r}; with k={k} the {version} kernel takes "
                         f"{steps} step(s) of {tile_k} along K (0..{steps - 1}).")
    sets = _gemm_sets(version, m, n, k, tuple(block), tuple(thread), k_step)

    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D
    if fig is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(11, 8.5), layout="constrained")
    gs = fig.add_gridspec(2, 2, width_ratios=[max(k, 0.3 * n), n], height_ratios=[max(k, 0.3 * m), m])
    ax_text, ax_b = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1])
    ax_a, ax_out = fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[1, 1])

    def draw(ax, shape, light, dark, loads, row_tile, col_tile, title, mark_dark=False):
        _paint_cells(ax, shape, light, dark)
        for r in range(0, shape[0] + 1, row_tile):
            ax.axhline(r, color="#888888", linewidth=0.6)
        for c in range(0, shape[1] + 1, col_tile):
            ax.axvline(c, color="#888888", linewidth=0.6)
        if mark_dark and dark and max(shape) > 64:     # tiny cells: outline them too
            rr, cc = zip(*sorted(dark))
            ax.scatter(np.array(cc) + 0.5, np.array(rr) + 0.5, marker="s", s=14,
                       facecolor="#fd8d3c", edgecolor="#7f2704", linewidths=0.6, zorder=3)
        if loads:
            rr, cc = zip(*sorted(loads))
            ax.scatter(np.array(cc) + 0.5, np.array(rr) + 0.5, marker="x", s=28, color="black",
                       linewidths=1.2, zorder=3)
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=7)

    bx, by = block
    tx, ty = thread
    draw(ax_out, (m, n), sets["out_block"], sets["out_thread"], (), tile_m, tile_n,
         f"out ({m} x {n}): block ({bx}, {by}) light, thread ({tx}, {ty}) orange", mark_dark=True)
    draw(ax_a, (m, k), sets["a_staged"], sets["a_reads"], sets["a_loads"], tile_m, tile_k,
         f"op(A) ({m} x {k})")
    draw(ax_b, (k, n), sets["b_staged"], sets["b_reads"], sets["b_loads"], tile_k, tile_n,
         f"op(B) ({k} x {n})")
    ax_text.set_axis_off()
    ax_text.text(0.0, 1.0, _GEMM_STORY[version], transform=ax_text.transAxes, ha="left", va="top",
                 fontsize=9, family="monospace")
    handles = [Patch(facecolor="#c6dbef", label="block: its outputs, tiles staged in shared memory"
                     if version != "v1" else "block: its outputs, what its threads read (16x each)"),
               Patch(facecolor="#fd8d3c", label="thread: its outputs, the values it reads"),
               Line2D([], [], marker="x", linestyle="none", color="black",
                      label="thread: copies into shared memory")]
    if version == "v1":
        handles = handles[:2]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    stage = "" if version == "v1" else f", k-step {k_step} (steps 0..{steps - 1})"
    fig.suptitle(f"GEMM {version}: who computes and loads what (out = A @ B{stage})")
    return fig


# --- conv2d ------------------------------------------------------------------------------

def conv2d_mapping(version="v1", in_hw=(28, 28), kernel_hw=(3, 3), cout=32, thread=0, block=0,
                   fig=None):
    """Which outputs one warp (v1) or one block (v2) of ``kernels/conv2d.py`` computes, and
    which input pixels it reads; returns the Figure. Image 0, stride 1, "valid" padding,
    one input channel (the course lab's first layer: 28 x 28 x 1, 3 x 3, 32 filters).

    v1 (one thread per output, co fastest): thread ``thread`` and its warp (32 consecutive
    threads: for Cout = 32, every channel of one output pixel). Right: the warp's output
    pixel(s) (light) and the thread's (orange); left: the 3 x 3 window(s) the warp reads
    from global memory (each input value once per warp: a broadcast).
    v2 (a block per V2_TILE x V2_TILE output tile, all channels): block ``block``. Right:
    its tile (light) and the pixels thread ``thread`` of the block computes (orange); left:
    the input patch the block copies into shared memory once (light) and the windows the
    thread then reads from shared memory (orange).
    """
    from kernels import conv2d as conv
    from kernels.launch import nhwc_index

    if version not in conv.VERSIONS:
        raise ValueError(f"conv2d_mapping: unknown version {version!r}; expected one of "
                         f"{conv.VERSIONS} (the kernels in kernels/conv2d.py).")
    out_h, out_w, _ = conv.window_geometry("conv2d_mapping", in_hw, kernel_hw, 1, "valid", "kernel")
    kh, kw = conv.pair("conv2d_mapping", "kernel size", kernel_hw)
    h, w = (int(v) for v in in_hw)
    index = nhwc_index.py_func                       # the kernels' own (n, oh, ow, co) of i
    out_light, out_dark, in_light, in_dark = set(), set(), set(), set()

    def window(oh, ow):
        return _rect(range(oh, oh + kh), range(ow, ow + kw))

    if version == "v1":
        total = out_h * out_w * cout
        if not (isinstance(thread, numbers.Integral) and 0 <= thread < total):
            raise ValueError(f"conv2d_mapping: thread={thread!r}; v1 has one thread per output, "
                             f"0..{total - 1} for a {out_h} x {out_w} x {cout} output.")
        block_threads = 256                          # THREADS_1D on a GPU (kernels/launch.py)
        block0, warp0 = thread // block_threads * block_threads, thread // 32 * 32
        for first, count, outs, ins in ((block0, block_threads, out_light, in_light),
                                         (warp0, 32, out_dark, in_dark)):
            for i in range(first, min(first + count, total)):
                _, oh, ow, _ = index(i, out_h, out_w, cout)
                outs.add((oh, ow))
                ins |= window(oh, ow)
        _, oh, ow, co = index(thread, out_h, out_w, cout)
        last = min(warp0 + 32, total) - 1
        story = (f"v1: thread {thread} computes out[0, {oh}, {ow}, {co}] (co fastest). Its warp, "
                 f"threads {warp0}..{last} (orange), computes out[0, {oh}, {ow}, :]: it writes 32 "
                 f"consecutive floats and reads each input value of one 3 x 3 window once (a "
                 f"broadcast to the 32 threads), against consecutive weights w[kh, kw, 0, 0..31]. "
                 f"Its block of {block_threads} threads (light) takes {block_threads // cout} "
                 f"neighbouring pixels, whose windows overlap: the same input values are read "
                 f"again by the next warp (from cache, at best).")
        who = (f"light = thread {thread}'s block ({block_threads} threads), "
               f"orange = its warp (32 threads)")
    else:
        tile = conv.V2_TILE
        tiles_h, tiles_w = ceil_div(out_h, tile), ceil_div(out_w, tile)
        if not (isinstance(block, numbers.Integral) and 0 <= block < tiles_h * tiles_w):
            raise ValueError(f"conv2d_mapping: block={block!r}; v2 has one block per {tile} x "
                             f"{tile} output tile, 0..{tiles_h * tiles_w - 1} here.")
        threads = 256                                # V2_THREADS on a GPU (the simulator uses fewer)
        if not (isinstance(thread, numbers.Integral) and 0 <= thread < threads):
            raise ValueError(f"conv2d_mapping: thread={thread!r}; a v2 block has {threads} threads.")
        oh0, ow0 = block // tiles_w * tile, block % tiles_w * tile
        out_light = _rect(range(oh0, min(oh0 + tile, out_h)), range(ow0, min(ow0 + tile, out_w)))
        in_light = _rect(range(oh0, min(oh0 + tile - 1 + kh, h)), range(ow0, min(ow0 + tile - 1 + kw, w)))
        cos = set()
        for e in range(thread, tile * tile * cout, threads):     # the kernel's loop over e
            pix, co = e // cout, e % cout
            oh, ow = oh0 + pix // tile, ow0 + pix % tile
            if oh < out_h and ow < out_w:
                out_dark.add((oh, ow))
                in_dark |= window(oh, ow)
                cos.add(co)
        who = f"light = block {block}, orange = thread {thread} of it"
        story = (f"v2: block {block} computes the {tile} x {tile} output tile at ({oh0}, {ow0}), "
                 f"all {cout} channels; it first copies the {tile - 1 + kh} x {tile - 1 + kw} input "
                 f"patch into shared memory (each value read from global memory once). Thread "
                 f"{thread} of {threads} computes channel(s) {sorted(cos)} of {len(out_dark)} "
                 f"pixel(s) of the tile, reading shared memory.")

    if fig is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax_in, ax_out = fig.subplots(1, 2, width_ratios=[w, out_w])
    for ax, shape, light, dark, title in (
            (ax_in, (h, w), in_light, in_dark, f"input x[0, :, :, 0] ({h} x {w})"),
            (ax_out, (out_h, out_w), out_light, out_dark,
             f"output out[0, :, :, co] ({out_h} x {out_w} x {cout})")):
        _paint_cells(ax, shape, light, dark)
        ax.set_xticks(range(0, shape[1] + 1, 4))
        ax.set_yticks(range(0, shape[0] + 1, 4))
        ax.grid(color="#bbbbbb", linewidth=0.4)
        ax.set_xlabel("column (w)")
        ax.set_ylabel("row (h)")
        ax.set_title(title, fontsize=10)
    import textwrap
    fig.suptitle(f"conv2d {version}: {who}", fontsize=11)
    fig.supxlabel(textwrap.fill(story, 120), fontsize=9)
    return fig


# --- timing results ------------------------------------------------------------------

def plot_comparison(rows, path=None, title=None):
    """Bar charts of epoch time and samples/s per strategy (efficiency on the bars).

    ``rows``: ``scaling.compare``'s. The percentage on each throughput bar is the row's
    ``efficiency`` (the table's), and its definition, with the table's baseline, is
    written under the charts. Writes a PNG to ``path`` if given; returns the Figure.
    """
    from matplotlib.figure import Figure
    names = [r["name"] for r in rows]
    fig = Figure(figsize=(max(8, 2.4 * len(rows)), 4.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    colors = ["#888888" if r["name"] == "no strategy" else "#1f77b4" for r in rows]
    ax1.bar(names, [r["epoch_time_s"] for r in rows], color=colors)
    ax1.set_ylabel("seconds per epoch (median)")
    ax1.set_title("epoch time (lower is better)")
    bars = ax2.bar(names, [r["samples_per_s"] for r in rows], color=colors)
    ax2.set_ylabel("training examples per second")
    _plain_numbers(ax2.yaxis)
    labelled = False
    for bar, r in zip(bars, rows):
        if not math.isnan(r.get("efficiency", float("nan"))):
            ax2.annotate(f"{r['efficiency']:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=9)
            labelled = True
    ax2.set_title("throughput (higher is better)" + ("; % = efficiency" if labelled else ""))
    ax2.margins(y=0.12)                                  # room for the percentages
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title or "MNIST lab: no strategy vs MirroredStrategy")
    baseline = next((r.get("baseline") for r in rows if r.get("baseline")), None)
    if labelled and baseline:
        fig.supxlabel(efficiency_text(baseline) + "; 100% = every replica adds a whole "
                      f"'{baseline}' worth", fontsize=9, color="#444444")
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def plot_performance_model(measured, predicted, ax=None, title=None):
    """Samples/s against devices: measured rows (``compare``) and model lines per link.

    ``measured``: rows with ``replicas`` and ``samples_per_s`` (e.g. the MirroredStrategy
    rows of ``scaling.compare``); ``predicted``: ``perf_model.predict_throughput`` rows.
    Returns the Figure.
    """
    from matplotlib.figure import Figure
    if ax is None:
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    styles = iter(["--", ":", "-.", (0, (5, 1))])
    for link in dict.fromkeys(p["link"] for p in predicted):
        pts = sorted((p["n"], p["samples_per_s"]) for p in predicted if p["link"] == link)
        bw = next(p["bandwidth"] for p in predicted if p["link"] == link)
        ax.plot(*zip(*pts), linestyle=next(styles, "--"), marker="x",
                label=f"model: {link} ({bw / 1e9:g} GB/s)")
    pts = sorted((r["replicas"], r["samples_per_s"]) for r in measured)
    if pts:
        ax.plot(*zip(*pts), "o-", color="black", linewidth=2, label="measured here")
    ax.set_xlabel("devices (replicas)")
    ax.set_ylabel("training throughput (samples/s)")
    _plain_numbers(ax.yaxis)
    ax.set_xticks(sorted({n for n, _ in pts} | {p["n"] for p in predicted}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "Performance model for N physical GPUs vs measurement")
    return fig
