"""The two implementations of every op: NumPy (``CpuOps``) and CUDA (``CudaOps``).

The same interface, implemented by a simple backend and a fast one, switched in
one place (``Device.ops``), as minitorch does. Each method writes its result
into a caller-provided ``out`` array that lives on the device, so the layers
above can reuse buffers step after step.

* ``CpuOps`` calls the NumPy reference of each kernel (``kernels/*.py``,
  functions named ``<op>_ref``): the CPU backend *is* the reference math, except
  for the image layers (Conv2D, MaxPooling2D) and the ReLU backward, whose
  references are too slow to train with (whole-array temporaries per window
  position, im2col copies): those call ``kernels/cpu_loops.py``, the same math
  compiled by Numba for the CPU, checked against the references by
  tests/test_kernels_cpu_loops.py.
* ``CudaOps`` calls each kernel's launcher on the device's own stream.

When a kernel file gains a new op, it gets one method here in each class.
"""
import contextlib
import functools
import threading
import types
import weakref

import numpy as np

from kernels import (activations, allreduce, categorical_xent, conv2d, conv2d_grad, conv2d_v3, cpu_conv1, cpu_conv_pool, cpu_loops, dropout,
                     elementwise, gather, gemm, optimizers, pooling, reduction, regression_losses, softmax_xent)
from kernels.launch import SIMULATOR
from kernels import gradient_transforms, optimizers_more   # RMSprop, Adagrad; clipping, weight decay
from kernels import merge   # the merge layers' column copy (Concatenate; the blocks marked below)
# TensorFlow's ops (mirrored/ops.py; the block marked below in each class)
from kernels import broadcast, random_fill, reduce_axis, resize, strided_copy, unary_math

#: The GEMM version the library uses: on a GPU, None lets ``gemm.choose_version`` pick
#: by the output's shape (v3 for outputs that fill the GPU, v2 for small ones).
#: In the CUDA simulator every thread is a Python thread, so the register-tiled
#: v3 (256 threads per block whatever the matrix size) is the slowest there; the
#: library uses v1 (one thread per output) and the kernel tests cover every version.
GEMM_VERSION = "v1" if SIMULATOR else None      # None: gemm.choose_version by shape


def one_label_type(what, labels):
    """Every backend's loss ops take class labels of ONE dtype, ``softmax_xent.LABEL_DTYPE``
    (int64): whatever the data set holds was converted where the batch was staged
    (``keras/data_adapters.py``, ``keras/tape.py``). Checked here, the same on the CPU, the
    simulator and a real GPU, so a path that forgets the conversion fails on every backend
    alike, not only on a GPU (uint8 labels once failed on an H200 and nowhere else)."""
    if np.dtype(labels.dtype) != softmax_xent.LABEL_DTYPE:
        raise TypeError(f"{what}: labels reached the loss op as {np.dtype(labels.dtype)}, expected "
                        f"{softmax_xent.LABEL_DTYPE} (converted where the batch is staged: "
                        f"keras/data_adapters.py class_indices). This is a bug in mirrored.")


def target_loss(ops, mode, pred, targets, loss, grad, correct, scale=1.0):
    """A loss against float targets (b, classes), as ``keras/losses.py``'s ``kernel_mode``
    names it: ("categorical", label_smoothing) runs ``categorical_xent``, which also fills
    ``correct`` (argmax of the output == argmax of the target row); a regression kind ("mse",
    "bce_logits", "bce_probs") runs ``regression_loss``, and ``correct`` is zeroed (no
    accuracy for those). ``grad`` None: no gradient."""
    if isinstance(mode, tuple):
        return ops.categorical_xent(pred, targets, loss, grad, correct, scale, mode[1])
    ops.regression_loss(mode, pred, targets, loss, grad, scale)
    return ops.fill(correct, 0.0)


def uses_blas(method):
    """A ``CpuOps`` method that calls NumPy's BLAS (a GEMM; a conv's im2col product): run
    at the CPU's BLAS-thread policy (``blas_threads``, below) wherever it is called from.

    fit, evaluate, predict, ``strategy.run``, a ``@function``'s call, ``model(x)`` and
    ``tape.gradient`` open a policy block around all of their products; inside one this
    costs one check (``_OPEN_BLOCKS``). Anything else (an eager ``tf.matmul``, a layer
    called on its own) gets a block of its own per op (~10-25 us), rather than OpenBLAS's
    default of one spinning thread per core (issue 25; the first-run note in
    ``blas_threads``)."""
    @functools.wraps(method)
    def under_policy(self, *args, **kwargs):
        if _OPEN_BLOCKS:                        # fit's, a model call's ...: the count is set
            return method(self, *args, **kwargs)
        with blas_threads():
            return method(self, *args, **kwargs)
    return under_policy


