"""kernels/conv2d.py remembers its geometry answers: the same answers, worked out once.

``window_geometry`` and ``conv2d_output_shape`` are asked the same questions every
training step; they now keep their answers (``_geometry``). Checked: the answers equal
TensorFlow's shape rule (float64-free integer formulas written out here) before and after
being remembered, a refused argument is refused every time (also after the same value
of another type was answered), and the memo stays bounded.

    python -m pytest -q tests/test_conv_geometry_memo.py
"""
import pytest

from kernels import conv2d


def tf_axis(size, window, stride, padding):
    if padding == "valid":
        return (size - window) // stride + 1, 0, 0
    out = -(-size // stride)
    total = max((out - 1) * stride + window - size, 0)
    return out, total // 2, total - total // 2


def test_answers_follow_tensorflows_rule_first_and_remembered(rng, monkeypatch):
    worked = []
    real = conv2d._window_geometry
    monkeypatch.setattr(conv2d, "_window_geometry", lambda *a: worked.append(a) or real(*a))
    conv2d._geometry.clear()
    for _ in range(40):
        h, w = (int(v) for v in rng.integers(1, 34, 2))
        kh, kw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        sh, sw = (int(v) for v in rng.integers(1, 4, 2))
        padding = ["valid", "same", "SAME"][int(rng.integers(0, 3))]
        oh, pt, pb = tf_axis(h, kh, sh, padding.lower())
        ow, pl, pr = tf_axis(w, kw, sw, padding.lower())
        for _ in range(2):                              # worked out, then remembered
            assert conv2d.window_geometry("t", (h, w), (kh, kw), (sh, sw), padding) == \
                (oh, ow, (pt, pb, pl, pr))
            b, cin, cout = (int(v) for v in rng.integers(1, 5, 3))
            assert conv2d.conv2d_output_shape((b, h, w, cin), (kh, kw, cin, cout), (sh, sw), padding) == \
                (b, oh, ow, cout)
    assert 0 < len(worked) <= 40                        # once per new question, not per call


def test_a_refused_argument_is_refused_every_time():
    conv2d.window_geometry("t", (5, 5), 3, 1, "valid")
    conv2d.conv2d_output_shape((2, 5, 5, 1), (3, 3, 1, 4), 1, "valid")
    for _ in range(2):
        with pytest.raises(ValueError, match="strides"):
            conv2d.window_geometry("t", (5, 5), 3, True, "valid")        # True is not 1
        with pytest.raises(ValueError, match="kernel is 6 along height"):
            conv2d.window_geometry("t", (5, 5), 6, 1, "valid", "kernel")
        with pytest.raises(ValueError, match="expects Cin = 2"):
            conv2d.conv2d_output_shape((2, 5, 5, 1), (3, 3, 2, 4), 1, "valid")


def test_the_memo_stays_bounded():
    for h in range(1, 3 * conv2d.GEOMETRY_ENTRIES):
        conv2d.window_geometry("t", (h, 1), 1, 1, "valid")
        assert len(conv2d._geometry) <= conv2d.GEOMETRY_ENTRIES
    assert conv2d.window_geometry("t", (7, 1), 1, 1, "valid") == (7, 1, (0, 0, 0, 0))
