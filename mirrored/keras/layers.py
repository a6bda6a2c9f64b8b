"""The course lab's layers, each owning its forward and backward: ``Flatten``, ``Dense``,
``Conv2D``, ``MaxPooling2D`` (and, from their own files, ``Dropout`` and ``Input``).

The layer protocol. A layer is built once (``build(input_shape)``: its weights
become ``mirrored.Variable``s, ``MirroredVariable``s inside a strategy's scope).
On each replica's device it then gets a ``LayerState`` (``keras/engine.py``): its
weights and their gradients as views into that replica's packed buffers, and the
buffers it asked for, made once per batch size. Three methods are all the step
ever calls::

    make_buffers(state, b)        what it keeps per batch size on that device
    forward(state, x, training)   x: (b,) + input shape -> y: (b,) + output shape   (kernel launches)
    backward(state, dy)           dy: gradient w.r.t. y -> the weights' gradients into
                                  state.grads; returns dx, or None when no earlier
                                  layer needs it (state.need_dx)

``training`` is True in ``fit``'s step and False in ``evaluate``/``predict`` (what a
dropout layer needs). The model's input reaches the first layer as (b, features):
each example flattened in row-major order, as the host copies it in, so a layer
that wants the example's axes back takes a reshaped view of it (free).

A replica's program (``engine.ReplicaProgram``) is then the layers in order,
forward, then the loss, then the layers in reverse, backward: adding a layer
means writing one class, not editing the step.

Neighbours: ``engine.py`` (LayerState, ReplicaProgram), ``base_layer.py`` (``Layer``:
name, shapes, the protocol's defaults; ``Input``; the Keras layers not written here),
``dropout.py`` (Dropout), ``initializers.py`` (Glorot-uniform kernels, zero biases, as
Keras), ``models.py`` (Sequential builds the layers), ``kernels/`` (what ``state.ops`` launches).
"""
from types import SimpleNamespace

import numpy as np

from kernels import conv2d as conv2d_kernels, pooling   # shape rules (the math runs in state.ops)
from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored.keras import initializers, regularizers
from mirrored.keras.base_layer import (  # noqa: F401 (tf.keras.layers' names, defined there)
    SUPPORTED, Conv1D, Input, InputLayer, Layer, LSTM,
    IntegerLookup, StringLookup, channels_last, image_shape, padding_arg, snake_case)
from mirrored.keras.composed_layers import unfused_activation
from mirrored.keras.dropout import Dropout  # noqa: F401 (tf.keras.layers.Dropout, defined there)
from mirrored.values import Variable

FUSED = ("relu", "softmax")      # Dense's activations in its own kernels (composed_layers.unfused_activation)
FLOAT = np.dtype(np.float32)


class Flatten(Layer):
    """(b, d1, d2, ...) -> (b, d1*d2*...): a free reshape (a view), no weights, no launch."""

    def output_shape_for(self, input_shape):
        return (int(np.prod(input_shape, dtype=np.int64)),)

    def get_config(self):
        return dict(self.base_config(), data_format="channels_last")

    def forward(self, state, x, training=False):
        # NHWC is C-contiguous, so (b, H, W, C) -> (b, H*W*C) keeps Keras's (h, w, c) order
        # of the features: a following Dense kernel has exactly Keras's rows.
        return view(x, (x.shape[0], self.output_shape[0]))                    # (b, features)

    def backward(self, state, dy):
        if not state.need_dx:
            return None
        return view(dy, (dy.shape[0],) + self.input_shape)                     # (b,) + input shape


