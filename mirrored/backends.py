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
import contextlib
import threading

import numpy as np

from kernels import activations, allreduce, elementwise, gather, gemm, optimizers, reduction, softmax_xent

from kernels.launch import SIMULATOR

#: The GEMM version the library uses: the fastest (gemm.DEFAULT_VERSION) on a GPU.
#: In the CUDA simulator every thread is a Python thread, so the register-tiled
#: v3 (256 threads per block whatever the matrix size) is the slowest there; the
#: library uses v1 (one thread per output) and the kernel tests cover every version.
GEMM_VERSION = "v1" if SIMULATOR else gemm.DEFAULT_VERSION


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

    # the dense layer stack (kernels/gemm.py, activations.py, softmax_xent.py)
    def gemm(self, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        return gemm.gemm_ref(a, b, out, trans_a, trans_b, alpha, beta)

    def bias_relu(self, x, bias, out):
        return activations.bias_relu_ref(x, bias, out)

    def bias_add(self, x, bias, out):
        return activations.bias_add_ref(x, bias, out)

    def relu_backward(self, dy, y, out):
        return activations.relu_backward_ref(dy, y, out)

    def softmax(self, x, out):
        return activations.softmax_ref(x, out)

    def softmax_xent(self, logits, labels, loss, grad, correct, scale=1.0):
        return softmax_xent.softmax_xent_ref(logits, labels, loss, grad, correct, scale)

    def prob_xent(self, probs, labels, loss, grad, correct, scale=1.0):
        return softmax_xent.prob_xent_ref(probs, labels, loss, grad, correct, scale)

    # optimizers (kernels/optimizers.py): one call per (packed) parameter buffer
    def sgd(self, w, g, velocity, lr, momentum=0.0, nesterov=False):
        return optimizers.sgd_ref(w, g, velocity, lr, momentum, nesterov)

    def adam(self, w, g, m, v, lr, step, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        return optimizers.adam_ref(w, g, m, v, lr, step, beta_1, beta_2, epsilon)

    # a batch from a data set kept on the device (kernels/gather.py)
    def gather_rows(self, src, idx, out):
        return gather.gather_rows_ref(src, idx, out)


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

    def gemm(self, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        return gemm.gemm(a, b, out, trans_a, trans_b, alpha, beta, self.stream, version=GEMM_VERSION)

    def bias_relu(self, x, bias, out):
        return activations.bias_relu(x, bias, out, self.stream)

    def bias_add(self, x, bias, out):
        return activations.bias_add(x, bias, out, self.stream)

    def relu_backward(self, dy, y, out):
        return activations.relu_backward(dy, y, out, self.stream)

    def softmax(self, x, out):
        return activations.softmax(x, out, self.stream)

    def softmax_xent(self, logits, labels, loss, grad, correct, scale=1.0):
        return softmax_xent.softmax_xent(logits, labels, loss, grad, correct, scale, self.stream)

    def prob_xent(self, probs, labels, loss, grad, correct, scale=1.0):
        return softmax_xent.prob_xent(probs, labels, loss, grad, correct, scale, self.stream)

    def sgd(self, w, g, velocity, lr, momentum=0.0, nesterov=False):
        return optimizers.sgd(w, g, velocity, lr, momentum, nesterov, self.stream)

    def adam(self, w, g, m, v, lr, step, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        return optimizers.adam(w, g, m, v, lr, step, beta_1, beta_2, epsilon, self.stream)

    def gather_rows(self, src, idx, out):
        return gather.gather_rows(src, idx, out, self.stream)


# --- BLAS threads under the CPU backend ---------------------------------------------------
# NumPy's matmul calls OpenBLAS, which splits every large enough GEMM over one thread per
# core. N replicas on N logical CPU devices run in N threads that call matmul at the same
# time, so they ask for N x cores BLAS threads on `cores` cores: the threads oversubscribe
# the machine and take turns at OpenBLAS's shared thread pool. While N replicas train we
# therefore give BLAS cores // N threads (at least 1), so each replica thread keeps about
# its share of the cores.
#
# OpenBLAS's thread count is ONE process-wide setting (even its
# ``openblas_set_num_threads_local``: in the pthreads builds NumPy ships it sets the
# global), and environment variables such as OPENBLAS_NUM_THREADS are read only when the
# library loads. So we change the setting around a multi-replica fit() through ctypes,
# with no new dependency, and put it back after. With another BLAS (Accelerate, MKL) or
# on a system without /proc/self/maps, ``blas_info()`` says so and nothing is changed.

#: Names of OpenBLAS's get/set functions: the plain build, and the symbol-prefixed
#: 64-bit-integer builds that NumPy's and SciPy's wheels bundle.
_OPENBLAS_GET = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
                 "openblas_get_num_threads64_")
_OPENBLAS_SET = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                 "openblas_set_num_threads64_")

_blas = None                      # (path, get, set) or (None, reason) once looked up
_blas_lock = threading.RLock()    # one fit at a time changes the setting (re-entered by evaluate)


def _find_openblas():
    """(library path, get_threads, set_threads) of the OpenBLAS NumPy loaded, or (None, why)."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:        # the libraries this process has loaded
            paths = sorted({line.split()[-1] for line in maps
                            if "openblas" in line.rsplit("/", 1)[-1].lower()})
    except OSError:
        return None, "cannot list loaded libraries (no /proc/self/maps): BLAS threads left as they are"
    for path in paths:
        try:
            lib = ctypes.CDLL(path)                  # already loaded: this only looks it up
        except OSError:
            continue
        get = next((getattr(lib, n) for n in _OPENBLAS_GET if hasattr(lib, n)), None)
        put = next((getattr(lib, n) for n in _OPENBLAS_SET if hasattr(lib, n)), None)
        if get is not None and put is not None:
            get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
            return path, get, put
    return None, "NumPy's BLAS is not OpenBLAS (or not found): BLAS threads left as they are"


def _openblas():
    global _blas
    if _blas is None:
        _blas = _find_openblas()
    return _blas


def blas_info():
    """What the CPU backend's BLAS is: ``{"library", "threads", "note"}`` (for benchmarks)."""
    found = _openblas()
    if found[0] is None:
        return {"library": None, "threads": None, "note": found[1]}
    path, get, _ = found
    return {"library": path, "threads": int(get()), "note": "OpenBLAS, thread count settable"}


@contextlib.contextmanager
def blas_threads_for_replicas(num_replicas):
    """Inside the block, BLAS uses ``max(1, threads // num_replicas)`` threads.

    ``threads`` is the setting found on entry (OpenBLAS's default: one per core).
    A no-op for one replica or when the BLAS cannot be controlled (see ``blas_info``).
    """
    found = _openblas() if num_replicas > 1 else (None,)
    if found[0] is None:
        yield
        return
    _, get, put = found
    with _blas_lock:
        before = int(get())
        put(max(1, before // num_replicas))
        try:
            yield
        finally:
            put(before)
