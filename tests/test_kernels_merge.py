"""kernels/merge.py: the column-block copy behind Concatenate, against plain-loop oracles.

In the simulator where there is no GPU (a real GPU where there is one): tiny, awkward
shapes (1 row, widths that are no multiple of a block, copies into the middle of a wider
matrix), NaN-poisoned destinations so a missed element fails and an element written
outside the block shows, fresh random inputs. A copy does no arithmetic, so every claim
here is bitwise. Then concatenation along every axis of an example, as Concatenate
does it (one copy per input into y seen as a matrix), against ``np.concatenate``, and
the split back; bad input refused before any launch; and the real compiler's check of
the kernel for sm_80 and sm_90 (no GPU needed; tests/test_kernels_compile.py checks
every kernel the same way).

    python -m pytest -q tests/test_kernels_merge.py
"""
import numpy as np
import pytest
from numba import cuda

import kernels.merge as merge
from conftest import poisoned
from kernels import registry, report

#: (rows, src columns, dst columns, src_col, dst_col, width): one element, a whole row,
#: a block in the middle of both, widths and row counts that fill no block evenly.
COPIES = [(1, 1, 1, 0, 0, 1), (1, 5, 9, 0, 4, 5), (7, 3, 10, 0, 7, 3), (33, 17, 17, 0, 0, 17),
          (5, 40, 6, 31, 1, 5), (65, 9, 12, 2, 3, 7), (4, 6, 6, 2, 2, 0)]


def loop_oracle(src, dst, src_col, dst_col, width):
    """dst with the block copied in, one element at a time (the docstring's loop nest)."""
    out = dst.copy()
    for r in range(src.shape[0]):
        for j in range(width):
            out[r, dst_col + j] = src[r, src_col + j]
    return out


@pytest.mark.parametrize("case", COPIES)
def test_reference_equals_the_loop_nest(rng, case):
    rows, s, d, sc, dc, w = case
    src = rng.standard_normal((rows, s)).astype(np.float32)
    dst = np.full((rows, d), np.nan, np.float32)
    want = loop_oracle(src, dst, sc, dc, w)
    got = merge.copy_columns_ref(src, dst, sc, dc, w)
    assert got is dst
    np.testing.assert_array_equal(got, want)       # NaN where nothing was copied: untouched


@pytest.mark.parametrize("case", COPIES)
def test_kernel_equals_the_loop_nest_bitwise(rng, case):
    """Every element of the block written, nothing outside it (still NaN), bit for bit."""
    rows, s, d, sc, dc, w = case
    src = rng.standard_normal((rows, s)).astype(np.float32)
    want = loop_oracle(src, np.full((rows, d), np.nan, np.float32), sc, dc, w)
    dst = poisoned((rows, d))
    assert merge.copy_columns(cuda.to_device(src), dst, sc, dc, w) is dst
    np.testing.assert_array_equal(dst.copy_to_host(), want, err_msg=f"case {case}")


#: (per-example shapes, example axis): every axis of 1-, 2- and 3-axis examples, widths of 1.
CONCATS = [([(3,), (5,), (1,)], 0), ([(1, 4), (3, 4)], 0), ([(2, 3), (2, 1), (2, 4)], 1),
           ([(2, 1, 3), (2, 4, 3)], 1), ([(3, 2, 1), (3, 2, 2)], 2), ([(2, 2, 3), (1, 2, 3)], 0)]


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("shapes, axis", CONCATS)
def test_concatenation_along_any_axis_is_one_copy_per_input(rng, shapes, axis, b):
    """As Concatenate runs it: y viewed as (R, W), input i as (R, w_i) into columns
    [off_i, off_i + w_i); then the split of y back into the inputs. Host (reference) and
    device (kernel) against np.concatenate, bitwise."""
    xs = [rng.standard_normal((b,) + s).astype(np.float32) for s in shapes]
    want = np.concatenate(xs, axis=axis + 1)                        # + 1: the batch axis
    rows, width = merge.concat_matrix_shape(b, want.shape[1:], axis)
    assert (rows, width) == (b * int(np.prod(want.shape[1:axis + 1])), want[0].size // int(
        np.prod(want.shape[1:axis + 1])))
    host = np.full(want.shape, np.nan, np.float32)
    dev = poisoned(want.shape)
    dev2 = dev.reshape(rows, width)
    off = 0
    for x in xs:
        r, w = merge.concat_matrix_shape(b, x.shape[1:], axis)
        assert r == rows
        merge.copy_columns_ref(x.reshape(r, w), host.reshape(rows, width), 0, off, w)
        merge.copy_columns(cuda.to_device(x).reshape(r, w), dev2, 0, off, w)
        off += w
    assert off == width
    np.testing.assert_array_equal(host, want)
    np.testing.assert_array_equal(dev.copy_to_host(), want)
    off = 0
    for x in xs:                                                    # the backward: the split
        r, w = merge.concat_matrix_shape(b, x.shape[1:], axis)
        back = poisoned((r, w))
        merge.copy_columns(dev2, back, off, 0, w)
        np.testing.assert_array_equal(back.copy_to_host().reshape(x.shape), x)
        np.testing.assert_array_equal(merge.copy_columns_ref(want.reshape(rows, width), np.empty((r, w),
                                      np.float32), off, 0, w).reshape(x.shape), x)
        off += w


