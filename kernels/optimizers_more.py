"""Optimizer updates beyond SGD and Adam: RMSprop and Adagrad, exactly as Keras 3.

(AdamW is Adam's kernel after a weight-decay launch: ``kernels/gradient_transforms.py``.)

Versions: v1 only, as ``kernels/optimizers.py``: one launch per (packed) parameter
buffer, one thread per element with a grid-stride loop, every value read once and
written once. Memory-bound: RMSprop moves 5 floats per element (read w, g, velocity;
write w, velocity), 7 with momentum, 9 centered with momentum; Adagrad 5.

Keras's formulas (``keras/src/optimizers/rmsprop.py`` and ``adagrad.py``)::

    RMSprop:  velocity = rho * velocity + (1 - rho) * g**2
              centered: average = rho * average + (1 - rho) * g
                        denominator = velocity - average**2 + epsilon
              else:     denominator = velocity + epsilon        (epsilon INSIDE the sqrt)
              increment = lr * g / sqrt(denominator)
              momentum > 0: m = momentum * m + increment;  w -= m
              else:         w -= increment
    Adagrad:  accumulator += g**2          (it starts at initial_accumulator_value, 0.1)
              w -= lr * g / sqrt(accumulator + epsilon)

As in ``kernels/optimizers.py``, the scalars are a small float32 vector in DEVICE memory
(``rmsprop_scalars``, ``adagrad_scalars``; computed on the host in float64 and rounded
once), so a captured CUDA graph updates with each step's learning rate (a schedule's).
The NumPy references read the same vector and do float32 math in the same order.

All updates are in place on ``w`` and the slots; ``g`` is only read. None may overlap.
"""
import math

import numpy as np
from numba import cuda

from kernels.launch import flat, grid_1d, launch
from kernels.optimizers import check_buffers   # the argument checks every optimizer launcher makes
from kernels.registry import register, sig, vec

#: Where each scalar sits in the vectors (the kernels index them by these names).
RMS_LR, RMS_RHO, RMS_ONE_MINUS_RHO, RMS_MOMENTUM, RMS_EPSILON = 0, 1, 2, 3, 4
RMSPROP_HYPER_SIZE = 5
ADAGRAD_LR, ADAGRAD_EPSILON = 0, 1
ADAGRAD_HYPER_SIZE = 2


def rmsprop_scalars(lr, rho=0.9, momentum=0.0, epsilon=1e-7, dtype=np.float32):
    """[lr, rho, 1 - rho, momentum, epsilon]: (5,) ``dtype`` (1 - rho in float64, rounded once)."""
    return np.array([lr, rho, 1.0 - rho, momentum, epsilon], dtype)


def adagrad_scalars(lr, epsilon=1e-7, dtype=np.float32):
    """[lr, epsilon]: (2,) ``dtype``."""
    return np.array([lr, epsilon], dtype)


# --- NumPy references (in place) ---------------------------------------------------------------

def rmsprop_ref(w, g, velocity, momentum, average, hyper):
    """Keras RMSprop step, in place on ``w`` and the slots. ``momentum`` None: Keras's
    momentum == 0 (no slot); ``average`` None: not centered. ``hyper``: ``rmsprop_scalars``."""
    lr, rho, one_minus_rho = hyper[RMS_LR], hyper[RMS_RHO], hyper[RMS_ONE_MINUS_RHO]
    mom, eps = hyper[RMS_MOMENTUM], hyper[RMS_EPSILON]
    velocity[...] = velocity * rho + (g * g) * one_minus_rho
    if average is not None:
        average[...] = average * rho + g * one_minus_rho
        denominator = (velocity - average * average) + eps
    else:
        denominator = velocity + eps
    increment = (g * lr) / np.sqrt(denominator)
    if momentum is not None:
        momentum[...] = momentum * mom + increment
        w -= momentum
    else:
        w -= increment
    return w


