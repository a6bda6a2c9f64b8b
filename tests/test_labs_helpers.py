"""What the lab notebooks lean on: ``mirrored.lab.labs`` (the first cell, the lab's model), the
efficiency written in the figures, the performance model's calibration, the Conv2D mapping
picture, and each replica's own optimizer time. The notebooks themselves run in
tests/test_labs_01_05.py and tests/test_labs_02_04.py; these checks are small and fast.
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.lab import labs, perf_model, timing, viz
from mirrored.keras.step import OPTIMIZER


def render(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()           # tick labels and offsets exist only once drawn
    return fig


# --- labs.setup, labs.make_model ------------------------------------------------------------

@pytest.mark.parametrize("device_type", [None, "CPU"])
def test_setup_reads_quick_mode_and_splits_the_cpu(devices, monkeypatch, device_type):
    from mirrored import devices as registry
    registry._reset()                     # setup configures the devices itself (the fixture resets after)
    monkeypatch.setenv("MIRRORED_QUICK", "1")
    said = []
    lab = labs.setup(replicas=3, device_type=device_type, out=said.append)
    assert lab.quick is True
    if device_type is None and "logical GPU" in lab.description:     # a machine with a real GPU
        assert [d.name for d in tf.config.list_logical_devices("GPU")][:3] == lab.devices
    else:
        assert [tf.config.list_logical_devices("CPU")[i].name for i in range(3)] == lab.devices
        assert "3 logical CPU" in lab.description
    assert len(lab.devices) == 3 and lab.description in "\n".join(said)
    assert (tf.__file__).startswith(lab.root) and "kernels" in __import__("os").listdir(lab.root)
    monkeypatch.setenv("MIRRORED_QUICK", "0")
    assert labs.setup(replicas=None, out=None).quick is False


def test_setup_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="positive integer"):
        labs.setup(replicas=0, out=None)
    with pytest.raises(ValueError, match="'CPU'"):
        labs.setup(replicas=2, device_type="TPU", out=None)


def test_make_model_is_the_lab_convnet_or_the_dense_stack(devices):
    devices(cpus=1)
    conv, dense = labs.make_model(), labs.make_model("dense")
    assert [type(l).__name__ for l in conv.layers] == ["Conv2D", "MaxPooling2D", "Flatten", "Dense", "Dense"]
    assert [w.shape for w in conv.get_weights()] == [(3, 3, 1, 32), (32,), (5408, 64), (64,), (64, 10), (10,)]
    assert conv.count_params() == labs.PARAMS["conv"] == 347_146          # Keras's summary
    assert dense.count_params() == labs.PARAMS["dense"] == 50_890
    with pytest.raises(ValueError, match="'conv'"):
        labs.make_model("resnet")


# --- one definition of efficiency, written in the figures; no "1e6" offsets ---------------

def test_scaling_plot_against_a_baseline_row_writes_the_tables_efficiency():
    base = {"name": "no strategy", "replicas": 1, "samples_per_s": 1_000_000.0}
    rows = [{"replicas": 1, "samples_per_s": 950_000.0},
            {"replicas": 2, "samples_per_s": 1_500_000.0},
            {"replicas": 4, "samples_per_s": 2_600_000.0}]
    fig = render(viz.scaling_plot(rows, baseline=base))
    ax = fig.axes[0]
    want = [f"{s['samples_per_s'] / (s['replicas'] * base['samples_per_s']):.0%}" for s in rows]
    assert [t.get_text() for t in ax.texts if t.get_text().endswith("%")] == want == ["95%", "75%", "65%"]
    ideal = ax.get_lines()[1]
    np.testing.assert_allclose(ideal.get_ydata(), [1_000_000.0, 4_000_000.0])
    assert "replicas × 'no strategy'" in ideal.get_label()
    assert "samples/s of 'no strategy'" in ax.get_xlabel()                      # the definition
    assert ax.yaxis.get_offset_text().get_text() == ""                          # no "1e6"
    assert any("," in t.get_text() for t in ax.get_yticklabels())               # 1,000,000
    with pytest.raises(ValueError, match="baseline"):
        viz.scaling_plot(rows, baseline={"name": "x", "samples_per_s": 0})


def test_comparison_and_model_figures_say_what_the_percentages_are():
    rows = [{"name": "no strategy", "replicas": 1, "epoch_time_s": 2.0, "samples_per_s": 1.2e6,
             "efficiency": 1.0, "baseline": "no strategy"},
            {"name": "MirroredStrategy ×2", "replicas": 2, "epoch_time_s": 1.5, "samples_per_s": 1.6e6,
             "efficiency": 1.6e6 / 2.4e6, "baseline": "no strategy"}]
    fig = render(viz.plot_comparison(rows))
    assert "samples/s of 'no strategy'" in fig.get_supxlabel()
    bars = fig.axes[1]
    assert [t.get_text() for t in bars.texts] == ["100%", "67%"]
    assert "% = efficiency" in bars.get_title()
    assert bars.yaxis.get_offset_text().get_text() == ""
    predicted = [{"link": "PCIe", "bandwidth": 25e9, "n": n, "samples_per_s": 1e6 * n} for n in (1, 2, 8)]
    fig = render(viz.plot_performance_model([dict(rows[1], replicas=2)], predicted))
    assert fig.axes[0].yaxis.get_offset_text().get_text() == ""


# --- the performance model, calibrated so that N=1 is fit's measurement ---------------------

def test_calibrated_on_fits_throughput_the_model_reproduces_it_at_one_replica(rng):
    compute = float(rng.uniform(1e-4, 1e-3))
    breakdown = {"global_batch": 64, "step_s": compute + 5e-5,
                 "phases": {"input copy": {"median_s": 0.1 * compute},
                            "forward+backward": {"median_s": 0.9 * compute}}}
    measured = {"name": "MirroredStrategy ×1", "replicas": 1, "global_batch": 64,
                "samples_per_s": 64 / (compute + float(rng.uniform(1e-4, 1e-3)))}   # fit is slower
    cal = perf_model.calibrate(breakdown, grad_bytes=4 * 347_146, measured=measured)
    for p in perf_model.predict_throughput(cal, [1, 2], 64):
        if p["n"] == 1:
            assert p["samples_per_s"] == pytest.approx(measured["samples_per_s"], rel=1e-12)
    bare = perf_model.calibrate(breakdown, grad_bytes=4 * 347_146)               # the bare step
    one = next(p for p in perf_model.predict_throughput(bare, [1], 64))
    assert one["samples_per_s"] == pytest.approx(64 / breakdown["step_s"], rel=1e-12)
    assert one["samples_per_s"] > measured["samples_per_s"]
    with pytest.raises(ValueError, match="1-replica row"):
        perf_model.calibrate(breakdown, measured=dict(measured, replicas=2))


# --- Conv2D's thread -> output mapping, as lab 04 draws it ----------------------------------

def _cells(image, value):
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(np.asarray(image.get_array()) == value))}


def test_conv2d_mapping_v1_marks_the_threads_warp_and_block():
    fig = viz.conv2d_mapping("v1", thread=300)         # 28x28 input, 3x3, 26x26x32 output
    ax_in, ax_out = fig.axes
    # thread 300 -> pixel 300 // 32 = 9 of row 0; its warp is that pixel, its block of 256
    # threads pixels 8..15 of row 0
    assert _cells(ax_out.images[0], 2) == {(0, 9)}
    assert _cells(ax_out.images[0], 1) == {(0, c) for c in range(8, 16)} - {(0, 9)}
    assert _cells(ax_in.images[0], 2) == {(r, c) for r in range(3) for c in range(9, 12)}
    assert _cells(ax_in.images[0], 1) == {(r, c) for r in range(3) for c in range(8, 18)} - \
        {(r, c) for r in range(3) for c in range(9, 12)}
    assert "out[0, 0, 9, 12]" in fig.get_supxlabel()
    with pytest.raises(ValueError, match="one thread per output"):
        viz.conv2d_mapping("v1", thread=26 * 26 * 32)


def test_conv2d_mapping_v2_marks_the_tile_the_patch_and_one_threads_outputs():
    fig = viz.conv2d_mapping("v2", block=5, thread=37)
    ax_in, ax_out = fig.axes
    # 4 tiles per row of 26: block 5 is the tile at (8, 8); thread 37 computes e = 37 + 256 k,
    # pixel e // 32 = 1 + 8 k: column 9, rows 8..15 (channel 5)
    assert _cells(ax_out.images[0], 2) == {(r, 9) for r in range(8, 16)}
    assert _cells(ax_out.images[0], 1) | _cells(ax_out.images[0], 2) == \
        {(r, c) for r in range(8, 16) for c in range(8, 16)}
    assert _cells(ax_in.images[0], 2) == {(r, c) for r in range(8, 18) for c in range(9, 12)}
    assert _cells(ax_in.images[0], 1) | _cells(ax_in.images[0], 2) == \
        {(r, c) for r in range(8, 18) for c in range(8, 18)}
    assert "channel(s) [5]" in fig.get_supxlabel()
    with pytest.raises(ValueError, match="unknown version"):
        viz.conv2d_mapping("v3")
    with pytest.raises(ValueError, match="output tile"):
        viz.conv2d_mapping("v2", block=16)


# --- the breakdown: each replica's optimizer row is its own launch ------------------------

def test_each_replicas_optimizer_phase_is_its_own_update(devices, rng):
    devices(cpus=2)
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu", input_shape=(64,)),
                                     tf.keras.layers.Dense(4)])
    model.compile(optimizer="adam",
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.standard_normal((32, 64)).astype(np.float32)
    y = rng.integers(0, 4, 32)
    timer = timing.PhaseTimer()
    for _ in range(3):
        timing.timed_train_step(model, x, y, timer)
    spans = [(r, s, e) for r, name, s, e in timer.records() if name == OPTIMIZER]
    assert [r for r, _, _ in spans] == [0, 1] * 3
    for (_, s0, e0), (_, s1, e1) in zip(spans[::2], spans[1::2]):
        # CPU devices: one host thread updates replica 0, then replica 1, each timed alone
        # (not the whole loop over the devices on both rows)
        assert e0 <= s1 and s0 < e0 and s1 < e1


# --- the ring pictures: no label under an arrowhead ---------------------------------------

def test_no_text_sits_under_an_arrowhead_in_the_ring_pictures(devices, rng):
    MARGIN = 2                            # points between any text and any arrowhead
    from matplotlib.patches import FancyArrowPatch
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox
    from mirrored.ring import RingAllReduce

    names = [d.name for d in devices(cpus=4) if d.device_type == "CPU"]
    strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=RingAllReduce(keep_steps=True))
    grads = strategy.experimental_distribute_values_from_function(
        lambda ctx: rng.standard_normal(10).astype(np.float32))
    strategy.extended.reduce_to("SUM", grads, grads)
    steps = strategy.extended.cross_device_ops.steps
    for fig in (render(viz.ring_diagram(steps, initial=True)), render(viz.ring_step(steps[0]))):
        renderer = fig.canvas.get_renderer()                # Agg, attached by render()
        points = fig.dpi / 72                               # pixels per point
        heads = []
        for ax in fig.axes:
            for patch in ax.patches:
                if isinstance(patch, FancyArrowPatch):
                    # the arrows point down: the head of "-|>" at mutation_scale m is the
                    # lowest 0.4 m of the arrow, as wide as the arrow's extent; no text
                    # within MARGIN points of it (touching reads as "under" too)
                    ext = patch.get_window_extent(renderer)     # display coordinates, y up
                    m = patch.get_mutation_scale() * points
                    pad = MARGIN * points
                    heads.append(Bbox([[ext.x0 - pad, ext.y0 - pad], [ext.x1 + pad, ext.y0 + 0.4 * m]]))
        checked = 0
        for text in fig.findobj(Text):          # labels, cell texts, ticks, titles, legend
            if not text.get_visible() or not text.get_text().strip():
                continue
            box = text.get_window_extent(renderer)
            for head in heads:
                checked += 1
                assert not box.overlaps(head), (text.get_text(), box, head)
        assert checked > 0
