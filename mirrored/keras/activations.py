"""Keras's ``keras.activations``: the activation functions by name, as ops on tensors.

    keras.activations.tanh(x)                       an op: differentiable on a GradientTape
    keras.layers.Dense(64, activation="tanh")       the same function after the layer's kernel
    keras.layers.Dense(64, activation=keras.activations.tanh)   the same (its name is kept)
    keras.activations.get("swish")                  the function of a name

Each is a composition of the op table's entries (``mirrored/ops.py``: forward kernel and gradient
rule); the table of names is ``composed_layers.ACTIVATIONS`` (one copy), where the ``Activation``
layer and ``unfused_activation`` (a Dense's or Conv2D's activation its kernels do not apply) use
it too.

Neighbours: ``composed_layers.py`` (the table, ``Activation``), ``layers.py`` (Dense, Conv2D).
"""
from mirrored.keras.composed_layers import ACTIVATIONS, NAMES, activation_fn

linear = ACTIVATIONS["linear"]
relu = ACTIVATIONS["relu"]
sigmoid = ACTIVATIONS["sigmoid"]
tanh = ACTIVATIONS["tanh"]
softmax = ACTIVATIONS["softmax"]
leaky_relu = ACTIVATIONS["leaky_relu"]
elu = ACTIVATIONS["elu"]
softplus = ACTIVATIONS["softplus"]
exponential = ACTIVATIONS["exponential"]
swish = ACTIVATIONS["swish"]
silu = ACTIVATIONS["silu"]


def get(identifier):
    """Keras's ``activations.get``: the function of a name (None: linear), or a function itself."""
    return activation_fn(identifier, "keras.activations.get")


def serialize(activation):
    """Keras's ``activations.serialize``: the name of one of the functions above."""
    name = NAMES.get(activation, activation if activation in ACTIVATIONS else None)
    if name is None:
        raise ValueError(f"keras.activations.serialize: {activation!r} is not one of Keras's activations "
                         f"{sorted(ACTIVATIONS)}; a function of one's own has no name to save.")
    return name


def deserialize(name):
    """Keras's ``activations.deserialize``: ``get`` of a saved name."""
    return get(name)
