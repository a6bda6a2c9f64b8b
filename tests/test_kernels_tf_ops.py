"""TensorFlow's ops on the GPU (issue 48), in the CUDA simulator on CPU-only machines.

kernels/broadcast.py, unary_math.py, reduce_axis.py, strided_copy.py, random_fill.py and
resize.py: each kernel against its NumPy reference, each reference against an independent
float64 (or Python-integer) oracle written here with explicit loops, and the CPU backend
(``CpuOps``) against the CUDA one (``CudaOps`` on a simulated GPU device).

Which equality each test claims, and why:
    bit for bit   integer work, comparisons, selects, copies, max/min/arg*, floor/ceil/round,
                  +-*/ (one IEEE operation, the same on both sides), the uniform draws, resize
                  (the same float32 operations in the same order)
    a few ulps    exp, log, tanh, pow, ... (libdevice or Python's math against NumPy's own;
                  the simulator runs Python's math in float64 and rounds when storing)
    float sums    within the float32 bound of conftest.assert_sum_close (NumPy adds a
                  contiguous axis pairwise, the kernel in order)
Outputs start poisoned (NaN, the lowest integer, or the complement of a bool answer), so a
kernel that skips an element fails. Fresh random inputs each run (the seed is printed).

    python -m pytest -n 0 -q tests/test_kernels_tf_ops.py
"""
import math
import operator
import warnings

import numpy as np
import pytest
from numba import cuda

from conftest import assert_sum_close
from kernels import broadcast, random_fill, reduce_axis, resize, strided_copy, unary_math
from kernels.dropout import GOLDEN

#: Broadcasting pairs: stretched middle axes, a 0-d operand, a 0-size axis, equal shapes.
SHAPE_PAIRS = [((3, 1, 5), (4, 1)), ((), (2, 3)), ((2, 0, 3), (3,)), ((4, 3), (4, 3))]
#: ulps a transcendental float32 result may differ between two libraries (see the docstring).
ULPS = 4


def poison(shape, dtype, answer=None):
    """A device array that no correct kernel leaves as it is: NaN, the lowest integer, or, for
    bool, the complement of the expected ``answer``."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return cuda.to_device(~np.asarray(answer, bool).reshape(shape))
    fill = np.nan if dtype.kind == "f" else np.iinfo(dtype).min
    return cuda.to_device(np.full(shape, fill, dtype))


def ulps_apart(a, b):
    """Elementwise distance in float32/float64 steps (NaN == NaN, inf == inf: 0)."""
    a, b = np.asarray(a), np.asarray(b)
    ints = np.int32 if a.dtype == np.float32 else np.int64

    def ordered(v):
        i = v.view(ints).astype(np.int64)
        return np.where(i < 0, np.iinfo(ints).min - i, i)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(same, 0, np.abs(ordered(a) - ordered(b)))


def assert_same(got, want, what, ulps=0):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype,
                                                                 got.shape, want.shape)
    if ulps and want.dtype.kind == "f":
        far = ulps_apart(got, want)
        assert far.max(initial=0) <= ulps, (f"{what}: {far.max()} ulps apart at "
                                            f"{np.unravel_index(far.argmax(), far.shape)}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def quiet(fn, *args):
    """Run a simulated launch whose NumPy scalar arithmetic may warn (integer overflow, x // 0)
    where a GPU is silent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args)


# --- broadcasting binary ops ---------------------------------------------------------------------

def _operands(op, dtype, shapes, rng):
    x_shape, y_shape = shapes
    if dtype == np.bool_:
        return rng.random(x_shape) > 0.5, rng.random(y_shape) > 0.5
    if op == "pow":                                   # small non-negative integer powers
        x = rng.integers(-3, 4, x_shape).astype(dtype)
        return x, rng.integers(0, 4, y_shape).astype(dtype)
    x = (rng.standard_normal(x_shape) * 4).astype(dtype)
    y = (rng.standard_normal(y_shape) * 4).astype(dtype)
    if dtype.kind == "i":
        x, y = np.round(x).astype(dtype), np.round(y).astype(dtype)
    if op in ("div", "floordiv", "mod"):
        y = np.where(y == 0, dtype.type(3), y).astype(dtype)    # TF raises on integer / 0
    if dtype.kind == "f" and x.size > 1:
        x.reshape(-1)[1] = np.nan                      # NaN propagates (maximum, minimum too)
    return x, y