class Dense(Layer):
    """``y = activation(x @ kernel + bias)``; kernel (in, units), bias (units,).

    Forward is one GEMM and one fused bias(+ReLU) launch; backward, for
    dz = dy * relu'(y) (in place, in dy's buffer)::

        d kernel = x^T @ dz      gemm(trans_a)    (in, units)
        d bias   = sum_rows(dz)  sum_axis         (units,)
        dx       = dz @ kernel^T gemm(trans_b)    (b, in), only if an earlier layer needs it

    A final ``'softmax'`` is not applied here: the fused softmax cross-entropy
    takes the logits (as Keras does), and ``predict`` applies it
    (``ReplicaProgram.forward(probabilities=True)``).
    """

    def __init__(self, units, activation=None, use_bias=True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, input_shape=None, name=None, **kwargs):
        super().__init__(input_shape=input_shape, name=name, **kwargs)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        if not isinstance(units, (int, np.integer)) or units < 1:
            raise ValueError(f"Dense: units must be a positive integer, got {units!r}.")
        if not use_bias:
            raise NotImplementedError("Dense(use_bias=False) is not implemented: every layer has a bias here.")
        self.units = int(units)
        self.activation, self.activation_layer = unfused_activation(activation, FUSED, self)   # 'tanh'...
        self.kernel_initializer = initializers.get(kernel_initializer, "Dense kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, "Dense bias_initializer")
        self.kernel = self.bias = None
        self.input_dim = None

    def output_shape_for(self, input_shape):
        if len(input_shape) != 1:
            raise ValueError(f"Dense {self.name!r} expects flat inputs (batch, features), got "
                             f"examples of shape {input_shape}; put a layers.Flatten() before it.")
        return (self.units,)

    def get_config(self):
        return dict(self.base_config(), units=self.units, activation=self.activation or "linear", use_bias=True,
                    **_weights_config(self))

    def build(self, input_shape):
        super().build(input_shape)
        (self.input_dim,) = input_shape
        shape = (self.input_dim, self.units)
        self.kernel = Variable(self.kernel_initializer(shape), name=f"{self.name}/kernel")
        self.bias = Variable(self.bias_initializer((self.units,)), name=f"{self.name}/bias")

    @property
    def weights(self):
        return [self.kernel, self.bias] if self.built else []

    def make_buffers(self, state, b):
        dev = state.dev
        return SimpleNamespace(y=dev.empty((b, self.units), FLOAT),                                # (b, units)
                               dx=dev.empty((b, self.input_dim), FLOAT) if state.need_dx else None,  # (b, in)
                               x=None)                  # the last forward's input (b, in), not owned

    def forward(self, state, x, training=False):
        kernel, bias = state.weights                       # (in, units), (units,)
        buf = state.buffers(x.shape[0])
        buf.x = x                                          # kept for d kernel = x^T dz
        state.ops.gemm(x, kernel, buf.y)                   # z = x @ kernel: (b, units)
        if self.activation == "relu":
            state.ops.bias_relu(buf.y, bias, buf.y)        # y = relu(z + bias)
        else:
            state.ops.bias_add(buf.y, bias, buf.y)         # y = z + bias (logits before a softmax)
        return buf.y

    def backward(self, state, dy):
        kernel, _ = state.weights
        dkernel, dbias = state.grads                       # views into the packed gradients
        b = dy.shape[0]
        buf = state.buffers(b)
        if self.activation == "relu":
            state.ops.relu_backward(dy, buf.y, dy)         # dz = dy * (y > 0), in place: (b, units)
        state.ops.gemm(buf.x, dy, dkernel, trans_a=True)   # d kernel = x^T dz: (in, units)
        state.ops.sum_axis(view(dy, (1, b, self.units)), view(dbias, (1, self.units)))   # d bias: (units,)
        if not state.need_dx:
            return None
        state.ops.gemm(dy, kernel, buf.dx, trans_b=True)   # dx = dz kernel^T: (b, in)
        return buf.dx


def _weights_config(layer):
    """The config keys Dense and Conv2D share, last in Keras's order: the kernel's and the
    bias's initialisers, the kernel's regularizer."""
    return dict(kernel_initializer=initializers.config(layer.kernel_initializer),
                bias_initializer=initializers.config(layer.bias_initializer),
                kernel_regularizer=regularizers.serialize(layer.kernel_regularizer))


# --- images: Conv2D and MaxPooling2D (NHWC, Keras's layouts; their arguments' checks: base_layer.py) ---
class Conv2D(Layer):
    """2-D convolution (cross-correlation) as Keras's: NHWC in and out, kernel (KH, KW, Cin, Cout)
    (HWIO), bias (Cout,); ``activation`` None or 'relu' (fused into the forward kernel).

    Forward: one ``ops.conv2d`` launch, ``y = relu(conv(x, kernel) + bias)``. Backward, for
    dz = dy * relu'(y) (in place, in dy's buffer), one ``ops.conv2d_backward``::

        d kernel[kh, kw, ci, co] = sum over n, oh, ow of x[n, oh*sh+kh-pt, ow*sw+kw-pl, ci] * dz[n, oh, ow, co]
        d bias[co]               = sum over n, oh, ow of dz[n, oh, ow, co]
        dx                       = each window's dz @ kernel^T added back onto its pixels
                                   (only if an earlier layer needs it)

    The math is kernels/conv2d.py's: ``conv2d_ref`` (im2col + one matmul) on the CPU, the
    launchers on a GPU. As the first layer it gets the model's input as (b, H*W*Cin) and
    views it as (b, H, W, Cin) (free: the host copied each image in row-major order).

    Fused with a following MaxPooling2D where the device's ops fuse the pair (``fuse_next``,
    the loop in keras/engine.py's ``ReplicaProgram``): the forward is one
    ``ops.conv2d_relu_pool`` into the pool's buffers (the conv output is never written), the
    backward one ``ops.conv2d_relu_pool_backward`` from the pooled gradient (a GPU: the pool's
    backward with the ReLU mask writes dz, then the conv's backward; the CPU: where it pays,
    only the arg-max terms, dz never written, kernels/cpu_conv_pool.py).
    """

    def __init__(self, filters, kernel_size, strides=1, padding="valid", data_format=None,
                 dilation_rate=1, groups=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", kernel_regularizer=None,
                 input_shape=None, name=None, **kwargs):
        super().__init__(input_shape=input_shape, name=name, **kwargs)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        what = f"Conv2D {self.name!r}"
        if not isinstance(filters, (int, np.integer)) or isinstance(filters, bool) or filters < 1:
            raise ValueError(f"{what}: filters must be a positive integer (the number of output "
                             f"channels), got {filters!r}.")
        self.filters = int(filters)
        self.kernel_size = conv2d_kernels.pair(what, "kernel_size", kernel_size)   # (KH, KW)
        self.strides = conv2d_kernels.pair(what, "strides", strides)               # (sh, sw)
        self.padding = padding_arg(self, padding)
        channels_last(self, data_format)
        if conv2d_kernels.pair(what, "dilation_rate", dilation_rate) != (1, 1) or groups != 1:
            raise NotImplementedError(f"{what}: dilation_rate={dilation_rate!r}, groups={groups!r} "
                                      f"are not supported; only dilation_rate=1 and groups=1 are.")
        self.activation, self.activation_layer = unfused_activation(activation, ("relu",), self)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.get(kernel_initializer, "Conv2D kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, "Conv2D bias_initializer")
        self.kernel = self.bias = None

    def output_shape_for(self, input_shape):
        h, w, cin = image_shape(self, input_shape)
        _, oh, ow, cout = conv2d_kernels.conv2d_output_shape(
            (1, h, w, cin), self.kernel_size + (cin, self.filters), self.strides, self.padding,
            what=f"Conv2D {self.name!r} (input images {(h, w, cin)})")
        return oh, ow, cout

    def get_config(self):
        return dict(self.base_config(), filters=self.filters, kernel_size=list(self.kernel_size),
                    strides=list(self.strides), padding=self.padding, data_format="channels_last",
                    dilation_rate=[1, 1], groups=1, activation=self.activation or "linear",
                    use_bias=self.use_bias, **_weights_config(self))

    def build(self, input_shape):
        super().build(input_shape)
        shape = self.kernel_size + (self.input_shape[2], self.filters)     # (KH, KW, Cin, Cout)
        self.kernel = Variable(self.kernel_initializer(shape), name=f"{self.name}/kernel")
        if self.use_bias:
            self.bias = Variable(self.bias_initializer((self.filters,)), name=f"{self.name}/bias")

    @property
    def weights(self):
        if not self.built:
            return []
        return [self.kernel, self.bias] if self.use_bias else [self.kernel]

    def make_buffers(self, state, b):
        dev = state.dev
        zero_bias = None
        if not self.use_bias:                         # the kernel adds a bias: give it zeros
            zero_bias = dev.empty((self.filters,), FLOAT)
            state.ops.fill(zero_bias, 0.0)
        return SimpleNamespace(
            y=dev.empty((b,) + self.output_shape, FLOAT),   # (b, OH, OW, Cout); fused: the pair's dz (backward)
            dx=dev.empty((b,) + self.input_shape, FLOAT) if state.need_dx else None,   # (b, H, W, Cin)
            zero_bias=zero_bias,                            # (Cout,) zeros when use_bias=False, else None
            x=None)                                         # the last forward's input (b, H, W, Cin), not owned

    def fuse_next(self, layer, ops):
        """True when this layer and ``layer`` (the next) run as one op on ``ops``'s device: a
        ReLU conv followed by MaxPooling2D, where the backend fuses that pair
        (``ops.fuses_conv_relu_pool``: the CPU's compiled loops for any pool; a GPU's
        ``conv2d_v3.conv2d_relu_pool`` for a 2x2, stride-2, 'valid' pool of a kernel it holds).
        The engine then gives each layer's state the other's (``state.fused``): the conv
        writes the pool's output and arg-max, and in backward runs the pair's backward
        (``ops.conv2d_relu_pool_backward``); the pool passes through."""
        fuses = getattr(ops, "fuses_conv_relu_pool", None)
        return (self.activation == "relu" and isinstance(layer, MaxPooling2D) and fuses is not None
                and fuses(self.kernel_size + (self.input_shape[2], self.filters), self.strides,
                          layer.pool_size, layer.strides, layer.padding))

    def forward(self, state, x, training=False):
        b = x.shape[0]
        buf = state.buffers(b)
        kernel = state.weights[0]                                   # (KH, KW, Cin, Cout)
        bias = state.weights[1] if self.use_bias else buf.zero_bias  # (Cout,)
        buf.x = view(x, (b,) + self.input_shape)                    # (b, H, W, Cin), kept for d kernel
        if state.fused is not None:                                 # + the next MaxPooling2D, one op
            pool, pbuf = state.fused.layer, state.fused.buffers(b)
            state.ops.conv2d_relu_pool(buf.x, kernel, bias, pbuf.y, pbuf.arg, self.strides,
                                       self.padding, pool.pool_size, pool.strides, pool.padding)
            return pbuf.y                                           # pooled: (b, PH, PW, Cout)
        state.ops.conv2d(buf.x, kernel, bias, buf.y, self.strides, self.padding,
                         relu=self.activation == "relu")            # y: (b, OH, OW, Cout)
        return buf.y

    def backward(self, state, dy):
        buf = state.buffers(dy.shape[0])
        dkernel = state.grads[0]                                    # (KH, KW, Cin, Cout)
        dbias = state.grads[1] if self.use_bias else None           # (Cout,)
        dx = buf.dx if state.need_dx else None                      # (b, H, W, Cin) or None
        if state.fused is not None:                                 # dy: the pool's output gradient
            pool, pbuf = state.fused.layer, state.fused.buffers(dy.shape[0])
            state.ops.conv2d_relu_pool_backward(buf.x, state.weights[0], dy, pbuf.arg, pbuf.y, buf.y, dx,
                                                dkernel, dbias, self.strides, self.padding, pool.pool_size,
                                                pool.strides, pool.padding)   # buf.y: dz (b, OH, OW, Cout)
            return dx
        if self.activation == "relu":
            state.ops.relu_backward(dy, buf.y, dy)                  # dz = dy * (y > 0), in place
        state.ops.conv2d_backward(buf.x, state.weights[0], dy, dx, dkernel, dbias,
                                  self.strides, self.padding)
        return dx


class MaxPooling2D(Layer):
    """Max over ``pool_size`` windows, ``strides`` apart (default: the pool size), per channel.

    Forward: one ``ops.max_pool`` launch writing the maxima and, per output, the position
    of its window's FIRST maximum (int32; TensorFlow's tie rule, kernels/pooling.py).
    Backward: one ``ops.max_pool_backward``, each output's gradient to that position;
    inputs in no window (the last row of an odd size with 'valid') get zero. No weights.
    Fused with the Conv2D before it (see ``Conv2D.fuse_next``): the conv writes y and the
    arg-max, and runs this layer's backward with its ReLU mask; this layer passes through.
    """

    def __init__(self, pool_size=2, strides=None, padding="valid", data_format=None,
                 input_shape=None, name=None, **kwargs):
        super().__init__(input_shape=input_shape, name=name, **kwargs)
        what = f"MaxPooling2D {self.name!r}"
        self.pool_size = conv2d_kernels.pair(what, "pool_size", pool_size)                   # (PH, PW)
        self.strides = self.pool_size if strides is None else conv2d_kernels.pair(what, "strides", strides)
        self.padding = padding_arg(self, padding)
        channels_last(self, data_format)

    def output_shape_for(self, input_shape):
        image = image_shape(self, input_shape)
        (_, oh, ow, c), _, _, _ = pooling.pool_geometry(
            (1,) + image, self.pool_size, self.strides, self.padding,
            what=f"MaxPooling2D {self.name!r} (input images {image})")
        return oh, ow, c

    def get_config(self):
        return dict(self.base_config(), pool_size=list(self.pool_size), strides=list(self.strides),
                    padding=self.padding, data_format="channels_last")

    def make_buffers(self, state, b):
        dev = state.dev
        arg_dtype = getattr(state.ops, "FUSED_ARG_DTYPE", pooling.ARG_DTYPE) if state.fused else pooling.ARG_DTYPE
        return SimpleNamespace(y=dev.empty((b,) + self.output_shape, FLOAT),                      # (b, OH, OW, C)
                               arg=dev.empty((b,) + self.output_shape, arg_dtype),                 # (b, OH, OW, C)
                               dx=dev.empty((b,) + self.input_shape, FLOAT)                        # (b, H, W, C)
                               if state.need_dx and state.fused is None else None)

    def forward(self, state, x, training=False):
        if state.fused is not None:             # the conv before wrote this layer's y and arg
            return x
        b = x.shape[0]
        buf = state.buffers(b)
        x = view(x, (b,) + self.input_shape)                       # (b, H, W, C)
        state.ops.max_pool(x, buf.y, buf.arg, self.pool_size, self.strides, self.padding)
        return buf.y                                               # (b, OH, OW, C)

    def backward(self, state, dy):
        if not state.need_dx:
            return None
        if state.fused is not None:             # the conv before runs this layer's backward
            return dy
        buf = state.buffers(dy.shape[0])
        state.ops.max_pool_backward(dy, buf.arg, buf.dx, self.pool_size, self.strides, self.padding)
        return buf.dx                                              # (b, H, W, C)


#: What a model's first layer must be given as is (no reshaping of other shapes with
#: the same number of features): the layers that see the image's axes.
IMAGE_LAYERS = (Conv2D, MaxPooling2D)