def adagrad_ref(w, g, accumulator, hyper):
    """Keras Adagrad step, in place on ``w`` and ``accumulator``. ``hyper``: ``adagrad_scalars``."""
    lr, eps = hyper[ADAGRAD_LR], hyper[ADAGRAD_EPSILON]
    accumulator += g * g
    w -= (g * lr) / np.sqrt(accumulator + eps)
    return w


# --- kernels ----------------------------------------------------------------------------------------

@cuda.jit
def rmsprop_kernel(w, g, velocity, momentum, average, hyper, has_momentum, centered):
    """One thread per element i (grid-stride), all arrays 1-D of one size. ``has_momentum``
    and ``centered`` (0 or 1, the same for every thread: no divergence) say whether the
    ``momentum`` and ``average`` slots exist; when not, the launcher passes ``velocity``
    in their place and they are neither read nor written.
    Loop nest: for i in range(size): the module docstring's RMSprop lines for element i."""
    lr = hyper[RMS_LR]
    rho = hyper[RMS_RHO]
    one_minus_rho = hyper[RMS_ONE_MINUS_RHO]
    mom = hyper[RMS_MOMENTUM]
    eps = hyper[RMS_EPSILON]
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        gi = g[i]
        vi = velocity[i] * rho + (gi * gi) * one_minus_rho
        velocity[i] = vi
        if centered:
            ai = average[i] * rho + gi * one_minus_rho
            average[i] = ai
            denominator = (vi - ai * ai) + eps
        else:
            denominator = vi + eps
        increment = (gi * lr) / math.sqrt(denominator)
        if has_momentum:
            mi = momentum[i] * mom + increment
            momentum[i] = mi
            w[i] -= mi
        else:
            w[i] -= increment


@cuda.jit
def adagrad_kernel(w, g, accumulator, hyper):
    """One thread per element i (grid-stride). Loop nest: for i in range(size):
    acc[i] += g[i]**2; w[i] -= lr * g[i] / sqrt(acc[i] + eps)."""
    lr = hyper[ADAGRAD_LR]
    eps = hyper[ADAGRAD_EPSILON]
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        gi = g[i]
        ai = accumulator[i] + gi * gi
        accumulator[i] = ai
        w[i] -= (gi * lr) / math.sqrt(ai + eps)


_F32 = vec("float32")
register(rmsprop_kernel, "rmsprop_kernel", sig(_F32, _F32, _F32, _F32, _F32, _F32, "int32", "int32"),
         block=grid_1d(1)[1])
register(adagrad_kernel, "adagrad_kernel", sig(_F32, _F32, _F32, _F32), block=grid_1d(1)[1])


# --- launchers ------------------------------------------------------------------------------------

def rmsprop(w, g, velocity, momentum, average, hyper, stream=None):
    """Keras RMSprop step on the GPU, in place. ``momentum`` / ``average``: None when
    Keras has no such slot (momentum == 0 / not centered). ``hyper``: (5,) float32 on the device."""
    slots = {k: s for k, s in (("velocity", velocity), ("momentum", momentum), ("average", average))
             if s is not None}
    check_buffers("rmsprop", w, g, slots, hyper, RMSPROP_HYPER_SIZE)
    if w.size:
        launch(rmsprop_kernel, *grid_1d(w.size), stream, flat(w), flat(g), flat(velocity),
               flat(velocity if momentum is None else momentum), flat(velocity if average is None else average),
               hyper, np.int32(momentum is not None), np.int32(average is not None))
    return w


def adagrad(w, g, accumulator, hyper, stream=None):
    """Keras Adagrad step on the GPU, in place. ``hyper``: (2,) float32 on the device."""
    check_buffers("adagrad", w, g, {"accumulator": accumulator}, hyper, ADAGRAD_HYPER_SIZE)
    if w.size:
        launch(adagrad_kernel, *grid_1d(w.size), stream, flat(w), flat(g), flat(accumulator), hyper)
    return w