def _scalar_oracle(op, a, b):
    """One element of ``op`` with Python numbers (float64 or exact integers)."""
    table = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
             "div": lambda a, b: a / b,
             "floordiv": lambda a, b: math.floor(a / b) if isinstance(a, int) else
             (a // b if not (math.isnan(a) or math.isnan(b)) else math.nan),
             "mod": lambda a, b: a % b if not (isinstance(a, float) and math.isnan(a)) else math.nan,
             "pow": lambda a, b: a ** b,
             "maximum": lambda a, b: a if (a != a or a >= b) else b,
             "minimum": lambda a, b: a if (a != a or a <= b) else b,
             "squared_difference": lambda a, b: (a - b) ** 2,
             "less": operator.lt, "less_equal": operator.le, "greater": operator.gt,
             "greater_equal": operator.ge, "equal": operator.eq, "not_equal": operator.ne,
             "logical_and": lambda a, b: a and b, "logical_or": lambda a, b: a or b,
             "logical_xor": operator.xor}
    return table[op](a, b)


def _oracle(op, x, y):
    """``op`` by an explicit loop over np.broadcast_to'd operands, element by element."""
    shape = np.broadcast_shapes(x.shape, y.shape)
    xb, yb = np.broadcast_to(x, shape), np.broadcast_to(y, shape)
    py = bool if x.dtype == np.bool_ else (int if x.dtype.kind == "i" else float)
    out = np.empty(shape, object)
    for idx in np.ndindex(*shape):
        out[idx] = _scalar_oracle(op, py(xb[idx]), py(yb[idx]))
    return out


def _check_ref_against_oracle(op, x, y):
    ref = broadcast.broadcast_binary_ref(op, x, y)
    want = _oracle(op, x, y)
    if ref.dtype == np.bool_ or ref.dtype.kind == "i":
        np.testing.assert_array_equal(ref, want.astype(ref.dtype), err_msg=op)
    else:
        np.testing.assert_allclose(ref, want.astype(np.float64), rtol=2e-6, atol=1e-6, err_msg=op)
    return ref


@pytest.mark.parametrize("op", sorted(broadcast.ALL_OPS))
def test_broadcast_binary_against_reference_and_oracle(op, rng):
    dtypes = (["bool"] if op in broadcast.LOGICAL else
              ["float32", "float64"] if op == "div" else ["float32", "int32", "int64", "float64"])
    for k, dtype in enumerate(map(np.dtype, dtypes)):
        for shapes in (SHAPE_PAIRS if k == 0 else SHAPE_PAIRS[:1]):     # every pair once per op
            x, y = quiet(_operands, op, dtype, shapes, rng)
            ref = quiet(_check_ref_against_oracle, op, x, y)
            out = poison(ref.shape, ref.dtype, ref)
            quiet(broadcast.broadcast_binary, op, cuda.to_device(x), cuda.to_device(y), out)
            assert_same(out.copy_to_host(), ref, f"{op} {dtype} {shapes}",
                        ulps=ULPS if op == "pow" else 0)


def test_collapse_dims_merges_what_walks_as_one():
    assert broadcast.collapse_dims((2, 3, 4), (12, 4, 1), (12, 4, 1)) == ((24,), [(1,), (1,)])
    assert broadcast.collapse_dims((2, 3, 4), (12, 4, 1), (0, 0, 1)) == ((6, 4), [(4, 1), (0, 1)])
    assert broadcast.collapse_dims((1, 5, 1), (5, 1, 1)) == ((5,), [(1,)])
    assert broadcast.collapse_dims((), ) == ((1,), [])
    assert broadcast.collapse_dims((3, 2), (-2, -1)) == ((6,), [(-1,)])     # reversed, contiguous


