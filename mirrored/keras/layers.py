"""Keras layers, each owning its forward and backward: ``Input``, ``Flatten``, ``Dense``,
``Conv2D``, ``MaxPooling2D``, ``Dropout``.

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
(a convolution, pooling, dropout) means writing one class here, not editing the
step. The layers written so far are the course lab's (Flatten, Dense, Conv2D,
MaxPooling2D) and Dropout; the others raise ``NotImplementedError`` that says so.

Initialisers follow Keras: Glorot-uniform kernels, zero biases.

Neighbours: ``engine.py`` (LayerState, ReplicaProgram), ``models.py`` (Sequential
builds the layers), ``kernels/`` (what ``state.ops`` launches).
"""
import math
import re

import numpy as np

from kernels import conv2d as conv2d_kernels, pooling   # shape rules (the math runs in state.ops)
from kernels import conv2d_v3                            # which Conv2D + MaxPooling2D pairs fuse
from kernels import dropout as dropout_kernels           # the mask's key and the rate's check
from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored import random as _random
from mirrored.keras import regularizers
from mirrored.values import Variable

ACTIVATIONS = (None, "linear", "relu", "softmax")
FLOAT = np.dtype(np.float32)


def fans(shape):
    """(fan_in, fan_out) of a kernel, Keras's rule: a Dense kernel (in, out) has fans
    (in, out); a conv kernel (KH, KW, Cin, Cout) has (KH*KW*Cin, KH*KW*Cout), the
    receptive field times the channels (each output sums KH*KW*Cin inputs)."""
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[:-2], dtype=np.int64))    # KH * KW
    return receptive * shape[-2], receptive * shape[-1]


