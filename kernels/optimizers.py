"""Optimizer updates: SGD (plain, momentum, Nesterov) and Adam, exactly as Keras 3.

Versions: v1 only. One launch per parameter buffer: every array is seen flattened,
one thread per element with a grid-stride loop, so a single packed buffer holding
all of a model's parameters (``mirrored`` packs them for the all-reduce anyway) is
updated by a single launch. Memory-bound: SGD with momentum moves 5 floats per
element (read w, g, v; write w, v), Adam 7 (read w, g, m, v; write w, m, v).

Keras's formulas (``keras/src/optimizers/sgd.py`` and ``adam.py``)::

    SGD, momentum == 0:   w -= lr * g
    SGD, momentum:        v = momentum * v - lr * g;  w += v
    SGD, Nesterov:        v = momentum * v - lr * g;  w += momentum * v - lr * g
    Adam, step t >= 1:    alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
                          m += (g - m) * (1 - beta_1)
                          v += (g*g - v) * (1 - beta_2)
                          w -= alpha * m / (sqrt(v) + epsilon)        epsilon = 1e-7

Scalars are computed once per step on the host in float64 and rounded once to float32
(``sgd_scalars``, ``adam_scalars``: a small vector, the *hyper-parameter vector*). The
kernels read that vector from DEVICE memory rather than take the numbers as launch
arguments: a launch argument is frozen into a captured CUDA graph, a device buffer is
not, so a training step captured once (``mirrored/program/capture.py``) still updates with each
step's alpha once the host has copied the new vector into the buffer. The NumPy
references read the very same float32 vector and do float32 math in the same order. The GPU may still differ from NumPy in the last bit:
NVVM fuses ``a * b + c`` into one fused multiply-add (one rounding instead of two).
Replicas all run the same kernel, so their copies stay bit-identical regardless.

All updates are in place: ``w``, ``velocity``, ``m``, ``v`` are both read and written,
``g`` only read. None of them may overlap another.
"""
import math

import numpy as np
from numba import cuda, njit

from kernels import disk_cache
from kernels.launch import check_array, check_no_alias, flat, grid_1d, launch
from kernels.registry import register, sig, vec


# --- the hyper-parameter vectors shared by the kernels and the references ------------------

#: Where each scalar sits in the vectors below (the kernels index them by these names).
SGD_LR, SGD_MOMENTUM = 0, 1
SGD_HYPER_SIZE = 2
ADAM_ALPHA, ADAM_ONE_MINUS_B1, ADAM_ONE_MINUS_B2, ADAM_EPSILON = 0, 1, 2, 3
ADAM_HYPER_SIZE = 4


def sgd_scalars(lr, momentum, dtype=np.float32):
    """[lr, momentum]: (2,) ``dtype``, exactly what the kernel reads."""
    return np.array([lr, momentum], dtype)


def adam_scalars(lr, step, beta_1=0.9, beta_2=0.999, epsilon=1e-7, dtype=np.float32):
    """[alpha, 1 - beta_1, 1 - beta_2, epsilon] for step ``step`` (>= 1): (4,) ``dtype``,
    each computed in float64 on the host and then rounded once."""
    if int(step) != step or step < 1:
        raise ValueError(f"adam: step must be an integer >= 1 (the first update is step "
                         f"1, as Keras's iterations + 1), got {step!r}.")
    alpha = lr * math.sqrt(1.0 - beta_2 ** step) / (1.0 - beta_1 ** step)
    return np.array([alpha, 1.0 - beta_1, 1.0 - beta_2, epsilon], dtype)


# --- NumPy references (in place) -----------------------------------------------------------

def sgd_ref(w, g, velocity, hyper, nesterov=False):
    """Keras SGD step, in place on ``w`` (and on ``velocity``; None means momentum == 0).
    ``hyper``: ``sgd_scalars(lr, momentum, w.dtype)``. Any float dtype."""
    lr, mom = hyper[SGD_LR], hyper[SGD_MOMENTUM]
    if velocity is None:
        w -= g * lr
        return w
    velocity *= mom
    velocity -= g * lr          # v = momentum * v - lr * g
    if nesterov:
        w += velocity * mom - g * lr
    else:
        w += velocity
    return w


