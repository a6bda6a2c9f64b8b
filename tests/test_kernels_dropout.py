"""Dropout (kernels/dropout.py): the mask's bits, the kernel against the NumPy reference.

The generator is checked against an independent implementation here (splitmix64 on
Python integers, masked to 64 bits) and the published first outputs of splitmix64; the
CUDA kernel must then give the SAME mask and the same output bits as the NumPy
reference for the same (seed, step, replica), and a different mask when any of them
changes. Outputs are NaN-poisoned; a bad rate is refused before any launch.

    python -m pytest -q tests/test_kernels_dropout.py     # CUDA simulator: a few seconds
"""
import warnings

import numpy as np
import pytest
from numba import cuda

import kernels.dropout as drop
from conftest import device_zeros, poisoned

MASK64 = 2**64 - 1
#: Elements per mask in the statistical tests: enough for a 5-sigma band of about
#: +-4% of the kept count, small enough for the simulator.
N_STAT = 4096
#: Shapes: a batch of 1, odd widths, a 4-D NHWC activation.
SHAPES = [(1, 1), (3, 33), (2, 5, 5, 3)]


# --- an independent splitmix64 ------------------------------------------------------------

def oracle_mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def oracle_keep(key, i, rate):
    bits = oracle_mix64((int(key) + (i + 1) * 0x9E3779B97F4A7C15) & MASK64)
    return (bits >> 40) / 2**24 >= rate            # TensorFlow's rule: uniform >= rate


def test_mix64_is_splitmix64(rng):
    # splitmix64 seeded with 0 starts 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f.
    golden = 0x9E3779B97F4A7C15
    firsts = [oracle_mix64((k * golden) & MASK64) for k in (1, 2, 3)]
    assert firsts == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    zs = rng.integers(0, 2**63, 257, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    got = drop.mix64(zs)
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [oracle_mix64(int(z)) for z in zs]


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 0.9])
def test_reference_mask_matches_the_oracle(rng, rate):
    key = drop.dropout_key(int(rng.integers(0, 2**31)), 7, 1)
    mask = drop.dropout_mask_ref(key, 300, rate)
    assert mask.tolist() == [oracle_keep(key, i, rate) for i in range(300)]


# --- the kernel: the same bits as the reference ------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rate", [0.0, 0.25, 0.5])
def test_kernel_equals_reference_bitwise(rng, shape, rate):
    x = rng.standard_normal(shape).astype(np.float32)
    key = drop.dropout_key(int(rng.integers(0, 2**31)), int(rng.integers(0, 1000)), 0)
    want = drop.dropout_ref(x, key, rate)
    out = poisoned(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # no overflow warnings from the simulator either
        drop.dropout(cuda.to_device(x), out, rate, key)
    got = out.copy_to_host()
    assert got.dtype == np.float32 and np.array_equal(got, want), "kernel != dropout_ref"
    keep = drop.dropout_mask_ref(key, x.size, rate).reshape(shape)
    scale = np.float32(1 / (1 - rate))
    assert np.array_equal(want, np.where(keep, x * scale, np.float32(0)))
    if rate == 0.0:
        assert np.array_equal(got, x)             # rate 0: the identity


def _kernel_mask(key, rate, n=N_STAT):
    out = poisoned(n)
    drop.dropout(cuda.to_device(np.ones(n, np.float32)), out, rate, key)
    return out.copy_to_host() != 0


def test_kept_fraction_and_every_counter_changes_the_mask(rng):
    rate = 0.3
    seed = int(rng.integers(0, 2**31))
    base = _kernel_mask(drop.dropout_key(seed, 5, 0), rate)
    expected, sigma = N_STAT * (1 - rate), np.sqrt(N_STAT * rate * (1 - rate))
    assert abs(base.sum() - expected) < 5 * sigma, (base.sum(), expected)
    assert np.array_equal(base, drop.dropout_mask_ref(drop.dropout_key(seed, 5, 0), N_STAT, rate))
    for other in [(seed + 1, 5, 0), (seed, 6, 0), (seed, 5, 1)]:   # seed, step, replica
        mask = drop.dropout_mask_ref(drop.dropout_key(*other), N_STAT, rate)
        agree = np.mean(mask == base)   # independent masks agree on r^2 + (1-r)^2 = 58%
        assert 0.5 < agree < 0.66, (other, agree)
    assert drop.dropout_key(seed, 5, 0) == drop.dropout_key(seed, 5, 0)


def test_backward_is_the_same_call_on_dy_and_in_place_works(rng):
    shape, rate = (4, 9), 0.5
    key = drop.dropout_key(3, 1, 2)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    keep = drop.dropout_mask_ref(key, x.size, rate).reshape(shape)
    d_dy = cuda.to_device(dy)
    drop.dropout(d_dy, d_dy, rate, key)            # in place: dx over dy
    assert np.array_equal(d_dy.copy_to_host(), np.where(keep, dy * np.float32(2), 0))


def test_dropped_nan_is_zero_and_kept_nan_stays(rng):
    key, rate = drop.dropout_key(1, 2, 3), 0.5
    x = np.full(64, np.nan, np.float32)
    keep = drop.dropout_mask_ref(key, 64, rate)
    assert 0 < keep.sum() < 64
    out = poisoned(64)
    drop.dropout(cuda.to_device(x), out, rate, key)
    got = out.copy_to_host()
    assert np.isnan(got[keep]).all() and (got[~keep] == 0).all()


# --- bad input ----------------------------------------------------------------------------------

@pytest.fixture
def no_launch(forbid_launches):
    forbid_launches(drop)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan"), "half", None])
def test_bad_rate_raises_before_launch(no_launch, rate):
    x = device_zeros((2, 3))
    with pytest.raises(ValueError, match=r"rate must be (a number )?in \[0, 1\)"):
        drop.dropout(x, device_zeros((2, 3)), rate, drop.dropout_key(0, 0, 0))


def test_bad_arrays_and_counters_raise_before_launch(no_launch):
    key = drop.dropout_key(0, 0, 0)
    with pytest.raises(ValueError, match=r"out has shape \(3, 2\), expected \(2, 3\)"):
        drop.dropout(device_zeros((2, 3)), device_zeros((3, 2)), 0.5, key)
    with pytest.raises(TypeError, match="float32"):
        drop.dropout(device_zeros((2, 3), np.float64), device_zeros((2, 3)), 0.5, key)
    buf = device_zeros(8)
    with pytest.raises(ValueError, match="shares memory"):
        drop.dropout(buf[0:6], buf[2:8], 0.5, key)
    with pytest.raises(ValueError, match=">= 0"):
        drop.dropout_key(0, -1, 0)
