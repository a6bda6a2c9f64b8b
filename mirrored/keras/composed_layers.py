"""Keras's layers that are a few ops each, written with ``call`` (``call_layers.py`` runs them in
a model, their gradients from the ops' rules): ``Activation``, ``ReLU``, ``LeakyReLU``,
``Softmax``, ``Reshape``, ``Rescaling``, ``Lambda``; and ``dense_as_ops``, a Dense called on data
inside another layer's ``call``.

Each has Keras 3's arguments and config keys (``get_config``), so a ``.keras`` file holds
them, except ``Lambda``: its function lives in memory only, and a file's Lambda is refused.

Neighbours: ``call_layers.py`` (how a ``call`` runs inside a model), ``mirrored/ops.py``.
"""
import numpy as np

from mirrored import ops
from mirrored.keras.base_layer import Layer

#: Keras's activation names and the ops they are.
ACTIVATIONS = {
    "linear": lambda x: x,
    "relu": ops.relu,
    "sigmoid": ops.sigmoid,
    "tanh": ops.tanh,
    "softmax": ops.softmax,
    "leaky_relu": lambda x: ops.leaky_relu(x, alpha=0.2),       # Keras 3's negative_slope default
    "elu": ops.elu,
    "softplus": ops.softplus,
    "exponential": ops.exp,
    "swish": lambda x: x * ops.sigmoid(x),
    "silu": lambda x: x * ops.sigmoid(x),
}


#: Keras's names of the functions above (``Dense(activation=keras.activations.tanh)`` is 'tanh').
NAMES = {function: name for name, function in ACTIVATIONS.items()}


def activation_fn(activation, what):
    """The op for Keras's ``activation`` (a name above, None, or a callable)."""
    if activation is None:
        return ACTIVATIONS["linear"]
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"{what}: unknown activation {activation!r}; available: {sorted(ACTIVATIONS)} "
                         f"or a function of one tensor.")
    return ACTIVATIONS[activation]


def dense_as_ops(layer, x):
    """``Dense(...)(x)`` on data inside another layer's ``call`` (keras.io's VAE: an ``Encoder``
    made of Dense layers): built on first use, then ``activation(x @ kernel + bias)`` as ops, so
    the tape of that ``call`` differentiates it and the weights are read as ``add_weight``'s are
    (replica r's copies in a model's forward). ``call_layers.inline_ops`` maps Dense here."""
    x = ops.as_tensor(x)
    if not layer.built:
        layer.build(tuple(x.shape[1:]))
    y = ops.matmul(x, layer.kernel) + layer.bias                  # (b, units)
    return activation_fn(layer.activation, f"Dense {layer.name!r}")(y)     # relu, sigmoid, ...


def unfused_activation(activation, fused, owner):
    """For a library layer's ``activation`` argument (Dense, Conv2D): ``(the name it keeps, the
    layer applied after it or None)``. The names in ``fused`` its kernels apply themselves (None:
    linear, 'relu', Dense's final 'softmax'); any other of Keras's activations, or a function,
    runs as an ``Activation`` of its own right after the layer, one node more in the model's
    program (``functional.expand``): the layer's own forward then is linear (z = x W + b) and
    the activation's gradient comes from its op's rule. Keras's layer is one layer: this
    ``Activation`` is not in ``model.layers``, has no weights and is not saved (the owner's
    config holds the name)."""
    name = "linear" if activation is None else NAMES.get(activation, activation)
    if name == "linear" or name in fused:
        return (None if name == "linear" else name), None
    activation_fn(name, f"{type(owner).__name__} {owner.name!r}")          # a name we have, or refused
    return name, Activation(name, name=f"{owner.name}_activation")


class Activation(Layer):
    """``Activation('relu')``: the activation function applied elementwise (softmax: last axis)."""

    def __init__(self, activation, **kwargs):
        super().__init__(**kwargs)
        self.function = activation_fn(activation, f"Activation {self.name!r}")
        self.function_name = activation if isinstance(activation, str) or activation is None else None

    def call(self, inputs):
        return self.function(inputs)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        if self.function_name is None and self.function is not ACTIVATIONS["linear"]:
            raise NotImplementedError(f"Activation {self.name!r} holds a Python function, which a file "
                                      f"cannot hold here: use an activation's name, or save_weights.")
        return dict(self.base_config(), activation=self.function_name or "linear")


class ReLU(Layer):
    """Keras's ReLU: ``max_value`` where x >= max_value, x where threshold <= x, else
    ``negative_slope * (x - threshold)``."""

    def __init__(self, max_value=None, negative_slope=0.0, threshold=0.0, **kwargs):
        super().__init__(**kwargs)
        if max_value is not None and max_value < 0:
            raise ValueError(f"ReLU: max_value must be >= 0 or None, got {max_value!r}.")
        if negative_slope is None or negative_slope < 0:
            raise ValueError(f"ReLU: negative_slope must be a number >= 0, got {negative_slope!r}.")
        self.max_value = None if max_value is None else float(max_value)
        self.negative_slope, self.threshold = float(negative_slope), float(threshold)

    def call(self, inputs):
        if self.negative_slope == 0.0 and self.threshold == 0.0:
            y = ops.relu(inputs)
        else:
            y = ops.where(inputs >= self.threshold, inputs, (inputs - self.threshold) * self.negative_slope)
        return y if self.max_value is None else ops.minimum(y, self.max_value)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(self.base_config(), max_value=self.max_value, negative_slope=self.negative_slope,
                    threshold=self.threshold)


