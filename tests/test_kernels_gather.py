"""Row gather (kernels/gather.py) against a plain-loop oracle, in the simulator where
there is no GPU: tiny shapes, a batch of 1, repeated rows, several dtypes, poisoned
outputs, and bad input refused before any launch."""
import numpy as np
import pytest
from numba import cuda

import kernels.gather as gather
from conftest import poisoned

#: (n rows, row size, batch): one row, odd widths, a batch larger than the data (rows repeat).
SHAPES = [(1, 1, 1), (5, 3, 1), (31, 17, 9), (7, 33, 12)]


def oracle(src, idx):
    return np.array([[src[i, j] for j in range(src.shape[1])] for i in idx]).reshape(len(idx), src.shape[1])


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gather_rows_matches_the_loop_oracle(rng, shape, dtype):
    n, row, b = shape
    src = (rng.random((n, row)) * 200).astype(dtype)
    idx = rng.integers(0, n, b).astype(np.int64)
    want = oracle(src, idx)
    np.testing.assert_array_equal(gather.gather_rows_ref(src, idx, np.empty((b, row), dtype)), want)
    out = poisoned((b, row), dtype)
    gather.gather_rows(cuda.to_device(src), cuda.to_device(idx), out)
    np.testing.assert_array_equal(out.copy_to_host(), want, err_msg=f"shape {shape}, idx {idx}")


def test_reference_refuses_rows_out_of_range():
    src = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        gather.gather_rows_ref(src, np.array([0, 4]), np.empty((2, 2), np.float32))


def test_launcher_refuses_bad_arguments_before_launching(forbid_launches):
    forbid_launches(gather)
    src = cuda.to_device(np.zeros((4, 3), np.float32))
    idx = cuda.to_device(np.array([1, 2], np.int64))
    with pytest.raises(TypeError, match="integer"):
        gather.gather_rows(src, cuda.to_device(np.array([1.0, 2.0])), cuda.device_array((2, 3), np.float32))
    with pytest.raises(ValueError, match="shape"):
        gather.gather_rows(src, idx, cuda.device_array((3, 3), np.float32))
    with pytest.raises(TypeError, match="float32"):
        gather.gather_rows(src, idx, cuda.device_array((2, 3), np.float64))
    with pytest.raises(ValueError, match="shares memory"):
        gather.gather_rows(src, idx, src[:2])
