"""mirrored.lab.viz: every picture is a Figure with the expected panels and marks.

The figures are drawn from real data where the library makes it (a ring
all-reduce's step record over logical CPU devices) and rendered to PNG bytes with the
Agg backend, so a drawing error cannot hide until a notebook runs. Bad input
must fail with a message that says what was expected.
"""
import io

import numpy as np
import pytest

import mirrored as tf
from mirrored.lab import viz
from mirrored.ring import RingAllReduce
from mirrored.values import PerReplica

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402


def render(fig):
    """Draw the figure to PNG bytes (what a notebook or savefig would do)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


def ring_steps(devices, rng, n, size=10, dtypes=(np.float32,)):
    devices(cpus=n)
    names = [f"CPU:{i}" for i in range(n)]
    ring = RingAllReduce(keep_steps=True)
    pairs = []
    for dtype in dtypes:
        comps = []
        for name in names:
            with tf.device(name):
                comps.append(tf.constant((rng.standard_normal(size) * 10).astype(dtype)))
        pairs.append((PerReplica(comps), None))
    ring.batch_reduce("SUM", pairs)
    return ring.steps


def cells(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def arrows(ax):
    return [p for p in ax.patches if isinstance(p, FancyArrowPatch)]


# --- ring ---------------------------------------------------------------------------

def test_ring_diagram_of_a_4_ring_has_one_panel_per_step(devices, rng):
    steps = ring_steps(devices, rng, 4)
    fig = viz.ring_diagram(steps)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 6 == 2 * (4 - 1)
    assert [ax.get_title() for ax in fig.axes] == [
        "reduce-scatter step 0", "reduce-scatter step 1", "reduce-scatter step 2",
        "all-gather step 0", "all-gather step 1", "all-gather step 2"]
    for ax in fig.axes:
        assert len(cells(ax)) == 16                       # 4 devices x 4 chunks
        assert len(arrows(ax)) == 4 + 1                   # one per device; the wrap is drawn in two
    last = [t.get_text() for t in fig.axes[-1].texts]
    assert last.count("SUM") == 16                        # every chunk on every device is the sum
    assert len(fig.legends) == 1
    render(fig)


def test_ring_diagram_initial_panel_and_layout(devices, rng):
    steps = ring_steps(devices, rng, 3)
    fig = viz.ring_diagram(steps, initial=True)
    titled = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titled[0].startswith("before step 0") and len(titled) == 1 + 4
    first = fig.axes[0]
    assert sorted(t.get_text() for t in first.texts) == ["g0"] * 3 + ["g1"] * 3 + ["g2"] * 3
    assert arrows(first) == []
    fig = viz.ring_diagram([s.as_dict() for s in steps], ncols=2)   # JSON form, 2 per row
    assert len(fig.axes) == 4
    render(fig)


def test_ring_diagram_draws_one_fused_buffer(devices, rng):
    steps = ring_steps(devices, rng, 3, dtypes=(np.float32, np.int32))
    assert len(steps) == 8                                # two fused buffers, 4 steps each
    assert len(viz.ring_diagram(steps).axes) == 4
    assert len(viz.ring_diagram(steps, buffer=1).axes) == 4
    with pytest.raises(ValueError, match="buffers"):
        viz.ring_diagram(steps, buffer=5)


def test_ring_step_cells_arrows_and_labels(devices, rng):
    steps = ring_steps(devices, rng, 4)
    fig = viz.ring_step(steps[0], 4)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_title() == "reduce-scatter step 0"
    labels = [t.get_text() for t in ax.texts]
    # after RS step 0, device i+1 holds g_i + g_{i+1} in chunk i (device 0: chunk 3)
    for expected in ("g0+g1", "g1+g2", "g2+g3", "g0+g3"):
        assert expected in labels
    assert labels.count("+=") + sum(t.startswith("+= from") for t in labels) == 4
    ag = viz.ring_step(steps[3], legend=False).axes[0]
    assert ag.get_title() == "all-gather step 0" and ag.get_legend() is None
    assert any(t.get_text().startswith("= from") for t in ag.texts)
    # the dict form and an existing axes
    other = Figure()
    ax2 = other.add_subplot()
    assert viz.ring_step(steps[2].as_dict(), ax=ax2) is other
    assert sum(t.get_text() == "SUM" for t in ax2.texts) == 4   # one finished chunk per device
    before = viz.ring_step(None, 4).axes[0]
    assert before.get_title().startswith("before step 0") and arrows(before) == []
    render(fig)


def test_ring_bad_input_says_what_to_pass(devices, rng):
    steps = ring_steps(devices, rng, 4)
    with pytest.raises(ValueError, match="n_devices=3"):
        viz.ring_step(steps[0], 3)
    with pytest.raises(ValueError, match=">= 2"):
        viz.ring_step(None, 1)
    with pytest.raises(ValueError, match="needs n_devices"):
        viz.ring_step(None)
    with pytest.raises(TypeError, match="RingAllReduce\\(keep_steps=True\\)"):
        viz.ring_step(np.zeros(3))
    with pytest.raises(ValueError, match="keys"):
        viz.ring_step({"phase": "all-gather"})
    with pytest.raises(ValueError, match="step record is empty"):
        viz.ring_diagram([])
    with pytest.raises(ValueError, match="step record is empty"):
        viz.ring_diagram(RingAllReduce().steps)            # recording was off: None


# --- timeline -------------------------------------------------------------------------

EVENTS = [(r, phase, t0 + 0.0002 * r, t1 + 0.0003 * r)
          for r in range(2)
          for phase, t0, t1 in (("input copy", 10.000, 10.001), ("forward+backward", 10.001, 10.004),
                                ("all-reduce", 10.0045, 10.006), ("optimizer", 10.006, 10.007))]


def test_timeline_one_bar_per_event_one_lane_per_replica():
    fig = viz.timeline(EVENTS)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bars) == len(EVENTS) == 8
    assert [t.get_text() for t in ax.get_yticklabels()] == ["replica 0", "replica 1"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "input copy", "forward+backward", "all-reduce", "optimizer"]
    assert "ms" in ax.get_xlabel()                        # a 7 ms span is drawn in ms
    assert min(b.get_x() for b in bars) == 0.0            # starts at the first event
    assert len({b.get_facecolor() for b in bars}) == 4    # one colour per phase
    render(fig)


def test_timeline_accepts_dicts_labels_and_an_axes():
    events = [{"replica": "GPU:0", "phase": "forward", "start_s": 0.0, "end_s": 1.5},
              {"replica": "GPU:1", "phase": "forward", "start": 0.0, "end": 2.0},
              {"replica": "GPU:1", "phase": "my phase", "start_s": 2.0, "end_s": 2.5}]
    fig = Figure()
    ax = fig.add_subplot()
    assert viz.timeline(events, ax=ax) is fig
    assert [t.get_text() for t in ax.get_yticklabels()] == ["GPU:0", "GPU:1"]
    assert ax.get_xlabel().startswith("time (s)")
    render(fig)


def test_timeline_bad_events():
    with pytest.raises(ValueError, match="no events"):
        viz.timeline([])
    with pytest.raises(ValueError, match="end_s >= start_s"):
        viz.timeline([(0, "forward", 2.0, 1.0)])
    with pytest.raises(ValueError, match="start_s"):
        viz.timeline([{"replica": 0, "phase": "forward", "end_s": 1.0}])
    with pytest.raises(ValueError, match="tuple"):
        viz.timeline([(0, "forward", 1.0)])


# --- scaling ----------------------------------------------------------------------------

def test_scaling_plot_lines_and_efficiency():
    rows = [{"replicas": 1, "samples_per_s": 1000.0, "predicted": 1000.0},
            {"replicas": 2, "samples_per_s": 1800.0, "predicted": 1900.0},
            {"replicas": 4, "samples_per_s": 3000.0, "predicted": 3500.0}]
    fig = viz.scaling_plot(rows)
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["measured", "ideal (linear from 1 replica)", "predicted"]
    measured = ax.get_lines()[0]
    np.testing.assert_array_equal(measured.get_xdata(), [1, 2, 4])
    np.testing.assert_array_equal(ax.get_lines()[1].get_ydata(), [1000.0, 4000.0])
    assert [t.get_text() for t in ax.texts] == ["100%", "90%", "75%"]
    render(fig)


def test_scaling_plot_series_by_label_without_predictions():
    rows = [{"replicas": r, "samples_per_s": 500.0 * r ** 0.8, "label": "CPU"} for r in (1, 2)]
    rows += [{"replicas": r, "samples_per_s": 9000.0 * r, "label": "logical GPUs"} for r in (2, 4)]
    ax = viz.scaling_plot(rows).axes[0]
    assert len(ax.get_lines()) == 4                       # measured + ideal, per series
    assert "ideal (linear from 2 replicas), logical GPUs" in [l.get_label() for l in ax.get_lines()]
    assert [t.get_text() for t in ax.texts][-2:] == ["100%", "100%"]


def test_scaling_plot_bad_rows():
    with pytest.raises(ValueError, match="no rows"):
        viz.scaling_plot([])
    with pytest.raises(ValueError, match="samples_per_s"):
        viz.scaling_plot([{"replicas": 1, "throughput": 3.0}])
    with pytest.raises(ValueError, match="integer >= 1"):
        viz.scaling_plot([{"replicas": 0, "samples_per_s": 3.0}])
    with pytest.raises(ValueError, match="positive"):
        viz.scaling_plot([{"replicas": 1, "samples_per_s": -3.0}])


# --- sharding ----------------------------------------------------------------------------

def test_sharding_6_rows_over_4_replicas_leaves_the_last_empty():
    fig = viz.sharding(6, 4)
    ax = fig.axes[0]
    bars = ax.containers[0]
    assert len(bars) == 4
    assert [b.get_width() for b in bars] == [2, 2, 2, 0]
    assert [b.get_x() for b in bars] == [0, 2, 4, 6]
    texts = [t.get_text() for t in ax.texts]
    assert texts[-1].startswith("empty slice")
    assert "2, 2, 2, 0" in ax.get_title()
    render(fig)


def test_sharding_even_and_uneven_batches_follow_rebatch_bounds():
    ax = viz.sharding(64, 2).axes[0]
    assert [b.get_width() for b in ax.containers[0]] == [32, 32]
    ax = viz.sharding(5, 2).axes[0]                       # an uneven last batch: 3 + 2
    assert [b.get_width() for b in ax.containers[0]] == [3, 2]
    ax = viz.sharding(1, 3).axes[0]                       # a batch of 1: two empty replicas
    assert [b.get_width() for b in ax.containers[0]] == [1, 0, 0]
    ax = viz.sharding(0, 2).axes[0]
    assert [b.get_width() for b in ax.containers[0]] == [0, 0]
    other = Figure()
    assert viz.sharding(7, 3, ax=other.add_subplot()) is other


def test_sharding_bad_input():
    with pytest.raises(ValueError, match="global_batch"):
        viz.sharding(-1, 2)
    with pytest.raises(ValueError, match="global_batch"):
        viz.sharding(6.5, 2)
    with pytest.raises(ValueError, match="num_replicas"):
        viz.sharding(6, 0)


def test_viz_never_opens_pyplot_figures():
    plt = pytest.importorskip("matplotlib.pyplot")
    before = plt.get_fignums()
    viz.sharding(6, 4)
    viz.timeline(EVENTS)
    assert plt.get_fignums() == before


# --- GEMM mapping -----------------------------------------------------------------------

def _cells_of(ax):
    """The image drawn in a gemm_mapping panel: 0 untouched, 1 block, 2 thread."""
    return np.asarray(ax.images[0].get_array())


def test_gemm_mapping_v1_one_output_one_row_one_column():
    fig = viz.gemm_mapping("v1", block=(1, 1), thread=(3, 5))
    ax_text, ax_b, ax_a, ax_out = fig.axes
    out, a, b = _cells_of(ax_out), _cells_of(ax_a), _cells_of(ax_b)
    assert out.shape == (48, 48) and a.shape == (48, 40) and b.shape == (40, 48)
    assert np.argwhere(out == 2).tolist() == [[21, 19]]             # i = 16 + 5, j = 16 + 3
    assert (out >= 1).sum() == 16 * 16                               # the block's tile
    assert np.argwhere(a == 2)[:, 0].tolist() == [21] * 40           # all of row 21 of A
    assert np.argwhere(b == 2)[:, 1].tolist() == [19] * 40           # all of column 19 of B
    assert len(ax_a.collections) == 0 == len(ax_b.collections)       # v1 stages nothing
    render(fig)


def test_gemm_mapping_v2_and_v3_stage_tiles_and_loads():
    fig = viz.gemm_mapping("v2", block=(1, 1), thread=(3, 5), k_step=1)
    _, ax_b, ax_a, ax_out = fig.axes
    a = _cells_of(ax_a)
    assert (a >= 1).sum() == 16 * 16 and (a == 2).sum() == 16        # a staged tile, one row read
    loads = ax_a.collections[0].get_offsets() - 0.5                  # (x = k, y = row) of the x marks
    assert loads.tolist() == [[16 + 3, 16 + 5]]                      # sa[ty, tx] = A[row0+ty, k0+tx]
    fig = viz.gemm_mapping("v3", block=(1, 0), thread=(3, 5), k_step=1)
    _, ax_b, ax_a, ax_out = fig.axes
    assert (_cells_of(ax_out) == 2).sum() == 8 * 4                   # 8 x 4 outputs per thread
    assert (_cells_of(ax_a) >= 1).sum() == 128 * 8 and (_cells_of(ax_b) >= 1).sum() == 8 * 64
    assert len(ax_a.collections[-1].get_offsets()) == 4                # A: 128 x 8 / 256 threads
    assert len(ax_b.collections[-1].get_offsets()) == 2                # B: 8 x 64 / 256 threads
    render(fig)


def test_gemm_mapping_bad_input():
    with pytest.raises(ValueError, match="unknown version"):
        viz.gemm_mapping("v4")
    with pytest.raises(ValueError, match="block"):
        viz.gemm_mapping("v2", block=(3, 0))                           # 48 columns: blocks 0..2
    with pytest.raises(ValueError, match="thread"):
        viz.gemm_mapping("v3", thread=(16, 0))
    with pytest.raises(ValueError, match="k_step"):
        viz.gemm_mapping("v2", k_step=3)                               # K = 40: steps 0..2
