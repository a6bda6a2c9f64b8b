"""A performance model of data-parallel training on N physical GPUs.

What would N real GPUs over PCIe or NVLink do with this model? A step on N
devices costs its compute divided by N, plus a ring all-reduce of the gradient
buffer over the slowest link, plus an overhead that does not shrink::

    t(N) = compute/N + 2(N-1)/N * bytes/link_bandwidth + overhead

``calibrate`` measures compute and overhead on ONE replica (from
``timing.step_breakdown``, and ``fit``'s measured throughput so that N=1 matches it); ``predict_throughput`` then extrapolates to N devices
with the lab's rule (the global batch grows with N). Everything returns plain
numbers and dicts; ``mirrored.lab.viz.plot_performance_model`` draws them beside
measurements.

Neighbours: ``timing.py`` (the measurements), ``viz.py`` (the plot),
``ring.py`` (the ring whose traffic ``ring_allreduce_time`` counts).
"""
import warnings

import numpy as np

from mirrored.keras.step import FORWARD_BACKWARD, INPUT_COPY


class CalibrationWarning(UserWarning):
    """``calibrate`` had to change what it measured to keep the model meaningful."""


#: Link bandwidths (bytes/s, one direction, what a ring step can use). Rounded
#: practical figures; pass your own measured numbers where you have them.
LINKS = {
    "PCIe 3.0 x16": 12e9,            # 16 GB/s theoretical, ~12 achieved
    "PCIe 4.0 x16": 25e9,            # 32 GB/s theoretical, ~25 achieved
    "NVLink (V100, 6 links)": 150e9,
    "NVLink (A100, 12 links)": 300e9,
    "NVLink (H100, 18 links)": 450e9,
}
#: The two a lab plots by default.
DEFAULT_LINKS = ("PCIe 4.0 x16", "NVLink (A100, 12 links)")