def adam_ref(w, g, m, v, hyper):
    """Keras Adam step, in place on w, m, v. ``hyper``: ``adam_scalars(lr, step, ...,
    dtype=w.dtype)`` for this step (>= 1)."""
    alpha, one_minus_b1 = hyper[ADAM_ALPHA], hyper[ADAM_ONE_MINUS_B1]
    one_minus_b2, eps = hyper[ADAM_ONE_MINUS_B2], hyper[ADAM_EPSILON]
    m += (g - m) * one_minus_b1
    v += (g * g - v) * one_minus_b2
    w -= (m * alpha) / (np.sqrt(v) + eps)
    return w


# --- the CPU backend's Adam: the reference's float32 operations, in its order, in one pass ----------

@njit(cache=disk_cache.trusted_for(__file__), nogil=True, error_model="numpy")
def _adam_loop(w, g, m, v, hyper):
    """for i in range(size): the reference's three lines for element i, each operation in
    float32 and in the reference's order (m's update, v's, then w's), no FMA (Numba does
    not contract a*b + c without fastmath): bitwise ``adam_ref``. One pass reading w, g,
    m, v once and writing w, m, v once, in SIMD lanes, where the reference's NumPy
    expressions make eight passes and four temporaries. ``error_model="numpy"``: a
    division by zero gives inf/NaN as NumPy's does, instead of Python's test and
    exception before every division, which kept LLVM from using SIMD lanes (measured
    here on 347,210 weights: 0.81 ms with the test, 0.10 ms without; the reference 0.46)."""
    alpha, one_minus_b1 = hyper[ADAM_ALPHA], hyper[ADAM_ONE_MINUS_B1]
    one_minus_b2, eps = hyper[ADAM_ONE_MINUS_B2], hyper[ADAM_EPSILON]
    for i in range(w.size):
        gi = g[i]
        mi = m[i] + (gi - m[i]) * one_minus_b1
        vi = v[i] + (gi * gi - v[i]) * one_minus_b2
        m[i] = mi
        v[i] = vi
        w[i] = w[i] - (mi * alpha) / (np.sqrt(vi) + eps)


def adam_cpu(w, g, m, v, hyper):
    """``adam_ref`` in one compiled pass (``_adam_loop``) for float32 C-contiguous buffers
    of one size that do not overlap (the CPU backend's packed weights); bitwise the
    reference's result (tests/test_cpu_adam_loop.py). Anything else: the reference.
    On the lab ConvNet's 347,210 weights, this 2-core machine: 0.10 ms, the reference 0.46."""
    arrays = (w, g, m, v)
    if (all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
            and a.size == w.size for a in arrays)
            and isinstance(hyper, np.ndarray) and hyper.dtype == np.float32
            and not any(np.shares_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])):
        _adam_loop(w.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1), hyper)
        return w
    return adam_ref(w, g, m, v, hyper)


# --- kernels -------------------------------------------------------------------------------------
# Every thread reads the few scalars of ``hyper`` (the same addresses for all threads:
# one memory transaction per warp, then cached) before its grid-stride loop.

@cuda.jit
def sgd_kernel(w, g, hyper):
    """One thread per element i (grid-stride), all arrays 1-D of one size.
    Loop nest: for i in range(size): w[i] -= lr * g[i]."""
    lr = hyper[SGD_LR]
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        w[i] -= g[i] * lr


@cuda.jit
def sgd_momentum_kernel(w, g, velocity, hyper):
    """One thread per element i (grid-stride). Loop nest:
    for i in range(size): v[i] = momentum * v[i] - lr * g[i]; w[i] += v[i]."""
    lr = hyper[SGD_LR]
    momentum = hyper[SGD_MOMENTUM]
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        vi = velocity[i] * momentum - g[i] * lr
        velocity[i] = vi
        w[i] += vi


@cuda.jit
def sgd_nesterov_kernel(w, g, velocity, hyper):
    """One thread per element i (grid-stride). Loop nest: for i in range(size):
    v[i] = momentum * v[i] - lr * g[i]; w[i] += momentum * v[i] - lr * g[i]."""
    lr = hyper[SGD_LR]
    momentum = hyper[SGD_MOMENTUM]
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        gi = g[i] * lr
        vi = velocity[i] * momentum - gi
        velocity[i] = vi
        w[i] += vi * momentum - gi