def test_where_broadcasts_three_operands_and_selects(rng):
    for c_shape, x_shape, y_shape in [((2, 1), (3,), ()), ((4, 3), (4, 3), (4, 3)), ((0, 2), (2,), ())]:
        cond = rng.random(c_shape) > 0.5
        x = rng.standard_normal(x_shape).astype(np.float32)
        y = np.full(y_shape, np.inf, np.float32)               # the branch not taken never leaks
        ref = broadcast.where_ref(cond, x, y)
        shape = np.broadcast_shapes(c_shape, x_shape, y_shape)
        cb, xb, yb = (np.broadcast_to(a, shape) for a in (cond, x, y))
        want = np.array([xb[i] if cb[i] else yb[i] for i in np.ndindex(*shape)], np.float32)
        np.testing.assert_array_equal(ref.reshape(-1), want)
        out = poison(shape, np.float32)
        broadcast.where(cuda.to_device(cond), cuda.to_device(x), cuda.to_device(y), out)
        assert_same(out.copy_to_host(), ref, f"where {c_shape} {x_shape} {y_shape}")
    x = rng.integers(-5, 5, (3, 1)).astype(np.int64)
    y = rng.integers(-5, 5, (1, 4)).astype(np.int64)
    cond = rng.random(()) > 0.5
    out = poison((3, 4), np.int64)
    broadcast.where(cuda.to_device(np.asarray(cond)), cuda.to_device(x), cuda.to_device(y), out)
    assert_same(out.copy_to_host(), broadcast.where_ref(cond, x, y), "where int64, 0-d cond")


def test_broadcast_launchers_say_what_is_wrong():
    f32 = cuda.to_device(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="incompatible"):
        broadcast.broadcast_binary("add", f32, cuda.to_device(np.zeros(4, np.float32)), f32)
    with pytest.raises(ValueError, match="out has shape"):
        broadcast.broadcast_binary("add", f32, f32, cuda.to_device(np.zeros(6, np.float32)))
    with pytest.raises(TypeError, match="must be bool"):
        broadcast.broadcast_binary("less", f32, f32, f32)
    ints = cuda.to_device(np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="cast to a float"):
        broadcast.broadcast_binary("div", ints, ints, ints)
    with pytest.raises(TypeError, match="bool"):
        broadcast.broadcast_binary("logical_and", ints, ints, ints)
    with pytest.raises(ValueError, match="at most 6"):
        broadcast.padded("add", (2, 3, 2, 3, 2, 3, 2), (1,) * 7)


# --- unary math --------------------------------------------------------------------------------

#: op -> the float64 oracle of one element (Python's math).
_UNARY_ORACLE = {
    "neg": lambda a, al: -a, "abs": lambda a, al: abs(a), "square": lambda a, al: a * a,
    "sign": lambda a, al: a if a != a else float((a > 0) - (a < 0)),
    "exp": lambda a, al: math.exp(a), "log": lambda a, al: math.log(a),
    "log1p": lambda a, al: math.log1p(a), "expm1": lambda a, al: math.expm1(a),
    "sqrt": lambda a, al: math.sqrt(a), "rsqrt": lambda a, al: 1 / math.sqrt(a),
    "reciprocal": lambda a, al: 1 / a, "sin": lambda a, al: math.sin(a),
    "cos": lambda a, al: math.cos(a), "tanh": lambda a, al: math.tanh(a),
    "sigmoid": lambda a, al: 1 / (1 + math.exp(-a)) if (a > -700 or a != a) else 0.0,
    "softplus": lambda a, al: math.log1p(math.exp(a)) if a < 30 else a,
    "relu": lambda a, al: a if (a > 0 or a != a) else 0.0,
    "leaky_relu": lambda a, al: a if a > 0 else al * a,
    "elu": lambda a, al: a if a > 0 else al * math.expm1(a),
    "round": lambda a, al: a if a != a else float(round(a)),           # Python's: half to even
    "floor": lambda a, al: a if a != a else float(math.floor(a)),
    "ceil": lambda a, al: a if a != a else float(math.ceil(a)), "logical_not": lambda a, al: not a,
}
#: Ops whose result the GPU and NumPy give bit for bit (one exact IEEE step, or none).
EXACT_UNARY = ("neg", "abs", "sign", "square", "reciprocal", "relu", "leaky_relu", "round",
               "floor", "ceil", "logical_not")