def glorot_uniform(shape, rng=None):
    """Keras's default kernel initialiser: U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    rng = rng or _random.generator()
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)    # (in, out) or (KH, KW, Cin, Cout)


def he_uniform(shape, rng=None):
    """U(-limit, limit), limit = sqrt(6 / fan_in) (Keras's he_uniform)."""
    limit = math.sqrt(6.0 / fans(shape)[0])
    return (rng or _random.generator()).uniform(-limit, limit, size=shape).astype(np.float32)


INITIALIZERS = {
    "glorot_uniform": glorot_uniform,
    "zeros": lambda shape, rng=None: np.zeros(shape, np.float32),
    "ones": lambda shape, rng=None: np.ones(shape, np.float32),
    "he_uniform": he_uniform,
}


def _initializer(spec, what):
    if callable(spec) and not isinstance(spec, str):
        return spec
    if spec not in INITIALIZERS:
        raise ValueError(f"{what}: unknown initializer {spec!r}; available: {sorted(INITIALIZERS)}.")
    return INITIALIZERS[spec]


class Layer:
    """Base layer: a name, an optional input shape, maybe weights, and the protocol.

    ``input_shape`` / ``output_shape``: the shape of ONE example (no batch axis),
    known once the layer is built. A layer without weights or buffers only
    overrides ``forward`` and ``backward`` (and ``output_shape_for``).
    """

    _counts = {}

    def __init__(self, input_shape=None, name=None, **kwargs):
        if "batch_input_shape" in kwargs and input_shape is None:
            input_shape = tuple(kwargs.pop("batch_input_shape"))[1:]
        unknown = set(kwargs) - {"dtype", "trainable"}
        if unknown:
            raise TypeError(f"{type(self).__name__}: unexpected arguments {sorted(unknown)}.")
        base = snake_case(type(self).__name__)
        n = Layer._counts.get(base, 0)
        Layer._counts[base] = n + 1
        self.name = name or (base if n == 0 else f"{base}_{n}")
        self.input_shape_arg = tuple(input_shape) if input_shape is not None else None
        self.input_shape = self.output_shape = None
        self.built = False

    @property
    def weights(self):
        return []

    trainable_weights = weights

    # -- weight penalties (keras/regularizers.py): Dense and Conv2D take kernel_regularizer=
    kernel_regularizer = None

    @property
    def regularized(self):
        """[(regularizer, index of the weight in ``weights``)] for this layer's penalties."""
        if self.kernel_regularizer is None or not self.built:
            return []
        return [(self.kernel_regularizer, 0)]

    @property
    def losses(self):
        """The penalties of this layer's weights as scalar tensors (Keras's ``layer.losses``)."""
        return [reg(self.weights[i]) for reg, i in self.regularized]

    def output_shape_for(self, input_shape):
        return input_shape

    def get_config(self):
        """Keras's config of this layer (``layer_config``; ``keras/saving.py`` writes and reads it)."""
        return layer_config(self)

    def build(self, input_shape):
        """Create the weights for examples of ``input_shape`` (under the model's strategy)."""
        self.input_shape = tuple(input_shape)
        self.output_shape = tuple(self.output_shape_for(self.input_shape))
        self.built = True

    # -- state besides the weights (keras/saving.py keeps it in .keras archives)
    def training_state(self):
        """What training advances besides the weights and a resumed run needs, as
        ``{name: integer scalar or array}`` (Dropout: its seed and mask counters); None:
        nothing. ``model.save`` writes it, ``load_model`` gives it back."""
        return None

    def set_training_state(self, state, what):
        """Restore what ``training_state`` returned; ``what`` names the file in errors."""
        raise ValueError(f"{what}: the file holds training state {sorted(state)} for layer "
                         f"{self.name!r} ({type(self).__name__}), which keeps none: the file was not "
                         f"written by model.save for this architecture. Read its weights alone with "
                         f"model.load_weights.")

    # -- the protocol (see the module docstring)
    def make_buffers(self, state, b):
        """What this layer keeps on ``state.dev`` for batches of ``b``: made once, reused."""
        return None

    def forward(self, state, x, training=False):
        """x: (b,) + input_shape on ``state.dev`` -> y: (b,) + output_shape (launches only)."""
        raise NotImplementedError(f"layer {self.name!r} ({type(self).__name__}) has no forward: a layer "
                                  f"defines forward(state, x, training) and backward(state, dy), see "
                                  f"the protocol in mirrored/keras/layers.py.")

    def backward(self, state, dy):
        """dy: d loss / d y -> the weights' gradients into ``state.grads``; returns d loss / d x,
        or None when ``state.need_dx`` is False."""
        raise NotImplementedError(f"layer {self.name!r} ({type(self).__name__}) has no backward: a layer "
                                  f"defines forward(state, x, training) and backward(state, dy), see "
                                  f"the protocol in mirrored/keras/layers.py.")


def snake_case(name):
    """Keras's layer names: Dense -> dense, Conv2D -> conv2d, MaxPooling2D -> max_pooling2d."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower().lstrip("_")


class InputLayer(Layer):
    """Declares the shape of one example (``layers.Input(shape=(28, 28, 1))``)."""

    def __init__(self, shape=None, name=None, **kwargs):
        if shape is None:
            raise ValueError("Input needs a shape, e.g. layers.Input(shape=(28, 28, 1)).")
        super().__init__(input_shape=tuple(shape), name=name, **kwargs)


def Input(shape=None, batch_size=None, name=None, dtype=None, **kwargs):  # noqa: N802 (Keras's name)
    """``tf.keras.layers.Input``/``tf.keras.Input``: the shape of one example."""
    return InputLayer(shape=shape, name=name)


class Flatten(Layer):
    """(b, d1, d2, ...) -> (b, d1*d2*...): a free reshape (a view), no weights, no launch."""

    def output_shape_for(self, input_shape):
        return (int(np.prod(input_shape, dtype=np.int64)),)

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
        if activation not in ACTIVATIONS:
            raise NotImplementedError(
                f"Dense: activation {activation!r} is not implemented; this dense stack has "
                f"None, 'relu' and 'softmax' (the ones the course lab uses).")
        if not use_bias:
            raise NotImplementedError("Dense(use_bias=False) is not implemented: every layer has a bias here.")
        self.units = int(units)
        self.activation = None if activation == "linear" else activation
        self.kernel_initializer = _initializer(kernel_initializer, "Dense kernel_initializer")
        self.bias_initializer = _initializer(bias_initializer, "Dense bias_initializer")
        self.kernel = self.bias = None
        self.input_dim = None

    def output_shape_for(self, input_shape):
        if len(input_shape) != 1:
            raise ValueError(f"Dense {self.name!r} expects flat inputs (batch, features), got "
                             f"examples of shape {input_shape}; put a layers.Flatten() before it.")
        return (self.units,)

    def build(self, input_shape):
        super().build(input_shape)
        (self.input_dim,) = input_shape
        shape = (self.input_dim, self.units)
        self.kernel = Variable(self.kernel_initializer(shape), name=f"{self.name}/kernel")
        self.bias = Variable(self.bias_initializer((self.units,)), name=f"{self.name}/bias")

    @property
    def weights(self):
        return [self.kernel, self.bias] if self.built else []

    trainable_weights = weights

    def make_buffers(self, state, b):
        dev = state.dev
        return _DenseBuffers(dev.empty((b, self.units), FLOAT),                                # y: (b, units)
                             dev.empty((b, self.input_dim), FLOAT) if state.need_dx else None)  # dx: (b, in)

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


class _DenseBuffers:
    """A Dense layer's buffers for one batch size on one device."""

    __slots__ = ("y", "dx", "x")

    def __init__(self, y, dx):
        self.y, self.dx = y, dx      # output (b, units); input gradient (b, in) or None
        self.x = None                # the last forward's input (b, in), not owned



# --- images: Conv2D and MaxPooling2D (NHWC, Keras's layouts) -----------------------------------

def _image_shape(layer, input_shape):
    """Check that one example is an image (H, W, C), as Keras's Conv2D/MaxPooling2D take it."""
    input_shape = tuple(input_shape)
    if len(input_shape) == 3:
        return input_shape
    hint = (f" A {input_shape[0]}x{input_shape[1]} image needs its channel axis: "
            f"input_shape={input_shape + (1,)} and images of that shape (x[..., None] adds it; "
            f"tfds's MNIST images are already (28, 28, 1))." if len(input_shape) == 2 else
            " Put it before any Flatten.")
    raise ValueError(f"{type(layer).__name__} {layer.name!r} takes images of shape (height, width, "
                     f"channels), got examples of shape {input_shape}.{hint}")


def _channels_last(layer, data_format):
    if data_format not in (None, "channels_last"):
        raise NotImplementedError(
            f"{type(layer).__name__}: data_format={data_format!r} is not supported; only "
            f"'channels_last' (NHWC: images (height, width, channels), Keras's default) is.")


def _padding(layer, padding):
    if not isinstance(padding, str) or padding.lower() not in conv2d_kernels.PADDINGS:
        raise ValueError(f"{type(layer).__name__}: padding must be 'valid' or 'same', got {padding!r}.")
    return padding.lower()


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
    the loop in keras/engine.py's ``ReplicaProgram``): the forward is one ``ops.conv2d_relu_pool`` into the pool's buffers
    (the conv output is never written), the pool's backward writes dz = d loss / d conv
    output with the ReLU mask applied, and this backward skips relu_backward. On the CPU the
    pair's backward is one ``ops.conv2d_relu_pool_backward`` (kernels/cpu_conv_pool.py: only
    the arg-max terms, dz never written, where that pays).
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
        self.padding = _padding(self, padding)
        _channels_last(self, data_format)
        if conv2d_kernels.pair(what, "dilation_rate", dilation_rate) != (1, 1) or groups != 1:
            raise NotImplementedError(f"{what}: dilation_rate={dilation_rate!r}, groups={groups!r} "
                                      f"are not supported; only dilation_rate=1 and groups=1 are.")
        if activation not in (None, "linear", "relu"):
            raise NotImplementedError(f"{what}: activation {activation!r} is not implemented; "
                                      f"Conv2D has None and 'relu' (fused into the kernel).")
        self.activation = None if activation == "linear" else activation
        self.use_bias = bool(use_bias)
        self.kernel_initializer = _initializer(kernel_initializer, "Conv2D kernel_initializer")
        self.bias_initializer = _initializer(bias_initializer, "Conv2D bias_initializer")
        self.kernel = self.bias = None

    def output_shape_for(self, input_shape):
        h, w, cin = _image_shape(self, input_shape)
        _, oh, ow, cout = conv2d_kernels.conv2d_output_shape(
            (1, h, w, cin), self.kernel_size + (cin, self.filters), self.strides, self.padding,
            what=f"Conv2D {self.name!r} (input images {(h, w, cin)})")
        return oh, ow, cout

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

    trainable_weights = weights

    def make_buffers(self, state, b):
        dev = state.dev
        zero_bias = None
        if not self.use_bias:                         # the kernel adds a bias: give it zeros
            zero_bias = dev.empty((self.filters,), FLOAT)
            state.ops.fill(zero_bias, 0.0)
        y = dev.empty((b,) + self.output_shape, FLOAT)   # fused: not the conv's output, its dz (backward)
        return _ConvBuffers(y,                                                                     # y: (b, OH, OW, Cout)
                            dev.empty((b,) + self.input_shape, FLOAT) if state.need_dx else None,  # dx: (b, H, W, Cin)
                            zero_bias)

    def fuse_next(self, layer, ops):
        """True when this layer and ``layer`` (the next) run as one op on ``ops``'s device: a
        ReLU conv followed by MaxPooling2D, where the backend fuses that pair
        (``ops.fuses_conv_relu_pool``: the CPU's compiled loops for any pool; a GPU's
        ``conv2d_v3.conv2d_relu_pool`` for a 2x2, stride-2, 'valid' pool of a kernel it holds).
        The engine then gives each layer's state the other's (``state.fused``): the conv
        writes the pool's output and arg-max, and in backward runs the pool's backward with
        the ReLU mask (``ops.max_pool_relu_backward``); the pool passes through."""
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
            both = getattr(state.ops, "conv2d_relu_pool_backward", None)  # the CPU: the pair's backward, one op
            if both is not None:
                both(buf.x, state.weights[0], dy, pbuf.arg, pbuf.y, buf.y, dx, dkernel, dbias, self.strides,
                     self.padding, pool.pool_size, pool.strides, pool.padding)
                return dx
            state.ops.max_pool_relu_backward(dy, pbuf.arg, pbuf.y, buf.y, pool.pool_size,
                                             pool.strides, pool.padding)   # dz: (b, OH, OW, Cout)
            dy = buf.y
        elif self.activation == "relu":
            state.ops.relu_backward(dy, buf.y, dy)                  # dz = dy * (y > 0), in place
        state.ops.conv2d_backward(buf.x, state.weights[0], dy, dx, dkernel, dbias,
                                  self.strides, self.padding)
        return dx


