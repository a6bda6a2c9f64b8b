"""kernels/elementwise.py and kernels/reduction.py launchers, in the simulator on CPU-only machines.

Fresh random inputs (seed printed on failure), NaN-poisoned outputs so an
unwritten element fails, sizes that are not multiples of any block size.
"""
import numpy as np
import pytest
from numba import cuda

from kernels import elementwise, reduction
from conftest import assert_sum_close, poisoned
from kernels.launch import ceil_div, flat, grid_1d, view

SIZES = [1, 17, 31, 33, 65, 300]




def test_ceil_div_and_grids():
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    blocks, threads = grid_1d(10 ** 9)
    assert blocks >= 1 and threads % 32 == 0


class _Array:
    """Just enough of a device array for ``view``: a shape and a counted reshape."""
    reshapes = 0

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.size = int(np.prod(shape))

    def reshape(self, shape):
        _Array.reshapes += 1
        return _Array(shape)


def test_views_are_made_once_per_array_and_shape():
    """A 1-D array goes to the kernel as it is; any other view is made at the first
    launch and reused (a new view object costs numba-cuda its typing again)."""
    one_d, two_d = _Array((12,)), _Array((3, 4))
    _Array.reshapes = 0
    assert flat(one_d) is one_d and _Array.reshapes == 0
    first = flat(two_d)
    assert first.shape == (12,) and flat(two_d) is first and _Array.reshapes == 1
    rows = view(two_d, (1, 3, 4))
    assert rows.shape == (1, 3, 4) and view(two_d, [1, 3, 4]) is rows and _Array.reshapes == 2
    assert view(two_d, (3, 4)) is two_d and _Array.reshapes == 2          # its own shape
    assert flat(_Array((3, 4))) is not first and _Array.reshapes == 3     # another array
    host = np.zeros((3, 4))
    assert view(host, (12,)).base is host                                  # NumPy: a plain reshape


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", sorted(elementwise.BINARY_REF))
def test_binary_and_scalar_ops(op, n, rng):
    x = rng.standard_normal(n).astype(np.float32)
    y = (rng.standard_normal(n) + 4.0).astype(np.float32)
    s = float(rng.uniform(1, 2))
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    oracle = {"add": x64 + y64, "sub": x64 - y64, "mul": x64 * y64, "div": x64 / y64,
              "rsub": y64 - x64, "rdiv": y64 / x64}[op]
    out = poisoned(n, np.float32)
    elementwise.binary(op, cuda.to_device(x), cuda.to_device(y), out)
    np.testing.assert_allclose(out.copy_to_host(), oracle, rtol=1e-6, err_msg=op)
    np.testing.assert_array_equal(out.copy_to_host(), elementwise.binary_ref(op, x, y))
    out = poisoned(n, np.float32)
    elementwise.binary_scalar(op, cuda.to_device(x), s, out)
    np.testing.assert_array_equal(out.copy_to_host(), elementwise.binary_scalar_ref(op, x, s))


def test_unary_cast_fill(rng):
    x = (rng.standard_normal((5, 7)) * 10).astype(np.float32)
    out = poisoned((5, 7), np.float32)
    elementwise.unary("neg", cuda.to_device(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), -x)
    ints = poisoned((5, 7), np.int32)
    elementwise.cast(cuda.to_device(x), ints)
    np.testing.assert_array_equal(ints.copy_to_host(), np.trunc(x).astype(np.int32))
    elementwise.fill(out, 2.5)
    assert (out.copy_to_host() == 2.5).all()


def test_launchers_refuse_bad_input_before_launching(rng):
    x = cuda.to_device(np.ones(8, np.float32))
    with pytest.raises(TypeError, match="float32"):
        elementwise.binary("add", x, cuda.to_device(np.ones(8, np.float64)), poisoned(8, np.float32))
    with pytest.raises(ValueError, match=r"\(8,\).*\(9,\)|\(9,\).*\(8,\)"):
        elementwise.binary("add", x, x, poisoned(9, np.float32))
    with pytest.raises(ValueError, match="unknown elementwise operator"):
        elementwise.binary("pow", x, x, x)
    strided = cuda.to_device(np.ones((4, 6), np.float32))[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        elementwise.unary("neg", strided, poisoned((4, 3), np.float32))
    with pytest.raises(ValueError, match="1 element"):
        reduction.sum_all(x, poisoned(2, np.float32))
    with pytest.raises(TypeError, match="no reduction kernel"):
        reduction.sum_all(cuda.to_device(np.ones(3, np.float16)), poisoned(1, np.float16))


@pytest.mark.parametrize("n", SIZES + [1000])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_sum_all(n, dtype, rng):
    x = (rng.standard_normal(n) * 100).astype(dtype)
    out = poisoned(1, dtype)
    reduction.sum_all(cuda.to_device(x), out)
    got = out.copy_to_host()[0]
    if dtype == np.int32:
        assert got == x.astype(np.int64).sum()
    else:
        assert_sum_close(got, x)
    # fixed order of additions: the same input gives the same bits every time
    again = poisoned(1, dtype)
    reduction.sum_all(cuda.to_device(x), again)
    assert again.copy_to_host()[0] == got or (np.isnan(got) and np.isnan(again.copy_to_host()[0]))


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 33, 17), (3, 5, 2), (2, 1, 9), (1, 65, 1)])
def test_sum_axis(shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    out = poisoned((shape[0], shape[2]), np.float32)
    reduction.sum_axis(cuda.to_device(x), out)
    assert_sum_close(out.copy_to_host(), x, axis=1)
    assert_sum_close(reduction.sum_axis_ref(x), x, axis=1)
