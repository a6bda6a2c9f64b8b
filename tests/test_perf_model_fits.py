"""What the labs fit to measurements: lab 05's calibration and lab 06's link model.

Both were wrong in ways the printed output hid: ``calibrate`` clamped a negative overhead
to 0 in silence (the model then missed the measurement it claims to reproduce), and lab
06's least-squares link fit was dominated by its largest buffers (a 1 KB latency ten times
the measurement). These tests give each fit data with a known answer.

    python -m pytest tests/test_perf_model_fits.py
"""
import warnings

import numpy as np
import pytest

from mirrored.lab import perf_model


def _breakdown(compute, step_s):
    return {"global_batch": 64, "step_s": step_s,
            "phases": {"input copy": {"median_s": 0.2 * compute},
                       "forward+backward": {"median_s": 0.8 * compute}}}


def test_calibrate_warns_and_still_reproduces_the_measurement_when_the_breakdown_is_slower(rng):
    compute = float(rng.uniform(1e-3, 2e-3))
    measured_step = compute * float(rng.uniform(0.4, 0.8))              # fit beat the breakdown
    measured = {"replicas": 1, "global_batch": 64, "samples_per_s": 64 / measured_step}
    with pytest.warns(perf_model.CalibrationWarning, match="longer than the whole measured step"):
        cal = perf_model.calibrate(_breakdown(compute, compute), grad_bytes=4000, measured=measured)
    assert cal["overhead_s"] == 0.0
    one = perf_model.predict_throughput(cal, [1], 64)[0]
    assert one["samples_per_s"] == pytest.approx(measured["samples_per_s"], rel=1e-12)


def test_calibrate_is_silent_when_the_overhead_is_positive(rng):
    compute = float(rng.uniform(1e-3, 2e-3))
    measured = {"replicas": 1, "global_batch": 64, "samples_per_s": 64 / (1.5 * compute)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal = perf_model.calibrate(_breakdown(compute, compute), grad_bytes=4000, measured=measured)
    assert cal["overhead_s"] == pytest.approx(0.5 * compute, rel=1e-9)


def _rows(alpha, beta, noise, rng, ns=(2, 4), sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 24)):
    return [{"n": n, "bytes": s,
             "ring_us": 1e6 * perf_model.ring_allreduce_time(s, n, beta, latency_s=alpha)
             * float(rng.uniform(1 - noise, 1 + noise))}
            for n in ns for s in sizes]


def test_fit_link_recovers_latency_and_bandwidth_and_fits_the_small_sizes(rng):
    alpha, beta = float(rng.uniform(5e-6, 50e-6)), float(rng.uniform(1e9, 20e9))
    rows = _rows(alpha, beta, 0.1, rng)
    fit = perf_model.fit_link(rows)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=0.25)
    assert fit["beta_bytes_per_s"] == pytest.approx(beta, rel=0.25)
    assert max(abs(e) for e in fit["relative_errors"]) < 0.35
    small = [i for i, r in enumerate(rows) if r["bytes"] == 1 << 10]
    assert all(abs(fit["relative_errors"][i]) < 0.35 for i in small)


def test_fit_link_keeps_the_small_sizes_where_a_plain_least_squares_fit_loses_them(rng):
    # Shared-memory MPI as lab 06 measured it: tens of us at 1 KB, and a bandwidth that falls
    # once the buffers leave the cache (the model's one beta cannot fit both ends).
    rows = []
    for n in (2, 4):
        for s in (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24):
            beta = 8e9 if s <= 1 << 18 else 1e9
            t = perf_model.ring_allreduce_time(s, n, beta, latency_s=15e-6)
            rows.append({"n": n, "bytes": s, "ring_us": 1e6 * t * float(rng.uniform(0.98, 1.02))})
    fit = perf_model.fit_link(rows)
    a = np.array([[2 * (r["n"] - 1), 2 * (r["n"] - 1) / r["n"] * r["bytes"]] for r in rows])
    t = np.array([r["ring_us"] * 1e-6 for r in rows])
    (old_alpha, old_inv_beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    old_model = a @ np.array([max(old_alpha, 0.0), old_inv_beta])
    small = [i for i, r in enumerate(rows) if r["bytes"] == 1 << 10]
    old_small = max(abs(old_model[i] / t[i] - 1) for i in small)
    new_small = max(abs(fit["relative_errors"][i]) for i in small)
    # Over 20,000 draws of the 2 % noise: the plain fit misses 1 KB by 38-98 % (usually 97 %;
    # by under 50 % when its latency comes out near zero, 0.5 % of draws, which failed a
    # "> 50 %" bound once in CI), the new fit by at most 20 %.
    assert old_small > 0.3, f"the plain fit was expected to miss 1 KB by > 30 %, missed by {old_small:.0%}"
    assert new_small < 0.25, f"fit_link missed 1 KB by {new_small:.0%} (the plain fit: {old_small:.0%})"


def test_fit_link_never_returns_a_negative_parameter(rng):
    beta = float(rng.uniform(1e9, 20e9))
    rows = _rows(0.0, beta, 0.0, rng)                                    # pure bandwidth
    rows[0]["ring_us"] *= 0.5                                            # a 1 KB outlier below it
    fit = perf_model.fit_link(rows)
    assert fit["alpha_s"] >= 0 and fit["beta_bytes_per_s"] > 0
    with pytest.raises(ValueError, match="at least two"):
        perf_model.fit_link(rows[:1])
