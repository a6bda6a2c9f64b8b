"""The two implementations of every op: NumPy (``CpuOps``) and CUDA (``CudaOps``).

The same interface, implemented by a simple backend and a fast one, switched in
one place (``Device.ops``), as minitorch does. Each method writes its result
into a caller-provided ``out`` array that lives on the device, so the layers
above can reuse buffers step after step.

* ``CpuOps`` calls the NumPy reference of each kernel (``kernels/*.py``,
  functions named ``<op>_ref``): the CPU backend *is* the reference math.
* ``CudaOps`` calls each kernel's launcher on the device's own stream.

When a kernel file gains a new op, it gets one method here in each class.
"""
import numpy as np

from kernels import allreduce, elementwise, reduction


class CpuOps:
    """Ops on ``np.ndarray`` buffers of a ``CpuDevice``: the NumPy references."""

    def __init__(self, device):
        self.device = device

    # elementwise (kernels/elementwise.py)
    def binary(self, op, x, y, out):
        out[...] = elementwise.binary_ref(op, x, y)
        return out

    def binary_scalar(self, op, x, s, out):
        out[...] = elementwise.binary_scalar_ref(op, x, s)
        return out

    def unary(self, op, x, out):
        out[...] = elementwise.unary_ref(op, x)
        return out

    def cast(self, x, out):
        out[...] = elementwise.cast_ref(x, out.dtype)
        return out

    # reductions (kernels/reduction.py)
    def sum_all(self, x, out):
        out.reshape(1)[...] = reduction.sum_all_ref(x)
        return out

    def sum_axis(self, x3, out):
        out[...] = reduction.sum_axis_ref(x3)
        return out

    def fill(self, out, value):
        return elementwise.fill_ref(out, value)

    # ring all-reduce steps (kernels/allreduce.py), in place on own[lo:hi]
    def ring_reduce_step(self, own, peer, lo, hi):
        return allreduce.ring_reduce_step_ref(own, peer, lo, hi)

    def ring_gather_step(self, own, peer, lo, hi):
        return allreduce.ring_gather_step_ref(own, peer, lo, hi)


class CudaOps:
    """Ops on Numba device arrays of a ``CudaDevice``: our kernels, on its stream."""

    def __init__(self, device):
        self.device = device
        self.stream = device.stream

    def binary(self, op, x, y, out):
        return elementwise.binary(op, x, y, out, self.stream)

    def binary_scalar(self, op, x, s, out):
        return elementwise.binary_scalar(op, x, s, out, self.stream)

    def unary(self, op, x, out):
        return elementwise.unary(op, x, out, self.stream)

    def cast(self, x, out):
        return elementwise.cast(x, out, self.stream)

    def sum_all(self, x, out):
        return reduction.sum_all(x, out, stream=self.stream)

    def sum_axis(self, x3, out):
        return reduction.sum_axis(x3, out, self.stream)

    def fill(self, out, value):
        return elementwise.fill(out, value, self.stream)

    def ring_reduce_step(self, own, peer, lo, hi):
        return allreduce.ring_reduce_step(own, peer, lo, hi, self.stream)

    def ring_gather_step(self, own, peer, lo, hi):
        return allreduce.ring_gather_step(own, peer, lo, hi, self.stream)
