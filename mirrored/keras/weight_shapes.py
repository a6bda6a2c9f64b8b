"""The weights a model WILL have, worked out from shapes alone: nothing is allocated.

Why. Two loaders build a model from shapes a file declares: ``tf.train.Checkpoint.restore``
builds a model that is not built yet from the file's ``input_shape``
(``mirrored/checkpoint.py``), and ``load_model`` builds the model its ``config.json``
describes (units, filters, kernel sizes, the input shape; ``saving.py``). A file may come
from anywhere (``file_safety.py``), and a few bytes of it can declare a 16 GiB kernel:
``Dense(units=2**31)``, or an input of (100000, 100000, 1) in front of ``Flatten``. So the
loaders first ask this file what the model would hold, compare it with what the file
STORES (its arrays, their stored bytes), and refuse before anything is built. A model
is built only when the file holds exactly its weights (shape and dtype).

How. Every layer has ``output_shape_for(input_shape)``: the shapes flow through the model
with no weight made (a Sequential's chain: ``of_chain``; a functional config's calls:
``of_functional``, which replays them on symbolic tensors through stand-ins that record
the shapes each layer is called on and build nothing). Then each layer's weights::

    Dense(units)                      kernel (in, units), bias (units,)
    Conv2D(filters, (KH, KW))         kernel (KH, KW, Cin, filters), bias (filters,) unless use_bias=False
    BatchNormalization, LayerNormalization, Embedding: their ``weight_specs`` (the shapes build makes)
    a library layer showing none      none (Flatten, MaxPooling2D, Dropout, the merge layers,
                                      Activation, Reshape...)
    a layer of the user's own         unknown (None): its own ``build`` (``add_weight``) decides

These are the shapes ``layers.py``'s ``build`` makes (tests/test_faults_round4_shapes.py
builds random layers and checks that the two agree). Where a layer is unknown,
``minimum_count`` gives a lower bound that needs no input shape (a Dense kernel has at
least one row of ``units``): the loaders' fallback for models they cannot plan.

Neighbours: ``layers.py`` (the layers and their ``build``), ``functional.py`` (symbolic
calls, ``program``: the layers in Keras's order), ``functional_config.py`` (a config's
calls, replayed), ``saving.py`` and ``mirrored/checkpoint.py`` (the loaders that ask),
``file_safety.py`` (what a file we load may not make us do).
"""
import math

from mirrored.keras import functional, functional_config
from mirrored.keras.base_layer import Layer
from mirrored.keras.layers import Conv2D, Dense


def _dense(layer, input_shape):
    (features,) = input_shape                        # output_shape_for checked it is flat
    return [("kernel", (features, layer.units)), ("bias", (layer.units,))]


def _conv2d(layer, input_shape):
    kernel = [("kernel", tuple(layer.kernel_size) + (input_shape[2], layer.filters))]   # HWIO
    return kernel + ([("bias", (layer.filters,))] if layer.use_bias else [])


#: The library's layers with weights: (class, its weights from an input shape).
RULES = ((Dense, _dense), (Conv2D, _conv2d))


def _rule(layer):
    """The rule for ``layer`` when its class makes and shows its weights as the library's
    class does (a subclass that keeps ``build`` and ``weights``), else None."""
    cls = type(layer)
    for base, rule in RULES:
        if isinstance(layer, base) and cls.build is base.build and cls.trainable_weights is base.trainable_weights:
            return rule
    return None


