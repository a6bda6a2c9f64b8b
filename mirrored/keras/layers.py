"""Keras layers, each owning its forward and backward: ``Input``, ``Flatten``, ``Dense``.

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
step. The layers written so far are the dense stack's; the others raise
``NotImplementedError`` that says so.

Initialisers follow Keras: Glorot-uniform kernels, zero biases.

Neighbours: ``engine.py`` (LayerState, ReplicaProgram), ``models.py`` (Sequential
builds the layers), ``kernels/`` (what ``state.ops`` launches).
"""
import math

import numpy as np

from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored import random as _random
from mirrored.values import Variable

ACTIVATIONS = (None, "linear", "relu", "softmax")
FLOAT = np.dtype(np.float32)


def glorot_uniform(shape, rng=None):
    """Keras's default kernel initialiser: U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = shape
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    rng = rng or _random.generator()
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)    # (in, out)


INITIALIZERS = {
    "glorot_uniform": glorot_uniform,
    "zeros": lambda shape, rng=None: np.zeros(shape, np.float32),
    "ones": lambda shape, rng=None: np.ones(shape, np.float32),
    "he_uniform": lambda shape, rng=None: (rng or _random.generator()).uniform(
        -math.sqrt(6.0 / shape[0]), math.sqrt(6.0 / shape[0]), size=shape).astype(np.float32),
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
        base = _snake(type(self).__name__)
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

    def output_shape_for(self, input_shape):
        return input_shape

    def build(self, input_shape):
        """Create the weights for examples of ``input_shape`` (under the model's strategy)."""
        self.input_shape = tuple(input_shape)
        self.output_shape = tuple(self.output_shape_for(self.input_shape))
        self.built = True

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


def _snake(name):
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


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
        b = x.shape[0]
        return x if len(x.shape) == 2 else x.reshape(b, self.output_shape[0])    # (b, features)

    def backward(self, state, dy):
        if not state.need_dx:
            return None
        b = dy.shape[0]
        return dy.reshape((b,) + self.input_shape)                                # (b,) + input shape


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
                 bias_initializer="zeros", input_shape=None, name=None, **kwargs):
        super().__init__(input_shape=input_shape, name=name, **kwargs)
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


def _not_here(name):
    class Unsupported(Layer):
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                f"layers.{name} is not implemented: mirrored teaches data parallelism on a "
                f"dense-layer stack (Flatten, Dense with None/'relu'/'softmax'). Replace the "
                f"convolutional part of the model with layers.Flatten() and Dense layers, e.g. "
                f"Sequential([Flatten(input_shape=(28, 28, 1)), Dense(64, activation='relu'), Dense(10)]).")
    Unsupported.__name__ = name
    return Unsupported


Conv2D = _not_here("Conv2D")
Conv1D = _not_here("Conv1D")
MaxPooling2D = _not_here("MaxPooling2D")
AveragePooling2D = _not_here("AveragePooling2D")
Dropout = _not_here("Dropout")
BatchNormalization = _not_here("BatchNormalization")
Embedding = _not_here("Embedding")
LSTM = _not_here("LSTM")
