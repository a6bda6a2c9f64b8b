"""benchmarks/pipeline.py: the lab's epoch-1 pipeline timed stage by stage (issue 40).

The smoke run times every stage on 512 images of the bundled subset and writes the JSON;
the comparison (``--baseline``) runs both sides in fresh processes and checks they yield the
same bits: here this checkout against itself, so the digests must agree.
"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import pipeline  # noqa: E402
from conftest import run_smoke  # noqa: E402


def _env():
    return dict(os.environ, MIRRORED_OFFLINE="1", NUMBA_ENABLE_CUDASIM="0",
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def _check_summary(summary):
    medians = summary["median_us"]
    assert list(medians) == list(pipeline.STAGES)
    for stage, m in medians.items():
        assert 0 < m["cpu_us"] < 10_000 and 0 < m["wall_us"] < 10_000, (stage, m)
    assert list(summary["stage_cost_us"]) == ["map", "cache", "shuffle", "batch"]
    cost = summary["stage_cost_us"]["map"]["cpu_us"]
    assert cost == medians["map"]["cpu_us"] - medians["source"]["cpu_us"]


def test_smoke_run_times_every_stage_of_the_labs_first_epoch(tmp_path):
    out = tmp_path / "pipe.json"
    proc = run_smoke("pipeline", "--out", str(out), env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "pipeline" and doc["mode"] == "smoke"
    assert doc["elements"] == pipeline.SMOKE_ELEMENTS and doc["source"] == "bundled subset"
    _check_summary(doc)
    samples = doc["samples"]["batch"]["cpu_us"]
    assert len(samples) == doc["repeat"] == 1
    assert len(doc["digest"]) == 64 and Path(doc["code"]) == ROOT
    assert len(doc["machine"]["load_average_1min_start_end"]) == 2
    assert "batch" in proc.stdout and "epoch 2" in proc.stdout


def test_a_comparison_runs_both_sides_in_fresh_processes_and_checks_their_bits(tmp_path):
    out = tmp_path / "cmp.json"
    proc = run_smoke("pipeline", "--baseline", str(ROOT), "--rounds", "1",
                     "--out", str(out), env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["rounds"] == 1 and doc["elements"] == pipeline.SMOKE_ELEMENTS
    for side in ("before", "after"):
        _check_summary(doc[side])
        assert Path(doc[side]["code"]) == ROOT
    assert doc["same_output"] is True
    assert set(doc["speedup"]) == set(pipeline.STAGES)
    assert proc.stdout.count("round 1/1") == 2                  # one process per side
    assert sorted(r["side"] for r in doc["rounds_log"]) == ["after", "before"]
    assert doc["command"].startswith("python -m benchmarks.pipeline --smoke --baseline")
