"""Keras layers for the dense stack: ``Input``, ``Flatten``, ``Dense``.

This project teaches data parallelism on a small dense network, so these are
the layers there are; a convolution, pooling or normalisation layer raises
``NotImplementedError`` that says so (the course lab's ConvNet becomes
``Flatten -> Dense(64, relu) -> Dense(10)``).

Weights are created as ``mirrored.Variable``s when the layer is built: inside
a ``MirroredStrategy.scope()`` they are ``MirroredVariable``s, one copy per
replica device. Initialisers follow Keras: Glorot-uniform kernels, zero biases.
"""
import math

import numpy as np

from mirrored import random as _random
from mirrored.values import Variable

ACTIVATIONS = (None, "linear", "relu", "softmax")


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
    """Base layer: a name, an optional input shape, and (maybe) weights."""

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
        self.built = False

    @property
    def weights(self):
        return []

    trainable_weights = weights

    def output_shape_for(self, input_shape):
        return input_shape

    def build(self, input_shape):
        self.built = True


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
    """(batch, d1, d2, ...) -> (batch, d1*d2*...): a free reshape, no weights."""

    def output_shape_for(self, input_shape):
        return (int(np.prod(input_shape, dtype=np.int64)),)


class Dense(Layer):
    """``outputs = activation(inputs @ kernel + bias)``; kernel (in, units), bias (units,)."""

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
        (self.input_dim,) = input_shape
        shape = (self.input_dim, self.units)
        self.kernel = Variable(self.kernel_initializer(shape), name=f"{self.name}/kernel")
        self.bias = Variable(self.bias_initializer((self.units,)), name=f"{self.name}/bias")
        self.built = True

    @property
    def weights(self):
        return [self.kernel, self.bias] if self.built else []

    trainable_weights = weights


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