def of_layer(layer, input_shape):
    """``[(variable name, shape)]`` of the weights ``layer`` will make when built for
    examples of ``input_shape`` (a list of shapes for a merge layer), in its weights' order;
    ``[]`` for a layer that shows none; ``None`` when unknown (a layer of the user's own)."""
    rule = _rule(layer)
    if rule is None and hasattr(layer, "weight_specs") and type(layer).__module__.startswith("mirrored.keras."):
        rule = type(layer).weight_specs       # the library's call layers (normalization.py, embedding.py)
    if rule is not None:
        return [(f"{layer.name}/{suffix}:0", tuple(int(d) for d in shape))   # Variable's name
                for suffix, shape in rule(layer, tuple(input_shape))]
    cls = type(layer)
    if cls.weights is Layer.weights and cls.__module__.startswith("mirrored."):
        return []                    # one of the library's layers that makes no weight (one that
        #                              makes them with add_weight says so in ``weight_specs``)
    return None                      # a layer of the user's own (add_weight in its build)


def minimum_count(layer):
    """A lower bound on the number of numbers in ``layer``'s weights, for any input shape
    (an input has at least one feature, one channel); 0 when unknown or weightless."""
    rule = _rule(layer)
    if rule is None:
        return 0
    smallest = (1,) if rule is _dense else (1, 1, 1)
    return sum(math.prod(shape) for _, shape in rule(layer, smallest))


def example_shape(shape, what):
    """One example's shape from a file: a tuple of positive integers, the leading ``None``
    (batch axis) of Keras's ``batch_shape`` taken off when there is one (``Model.build``'s
    rule); else ``ValueError`` naming ``what``."""
    shape = list(shape) if isinstance(shape, (list, tuple)) else shape
    if isinstance(shape, list) and len(shape) > 1 and shape[0] is None:
        shape = shape[1:]
    ok = isinstance(shape, list) and shape and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    if not ok:
        raise ValueError(f"{what}: an input shape is a list of positive integers (one example's "
                         f"axes), got {shape!r}: the file was changed or not written for a model; "
                         f"nothing was built from it.")
    return tuple(shape)


def of_chain(layers, input_shape):
    """``[(layer, of_layer(...))]`` for a chain of ``layers`` (a Sequential's) fed examples of
    ``input_shape``: each layer's shape is checked (``output_shape_for``) before its weights
    are worked out, as ``Sequential.build`` checks them, so a bad one raises its own error."""
    plan, shape = [], tuple(input_shape)
    for layer in layers:
        out = tuple(layer.output_shape_for(shape))
        plan.append((layer, of_layer(layer, shape)))
        shape = out
    return plan


class _ShapeOnly:
    """Stands in for ``layer`` while a functional config is replayed on symbolic tensors
    (``functional.call_layer`` calls it as it calls a layer): it records the shapes it is
    called on and makes no weight. ``of_functional`` gives it the layer's class name."""

    def __init__(self, layer):
        self.layer, self.name = layer, layer.name
        self.built, self.input_shape, self.output_shape = False, None, None
        self.inbound_nodes = []

    def __call__(self, inputs, **kwargs):
        return functional.call_layer(self, inputs, kwargs)

    def output_shape_for(self, input_shape):
        return self.layer.output_shape_for(input_shape)

    def build(self, input_shape):
        self.input_shape = input_shape
        self.output_shape = tuple(self.layer.output_shape_for(input_shape))
        self.built = True


def of_functional(config, make_layer, make_input):
    """``[(layer, of_layer(...))]`` of the functional model ``config`` describes (Keras's
    "Functional" config, ``functional_config.py``), in Keras's order (``model.layers``'s:
    the order of the weights), built for nothing. ``make_layer(entry)``: the layer of a
    config entry (the loader's own, which it then builds for real); ``make_input(entry)``:
    the symbolic input of an InputLayer's entry."""
    def stand_in(entry):
        layer = make_layer(entry)
        return type(type(layer).__name__, (_ShapeOnly,), {})(layer)   # errors name the class

    def ordered(inputs, outputs, name):
        xs, ys = functional.flat_tensors(inputs, "inputs"), functional.flat_tensors(outputs, "outputs")
        return functional.graph(xs, ys)[1]

    stand_ins = functional_config.functional_from_config(config, stand_in, make_input, ordered)
    return [(s.layer, of_layer(s.layer, s.input_shape)) for s in stand_ins]