POSITIVE_DOMAIN = ("log", "sqrt", "rsqrt", "log1p")


def _unary_input(op, dtype, rng):
    if dtype == np.bool_:
        return rng.random(37) > 0.5
    if dtype.kind == "i":
        return rng.integers(-50, 50, 37).astype(dtype)
    x = (rng.standard_normal(37) * 4).astype(dtype)
    x[:8] = [np.nan, 0.5, -2.5, 1.5, 2.5, -0.5, 40.0, -40.0]     # NaN, ties, sigmoid's tails
    if op in POSITIVE_DOMAIN:        # the simulator runs Python's math, which raises outside it
        x = np.where(np.isnan(x), x, np.abs(x) + dtype.type(0.01)).astype(dtype)
    if op in ("exp", "expm1"):
        x = np.clip(x, -20, 20).astype(dtype)
    return x


@pytest.mark.parametrize("op", list(unary_math.UNARY_MATH))
def test_unary_math_against_reference_and_oracle(op, rng):
    dtypes = (["bool"] if op in unary_math.BOOL_OPS else
              ["float32", "float64", "int32", "int64"] if op in unary_math.INTEGER_OK else
              ["float32", "float64"])
    alpha = float(rng.uniform(0.1, 0.5))
    for dtype in map(np.dtype, dtypes):
        x = _unary_input(op, dtype, rng)
        ref = unary_math.unary_math_ref(op, x, alpha)
        py = bool if dtype == np.bool_ else (int if dtype.kind == "i" else float)
        want = np.array([_UNARY_ORACLE[op](py(a), alpha) for a in x], np.float64 if py is float else dtype)
        if py is float:
            np.testing.assert_allclose(ref, want, rtol=4e-7 if dtype == np.float32 else 1e-14,
                                       atol=1e-30, err_msg=f"{op} {dtype} reference vs oracle")
        else:
            np.testing.assert_array_equal(ref, want, err_msg=f"{op} {dtype} reference vs oracle")
        out = poison(x.shape, dtype, ref)
        unary_math.unary_math(op, cuda.to_device(x), out, alpha)
        assert_same(out.copy_to_host(), ref, f"{op} {dtype}", ulps=0 if op in EXACT_UNARY else ULPS)


def test_round_is_half_to_even_and_keeps_huge_and_special_values():
    for dtype in (np.float32, np.float64):
        x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 2.0**52 + 1,
                      3e38, -np.inf, np.inf, np.nan, -1e-30], dtype)
        out = poison(x.shape, dtype)
        quiet(unary_math.unary_math, "round", cuda.to_device(x), out)     # inf - inf warns
        assert_same(out.copy_to_host(), np.round(x), f"round {np.dtype(dtype)}")
        for op, fn in (("floor", np.floor), ("ceil", np.ceil)):
            quiet(unary_math.unary_math, op, cuda.to_device(x), out)
            assert_same(out.copy_to_host(), fn(x), f"{op} {np.dtype(dtype)}")


def test_unary_math_refuses_what_tensorflow_refuses():
    ints = cuda.to_device(np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="integer tensors take only"):
        unary_math.unary_math("exp", ints, ints)
    with pytest.raises(TypeError, match="logical_not"):
        unary_math.unary_math("logical_not", ints, ints)
    with pytest.raises(ValueError, match="unknown unary"):
        unary_math.unary_math("erf", ints, ints)


