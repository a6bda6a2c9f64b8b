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

Scalars are computed once on the host in float64 and handed to the kernel as float32
(``adam_scalars``); the NumPy references use the very same float32 scalars and do
float32 math in the same order. The GPU may still differ from NumPy in the last bit:
NVVM fuses ``a * b + c`` into one fused multiply-add (one rounding instead of two).
Replicas all run the same kernel, so their copies stay bit-identical regardless.

All updates are in place: ``w``, ``velocity``, ``m``, ``v`` are both read and written,
``g`` only read. None of them may overlap another.
"""
import math

import numpy as np
from numba import cuda

from kernels.launch import check_array, check_no_alias, grid_1d, launch


# --- host-side scalars shared by the kernels and the references ------------------------

def sgd_scalars(lr, momentum, dtype=np.float32):
    """(lr, momentum) as ``dtype`` scalars, exactly what the kernel receives."""
    t = np.dtype(dtype).type
    return t(lr), t(momentum)


def adam_scalars(lr, step, beta_1=0.9, beta_2=0.999, epsilon=1e-7, dtype=np.float32):
    """(alpha, 1 - beta_1, 1 - beta_2, epsilon) for step ``step`` (>= 1), each computed
    in float64 on the host and then rounded once to ``dtype``."""
    if int(step) != step or step < 1:
        raise ValueError(f"adam: step must be an integer >= 1 (the first update is step "
                         f"1, as Keras's iterations + 1), got {step!r}.")
    t = np.dtype(dtype).type
    alpha = lr * math.sqrt(1.0 - beta_2 ** step) / (1.0 - beta_1 ** step)
    return t(alpha), t(1.0 - beta_1), t(1.0 - beta_2), t(epsilon)


# --- NumPy references (in place) -----------------------------------------------------------

def sgd_ref(w, g, velocity, lr, momentum=0.0, nesterov=False):
    """Keras SGD step, in place on ``w`` (and ``velocity`` when momentum != 0).
    Any float dtype; the scalars are rounded to w's dtype first, as on the GPU."""
    lr, mom = sgd_scalars(lr, momentum, w.dtype)
    if momentum == 0:
        w -= g * lr
        return w
    velocity *= mom
    velocity -= g * lr          # v = momentum * v - lr * g
    if nesterov:
        w += velocity * mom - g * lr
    else:
        w += velocity
    return w


def adam_ref(w, g, m, v, lr, step, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Keras Adam step ``step`` (>= 1), in place on w, m, v."""
    alpha, one_minus_b1, one_minus_b2, eps = adam_scalars(lr, step, beta_1, beta_2,
                                                          epsilon, w.dtype)
    m += (g - m) * one_minus_b1
    v += (g * g - v) * one_minus_b2
    w -= (m * alpha) / (np.sqrt(v) + eps)
    return w


# --- kernels -------------------------------------------------------------------------------------

@cuda.jit
def sgd_kernel(w, g, lr):
    """One thread per element i (grid-stride), all arrays 1-D of one size.
    Loop nest: for i in range(size): w[i] -= lr * g[i]."""
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        w[i] -= g[i] * lr


@cuda.jit
def sgd_momentum_kernel(w, g, velocity, lr, momentum):
    """One thread per element i (grid-stride). Loop nest:
    for i in range(size): v[i] = momentum * v[i] - lr * g[i]; w[i] += v[i]."""
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        vi = velocity[i] * momentum - g[i] * lr
        velocity[i] = vi
        w[i] += vi


@cuda.jit
def sgd_nesterov_kernel(w, g, velocity, lr, momentum):
    """One thread per element i (grid-stride). Loop nest: for i in range(size):
    v[i] = momentum * v[i] - lr * g[i]; w[i] += momentum * v[i] - lr * g[i]."""
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        gi = g[i] * lr
        vi = velocity[i] * momentum - gi
        velocity[i] = vi
        w[i] += vi * momentum - gi


@cuda.jit
def adam_kernel(w, g, m, v, alpha, one_minus_b1, one_minus_b2, epsilon):
    """One thread per element i (grid-stride); every value read once, written once.
    Loop nest: for i in range(size): m[i] += (g[i] - m[i]) * (1 - b1);
               v[i] += (g[i]**2 - v[i]) * (1 - b2); w[i] -= alpha * m[i] / (sqrt(v[i]) + eps)."""
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        gi = g[i]
        mi = m[i]
        vi = v[i]
        mi += (gi - mi) * one_minus_b1
        vi += (gi * gi - vi) * one_minus_b2
        m[i] = mi
        v[i] = vi
        w[i] -= (mi * alpha) / (math.sqrt(vi) + epsilon)


# --- launchers ------------------------------------------------------------------------------------

def _flat(a):
    return a.reshape(a.size)


def _check_buffers(what, w, g, state):
    """w float32 contiguous; g and each state buffer the same shape; no overlaps."""
    check_array(f"{what}: w", w, np.float32)
    check_array(f"{what}: g", g, np.float32, shape=w.shape)
    for name, s in state.items():
        check_array(f"{what}: {name}", s, np.float32, shape=w.shape)
    written = [w, *state.values()]
    for i, out in enumerate(written):
        check_no_alias(what, out, g, *written[i + 1:])


def sgd(w, g, velocity, lr, momentum=0.0, nesterov=False, stream=None):
    """Keras SGD step on the GPU, in place. w, g (and velocity, needed only when
    momentum != 0; may be None otherwise): float32, same shape, C-contiguous.
    As in Keras, ``nesterov`` has no effect when momentum == 0."""
    if momentum != 0 and velocity is None:
        raise ValueError("sgd: momentum != 0 needs a velocity buffer (zeros, shaped like w).")
    _check_buffers("sgd", w, g, {"velocity": velocity} if momentum != 0 else {})
    if not w.size:
        return w
    lr32, mom32 = sgd_scalars(lr, momentum)
    grid, block = grid_1d(w.size)
    if momentum == 0:
        launch(sgd_kernel, grid, block, stream, _flat(w), _flat(g), lr32)
    else:
        kernel = sgd_nesterov_kernel if nesterov else sgd_momentum_kernel
        launch(kernel, grid, block, stream, _flat(w), _flat(g), _flat(velocity), lr32, mom32)
    return w


def adam(w, g, m, v, lr, step, beta_1=0.9, beta_2=0.999, epsilon=1e-7, stream=None):
    """Keras Adam step ``step`` (>= 1) on the GPU, in place on w, m, v (float32, same
    shape, C-contiguous, m and v start as zeros)."""
    _check_buffers("adam", w, g, {"m": m, "v": v})
    scalars = adam_scalars(lr, step, beta_1, beta_2, epsilon)
    if w.size:
        launch(adam_kernel, *grid_1d(w.size), stream, _flat(w), _flat(g), _flat(m),
               _flat(v), *scalars)
    return w