class _ConvBuffers:
    """A Conv2D layer's buffers for one batch size on one device."""

    __slots__ = ("y", "dx", "zero_bias", "x")

    def __init__(self, y, dx, zero_bias):
        self.y, self.dx = y, dx          # output (b, OH, OW, Cout); input gradient (b, H, W, Cin) or None
        self.zero_bias = zero_bias       # (Cout,) zeros when use_bias=False, else None
        self.x = None                    # the last forward's input (b, H, W, Cin), not owned


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
        self.padding = _padding(self, padding)
        _channels_last(self, data_format)

    def output_shape_for(self, input_shape):
        image = _image_shape(self, input_shape)
        (_, oh, ow, c), _, _, _ = pooling.pool_geometry(
            (1,) + image, self.pool_size, self.strides, self.padding,
            what=f"MaxPooling2D {self.name!r} (input images {image})")
        return oh, ow, c

    def make_buffers(self, state, b):
        dev = state.dev
        arg_dtype = getattr(state.ops, "FUSED_ARG_DTYPE", pooling.ARG_DTYPE) if state.fused else pooling.ARG_DTYPE
        return _PoolBuffers(dev.empty((b,) + self.output_shape, FLOAT),                            # y: (b, OH, OW, C)
                            dev.empty((b,) + self.output_shape, arg_dtype),                       # arg: (b, OH, OW, C)
                            dev.empty((b,) + self.input_shape, FLOAT)                             # dx: (b, H, W, C)
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


class _PoolBuffers:
    """A MaxPooling2D layer's buffers for one batch size on one device."""

    __slots__ = ("y", "arg", "dx")

    def __init__(self, y, arg, dx):
        self.y, self.arg, self.dx = y, arg, dx


#: What a model's first layer must be given as is (no reshaping of other shapes with
#: the same number of features): the layers that see the image's axes.
IMAGE_LAYERS = (Conv2D, MaxPooling2D)


class Dropout(Layer):
    """Keras's inverted dropout: in training each unit is kept with probability 1 - rate and
    scaled by 1 / (1 - rate); in evaluate and predict the layer is the identity (no launch).

    The mask comes from kernels/dropout.py's counter-based generator: unit i of a replica's
    (b, ...) batch is kept or not by a hash of (key, i), with

        key = dropout_key(seed, step, replica)

    so the mask is reproducible (the seed is ``seed``, or drawn from ``mirrored.random``
    when the layer is built, so ``mirrored.random.set_seed`` repeats a run), different on
    every replica and step (each replica drops different units of its own slice, as in
    TensorFlow), and the same bits on the CPU (``dropout_ref``) and the GPU. ``step``
    counts this replica's training forwards.

    The counter lives on the replica's device (a (3,) uint64 array: seed, step, key; made
    on first use), not in Python: a training forward launches ``dropout_next_key`` (one
    thread writes this step's key and counts the step) and then the mask kernel, which
    reads the key there. Neither launch takes anything from the host that changes from
    step to step, so a CUDA graph of the step (``compile(run_eagerly=False)``,
    ``mirrored/graphs.py``) draws a new mask at every replay, the eager masks bit for bit.
    Backward applies the same mask to dy (the key is still there), in place:
    dx = dy * scale where kept.

    Because N replicas drop different units, a model with dropout does NOT train like one
    replica on the global batch (the other layers still do, given the same masks).

    ``model.save("m.keras")`` keeps the seed in use and every replica's step count
    (``training_state``, read from the devices) and ``load_model`` restores them, so
    training resumes with the masks an uninterrupted run would draw. Keras 3 keeps its
    Dropout's SeedGenerator state in neither file (a loaded model restarts its counter at
    0); ``save_weights`` / ``load_weights`` leave this state alone, as Keras's do.
    """

    def __init__(self, rate, noise_shape=None, seed=None, input_shape=None, name=None, **kwargs):
        super().__init__(input_shape=input_shape, name=name, **kwargs)
        self.rate = dropout_kernels.check_rate(rate, f"Dropout {self.name!r}")
        if noise_shape is not None:
            raise NotImplementedError(f"Dropout {self.name!r}: noise_shape is not supported; every "
                                      f"unit gets its own draw (noise_shape=None).")
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
                                 or seed < 0):
            raise ValueError(f"Dropout {self.name!r}: seed must be a non-negative integer or None, "
                             f"got {seed!r}.")
        self.seed = seed
        self._seed = None            # the seed in use, fixed when the layer is built
        self._counters = {}          # replica id -> (device, its (3,) uint64 counter there)
        self._start = {}             # replica id -> the step its counter starts at (a restore)

    def build(self, input_shape):
        super().build(input_shape)
        self._seed = int(self.seed) if self.seed is not None else int(_random.generator().integers(2**63))

    @property
    def _steps(self):
        """{replica id: training forwards so far}, read from the devices."""
        steps = dict(self._start)
        for r, (dev, counter) in self._counters.items():
            steps[r] = int(dev.to_numpy(counter)[dropout_kernels.STEP])
        return steps

    def training_state(self):
        counts = self._steps
        steps = np.zeros(max(counts, default=0) + 1, np.int64)    # (replicas,): forwards so far
        for r, n in counts.items():
            steps[r] = n
        return {"seed": np.uint64(self._seed % 2**64), "steps": steps}    # dropout_key takes mod 2^64

    def set_training_state(self, state, what):
        seed, steps = state.get("seed"), state.get("steps")
        if (set(state) != {"seed", "steps"} or np.ndim(seed) != 0 or np.ndim(steps) != 1
                or not np.issubdtype(np.asarray(seed).dtype, np.integer)
                or not np.issubdtype(np.asarray(steps).dtype, np.integer) or np.any(np.asarray(steps) < 0)):
            raise ValueError(f"{what}: the state of Dropout {self.name!r} is damaged: expected an "
                             f"integer seed and a vector of step counts >= 0, got {state!r}. Read the "
                             f"weights alone with model.load_weights (the masks then start afresh).")
        self._seed = int(seed)
        self._start = {r: int(n) for r, n in enumerate(steps)}
        for r, (dev, counter) in self._counters.items():          # in place: a graph reads them
            dev.upload_into(counter, dropout_kernels.counter_init(self._seed, self._start.pop(r, 0)))

    def _counter(self, state):
        """This replica's counter on its device, made on first use."""
        r = state.replica_id
        if r not in self._counters:
            host = dropout_kernels.counter_init(self._seed, self._start.pop(r, 0))   # (3,) uint64
            self._counters[r] = (state.dev, state.dev.from_numpy(host))
        return self._counters[r][1]

    def make_buffers(self, state, b):
        self._counter(state)                                          # before any step computes
        return state.dev.empty((b,) + self.input_shape, FLOAT)       # y: (b,) + input shape

    def forward(self, state, x, training=False):
        if not training or self.rate == 0.0:
            return x                                                  # identity: nothing launched
        b = x.shape[0]
        counter = self._counter(state)
        # the key names the replica among ALL replicas (every worker's), so no two draw one mask
        state.ops.dropout_next_key(counter, state.global_replica_id)  # this step's key, step += 1
        y = state.buffers(b)
        x = view(x, (b,) + self.input_shape)
        state.ops.dropout_keyed(x, y, self.rate, counter)             # y: (b,) + input shape
        return y

    def backward(self, state, dy):
        if not state.need_dx:
            return None
        if self.rate != 0.0:
            state.ops.dropout_keyed(dy, dy, self.rate, self._counter(state))  # dx = dy * mask * scale
        return dy