def ring_allreduce_time(grad_bytes, n, link_bandwidth, latency_s=0.0):
    """Seconds for a ring all-reduce of ``grad_bytes`` over ``n`` devices.

    2(N-1) steps (reduce-scatter, then all-gather), each moving a 1/N chunk to the
    next device while receiving one from the previous: 2(N-1)/N · bytes / bandwidth,
    plus ``latency_s`` per step. Zero for one device (nothing to sum).
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * grad_bytes / link_bandwidth + 2 * (n - 1) * latency_s


def predict_step_time(n, compute_s, grad_bytes, link_bandwidth, overhead_s=0.0, latency_s=0.0):
    """t(N) = compute/N + 2(N-1)/N · bytes/link_bandwidth + overhead (seconds per step).

    ``compute_s``: one device's time for the step's whole global batch (forward,
    backward, optimizer). ``grad_bytes``: the packed gradient buffer (4 × params).
    ``link_bandwidth``: bytes/s of the slowest link in the ring, one direction.
    ``overhead_s``: per-step cost that does not shrink with N (Python, launches,
    the merge point). ``latency_s``: per ring step (the α of an α-β model).

    Assumptions (say them when you quote a prediction):
      * compute divides perfectly: each of N identical GPUs does B/N of the batch
        (small per-GPU batches run a GPU below its peak, so this is optimistic);
      * no overlap: the all-reduce starts after the whole backward pass (true here:
        one packed buffer, one ring; frameworks that bucket gradients overlap it);
      * the ring is bandwidth-bound by its slowest link, every link used in both
        directions at once, the additions in the ring cost nothing extra;
      * nothing else shares the links (no PCIe switch contention, no host traffic);
      * the optimizer runs on every GPU on its own copy: it does not shrink with N,
        count it in ``overhead_s`` if you want it exact.
    """
    return compute_s / n + ring_allreduce_time(grad_bytes, n, link_bandwidth, latency_s) + overhead_s


def performance_model(ns, compute_s, grad_bytes, links=None, overhead_s=0.0, latency_s=0.0):
    """Predicted step times for every N and link: a list of dicts.

    ``links``: {name: bytes/s}, default the ``DEFAULT_LINKS`` entries of ``LINKS``.
    Each row: ``link, bandwidth, n, step_s, compute_s, allreduce_s, overhead_s,
    speedup`` (t(1)/t(N)), ``efficiency`` (speedup/N).
    """
    links = links or {k: LINKS[k] for k in DEFAULT_LINKS}
    rows = []
    for link, bw in links.items():
        t1 = predict_step_time(1, compute_s, grad_bytes, bw, overhead_s, latency_s)
        for n in ns:
            t = predict_step_time(n, compute_s, grad_bytes, bw, overhead_s, latency_s)
            rows.append({"link": link, "bandwidth": float(bw), "n": int(n), "step_s": t,
                         "compute_s": compute_s / n,
                         "allreduce_s": ring_allreduce_time(grad_bytes, n, bw, latency_s),
                         "overhead_s": overhead_s, "speedup": t1 / t, "efficiency": t1 / t / n})
    return rows


def calibrate(breakdown, grad_bytes=None, model=None, measured=None):
    """Model parameters measured on ONE replica: per-example compute and per-step overhead.

    ``breakdown``: ``step_breakdown`` of a single-replica model. Compute is the
    median input copy + forward+backward (work that a GPU count divides); the
    overhead is everything else in a step. ``grad_bytes`` (or ``model``): the
    gradient buffer size.

    ``measured``: the 1-replica row of ``scaling.compare`` (``samples_per_s``,
    ``global_batch``), when the model is to be drawn beside ``fit``'s throughput.
    The overhead is then what ``fit`` spends per step beyond the compute —
    ``global_batch / samples_per_s - compute``: the optimizer, the input pipeline
    (shuffle, batch, the host-to-device copy), Keras's callbacks and metrics — so the
    model reproduces that measurement at N=1 exactly. Where the breakdown's compute alone
    is longer than that measured step, the overhead would be negative: the compute is then
    scaled down to the measured step, the overhead is 0, and a ``CalibrationWarning`` says
    so (the figures it printed before hid this as an overhead of 0). Without it the overhead is the
    breakdown's bare step minus the compute (``step_breakdown`` feeds prepared host
    batches and runs no callbacks), and the model overestimates ``fit`` at N=1.
    """
    phases = breakdown["phases"]
    compute = sum(phases[p]["median_s"] for p in (INPUT_COPY, FORWARD_BACKWARD) if p in phases)
    if grad_bytes is None and model is not None:
        grad_bytes = 4 * model.count_params()
    step_s = breakdown["step_s"]
    if measured is not None:
        if measured.get("replicas", 1) != 1 or not measured.get("samples_per_s", 0) > 0:
            raise ValueError(f"calibrate: measured must be a 1-replica row of scaling.compare "
                             f"with a positive samples_per_s, got replicas="
                             f"{measured.get('replicas')!r}, samples_per_s="
                             f"{measured.get('samples_per_s')!r}.")
        step_s = measured["global_batch"] / measured["samples_per_s"]
    overhead = step_s - compute
    measured_compute = compute
    if overhead < 0:
        # The breakdown's phases, each timed on its own, add up to more than the measured
        # step (every phase boundary waits for the device; a busy machine slowed the
        # breakdown). A negative overhead means nothing, so the compute is scaled down to
        # the measured step: the model still reproduces the measurement at N=1, all of it
        # as compute. Said aloud, since it changes what the model assumes.
        warnings.warn(f"calibrate: the breakdown's compute ({compute * 1e3:.3g} ms per step) is "
                      f"longer than the whole measured step ({step_s * 1e3:.3g} ms): the compute is "
                      f"scaled down to the measured step and the overhead set to 0. Time the "
                      f"breakdown and the measurement on a quiet machine, one after the other.",
                      CalibrationWarning, stacklevel=2)
        compute, overhead = step_s, 0.0
    return {"compute_per_example_s": compute / max(breakdown["global_batch"], 1),
            "overhead_s": overhead,
            "grad_bytes": grad_bytes, "global_batch": breakdown["global_batch"],
            # False: the overhead above is the clamp's 0, not a measurement (model_verdict)
            "calibrated": measured_compute <= step_s, "step_s": step_s,
            "measured_compute_s": measured_compute}


#: A fixed cost under this share of the predicted step "hardly matters" (model_verdict).
SMALL_SHARE = 0.10


def model_verdict(calibration, n, link_bandwidth, link="the link", latency_s=0.0):
    """What the calibrated model says, in one sentence computed from its numbers: at ``n``
    GPUs on a link of ``link_bandwidth`` bytes/s, the share of the step that the ring and
    the overhead each take, and so which of them matters (over ``SMALL_SHARE``). A
    calibration that failed (``calibrated`` False: the breakdown's compute was longer than
    fit's whole step, the overhead clamped to 0) says so and draws no conclusion about
    the overhead or the link. Lab 05 prints it under its calibration."""
    if not calibration.get("calibrated", True):
        return (f"The calibration failed on this machine: the breakdown's compute "
                f"({calibration['measured_compute_s'] * 1e3:.3g} ms per step) was longer than fit's "
                f"whole step ({calibration['step_s'] * 1e3:.3g} ms), so the overhead is unknown (set "
                f"to 0) and this model says nothing about what the overhead or the link costs. "
                f"Run sections 3 to 5 again on a quiet machine, or on a GPU.")
    compute = calibration["compute_per_example_s"] * calibration["global_batch"]   # per GPU's batch
    ring = ring_allreduce_time(calibration["grad_bytes"], n, link_bandwidth, latency_s)
    overhead = calibration["overhead_s"]
    step = compute + ring + overhead
    said = []
    for name, t in (("the ring over " + link, ring), ("the per-step overhead", overhead)):
        matters = "matters" if t / step >= SMALL_SHARE else "hardly matters"
        said.append(f"{name} {t * 1e3:.3g} ms ({t / step:.0%}: {matters})")
    return (f"At N = {n}, per step: compute {compute * 1e3:.3g} ms, " + ", ".join(said)
            + f" (a cost {SMALL_SHARE:.0%} of the step or more matters).")


def predict_throughput(calibration, ns, batch_per_replica, links=None, latency_s=0.0):
    """Samples/s on N physical GPUs with ``batch_per_replica`` each (the lab's rule).

    The global batch grows with N, so compute(N·b)/N = compute(b): each step costs
    ``b · compute_per_example + ring(N) + overhead`` and moves N·b examples.
    Returns a list of dicts ``link, n, step_s, samples_per_s``.
    """
    links = links or {k: LINKS[k] for k in DEFAULT_LINKS}
    rows = []
    for link, bw in links.items():
        for n in ns:
            compute = calibration["compute_per_example_s"] * batch_per_replica * n   # whole global batch
            t = predict_step_time(n, compute, calibration["grad_bytes"], bw,
                                  calibration["overhead_s"], latency_s)
            rows.append({"link": link, "bandwidth": float(bw), "n": int(n), "step_s": t,
                         "samples_per_s": n * batch_per_replica / t})
    return rows


def fit_link(rows):
    """Latency α (s per ring step) and bandwidth β (bytes/s) of a link, fitted to ring times.

    ``rows``: dicts with ``n`` (ring size), ``bytes`` (buffer) and ``ring_us`` (measured
    all-reduce time), e.g. ``benchmarks.multiworker``'s results. The model is
    ``t = 2(N-1)·α + 2(N-1)/N · S/β`` (``ring_allreduce_time``).

    The fit minimises the *relative* error of every row, not the absolute one: the sizes
    span 1 KB to many MB, and a plain least-squares fit is dominated by the largest
    times, so it may give a latency ten times the 1 KB measurement. Neither parameter
    may be negative (if the unconstrained fit makes one negative, the other is refitted
    alone with it fixed at 0). Returns ``{"alpha_s", "beta_bytes_per_s",
    "relative_errors"}`` (model/measured - 1, one per row, in the rows' order).
    """
    rows = list(rows)
    if len(rows) < 2:
        raise ValueError(f"fit_link needs at least two measured rows (two sizes), got {len(rows)}.")
    n = np.array([r["n"] for r in rows], np.float64)
    size = np.array([r["bytes"] for r in rows], np.float64)
    t = np.array([r["ring_us"] for r in rows], np.float64) * 1e-6           # (rows,) seconds
    if (t <= 0).any() or (n < 2).any():
        raise ValueError("fit_link: every row needs n >= 2 and a positive ring_us.")
    a = np.stack([2 * (n - 1), 2 * (n - 1) / n * size], axis=1) / t[:, None]  # rows scaled by 1/t
    ones = np.ones_like(t)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, ones, rcond=None)
    if alpha < 0:                                   # bandwidth alone
        alpha, inv_beta = 0.0, max(float(a[:, 1] @ ones / (a[:, 1] @ a[:, 1])), 0.0)
    elif inv_beta < 0:                              # latency alone
        alpha, inv_beta = max(float(a[:, 0] @ ones / (a[:, 0] @ a[:, 0])), 0.0), 0.0
    beta = 1.0 / inv_beta if inv_beta > 0 else float("inf")
    model = np.array([ring_allreduce_time(s, int(k), beta, latency_s=alpha) for s, k in zip(size, n)])
    return {"alpha_s": float(alpha), "beta_bytes_per_s": float(beta),
            "relative_errors": [float(e) for e in model / t - 1]}