class LeakyReLU(Layer):
    """``x`` where x >= 0, else ``negative_slope * x`` (Keras 3: default 0.3; ``alpha`` the
    old name)."""

    def __init__(self, negative_slope=0.3, **kwargs):
        if "alpha" in kwargs:
            negative_slope = kwargs.pop("alpha")
        super().__init__(**kwargs)
        if negative_slope is None or negative_slope < 0:
            raise ValueError(f"LeakyReLU: negative_slope must be a number >= 0, got {negative_slope!r}.")
        self.negative_slope = float(negative_slope)

    def call(self, inputs):
        return ops.leaky_relu(inputs, alpha=self.negative_slope)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(self.base_config(), negative_slope=self.negative_slope)


class Softmax(Layer):
    """Softmax over ``axis`` (an int, or a list: over those axes together)."""

    def __init__(self, axis=-1, **kwargs):
        super().__init__(**kwargs)
        self.axis = axis

    def call(self, inputs):
        if isinstance(self.axis, (list, tuple)):
            shifted = inputs - ops.reduce_max(inputs, axis=list(self.axis), keepdims=True)
            e = ops.exp(shifted)
            return e / ops.reduce_sum(e, axis=list(self.axis), keepdims=True)
        return ops.softmax(inputs, axis=self.axis)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(self.base_config(), axis=self.axis)


class Reshape(Layer):
    """Each example to ``target_shape`` (one entry may be -1), the batch axis kept."""

    def __init__(self, target_shape, **kwargs):
        super().__init__(**kwargs)
        target_shape = tuple(int(d) for d in target_shape)
        if sum(d == -1 for d in target_shape) > 1 or any(d < -1 or d == 0 for d in target_shape):
            raise ValueError(f"Reshape: target_shape must hold positive sizes and at most one -1, "
                             f"got {target_shape}.")
        self.target_shape = target_shape

    def compute_output_shape(self, input_shape):
        n = int(np.prod(input_shape[1:], dtype=np.int64))
        known = int(np.prod([d for d in self.target_shape if d != -1], dtype=np.int64))
        if -1 in self.target_shape:
            if n % known:
                raise ValueError(f"Reshape {self.name!r}: examples of shape {tuple(input_shape[1:])} "
                                 f"({n} values) do not split into {self.target_shape}.")
            shape = tuple(n // known if d == -1 else d for d in self.target_shape)
        else:
            shape = self.target_shape
        if int(np.prod(shape, dtype=np.int64)) != n:
            raise ValueError(f"Reshape {self.name!r}: examples of shape {tuple(input_shape[1:])} ({n} "
                             f"values) cannot become {self.target_shape}: the sizes must multiply to {n}.")
        return (input_shape[0],) + shape

    def call(self, inputs):
        shape = self.compute_output_shape(tuple(inputs.shape))
        return ops.reshape(inputs, shape)

    def get_config(self):
        return dict(self.base_config(), target_shape=list(self.target_shape))


class Rescaling(Layer):
    """``inputs * scale + offset`` (images to [0, 1]: ``Rescaling(1. / 255)``)."""

    def __init__(self, scale, offset=0.0, **kwargs):
        super().__init__(**kwargs)
        self.scale, self.offset = float(scale), float(offset)

    def call(self, inputs):
        return inputs * self.scale + self.offset

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(self.base_config(), scale=self.scale, offset=self.offset)


class Lambda(Layer):
    """``function(inputs)`` as a layer (``arguments``: more keyword arguments for it). In
    memory only: a file's Lambda is refused (its function would be code read from the file)."""

    def __init__(self, function, output_shape=None, mask=None, arguments=None, **kwargs):
        super().__init__(**kwargs)
        if not callable(function):
            raise ValueError(
                f"Lambda {self.name!r}: the function is not a Python callable (got {type(function).__name__}): "
                f"a Lambda layer's function is not loaded from a file here, as running code read from "
                f"a file is unsafe (Keras 3 refuses it too unless safe_mode=False). Rebuild the model in "
                f"code and load its weights with model.load_weights(...).")
        if mask is not None:
            raise NotImplementedError("Lambda(mask=...) is not implemented here; leave it out.")
        self.function, self.arguments = function, dict(arguments or {})
        self.output_shape_arg = output_shape

    def call(self, inputs):
        return self.function(inputs, **self.arguments)

    def get_config(self):
        return dict(self.base_config(), function={
            "class_name": "__lambda__", "config": {"code": None, "defaults": None, "closure": None,
                                                   "name": getattr(self.function, "__name__", None)}},
            output_shape=None, arguments={}, mask=None)


__all__ = ["Activation", "ReLU", "LeakyReLU", "Softmax", "Reshape", "Rescaling", "Lambda"]