def _not_here(name):
    class Unsupported(Layer):
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                f"layers.{name} is not implemented: mirrored has the layers of the course lab "
                f"and its usual next steps: {', '.join(SUPPORTED)} (Input too).")
    Unsupported.__name__ = name
    return Unsupported


SUPPORTED = ("Flatten", "Dense", "Conv2D", "MaxPooling2D", "Dropout")
Conv1D = _not_here("Conv1D")
AveragePooling2D = _not_here("AveragePooling2D")
BatchNormalization = _not_here("BatchNormalization")
Embedding = _not_here("Embedding")
LSTM = _not_here("LSTM")
StringLookup = _not_here("StringLookup")      # the distributed-input tutorial's one preprocessing cell


# -- configs (Keras's get_config keys; keras/saving.py writes them) -----------------------------
def _initializer_config(fn):
    for name, f in INITIALIZERS.items():
        if f is fn:
            return {"module": "keras.initializers", "class_name": "".join(p.title() for p in name.split("_")),
                    "config": {} if name in ("zeros", "ones") else {"seed": None}, "registered_name": None}
    return None                      # a custom callable: the weights in the file are what count


def layer_config(layer):
    """``layer.get_config()``: Keras's keys for the arguments this library's layers take
    (``keras/saving.py`` writes them into a .keras archive's config.json)."""
    config = {"name": layer.name, "trainable": True, "dtype": "float32"}
    if isinstance(layer, Dense):
        config.update(units=layer.units, activation=layer.activation or "linear", use_bias=True,
                      kernel_initializer=_initializer_config(layer.kernel_initializer),
                      bias_initializer=_initializer_config(layer.bias_initializer))
    elif isinstance(layer, Conv2D):
        config.update(filters=layer.filters, kernel_size=list(layer.kernel_size), strides=list(layer.strides),
                      padding=layer.padding, data_format="channels_last", dilation_rate=[1, 1], groups=1,
                      activation=layer.activation or "linear", use_bias=layer.use_bias,
                      kernel_initializer=_initializer_config(layer.kernel_initializer),
                      bias_initializer=_initializer_config(layer.bias_initializer))
    elif isinstance(layer, MaxPooling2D):
        config.update(pool_size=list(layer.pool_size), strides=list(layer.strides), padding=layer.padding,
                      data_format="channels_last")
    elif isinstance(layer, Dropout):
        config.update(rate=layer.rate, seed=layer.seed, noise_shape=None)
    elif isinstance(layer, Flatten):
        config.update(data_format="channels_last")
    else:
        raise NotImplementedError(f"layer {layer.name!r} ({type(layer).__name__}) has no config: saving a "
                                  f"whole model needs the library's layers ({', '.join(SUPPORTED)}); "
                                  f"save_weights works for any layer.")
    if isinstance(layer, (Dense, Conv2D)):
        reg = layer.kernel_regularizer
        config["kernel_regularizer"] = (None if reg is None else
                                        {"module": "keras.regularizers", "class_name": type(reg).__name__,
                                         "config": reg.get_config(), "registered_name": None})
    return config