def test_no_rows_is_no_launch(forbid_launches):
    """A replica whose slice of the batch is empty (b = 0): nothing to copy, nothing launched."""
    forbid_launches(merge)
    src, dst = cuda.to_device(np.zeros((0, 3), np.float32)), cuda.to_device(np.zeros((0, 5), np.float32))
    assert merge.copy_columns(src, dst, 0, 2, 3) is dst
    assert merge.copy_columns_ref(np.zeros((0, 3), np.float32), np.zeros((0, 5), np.float32), 0, 2, 3).shape == (0, 5)


def test_launcher_refuses_bad_arguments_before_launching(forbid_launches):
    forbid_launches(merge)
    src = cuda.to_device(np.zeros((4, 3), np.float32))
    dst = cuda.device_array((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"columns \[3, 6\) are past dst's 5 columns"):
        merge.copy_columns(src, dst, 0, 3, 3)
    with pytest.raises(ValueError, match=r"columns \[1, 4\) are past src's 3 columns"):
        merge.copy_columns(src, dst, 1, 0, 3)
    with pytest.raises(ValueError, match="same rows"):
        merge.copy_columns(src, cuda.device_array((3, 5), np.float32), 0, 0, 3)
    with pytest.raises(ValueError, match="dst_col must be a non-negative integer"):
        merge.copy_columns(src, dst, 0, -1, 3)
    with pytest.raises(ValueError, match="width must be a non-negative integer"):
        merge.copy_columns(src, dst, 0, 0, 2.0)
    with pytest.raises(TypeError, match="float32"):
        merge.copy_columns(src, cuda.device_array((4, 5), np.float64), 0, 0, 3)
    with pytest.raises(ValueError, match="2-D"):
        merge.copy_columns(cuda.to_device(np.zeros(12, np.float32)), dst, 0, 0, 3)
    with pytest.raises(ValueError, match="shares memory"):
        merge.copy_columns(dst, dst, 0, 2, 3)
    with pytest.raises(ValueError, match="past dst"):     # the reference checks as the launcher
        merge.copy_columns_ref(np.zeros((4, 3), np.float32), np.zeros((4, 5), np.float32), 0, 3, 3)


def test_the_kernel_is_registered_with_what_the_launcher_passes():
    """float32 2-D arrays and three int64 scalars (Python ints: numba types them int64), the
    launcher's block: the signature the compile test below and tests/test_kernels_compile.py
    compile."""
    specs = [s for s in registry.registered() if s.kernel is merge.copy_columns_kernel]
    assert len(specs) == 1
    assert specs[0].signatures == ("void(float32[:, ::1], float32[:, ::1], int64, int64, int64)",)
    assert specs[0].block == (merge.grid_1d(1)[1],)          # the launcher's own block


def test_the_real_compiler_takes_the_kernel_for_sm80_and_sm90():
    """NVVM + ptxas, no GPU: it compiles and assembles, with no spill, no stack frame and no
    float64 instruction (a copy has no arithmetic at all). About 3 s in a child process
    (real CUDA and the simulator cannot share this one)."""
    rows, done = report.run_report("--only", "copy_columns", "--cc", "8.0", "--cc", "9.0", timeout=300)
    assert rows is not None, done.stderr[-2000:]
    assert sorted(r["cc"] for r in rows) == ["8.0", "9.0"], rows
    for r in rows:
        assert not r["error"], r["error"]
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, r
        assert r["f64_instructions"] == 0, r
        assert r["registers"] * r["block_threads"] <= report.REGISTERS_PER_SM, r
