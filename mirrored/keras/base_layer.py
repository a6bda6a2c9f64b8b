"""The base of every layer (``Layer``: its name, shapes and the protocol the step calls),
``Input``, the checks of the arguments Conv2D and MaxPooling2D share, and the Keras layers
this library does not have (each raises, saying so).

The protocol itself (``make_buffers``, ``forward``, ``backward``) and the layers that
follow it are in ``layers.py``, the file to read; this one holds what every layer
shares and a student rarely needs to open. Neighbours: ``layers.py`` (Flatten, Dense,
Conv2D, MaxPooling2D), ``dropout.py`` (Dropout), ``engine.py`` (``LayerState``: what a
layer holds on one replica), ``saving.py`` (``get_config``: a layer's arguments in Keras's
format).
"""
import re

import numpy as np

from kernels.conv2d import PADDINGS
from mirrored.keras import call_layers, functional, regularizers
from mirrored.keras.preprocessing import IntegerLookup, StringLookup  # noqa: F401 (keras.layers' host-side lookups)


def _is_float32(dtype):
    """True for the ways of naming float32 (``"float32"``, ``np.float32``, ``tf.float32``)."""
    try:
        return np.dtype(dtype) == np.float32
    except TypeError:                      # a Keras policy name ("mixed_float16") or object
        return False