@cuda.jit
def adam_kernel(w, g, m, v, hyper):
    """One thread per element i (grid-stride); every value read once, written once.
    Loop nest: for i in range(size): m[i] += (g[i] - m[i]) * (1 - b1);
               v[i] += (g[i]**2 - v[i]) * (1 - b2); w[i] -= alpha * m[i] / (sqrt(v[i]) + eps)."""
    alpha = hyper[ADAM_ALPHA]
    one_minus_b1 = hyper[ADAM_ONE_MINUS_B1]
    one_minus_b2 = hyper[ADAM_ONE_MINUS_B2]
    epsilon = hyper[ADAM_EPSILON]
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        gi = g[i]
        mi = m[i]
        vi = v[i]
        mi += (gi - mi) * one_minus_b1
        vi += (gi * gi - vi) * one_minus_b2
        m[i] = mi
        v[i] = vi
        w[i] -= (mi * alpha) / (math.sqrt(vi) + epsilon)


# What the real compiler checks (kernels/registry.py): flat float32 buffers and the
# float32 hyper-parameter vector.
_F32 = vec("float32")
register(sgd_kernel, "sgd_kernel", sig(_F32, _F32, _F32), block=grid_1d(1)[1])
register(sgd_momentum_kernel, "sgd_momentum_kernel", sig(_F32, _F32, _F32, _F32),
         block=grid_1d(1)[1])
register(sgd_nesterov_kernel, "sgd_nesterov_kernel", sig(_F32, _F32, _F32, _F32),
         block=grid_1d(1)[1])
register(adam_kernel, "adam_kernel", sig(_F32, _F32, _F32, _F32, _F32), block=grid_1d(1)[1])


# --- launchers ------------------------------------------------------------------------------------


def check_buffers(what, w, g, state, hyper, hyper_size):
    """w float32 contiguous; g and each state buffer the same shape; no overlaps;
    hyper a float32 vector of ``hyper_size`` on the device (at its front). Every optimizer
    launcher checks its arguments so (``optimizers_more.py`` too)."""
    check_array(f"{what}: w", w, np.float32)
    check_array(f"{what}: g", g, np.float32, shape=w.shape)
    for name, s in state.items():
        check_array(f"{what}: {name}", s, np.float32, shape=w.shape)
    check_array(f"{what}: hyper (the {what}_scalars(...) vector, on the device)", hyper, np.float32, ndim=1)
    if hyper.shape[0] < hyper_size:           # a longer one carries a tail (gradient_transforms.py)
        raise ValueError(f"{what}: hyper has {hyper.shape[0]} scalars, expected {hyper_size} "
                         f"(the {what}_scalars(...) vector) at its front.")
    written = [w, *state.values()]
    for i, out in enumerate(written):
        check_no_alias(what, out, g, hyper, *written[i + 1:])


def sgd(w, g, velocity, hyper, nesterov=False, stream=None):
    """Keras SGD step on the GPU, in place. w, g (and velocity, None when momentum
    == 0): float32, same shape, C-contiguous. ``hyper``: a (2,) float32 device
    array holding ``sgd_scalars(lr, momentum)``. As in Keras, ``nesterov`` has no
    effect without momentum."""
    check_buffers("sgd", w, g, {"velocity": velocity} if velocity is not None else {},
                   hyper, SGD_HYPER_SIZE)
    if not w.size:
        return w
    grid, block = grid_1d(w.size)
    if velocity is None:
        launch(sgd_kernel, grid, block, stream, flat(w), flat(g), hyper)
    else:
        kernel = sgd_nesterov_kernel if nesterov else sgd_momentum_kernel
        launch(kernel, grid, block, stream, flat(w), flat(g), flat(velocity), hyper)
    return w


def adam(w, g, m, v, hyper, stream=None):
    """Keras Adam step on the GPU, in place on w, m, v (float32, same shape,
    C-contiguous, m and v start as zeros). ``hyper``: a (4,) float32 device array
    holding ``adam_scalars(lr, step, ...)`` for this step."""
    check_buffers("adam", w, g, {"m": m, "v": v}, hyper, ADAM_HYPER_SIZE)
    if w.size:
        launch(adam_kernel, *grid_1d(w.size), stream, flat(w), flat(g), flat(m),
               flat(v), hyper)
    return w
