"""What the labs print must be able to say "no": the checks they show a student can fail.

    python -m pytest tests/test_labs_truth.py
"""
import zlib

import numpy as np
import pytest

from mirrored.lab import labs


def _write(folder, sums):
    for rank, crc in sums.items():
        (folder / f"weights-{rank}.crc32").write_text(f"{crc:08x}")


def test_lab_06s_weight_check_passes_only_when_every_worker_wrote_the_same_checksum(tmp_path, rng):
    crc = zlib.crc32(rng.standard_normal(17).astype(np.float32).tobytes())
    _write(tmp_path, {0: crc, 1: crc, 2: crc})
    assert labs.same_weights_on_every_worker(tmp_path, 3) == {r: f"{crc:08x}" for r in range(3)}
    _write(tmp_path, {2: crc ^ 1})                                     # worker 2's weights differ
    with pytest.raises(ValueError, match=r"weights differ.*2: '"):
        labs.same_weights_on_every_worker(tmp_path, 3)
    with pytest.raises(ValueError, match=r"worker\(s\) \[3\] wrote no weights checksum"):
        labs.same_weights_on_every_worker(tmp_path, 4)                  # one never finished