class Layer:
    """Base layer: a name, an optional input shape, maybe weights, and the protocol.

    ``input_shape`` / ``output_shape``: the shape of ONE example (no batch axis),
    known once the layer is built. A layer without weights or buffers only
    overrides ``forward`` and ``backward`` (and ``output_shape_for``).
    """

    _counts = {}

    def __init_subclass__(cls, **kwargs):
        """A layer written with ``call`` (Keras's way): its ``build`` also sets what the engine
        needs (``call_layers.wrap_build``)."""
        super().__init_subclass__(**kwargs)
        if "build" in cls.__dict__ and callable(getattr(cls, "call", None)):
            cls.build = call_layers.wrap_build(cls.__dict__["build"])

    def __setattr__(self, name, value):
        """Layers set as attributes of a layer written with ``call`` are its sublayers: their
        weights are its own, after its ``add_weight``s (Keras's order)."""
        found = value if isinstance(value, (list, tuple)) else [value]
        if not name.startswith("_") and found and all(isinstance(v, Layer) for v in found):
            tracked = self.__dict__.setdefault("_sublayers", [])
            tracked += [v for v in found if all(v is not t for t in tracked)]
        super().__setattr__(name, value)

    def __init__(self, input_shape=None, name=None, **kwargs):
        if "batch_input_shape" in kwargs and input_shape is None:
            input_shape = tuple(kwargs.pop("batch_input_shape"))[1:]
        self.trainable = kwargs.pop("trainable", True)            # False: frozen (non_trainable.py)
        dtype = kwargs.pop("dtype", None)
        if dtype is not None and not _is_float32(dtype):
            raise NotImplementedError(f"{type(self).__name__}(dtype={dtype!r}): every layer computes in "
                                      f"float32 here; leave dtype out (or 'float32').")
        if kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected arguments {sorted(kwargs)}.")
        self.name = name or unique_name(snake_case(type(self).__name__))
        self.input_shape_arg = tuple(input_shape) if input_shape is not None else None
        self.input_shape = self.output_shape = None
        self.built = False
        self.inbound_nodes = []          # this layer's calls on symbolic tensors (functional.py)

    def __call__(self, inputs, **kwargs):
        """Keras's ``layer(x)`` on symbolic tensors (``keras.Input``, or the input of a
        subclassed model's traced ``call``): builds the layer, records a node and returns its
        symbolic output (``keras/functional.py``). Data goes through a model, not a layer."""
        if call_layers.is_call_layer(self) and not functional.is_symbolic(inputs):
            return call_layers.eager_call(self, inputs, kwargs)      # layer(x) on data
        if call_layers.inside_call() and not functional.is_symbolic(inputs):
            y = call_layers.call_inline(self, inputs)                 # Dense(x) inside a call: its ops
            if y is not None:
                return y
        if Layer.run_alone is not None and not functional.is_symbolic(inputs) \
                and not isinstance(inputs, (list, tuple, dict)):
            return Layer.run_alone(self, inputs, kwargs)               # Dense(2)(x) on data
        return functional.call_layer(self, inputs, kwargs)

    #: ``layer(x)`` on data for a library layer (``Dense``, ``Conv2D``...): the layer run alone,
    #: as a one-layer model of its own (``models.run_alone``, set when models.py is imported:
    #: it imports this file, so this file cannot import it)
    run_alone = None

    @property
    def trainable(self):
        """Keras's flag: False freezes the layer (its weights, and its sublayers', get no update
        and no optimizer slot: ``non_trainable.py``). Set it before ``compile``, as Keras asks."""
        return self.__dict__.get("trainable_flag", True)

    #: how many times any layer's ``trainable`` was set: ``fit`` re-checks its pack only when
    #: this moved since the pack was made (a check of every weight would cost each fit)
    trainable_changes = 0

    @trainable.setter
    def trainable(self, value):
        self.__dict__["trainable_flag"] = bool(value)
        Layer.trainable_changes += 1
        for layer in self.__dict__.get("_sublayers", ()):
            layer.trainable = value

    @property
    def weights(self):
        """Keras 3's order: the weights made trainable (``add_weight``), then those made
        non-trainable, then the sublayers' (a layer written with ``call``); the library's
        layers list their own."""
        own = [v for v, _ in self.__dict__.get("_added", ())]
        own = [v for v in own if v.trainable] + [v for v in own if not v.trainable]
        return own + [w for layer in self.__dict__.get("_sublayers", ()) for w in layer.weights]

    @property
    def trainable_weights(self):
        """The weights the optimizer updates: none when the layer is frozen."""
        return [w for w in self.weights if w.trainable] if self.trainable else []

    @property
    def trainable_variables(self):
        """Keras's other name for ``trainable_weights`` (what a tape's gradient is asked for)."""
        return self.trainable_weights

    @property
    def variables(self):
        return self.weights

    def get_weights(self):
        """The weights' values as NumPy arrays, in ``weights``' order (Keras's ``layer.get_weights``)."""
        return [w.numpy() for w in self.weights]

    def set_weights(self, weights):
        """Assign ``weights`` (arrays in ``get_weights``' order and shapes) to every copy."""
        weights = list(weights)
        mine = self.weights
        if len(weights) != len(mine) or any(np.shape(a) != tuple(w.shape) for a, w in zip(weights, mine)):
            raise ValueError(f"{type(self).__name__} {self.name!r}.set_weights: expected "
                             f"{[tuple(w.shape) for w in mine]}, got {[np.shape(a) for a in weights]}.")
        for w, a in zip(mine, weights):
            w.assign(np.asarray(a, np.float32))

    @property
    def non_trainable_weights(self):
        """The rest of ``weights`` (Keras's): a frozen layer's, and state (moving statistics)."""
        trainable = {id(w) for w in self.trainable_weights}
        return [w for w in self.weights if id(w) not in trainable]

    def add_weight(self, shape=None, initializer=None, dtype=None, trainable=True, autocast=True,
                   regularizer=None, constraint=None, aggregation="none", name=None):
        """Keras's ``add_weight``: a new variable of this layer (a MirroredVariable under a
        strategy's scope), listed in ``weights`` in Keras's order, packed with the model's when
        trainable; ``trainable=False, aggregation="mean"``: per-replica state (``non_trainable.py``)."""
        reg = regularizers.get(regularizer)
        var = call_layers.make_weight(self, shape, initializer, dtype, trainable, reg, constraint, name,
                                      aggregation)
        self.__dict__.setdefault("_added", []).append((var, reg))
        return var

    def add_loss(self, loss):
        """Keras's ``self.add_loss(value)`` in ``call``: a scalar term listed in ``losses`` (and
        the model's) until the next call, for a GradientTape loop to add (``call_layers.add_loss``)."""
        call_layers.add_loss(self, loss)

    # -- weight penalties (keras/regularizers.py): Dense and Conv2D take kernel_regularizer=
    kernel_regularizer = None

    @property
    def regularized(self):
        """[(regularizer, index of the weight in ``weights``)] for this layer's penalties."""
        if not self.built:
            return []
        if self.kernel_regularizer is not None:
            return [(self.kernel_regularizer, 0)]
        found = [(reg, i) for i, (_, reg) in enumerate(self.__dict__.get("_added", ())) if reg is not None]
        offset = len(self.__dict__.get("_added", ()))
        for layer in self.__dict__.get("_sublayers", ()):
            found += [(reg, offset + i) for reg, i in layer.regularized]
            offset += len(layer.weights)
        return found

    @property
    def reported_losses(self):
        """[(term, index)] the engine reports with the penalties: what ``call`` gives ``add_loss``
        (``call_layers.AddedLosses``); the gradient is the layer's own backward's."""
        return call_layers.reported_losses(self)

    @property
    def losses(self):
        """The penalties of this layer's weights as scalar tensors (Keras's ``layer.losses``), then
        the terms its ``call`` (and its sublayers') gave ``add_loss`` in the last call."""
        return [reg(self.weights[i]) for reg, i in self.regularized] + self.added_losses

    @property
    def added_losses(self):
        """What ``call`` (and its sublayers') gave ``add_loss`` in the last call: an eager
        ``layer(x)``, or this layer's forward as a node of a model on this replica."""
        return call_layers.added_eagerly(self) + call_layers.added_in_model(self) + [
            t for layer in self.__dict__.get("_sublayers", ()) for t in layer.added_losses]

    def output_shape_for(self, input_shape):
        if call_layers.is_call_layer(self):
            return call_layers.output_shape_for(self, input_shape)
        return input_shape

    def base_config(self):
        """The keys of Keras's config that every layer has; ``get_config`` adds the layer's own."""
        return {"name": self.name, "trainable": self.trainable, "dtype": "float32"}

    def get_config(self):
        """Keras's config of this layer: its constructor's arguments under Keras's keys
        (``keras/saving.py`` writes it into a .keras archive and rebuilds the layer from it).
        A layer written with ``call`` gets the base keys, which its own get_config extends."""
        if call_layers.is_call_layer(self):
            return self.base_config()
        raise NotImplementedError(f"layer {self.name!r} ({type(self).__name__}) has no config: saving a "
                                  f"whole model needs the library's layers ({', '.join(SUPPORTED)}); "
                                  f"save_weights works for any layer.")

    @classmethod
    def from_config(cls, config):
        """The layer again from what ``get_config`` wrote (Keras's default: ``cls(**config)``;
        ``load_model(path, custom_objects={...})`` calls it for a layer of the user's own).
        A dtype policy written by Keras 3 as a dict is read as its name."""
        config = dict(config)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = config["dtype"].get("config", {}).get("name", "float32")
        config.pop("batch_input_shape", None)
        return cls(**config)

    def build(self, input_shape):
        """Create the weights for examples of ``input_shape`` (under the model's strategy)."""
        if call_layers.is_call_layer(self):
            return call_layers.build(self, input_shape)
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
        if call_layers.is_call_layer(self):
            return call_layers.make_buffers(self, state, b)
        return None

    def forward(self, state, x, training=False):
        """x: (b,) + input_shape on ``state.dev`` -> y: (b,) + output_shape (launches only).
        A layer written with ``call``: ``call`` under a tape (``call_layers.py``)."""
        if call_layers.is_call_layer(self):
            return call_layers.forward(self, state, x, training)
        raise NotImplementedError(f"layer {self.name!r} ({type(self).__name__}) has no forward: a layer "
                                  f"defines forward(state, x, training) and backward(state, dy), see "
                                  f"the protocol in mirrored/keras/layers.py.")

    def backward(self, state, dy):
        """dy: d loss / d y -> the weights' gradients into ``state.grads``; returns d loss / d x,
        or None when ``state.need_dx`` is False."""
        if call_layers.is_call_layer(self):
            return call_layers.backward(self, state, dy)
        raise NotImplementedError(f"layer {self.name!r} ({type(self).__name__}) has no backward: a layer "
                                  f"defines forward(state, x, training) and backward(state, dy), see "
                                  f"the protocol in mirrored/keras/layers.py.")