class CpuOps:
    """Ops on ``np.ndarray`` buffers of a ``CpuDevice``: the NumPy references."""

    def __init__(self, device):
        self.device = device
        #: which input each im2col buffer (``_cols``, one per shape) holds the columns of,
        #: as the last conv2d_relu_pool forward left it: {the buffer's shape: x and the geometry}
        self._cols_hold = {}

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
    @uses_blas
    def gemm(self, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        if (beta == 0.0 and alpha == 1.0 and out is not None and out.ndim == 2 and out.flags.c_contiguous
                and a.dtype == b.dtype == out.dtype == np.float32):
            # = gemm_ref to float32 rounding: a large product (the lab's dense layer) in
            # fixed blocks on the free cores (kernels/cpu_loops.py matmul_split)
            return cpu_loops.matmul_split(a.T if trans_a else a, b.T if trans_b else b, out)
        return gemm.gemm_ref(a, b, out, trans_a, trans_b, alpha, beta)

    def bias_relu(self, x, bias, out):
        return activations.bias_relu_ref(x, bias, out)

    def bias_add(self, x, bias, out):
        return activations.bias_add_ref(x, bias, out)

    def relu_backward(self, dy, y, out):
        return cpu_loops.relu_backward(dy, y, out)            # = relu_backward_ref, one pass

    def softmax(self, x, out):
        return activations.softmax_ref(x, out)

    def softmax_xent(self, logits, labels, loss, grad, correct, scale=1.0):
        one_label_type("softmax_xent", labels)
        return softmax_xent.softmax_xent_ref(logits, labels, loss, grad, correct, scale)

    def prob_xent(self, probs, labels, loss, grad, correct, scale=1.0):
        one_label_type("prob_xent", labels)
        return softmax_xent.prob_xent_ref(probs, labels, loss, grad, correct, scale)

    def regression_loss(self, kind, pred, target, loss, grad, scale=1.0):
        return regression_losses.regression_loss_ref(kind, pred, target, loss, grad, scale)

    # one-hot labels (kernels/categorical_xent.py): targets (b, classes) float32
    def categorical_xent(self, logits, targets, loss, grad, correct, scale=1.0, label_smoothing=0.0):
        return categorical_xent.categorical_xent_ref(logits, targets, loss, grad, correct, scale,
                                                     label_smoothing)

    def target_loss(self, mode, pred, targets, loss, grad, correct, scale=1.0):
        return target_loss(self, mode, pred, targets, loss, grad, correct, scale)

    # images (kernels/conv2d.py, pooling.py: the references; kernels/cpu_loops.py: the same
    # math in one compiled pass each) and dropout (kernels/dropout.py), NHWC
    @uses_blas
    def conv2d(self, x, kernel, bias, out, strides, padding, relu=False):
        cols = self._cols(x, kernel, strides, padding)                # im2col's matrix, reused
        self._cols_hold.pop(cols.shape, None)
        return cpu_loops.conv2d_forward(x, kernel, bias, out, strides, padding, relu, cols)  # = conv2d_ref

    @uses_blas
    def conv2d_backward(self, x, kernel, dy, dx, dw, db, strides, padding):
        # = conv2d_backward_ref; dx is None for a first layer (nothing needs it: not computed)
        cols = self._cols(x, kernel, strides, padding)
        self._cols_hold.pop(cols.shape, None)
        return cpu_loops.conv2d_backward(x, kernel, dy, dx, dw, db, strides, padding, cols)

    def _cols(self, x, kernel, strides, padding):
        # A scratch buffer of the device (made once per shape, as CudaOps's partial sums):
        # a fresh 1.5 MB array per call would cost its page faults every step.
        shape = cpu_loops.cols_shape(x.shape, kernel.shape, strides, padding)
        return self.device.scratch("conv2d cols", shape, "float32")

    def max_pool(self, x, out, arg, pool_size, strides, padding):
        return cpu_loops.max_pool_forward(x, out, arg, pool_size, strides, padding)  # = max_pool_ref

    def max_pool_backward(self, dy, arg, dx, pool_size, strides, padding):
        return cpu_loops.max_pool_backward(dy, arg, dx, pool_size, strides, padding)

    # Conv2D(relu) then MaxPooling2D as one op each way (layers.Conv2D.fuse_next): the
    # activation is never written out; its backward takes the ReLU's mask from the pooled
    # output. = max_pool_ref(conv2d_ref(..., relu=True)) bitwise, and its backward.
    @uses_blas
    def conv2d_relu_pool(self, x, kernel, bias, out, arg, strides, padding, pool_size=2,
                         pool_strides=None, pool_padding="valid"):
        if cpu_conv1.pays(kernel.shape, dx_needed=False):
            # one input channel (the lab's first conv): SIMD across output channels, no im2col
            return cpu_conv1.forward(x, kernel, bias, out, arg, strides, padding, pool_size,
                                     pool_strides, pool_padding)
        cols = self._cols(x, kernel, strides, padding)
        z_shape = conv2d.conv2d_output_shape(x.shape, kernel.shape, strides, padding, "conv2d_relu_pool")
        z = self.device.scratch("conv2d before pooling", z_shape, "float32")   # (B, OH, OW, Cout)
        self._cols_hold.pop(cols.shape, None)
        cpu_loops.conv2d_relu_pool(x, kernel, bias, out, arg, strides, padding, pool_size,
                                   pool_strides, pool_padding, cols, z)
        self._cols_hold[cols.shape] = self._input_token(x, kernel, strides, padding)
        return out, arg

    @staticmethod
    def _input_token(x, kernel, strides, padding):
        # The im2col buffer is the device's one per shape (``_cols``); the pair's backward
        # takes it as its forward left it when no other conv of that shape has used it
        # since (the backward takes the forward's x unchanged, as dW = cols^T dz needs
        # anyway): the lab's 43,264 x 9 columns are not made twice.
        return x.ctypes.data, x.shape, x.strides, tuple(kernel.shape[:3]), str(strides), str(padding)

    @uses_blas
    def conv2d_relu_pool_backward(self, x, kernel, dy, arg, y, dz, dx, dw, db, strides, padding,
                                  pool_size=2, pool_strides=None, pool_padding="valid"):
        # conv2d_relu_pool's backward in one op: dw, db and dx (None: not computed) from the
        # pooled gradient dy. Where it pays (kernels/cpu_conv_pool.py ``pays``: windows that
        # do not overlap, kernel rows reading >= 16 contiguous inputs) only the arg-max terms
        # are added and the conv's gradient is never written; else the general path
        # (cpu_loops.conv2d_relu_pool_backward) writes it into ``dz`` (B, OH, OW, Cout). A first
        # layer with one input channel: kernels/cpu_conv1.py (dW, db; dz not written either).
        if cpu_conv1.pays(kernel.shape, dx_needed=dx is not None):
            return cpu_conv1.backward(x, kernel, dy, arg, y, dw, db, strides, padding, pool_size,
                                      pool_strides, pool_padding)
        if cpu_conv_pool.pays(kernel.shape, pool_size, pool_strides):
            return cpu_conv_pool.backward(x, kernel, dy, arg, y, dx, dw, db, strides, padding,
                                          pool_size, pool_strides, pool_padding)
        cols = self._cols(x, kernel, strides, padding)
        ready = self._cols_hold.get(cols.shape) == self._input_token(x, kernel, strides, padding)
        if dx is not None:
            self._cols_hold.pop(cols.shape, None)    # dx's product is written into it
        return cpu_loops.conv2d_relu_pool_backward(x, kernel, dy, arg, y, dz, dx, dw, db, strides, padding,
                                                   pool_size, pool_strides, pool_padding, cols, ready)

    @staticmethod
    def fuses_conv_relu_pool(kernel_shape, strides, pool_size, pool_strides, pool_padding):
        return True                     # the compiled loops take any conv and any pool

    def dropout(self, x, out, rate, key):
        out[...] = dropout.dropout_ref(x, key, rate)
        return out

    def dropout_next_key(self, counter, replica):
        return dropout.next_key_ref(counter, replica)

    def dropout_keyed(self, x, out, rate, counter):
        out[...] = dropout.dropout_ref(x, counter[dropout.KEY], rate)
        return out

    # optimizers (kernels/optimizers.py): one call per (packed) parameter buffer
    def sgd(self, w, g, velocity, hyper, nesterov=False):
        return optimizers.sgd_ref(w, g, velocity, hyper, nesterov)

    def adam(self, w, g, m, v, hyper):
        return optimizers.adam_cpu(w, g, m, v, hyper)       # = adam_ref bitwise, one compiled pass

    # more optimizers, and what Keras's base optimizer does first (kernels/optimizers_more.py,
    # kernels/gradient_transforms.py): the references
    def rmsprop(self, w, g, velocity, momentum, average, hyper):
        return optimizers_more.rmsprop_ref(w, g, velocity, momentum, average, hyper)

    def adagrad(self, w, g, accumulator, hyper):
        return optimizers_more.adagrad_ref(w, g, accumulator, hyper)

    def decay_weights(self, w, hyper, at):
        return gradient_transforms.decay_ref(w, hyper, at)

    def clip_value(self, g, hyper, at):
        return gradient_transforms.clip_value_ref(g, hyper, at)

    def clip_norm(self, g, starts, sq, hyper, at, global_norm):
        gradient_transforms.segment_sum_squares_ref(g, starts, sq)
        return gradient_transforms.clip_norm_ref(g, starts, sq, hyper, at, global_norm)

    # a batch from a data set kept on the device (kernels/gather.py)
    def gather_rows(self, src, idx, out):
        return gather.gather_rows_ref(src, idx, out)

    # --- merge layers (mirrored/keras/merging.py; kernels/merge.py) ---------------------
    # Add, Subtract, Multiply and Average use ``binary`` / ``binary_scalar`` / ``unary``;
    # Concatenate (and any plain copy of a buffer) uses this column-block copy.
    def copy_columns(self, src, dst, src_col, dst_col, width):
        return merge.copy_columns_ref(src, dst, src_col, dst_col, width)
    # --- end of the merge layers' block ---------------------------------------------------

    # --- TensorFlow's ops (mirrored/ops.py): broadcasting, math, reductions, copies, random --
    def broadcast_binary(self, op, x, y, out):
        out[...] = broadcast.broadcast_binary_ref(op, x, y)
        return out

    def where(self, cond, x, y, out):
        out[...] = broadcast.where_ref(cond, x, y)
        return out

    def unary_math(self, op, x, out, alpha=0.0):
        out[...] = unary_math.unary_math_ref(op, x, alpha)
        return out

    def reduce_axis(self, op, x3, out):
        out[...] = reduce_axis.reduce_axis_ref(op, x3)
        return out

    def arg_reduce_axis(self, op, x3, out):
        out[...] = reduce_axis.arg_reduce_axis_ref(op, x3)
        return out

    def strided_copy(self, src, dst, shape, src_offset, src_strides, dst_offset, dst_strides):
        return strided_copy.strided_copy_ref(src, dst, shape, src_offset, src_strides,
                                             dst_offset, dst_strides)

    def random_fill(self, dist, out, state):
        return random_fill.random_fill_ref(dist, out, state)

    def random_advance(self, state, n):
        return random_fill.random_advance_ref(state, n)

    def resize(self, x, out, method):
        out[...] = resize.resize_ref(x, out.shape[1], out.shape[2], method)
        return out
    # --- end of TensorFlow's ops ----------------------------------------------------------


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
        # The SUM_BLOCKS partial sums live in a scratch buffer of the device: charged to
        # it once (memory_info and memory_limit see it), never allocated per call.
        partial = self.device.scratch("sum_all partials", (reduction.SUM_BLOCKS,), x.dtype)
        return reduction.sum_all(x, out, partial, stream=self.stream)

    def sum_axis(self, x3, out):
        return reduction.sum_axis(x3, out, self.stream)

    def fill(self, out, value):
        return elementwise.fill(out, value, self.stream)

    def ring_reduce_step(self, own, peer, lo, hi):
        return allreduce.ring_reduce_step(own, peer, lo, hi, self.stream)

    def ring_gather_step(self, own, peer, lo, hi):
        return allreduce.ring_gather_step(own, peer, lo, hi, self.stream)

    def gemm(self, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        return gemm.gemm(a, b, out, trans_a, trans_b, alpha, beta, self.stream, version=GEMM_VERSION,
                         sm_count=None if GEMM_VERSION else self.device.multiprocessors)

    def bias_relu(self, x, bias, out):
        return activations.bias_relu(x, bias, out, self.stream)

    def bias_add(self, x, bias, out):
        return activations.bias_add(x, bias, out, self.stream)

    def relu_backward(self, dy, y, out):
        return activations.relu_backward(dy, y, out, self.stream)

    def softmax(self, x, out):
        return activations.softmax(x, out, self.stream)

    def softmax_xent(self, logits, labels, loss, grad, correct, scale=1.0):
        one_label_type("softmax_xent", labels)
        return softmax_xent.softmax_xent(logits, labels, loss, grad, correct, scale, self.stream)

    def prob_xent(self, probs, labels, loss, grad, correct, scale=1.0):
        one_label_type("prob_xent", labels)
        return softmax_xent.prob_xent(probs, labels, loss, grad, correct, scale, self.stream)

    #: Conv2D(relu) then MaxPooling2D as one op each way (layers.Conv2D.fuse_next) where the
    #: fused kernel holds the layer (kernels/conv2d_v3.py): a 2x2, stride-2, 'valid' pool; its
    #: arg-max is the window position a*2 + b, as int8.
    FUSED_ARG_DTYPE = conv2d_v3.FUSED_ARG_DTYPE

    @staticmethod
    def fuses_conv_relu_pool(kernel_shape, strides, pool_size, pool_strides, pool_padding):
        return conv2d_v3.fuses_with_pool(kernel_shape, strides, "relu", pool_size, pool_strides, pool_padding)

    def regression_loss(self, kind, pred, target, loss, grad, scale=1.0):
        return regression_losses.regression_loss(kind, pred, target, loss, grad, scale, self.stream)

    def categorical_xent(self, logits, targets, loss, grad, correct, scale=1.0, label_smoothing=0.0):
        return categorical_xent.categorical_xent(logits, targets, loss, grad, correct, scale,
                                                 label_smoothing, self.stream)

    def target_loss(self, mode, pred, targets, loss, grad, correct, scale=1.0):
        return target_loss(self, mode, pred, targets, loss, grad, correct, scale)

    def conv2d(self, x, kernel, bias, out, strides, padding, relu=False):
        return conv2d_v3.forward(x, kernel, bias, out, strides, padding, relu, self.stream)  # v3 (v1 past its size)

    def conv2d_relu_pool(self, x, kernel, bias, out, arg, strides, padding, pool_size=2,
                         pool_strides=None, pool_padding="valid"):
        # the pool is 2x2, stride 2, 'valid' (fuses_conv_relu_pool said so)
        return conv2d_v3.conv2d_relu_pool(x, kernel, bias, out, arg, strides, padding, self.stream)

    def conv2d_relu_pool_backward(self, x, kernel, dy, arg, y, dz, dx, dw, db, strides, padding,
                                  pool_size=2, pool_strides=None, pool_padding="valid"):
        # conv2d_relu_pool's backward as two launches: the pool's backward (v2, one thread per
        # window) with the ReLU's mask read from the pooled output y writes dz (B, OH, OW,
        # Cout), then the conv's backward reads it
        pooling.max_pool_backward(dy, arg, dz, pool_size, pool_strides, pool_padding, self.stream, relu_y=y)
        return self.conv2d_backward(x, kernel, dz, dx, dw, db, strides, padding)

    def conv2d_backward(self, x, kernel, dy, dx, dw, db, strides, padding):
        # dW/db's pass-1 partial sums: a scratch buffer of the device, as sum_all's.
        scratch = lambda shape: self.device.scratch("conv2d dW partials", shape, "float32")  # noqa: E731
        return conv2d_grad.backward(x, kernel, dy, dx, dw, db, strides, padding, scratch, self.stream)

    def max_pool(self, x, out, arg, pool_size, strides, padding):
        return pooling.max_pool(x, out, arg, pool_size, strides, padding, self.stream)

    def max_pool_backward(self, dy, arg, dx, pool_size, strides, padding):
        # v2 (one thread per window) where windows do not overlap, else v1
        return pooling.max_pool_backward(dy, arg, dx, pool_size, strides, padding, self.stream)

    def dropout(self, x, out, rate, key):
        return dropout.dropout(x, out, rate, key, self.stream)

    def dropout_next_key(self, counter, replica):
        return dropout.dropout_next_key(counter, replica, self.stream)

    def dropout_keyed(self, x, out, rate, counter):
        return dropout.dropout_keyed(x, out, rate, counter, self.stream)

    def sgd(self, w, g, velocity, hyper, nesterov=False):
        return optimizers.sgd(w, g, velocity, hyper, nesterov, self.stream)

    def adam(self, w, g, m, v, hyper):
        return optimizers.adam(w, g, m, v, hyper, self.stream)

    def rmsprop(self, w, g, velocity, momentum, average, hyper):
        return optimizers_more.rmsprop(w, g, velocity, momentum, average, hyper, self.stream)

    def adagrad(self, w, g, accumulator, hyper):
        return optimizers_more.adagrad(w, g, accumulator, hyper, self.stream)

    def decay_weights(self, w, hyper, at):
        return gradient_transforms.decay(w, hyper, at, self.stream)

    def clip_value(self, g, hyper, at):
        return gradient_transforms.clip_value(g, hyper, at, self.stream)

    def clip_norm(self, g, starts, sq, hyper, at, global_norm):
        return gradient_transforms.clip_norm(g, starts, sq, hyper, at, global_norm, self.stream)

    def gather_rows(self, src, idx, out):
        return gather.gather_rows(src, idx, out, self.stream)

    # --- merge layers (mirrored/keras/merging.py; kernels/merge.py) ---------------------
    def copy_columns(self, src, dst, src_col, dst_col, width):
        return merge.copy_columns(src, dst, src_col, dst_col, width, self.stream)
    # --- end of the merge layers' block ---------------------------------------------------

    # --- TensorFlow's ops (mirrored/ops.py): broadcasting, math, reductions, copies, random --
    def broadcast_binary(self, op, x, y, out):
        return broadcast.broadcast_binary(op, x, y, out, self.stream)

    def where(self, cond, x, y, out):
        return broadcast.where(cond, x, y, out, self.stream)

    def unary_math(self, op, x, out, alpha=0.0):
        return unary_math.unary_math(op, x, out, alpha, self.stream)

    def reduce_axis(self, op, x3, out):
        return reduce_axis.reduce_axis(op, x3, out, self.stream)

    def arg_reduce_axis(self, op, x3, out):
        return reduce_axis.arg_reduce_axis(op, x3, out, self.stream)

    def strided_copy(self, src, dst, shape, src_offset, src_strides, dst_offset, dst_strides):
        return strided_copy.strided_copy(src, dst, shape, src_offset, src_strides, dst_offset,
                                         dst_strides, self.stream)

    def random_fill(self, dist, out, state):
        return random_fill.random_fill(dist, out, state, self.stream)

    def random_advance(self, state, n):
        return random_fill.random_advance(state, n, self.stream)

    def resize(self, x, out, method):
        return resize.resize(x, out, method, self.stream)
    # --- end of TensorFlow's ops ----------------------------------------------------------


# --- the device boundary: where a trace sees each call ----------------------------------------
# A ``@function``'s trace (program/recording.py) writes down every call that crosses into a device.
# Which calls a thread makes belongs to that thread alone: a data loader, a notebook's timer
# or a second caller of the same function must never land in someone else's trace. So each
# boundary method is wrapped ONCE, when its class is made (the two ops classes here, the
# devices' methods in devices.py), and the wrapper asks the calling thread whether it
# records: ``BOUNDARY.recorder``, a ``threading.local`` slot that program/recording.py sets for the
# tracing thread and for the replica threads its ``strategy.run`` starts (mirrored_run.py
# hands the recorder on explicitly), and nobody else. Not recording: the method, one extra
# call. Recording: ``recorder.device_call(kind, ...)`` decides what to write down.

#: Ops methods that only answer a question (nothing to record).
OPS_QUERIES = ("fuses_conv_relu_pool",)


class Boundary(threading.local):
    """Per thread: ``recorder``, the ``recording.ThreadRecorder`` this thread's device calls
    go to, or None (the thread does not record)."""

    recorder = None


#: The calling thread's side of the boundary (``BOUNDARY.recorder``).
BOUNDARY = Boundary()


def at_boundary(kind, method, info=None):
    """``method`` (a function ``method(self, *args, **kwargs)``) as a boundary call of
    ``kind`` ("op", "write", "read", "made", "from_numpy", "copy_from", "ordering", "host"):
    it runs as it is unless the calling thread records, and then goes to its recorder."""
    name = method.__name__

    @functools.wraps(method)
    def boundary(self, *args, **kwargs):
        recorder = BOUNDARY.recorder
        if recorder is None:
            return method(self, *args, **kwargs)
        return recorder.device_call(kind, self, name, method, args, kwargs, info)
    boundary.boundary_kind = kind
    return boundary


def op_methods(cls):
    """The names of ``cls``'s op methods: public functions (not a constant such as a dtype,
    not a static question)."""
    return [name for name, value in vars(cls).items()
            if not name.startswith("_") and isinstance(value, types.FunctionType)
            and name not in OPS_QUERIES]


for _ops_class in (CpuOps, CudaOps):
    for _name in op_methods(_ops_class):
        setattr(_ops_class, _name, at_boundary("op", vars(_ops_class)[_name]))
del _ops_class, _name


# --- the CPU backend's BLAS, and how many threads it may use --------------------------------
# NumPy's matmul calls a BLAS (OpenBLAS in NumPy's wheels), which by default splits every
# large enough GEMM over one thread per core, and whose threads spin-wait for each other.
# For the small GEMMs of the course's models that is a bad bet: on this 2-core machine,
# with one other busy process, the lab ConvNet's step went from 12 ms to 123-137 ms (one
# of OpenBLAS's threads descheduled, the other spinning for it; issue 25). So, by
# default, fit/evaluate/predict run with ONE BLAS thread (``blas_threads``, through
# threadpoolctl, restored when they return), and so do the custom loop's calls (``model(x)``,
# ``tape.gradient``, ``strategy.run``, a ``@function``) and any other op that calls the BLAS
# (``uses_blas``); the images of a batch can be spread over
# cores by our own compiled loops instead (kernels/cpu_loops.py, MIRRORED_CPU_PARALLEL).
# No environment variable is set: a user's own OPENBLAS_NUM_THREADS / OMP_NUM_THREADS
# (read by the BLAS at start) is respected, and MIRRORED_BLAS_THREADS chooses the count.

#: The variable choosing the policy: unset or "auto" (1 thread during fit/evaluate/
#: predict, unless a BLAS variable below is set), a number N (N threads), or "keep"
#: (leave the BLAS as it is).
BLAS_POLICY_VAR = "MIRRORED_BLAS_THREADS"
#: Variables by which a user sets the BLAS's thread count themselves ("auto" then keeps it).
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: "auto"'s count: one thread per replica, the replicas being driven one after another
#: by one host thread (keras/step.py), so one product at a time.
AUTO_BLAS_THREADS = 1

try:
    import threadpoolctl
except ImportError:                 # a requirement (requirements.txt); the ctypes route below remains
    threadpoolctl = None

#: Names of OpenBLAS's thread-count getter and setter: the plain build, and the
#: symbol-prefixed 64-bit-integer builds that NumPy's and SciPy's wheels bundle.
_OPENBLAS_GET = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
                 "openblas_get_num_threads64_")
_OPENBLAS_SET = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                 "openblas_set_num_threads64_")