# --- reductions over one axis ----------------------------------------------------------------------

REDUCE_SHAPES = [(2, 5, 3), (1, 4, 1), (3, 0, 2), (2, 1, 4)]


def _reduce_oracle(op, x3):
    o_, n_, i_ = x3.shape
    out = np.empty((o_, i_), object)
    for o in range(o_):
        for i in range(i_):
            col = [x3[o, n, i].item() for n in range(n_)]
            if op == "sum":
                out[o, i] = math.fsum(col) if x3.dtype.kind == "f" else sum(col)
            elif op == "prod":
                out[o, i] = math.prod(col)
            elif op in ("any", "all"):
                out[o, i] = (any if op == "any" else all)(col)
            elif any(v != v for v in col):
                out[o, i] = math.nan
            else:
                out[o, i] = (max if op == "max" else min)(col, default=reduce_axis.identity_of(op, x3.dtype).item())
    return out


@pytest.mark.parametrize("op", list(reduce_axis.REDUCE))
def test_reduce_axis_against_reference_and_oracle(op, rng):
    dtypes = ["bool"] if op in ("any", "all") else ["float32", "int32", "float64", "int64"]
    for k, dtype in enumerate(map(np.dtype, dtypes)):
        for shape in (REDUCE_SHAPES if k == 0 else REDUCE_SHAPES[:1]):
            if dtype == np.bool_:
                x3 = rng.random(shape) > (0.8 if op == "any" else 0.2)
            elif dtype.kind == "i":
                x3 = rng.integers(-3, 4, shape).astype(dtype)
            else:
                x3 = rng.standard_normal(shape).astype(dtype)
                if shape[1] > 1 and op in ("max", "min"):
                    x3[0, 1, 0] = np.nan                   # propagates, as np.max
            ref = reduce_axis.reduce_axis_ref(op, x3)
            want = _reduce_oracle(op, x3)
            if dtype.kind == "f" and op in ("sum", "prod"):
                np.testing.assert_allclose(ref, want.astype(np.float64), rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(ref, want.astype(dtype), err_msg=f"{op} {shape}")
            out = poison(ref.shape, dtype, ref)
            reduce_axis.reduce_axis(op, cuda.to_device(x3), out)
            got = out.copy_to_host()
            if dtype.kind == "f" and op == "sum":
                assert_sum_close(got, x3, axis=1)
                assert got.dtype == ref.dtype
            else:
                assert_same(got, ref, f"{op} {dtype} {shape}", ulps=2 if op == "prod" else 0)


@pytest.mark.parametrize("op", list(reduce_axis.ARG_REDUCE))
def test_arg_reduce_first_extreme_and_nan(op, rng):
    for dtype in (np.float32, np.int64):
        x3 = rng.integers(-2, 3, (3, 6, 2)).astype(dtype)          # ties: the first index wins
        if dtype == np.float32:
            x3[1, 3, 0] = x3[1, 4, 0] = np.nan                      # the first NaN wins
        ref = reduce_axis.arg_reduce_axis_ref(op, x3)
        pick = np.nanargmax if op == "argmax" else np.nanargmin
        for o, i in np.ndindex(3, 2):
            col = x3[o, :, i]
            nans = np.flatnonzero(np.isnan(col.astype(np.float64)))
            assert ref[o, i] == (nans[0] if nans.size else pick(col))
        out = poison(ref.shape, np.int64)
        reduce_axis.arg_reduce_axis(op, cuda.to_device(x3), out)
        assert_same(out.copy_to_host(), ref, f"{op} {np.dtype(dtype)}")
    with pytest.raises(ValueError, match="empty axis"):
        reduce_axis.arg_reduce_axis(op, cuda.to_device(np.zeros((2, 0, 1), np.float32)),
                                    cuda.to_device(np.zeros((2, 1), np.int64)))


# --- strided copy ------------------------------------------------------------------------------------

#: (shape, src_offset, src_strides, dst_offset, dst_strides) on a 60-element src, 40-element dst.
COPIES = [((3, 4), 8, (-4, 1), 0, (4, 1)),          # rows reversed
          ((3, 4), 11, (4, -1), 0, (1, 3)),         # columns reversed, written transposed
          ((2, 3, 2), 0, (0, 2, 1), 1, (6, 2, 1)),  # broadcast_to along the first axis
          ((5,), 59, (-2,), 0, (1,)),               # x[::-2]
          ((), 7, (), 3, ()),                       # a 0-d view
          ((2, 0, 3), 0, (0, 0, 0), 0, (0, 0, 0)),  # nothing to copy
          ((2, 2, 2, 1, 2, 1, 2), 0, (30, 12, 5, 0, 2, 0, 1), 2, (16, 8, 4, 4, 2, 2, 1))]  # rank 7


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "uint8"])
def test_strided_copy_against_reference_and_oracle(dtype, rng):
    dtype = np.dtype(dtype)
    src = (rng.random(60) > 0.5 if dtype == np.bool_ else
           (rng.standard_normal(60) * 50).astype(dtype) if dtype.kind == "f" else
           rng.integers(0, 200, 60).astype(dtype))
    for shape, so, ss, do, ds in COPIES:
        start = ~src[:40] if dtype == np.bool_ else np.full(40, 77, dtype)
        ref = strided_copy.strided_copy_ref(src, start.copy(), shape, so, ss, do, ds)
        want = start.copy()
        for idx in np.ndindex(*shape):                       # the oracle: one element at a time
            want[do + sum(k * s for k, s in zip(idx, ds))] = src[so + sum(k * s for k, s in zip(idx, ss))]
        np.testing.assert_array_equal(ref, want, err_msg=str(shape))
        dst = cuda.to_device(start)
        strided_copy.strided_copy(cuda.to_device(src), dst, shape, so, ss, do, ds)
        assert_same(dst.copy_to_host(), ref, f"strided_copy {dtype} {shape}")