def snake_case(name):
    """Keras's layer names: Dense -> dense, Conv2D -> conv2d, MaxPooling2D -> max_pooling2d."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower().lstrip("_")


def unique_name(base):
    """Keras's automatic names, layers' and models' alike: ``base`` the first time in this
    process, then ``base_1``, ``base_2``... (a functional config refers to layers by name, so
    two models used as layers in one model must not share one)."""
    n = Layer._counts.get(base, 0)
    Layer._counts[base] = n + 1
    return base if n == 0 else f"{base}_{n}"


class InputLayer(Layer):
    """Declares the shape of one example (``layers.Input(shape=(28, 28, 1))``)."""

    def __init__(self, shape=None, name=None, **kwargs):
        if shape is None:
            raise ValueError("Input needs a shape, e.g. layers.Input(shape=(28, 28, 1)).")
        super().__init__(input_shape=tuple(shape), name=name, **kwargs)


def Input(shape=None, batch_size=None, dtype=None, sparse=None, batch_shape=None, name=None,  # noqa: N802
          tensor=None, optional=False):
    """``tf.keras.layers.Input``/``tf.keras.Input`` (Keras 3's arguments): a symbolic tensor
    (``functional.KerasTensor``) for examples of ``shape``, or ``batch_shape`` with the batch
    axis first: the start of a functional model, or a Sequential's first entry. ``batch_size``
    and ``dtype`` are accepted (batches may have any size; inputs become float32, as Keras's
    layers cast them); sparse, symbolic-tensor and optional inputs are refused."""
    if sparse or tensor is not None or optional:
        raise NotImplementedError("Input(sparse=, tensor=, optional=) is not implemented; dense inputs only.")
    if batch_shape is not None:
        if shape is not None:
            raise ValueError("Input: give shape or batch_shape, not both.")
        shape = tuple(batch_shape)[1:]
    layer = InputLayer(shape=shape, name=name)
    return functional.input_tensor(layer, layer.input_shape_arg, name)


# --- images: the arguments Conv2D and MaxPooling2D share (NHWC, Keras's layouts) ------------------
def image_shape(layer, input_shape):
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


def channels_last(layer, data_format):
    """Refuse any ``data_format`` but NHWC (Keras's default, the only layout here)."""
    if data_format not in (None, "channels_last"):
        raise NotImplementedError(
            f"{type(layer).__name__}: data_format={data_format!r} is not supported; only "
            f"'channels_last' (NHWC: images (height, width, channels), Keras's default) is.")


def padding_arg(layer, padding):
    """``padding`` as 'valid' or 'same' (any case), else a ValueError."""
    if not isinstance(padding, str) or padding.lower() not in PADDINGS:
        raise ValueError(f"{type(layer).__name__}: padding must be 'valid' or 'same', got {padding!r}.")
    return padding.lower()


def unsupported(name):
    """A stand-in for Keras's layer ``name``: constructing it raises, saying what there is."""
    class Unsupported(Layer):
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                f"layers.{name} is not implemented: mirrored has the layers of the course lab "
                f"and its usual next steps: {', '.join(SUPPORTED)} (Input too).")
    Unsupported.__name__ = name
    return Unsupported


SUPPORTED = ("Flatten", "Dense", "Conv2D", "MaxPooling2D", "Dropout",
             "Add", "Subtract", "Multiply", "Average", "Concatenate",   # the merge layers: merging.py
             "Activation", "ReLU", "LeakyReLU", "Softmax", "Reshape", "Rescaling", "Lambda",  # composed_layers.py
             "BatchNormalization", "LayerNormalization",                                   # normalization.py
             "GlobalAveragePooling2D", "GlobalMaxPooling2D", "AveragePooling2D", "UpSampling2D",  # pooling_layers.py
             "Embedding",                                                                  # embedding.py
             "Conv2DTranspose")                                                            # conv_transpose.py
Conv1D = unsupported("Conv1D")
LSTM = unsupported("LSTM")