def _openblas():
    """``(path, getter, setter)`` of the OpenBLAS this process has loaded, or a string
    saying why there is none (the route where threadpoolctl is not installed)."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:        # the libraries this process has loaded
            paths = sorted({line.split()[-1] for line in maps
                            if "openblas" in line.rsplit("/", 1)[-1].lower()})
    except OSError:
        return "cannot list loaded libraries (no /proc/self/maps)"
    for path in paths:
        try:
            lib = ctypes.CDLL(path)                  # already loaded: this only looks it up
        except OSError:
            continue
        get = next((getattr(lib, n) for n in _OPENBLAS_GET if hasattr(lib, n)), None)
        put = next((getattr(lib, n) for n in _OPENBLAS_SET if hasattr(lib, n)), None)
        if get is not None:
            get.restype = ctypes.c_int
            return path, get, put
    return "NumPy's BLAS is not OpenBLAS (or not found)"


_CONTROLLERS = []


def _blas_controllers():
    """threadpoolctl's controllers of the BLAS libraries this process has loaded, found
    once (a ThreadpoolController scans every loaded library: ~50 ms on a busy machine,
    far too slow to make at every fit/predict call; setting a count is ~0.1 ms)."""
    if not _CONTROLLERS:
        found = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
        _CONTROLLERS.append(list(found))
    return _CONTROLLERS[0]


def blas_info():
    """What the CPU backend's BLAS is: ``{"library", "threads", "note", "kernel", "version"}`` (for the
    benchmarks and ``python -m mirrored info``). ``kernel``: the CPU kernels the BLAS
    picked (OpenBLAS's core name, e.g. SkylakeX or Haswell: the same GEMM is 3x slower on
    a machine where OPENBLAS_CORETYPE forces Haswell's), None where unknown."""
    if threadpoolctl is not None:
        blas = [c.info() for c in _blas_controllers()]
        if not blas:
            return {"library": None, "threads": None, "note": "no BLAS found by threadpoolctl",
                    "kernel": None, "version": None}
        first = blas[0]
        api = first["internal_api"]
        return {"library": first["filepath"], "threads": int(first["num_threads"]),
                "note": {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS"}.get(api, api),
                "kernel": first.get("architecture"), "version": first.get("version")}
    found = _openblas()
    if isinstance(found, str):
        return {"library": None, "threads": None, "note": found, "kernel": None, "version": None}
    path, get, _ = found
    return {"library": path, "threads": int(get()), "note": "OpenBLAS", "kernel": None, "version": None}


def set_blas_threads(n):
    """Let the BLAS use ``n`` threads from now on; returns the count it had, or None
    where NumPy's BLAS cannot be reached (then nothing changes).

    Used by ``MultiWorkerMirroredStrategy`` when several workers share one machine's
    cores: each worker's OpenBLAS would otherwise start one thread per core, and the
    workers' threads, spinning for each other, made 2 workers on 2 cores 7x slower per
    step than 1 (benchmarks.multiworker, README "Beyond one machine"); and by
    ``blas_threads`` around fit/evaluate/predict."""
    if threadpoolctl is not None:
        controllers = _blas_controllers()
        if not controllers:
            return None
        before = int(controllers[0].get_num_threads())
        for c in controllers:
            c.set_num_threads(int(n))
        return before
    import ctypes
    found = _openblas()
    if isinstance(found, str) or found[2] is None:
        return None
    _, get, put = found
    before = int(get())
    put.argtypes = [ctypes.c_int]
    put(int(n))
    return before


def blas_policy(environ=None):
    """``(threads, why)``: the BLAS thread count fit/evaluate/predict will use (None: the
    BLAS is left as it is) and a sentence saying why, from MIRRORED_BLAS_THREADS and the
    BLAS's own variables. A bad MIRRORED_BLAS_THREADS raises ValueError saying what is
    accepted."""
    import os
    environ = os.environ if environ is None else environ
    raw = environ.get(BLAS_POLICY_VAR, "").strip().lower()
    if raw in ("", "auto"):
        mine = [v for v in BLAS_THREAD_VARS if environ.get(v)]
        if mine:
            return None, (f"left as {mine[0]}={environ[mine[0]]} sets it (yours; "
                          f"{BLAS_POLICY_VAR}=N overrides)")
        return AUTO_BLAS_THREADS, (f"{AUTO_BLAS_THREADS} thread while fit/evaluate/predict run "
                                   f"(auto: small GEMMs; a busy core cannot stall it; "
                                   f"{BLAS_POLICY_VAR}=N or =keep to change)")
    if raw == "keep":
        return None, f"left as the BLAS set it ({BLAS_POLICY_VAR}=keep)"
    if raw.isdigit() and int(raw) >= 1:
        return int(raw), f"{int(raw)} thread(s) while fit/evaluate/predict run ({BLAS_POLICY_VAR}={raw})"
    raise ValueError(f"{BLAS_POLICY_VAR}={environ.get(BLAS_POLICY_VAR)!r}: expected 'auto', "
                     f"'keep' or a whole number of threads >= 1; unset it for the default (auto).")


_POLICY_LOCK = threading.Lock()
#: The policy blocks of ``blas_threads`` open now, in any thread. A set of weak references,
#: not a count: a Ctrl-C that lands inside ``__enter__`` or ``__exit__`` skips the rest of
#: it, and a count would then stay up for good (every later fit "nested", its policy never
#: applied); a skipped block leaves this set when the block object goes, with its frame.
_OPEN_BLOCKS = weakref.WeakSet()


class blas_threads:
    """Context manager: the BLAS at ``blas_policy()``'s thread count inside, as it was after.

    ``with backends.blas_threads(): model.fit(...)`` is what fit, evaluate and predict do
    (keras/trainer.py), and the custom loop's steps (``strategy.run``, a ``@function``'s
    call), and, called eagerly outside those, ``model(x)`` and ``tape.gradient`` (through
    ``call_block``) and each op that calls the BLAS (``uses_blas``). Only the process's
    BLAS is touched (threadpoolctl), never the environment.

    Why the eager calls too: keras.io's "Writing a training loop from scratch" calls
    ``model(x)`` under a tape, ``tape.gradient`` and ``optimizer.apply`` eagerly, outside
    ``strategy.run``; before they were covered, its GEMMs (32 x 784 x 64, large enough for
    OpenBLAS to split) ran on OpenBLAS's two spinning threads. On this 2-core machine with
    one other busy process, an epoch of its 1,563 steps took 4-62 s (median step up to 48 ms),
    now 0.8-2.8 s (0.5 ms); which of two identical loops was slow followed the scheduler, not
    which came first (36.8 s then 2.8 s in one process; 6.3 then 11.3 s in another), and
    Numba's first-use compiling is 0.1-1 s of it. The two blocks cost ~45 us of the step's
    ~480 (measured with the BLAS at one thread throughout). ``optimizer.apply_gradients``
    calls no BLAS (the updates are compiled loops): it opens no block.

    Nested policy blocks (fit's validation pass; ``strategy.run`` inside a ``@function``
    or inside a loop the user wrapped in one block) keep the outer count and cost
    nothing: no variable read, no call into the BLAS (``_OPEN_BLOCKS`` holds the open
    ones). An explicit count (``blas_threads(4)``) always sets it, and restores."""

    def __init__(self, threads="policy"):
        self.policy = threads == "policy"
        self.threads = None if self.policy else threads
        self.before = None
        self.inner = False

    def __enter__(self):
        if self.policy:
            with _POLICY_LOCK:
                self.inner = len(_OPEN_BLOCKS) > 0
                _OPEN_BLOCKS.add(self)
            if self.inner:
                return self                     # the outer block's count is in force
            try:
                self.threads = blas_policy()[0]
            except BaseException:
                self._close()
                raise
        if self.threads is not None:
            self.before = set_blas_threads(self.threads)
        return self

    def __exit__(self, *exc):
        if self.policy:
            self._close()
            if self.inner:
                return False
        if self.before is not None and self.before != self.threads:
            set_blas_threads(self.before)
        return False

    def _close(self):
        with _POLICY_LOCK:
            _OPEN_BLOCKS.discard(self)


_NO_BLOCK = contextlib.nullcontext()


def call_block():
    """The policy block for an entry point called once per step, from anywhere (``model(x)``,
    ``tape.gradient``): a new ``blas_threads()`` where no block is open (an eager custom loop:
    one set and one restore around all of the call's products), else nothing at all (inside
    fit, ``strategy.run`` or a ``@function``, whose block set the count: not even the
    nested block's lock)."""
    return _NO_BLOCK if _OPEN_BLOCKS else blas_threads()