def test_strided_copy_refuses_views_past_the_buffer_and_shared_memory():
    src, dst = cuda.to_device(np.zeros(10, np.float32)), cuda.to_device(np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="reaches elements -1"):
        strided_copy.strided_copy(src, dst, (3,), 1, (-1,), 0, (1,))
    with pytest.raises(ValueError, match=r"reaches elements 0 \.\. 10"):
        strided_copy.strided_copy(src, dst, (6,), 0, (1,), 0, (2,))
    with pytest.raises(ValueError, match="shares memory"):
        strided_copy.strided_copy(src, src, (3,), 0, (1,), 5, (1,))
    with pytest.raises(TypeError, match="must be float32"):
        strided_copy.strided_copy(src, cuda.to_device(np.zeros(10, np.int32)), (3,), 0, (1,), 0, (1,))


# --- random draws ---------------------------------------------------------------------------------------

_MASK = 2**64 - 1


def _mix64_python(z):
    """splitmix64's finaliser with Python integers: an oracle independent of NumPy's uint64."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def test_random_fill_bits_equal_the_reference_and_an_integer_oracle(rng):
    state = random_fill.state_init(int(rng.integers(0, 2**31)))
    state[random_fill.OFFSET] = 2**64 - 17                   # the counter wraps inside the draw
    key, offset = int(state[0]), int(state[1])
    uniform = random_fill.random_fill_ref("uniform", np.empty((5, 7), np.float32), state.copy())
    for i in range(35):
        z = _mix64_python(key ^ _mix64_python((((offset + i) & _MASK) + 1) * int(GOLDEN) & _MASK))
        assert uniform.reshape(-1)[i] == (z >> 40) / 2**24
    for dist in random_fill.DISTRIBUTIONS:
        ref = random_fill.random_fill_ref(dist, np.empty((5, 7), np.float32), state.copy())
        out = poison((5, 7), np.float32)
        random_fill.random_fill(dist, out, cuda.to_device(state))
        if dist == "uniform":
            assert_same(out.copy_to_host(), ref, dist)
        else:   # ulps near a zero of cos are meaningless (a tiny value, its own tiny ulp): absolute too
            np.testing.assert_allclose(out.copy_to_host(), ref, rtol=random_fill.NORMAL_ULPS * 2.0 ** -23,
                                       atol=4e-7)
    normal = random_fill.random_fill_ref("normal", np.empty(4000, np.float32), state.copy())
    assert abs(normal.mean()) < 0.1 and abs(normal.std() - 1) < 0.1 and np.isfinite(normal).all()


def test_random_advance_moves_the_device_offset():
    state = random_fill.state_init(3)
    state[random_fill.OFFSET] = 2**64 - 2
    dev = cuda.to_device(state)
    random_fill.random_advance(dev, 5)
    assert_same(dev.copy_to_host(), random_fill.random_advance_ref(state.copy(), 5), "advance")
    assert dev.copy_to_host()[random_fill.OFFSET] == 3       # modulo 2^64
    with pytest.raises(ValueError, match=">= 0"):
        random_fill.random_advance(dev, -1)
    with pytest.raises(ValueError, match="shape"):
        random_fill.random_fill("uniform", cuda.to_device(np.zeros(3, np.float32)),
                                cuda.to_device(np.zeros(3, np.uint64)))


# --- resize ------------------------------------------------------------------------------------------------

def test_resize_bilinear_matches_tensorflows_known_answer():
    """tf.image.resize(x, (4, 4)) of x = [[0, 1], [2, 3]] (TF 2, half-pixel centres): the
    edge pixels are clamped, the inner ones interpolated at quarter steps."""
    x = np.array([[0, 1], [2, 3]], np.float32).reshape(1, 2, 2, 1)
    want = np.array([[0, .25, .75, 1], [.5, .75, 1.25, 1.5], [1.5, 1.75, 2.25, 2.5],
                     [2, 2.25, 2.75, 3]], np.float32).reshape(1, 4, 4, 1)
    np.testing.assert_array_equal(resize.resize_ref(x, 4, 4, "bilinear"), want)
    np.testing.assert_array_equal(resize.resize_ref(x, 4, 4, "nearest")[0, :, :, 0],
                                  [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]])


def _resize_oracle(x, out_h, out_w, method):
    """Explicit loops in float64 with TF's formulas (the reference rounds to float32)."""
    b, h, w, c = x.shape
    out = np.empty((b, out_h, out_w, c))
    for n, oy, ox, ch in np.ndindex(b, out_h, out_w, c):
        if method == "nearest":
            out[n, oy, ox, ch] = x[n, min(int((oy + .5) * h / out_h), h - 1),
                                   min(int((ox + .5) * w / out_w), w - 1), ch]
            continue
        fy, fx = (oy + .5) * h / out_h - .5, (ox + .5) * w / out_w - .5
        y0, x0 = math.floor(fy), math.floor(fx)
        ly, lx = fy - y0, fx - x0
        ya, yb = max(y0, 0), min(y0 + 1, h - 1) if ly else max(y0, 0)
        xa, xb = max(x0, 0), min(x0 + 1, w - 1) if lx else max(x0, 0)
        top = x[n, ya, xa, ch] * (1 - lx) + x[n, ya, xb, ch] * lx
        bottom = x[n, yb, xa, ch] * (1 - lx) + x[n, yb, xb, ch] * lx
        out[n, oy, ox, ch] = top * (1 - ly) + bottom * ly
    return out


@pytest.mark.parametrize("method", resize.METHODS)
def test_resize_against_reference_and_oracle(method, rng):
    for h, w, out_h, out_w in [(4, 5, 7, 3), (3, 3, 3, 3), (1, 6, 2, 6), (5, 4, 2, 9)]:
        x = rng.standard_normal((2, h, w, 3)).astype(np.float32)
        ref = resize.resize_ref(x, out_h, out_w, method)
        np.testing.assert_allclose(ref, _resize_oracle(x.astype(np.float64), out_h, out_w, method),
                                   rtol=1e-5, atol=1e-5)
        out = poison(ref.shape, np.float32)
        resize.resize(cuda.to_device(x), out, method)
        assert_same(out.copy_to_host(), ref, f"resize {method} {(h, w)} -> {(out_h, out_w)}")
    with pytest.raises(ValueError, match="batch and channels"):
        resize.resize(cuda.to_device(x), cuda.to_device(np.zeros((2, 3, 3, 1), np.float32)), method)


# --- the two backends answer alike ---------------------------------------------------------------------------

def test_cpu_and_cuda_backends_agree(devices, rng):
    cpu, gpu = devices(cpus=1, gpus=1)

    def both(method, *arrays_then_args, outs=(), args=()):
        """Run ``method`` on each backend with copies of the host arrays, return the outputs."""
        answers = []
        for dev in (cpu, gpu):
            ins = [dev.from_numpy(a) for a in arrays_then_args]
            bufs = [dev.from_numpy(o) for o in outs]
            getattr(dev.ops, method)(*args[:1], *ins, *bufs, *args[1:])
            answers.append([dev.to_numpy(b) for b in bufs])
        return answers

    x = rng.standard_normal((3, 1, 5)).astype(np.float32)
    y = rng.standard_normal((4, 1)).astype(np.float32)
    for op, dtype in (("mul", np.float32), ("greater", np.bool_)):
        c, g = both("broadcast_binary", x, y, outs=[np.zeros((3, 4, 5), dtype)], args=(op,))
        assert_same(g[0], c[0], f"backends {op}")
    c, g = both("where", x > 0, x, y, outs=[np.zeros((3, 4, 5), np.float32)])
    assert_same(g[0], c[0], "backends where")
    c, g = both("unary_math", x, outs=[np.zeros_like(x)], args=("leaky_relu", 0.3))
    assert_same(g[0], c[0], "backends leaky_relu")
    x3 = rng.integers(-9, 9, (2, 3, 4)).astype(np.int32)
    c, g = both("reduce_axis", x3, outs=[np.zeros((2, 4), np.int32)], args=("max",))
    assert_same(g[0], c[0], "backends reduce max")
    c, g = both("arg_reduce_axis", x3, outs=[np.zeros((2, 4), np.int64)], args=("argmin",))
    assert_same(g[0], c[0], "backends argmin")
    src = rng.standard_normal(12).astype(np.float32)
    answers = []
    for dev in (cpu, gpu):
        dst = dev.from_numpy(np.zeros(12, np.float32))
        dev.ops.strided_copy(dev.from_numpy(src), dst, (3, 4), 0, (1, 3), 0, (4, 1))   # transpose
        answers.append(dev.to_numpy(dst))
    assert_same(answers[1], answers[0], "backends strided_copy")
    np.testing.assert_array_equal(answers[0].reshape(3, 4), src.reshape(4, 3).T)
    state = random_fill.state_init(11)
    answers = []
    for dev in (cpu, gpu):
        st, out = dev.from_numpy(state), dev.from_numpy(np.zeros((2, 9), np.float32))
        dev.ops.random_fill("uniform", out, st)
        dev.ops.random_advance(st, out.size)
        answers.append((dev.to_numpy(out), dev.to_numpy(st)))
    assert_same(answers[1][0], answers[0][0], "backends uniform")
    assert_same(answers[1][1], answers[0][1], "backends advance")
    img = rng.standard_normal((1, 3, 4, 2)).astype(np.float32)
    answers = []
    for dev in (cpu, gpu):
        out = dev.from_numpy(np.zeros((1, 5, 2, 2), np.float32))
        dev.ops.resize(dev.from_numpy(img), out, "bilinear")
        answers.append(dev.to_numpy(out))
    assert_same(answers[1], answers[0], "backends resize")
