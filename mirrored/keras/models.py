"""Keras's models (``Model``, ``Sequential``, ``Functional``): made, built, used as layers
(``fit``, the loop around one training step, is ``trainer.py``'s).

Every model is one program of layer nodes (``engine.Node``s in topological order, run by
``engine.ReplicaProgram``): ``Sequential`` makes a chain, ``keras.Model(inputs, outputs)``
(``Functional``) the recorded layer calls between them, and a subclass of ``Model`` the calls
its ``call`` makes when traced on a symbolic input (``functional.py`` records, sorts, traces).
After building, the three are the same to the step.

A model remembers the strategy in force when it was created (``with
strategy.scope(): model = Sequential([...])``): its weights are then
``MirroredVariable``s, and ``compile``, ``fit``, ``evaluate``, ``predict`` and
``save_weights`` may be called inside or outside the scope — the course lab
calls ``compile`` outside it with ``optimizers.Adam()`` created there.

This file is what a model IS: made (``_setup`` makes the state every method of the model
uses), built (its program, its weights and its ``step.Step``), used as a layer. What ``fit``
does with it is the base class ``trainer.Trainer`` (``trainer.py``: Keras's loop around the
step: epochs, callbacks, the progress line); what happens in one training step is in
``step.py`` (split → forward/backward → all-reduce → update). The rest of Keras's model API
(compile, evaluate, predict, ``model(x)``, weights, saving, summary) is the other base class,
``model_api.ModelAPI``: methods of the model all the same. ``trainer.py``'s docstring writes
down the contract between the three (``_setup``'s attributes).

One model, many threads. Each public method that runs or changes the model (``fit``,
``evaluate``, ``predict``, ``train_step``, ``model(x)`` outside ``strategy.run``, the
weights' getters and setters, saving and loading) holds the model's lock, a re-entrant
one: two threads using one model take turns, and a callback may still call ``predict`` or
``save_weights`` inside ``fit`` (same thread). Each replica's buffers are reused from call
to call, so without it a second thread's batch overwrote the first's mid-step. Inside
``strategy.run`` the replicas call the model on their own devices and programs, one
``run`` at a time per strategy; they take only the build lock, so a model with no
``input_shape`` is built exactly once, by whichever replica comes first. (Not guarded:
a custom loop's ``strategy.run`` calling the model while another thread runs its ``fit``;
taking the model's lock there would deadlock a callback that calls ``strategy.run``.)

Neighbours: ``trainer.py`` (fit), ``model_api.py`` (the rest of the model's methods),
``layers.py`` (what a model is made of), ``step.py`` (the step),
``data_adapters.py`` (what fit/evaluate/predict accept), ``saving.py``,
``losses.py``, ``optimizers.py``, ``callbacks.py``, ``progbar.py``,
``tape.py`` (``GradientTape`` custom loops use the same replica programs).
"""
import contextlib
import threading

import numpy as np

from mirrored import nest, strategy as _strategy
from mirrored.program import recording
from mirrored.keras import saving
from mirrored.keras import functional, model_call, multi_io
from mirrored.keras.base_layer import snake_case, unique_name
from mirrored.keras.dropout import Dropout
from mirrored.keras.layers import InputLayer, Layer
from mirrored.keras.model_api import ModelAPI
from mirrored.keras.engine import Node
from mirrored.keras.step import Step
from mirrored.keras.trainer import Trainer, is_default_strategy
from mirrored.values import components


@saving.register_model_class
class Model(Trainer, ModelAPI):
    """Keras's ``Model``: one program of layer nodes (``engine.Node``) and everything Keras's
    model API does with it (``fit`` is the base class ``Trainer``'s, ``trainer.py``; compile,
    evaluate, predict, weights and saving ``ModelAPI``'s, ``model_api.py``). Three ways to make one, one engine:

    * ``keras.Model(inputs, outputs)``: a ``Functional`` model, the nodes between them;
    * ``Sequential([...])``: a chain of nodes;
    * ``class M(keras.Model)`` with ``call(self, inputs, training=None)``: ``call`` traced
      with a symbolic input on first use (``functional.call_symbolically``), as tf.function traces it.
    """

    structured_io, step_type = False, Step   # several inputs/outputs: Functional, multi_io.py

    def __new__(cls, *args, **kwargs):
        if cls is Model and (args or "inputs" in kwargs or "outputs" in kwargs):
            cls = Functional                  # keras.Model(inputs, outputs), as Keras 3 does
        return super().__new__(cls)

    def __init__(self, *args, name=None, **kwargs):
        if _functional_arguments(args, kwargs):   # CustomModel(inputs, outputs), as Keras 3 takes it
            self.__class__ = functional_subclass(type(self))
            Functional.__init__(self, *args, name=name, **kwargs)
            return
        if args or "inputs" in kwargs or "outputs" in kwargs:
            raise NotImplementedError(
                f"{type(self).__name__}: a subclass of keras.Model made with inputs and outputs (a "
                f"functional subclass) is not implemented here; use keras.Model(inputs, outputs), or "
                f"define call(self, inputs, training=None).")
        trainable = _keras_defaults(type(self).__name__, kwargs)
        self._setup(name or unique_name(snake_case(type(self).__name__)))
        if not trainable:
            self.trainable = False

    def _setup(self, name):
        self._lock = threading.RLock()          # one caller at a time (module docstring)
        self._build_lock = threading.Lock()     # build exactly once, whoever calls first
        self._building = False                  # inside _build (its weights are being made)
        self.name = name
        self._strategy = _strategy.get_strategy()
        self._layers = None                     # None: the layers set as attributes (subclassed)
        self.nodes = None                       # the program (engine.Node list), once built
        self._input_shape = None
        self.built = False
        self.step = None                 # the training step (step.Step), made by build
        self._claimed = None             # custom_loop.MOVES when this model last claimed its weights
        self.inbound_nodes = []          # this model's calls on symbolic tensors, as a layer's (functional.py)
        self.optimizer = self.loss = None
        self._metric_names = []          # the accuracy the loss kernel counts on the devices
        self.host_metrics = []           # compile's other metrics, updated on the host
        # compile(run_eagerly=...): False (Keras's default) replays each pass as CUDA graphs
        # on a GPU; _graphs: its StepGraphs, made on first use; _captured: the CapturedStep
        self._run_eagerly, self._graphs_asked, self._graphs, self._captured = False, False, None, None
        self._steps_per_execution = 1    # compile(steps_per_execution=N): batches per execution
        self._custom_train = False       # fit runs the user's train_step (custom_step.py)
        self.step_logs = None            # the logs of the last step a user's train_step ran
        self.history = None
        self.stop_training = False

    @property
    def layers(self):
        """The model's layers in Keras's order (that of ``model.weights``)."""
        return list(self._layers if self._layers is not None else self.__dict__.get("_tracked", []))

    def scalar_examples(self):
        """A subclassed model whose ``call`` works on its own variables takes x of shape (N,), as
        Keras: ``call`` gets (b,) (``model_call.py``); a model of layers needs (b, features)."""
        return type(self)._program is Model._program and bool(self.own_variables) and (
            self._input_shape is None or self.__dict__.get("_scalar_call", False))

    @property
    def own_variables(self):
        """Its ``tf.Variable`` attributes, trainable first, in the order set (before its layers')."""
        own = self.__dict__.get("_own_variables", ())
        return [v for v in own if v.trainable] + [v for v in own if not v.trainable]

    @property
    def input_shape(self):
        """``(None,) + one example's shape`` once known."""
        return None if self._input_shape is None else (None,) + tuple(self._input_shape)

    @property
    def output_shape(self):
        return None if self.nodes is None else (None,) + tuple(self.nodes[-1].layer.output_shape)

    def _scope(self):
        if is_default_strategy(self._strategy):
            return contextlib.nullcontext()
        return self._strategy.scope()

    def build(self, input_shape=None):
        """Create the weights (under the model's strategy) for examples of ``input_shape``
        (with or without a leading ``None`` batch axis), then the training step.

        Thread-safe: replicas of ``strategy.run`` that call a model with no input shape
        all ask to build it; the first builds, the others wait and find it built (each
        building its own weights left the tape holding weights the optimizer never saw)."""
        if self.built:                             # set last, once everything exists
            return
        with self._build_lock:
            if not self.built:
                self._building = True
                try:
                    self._build(input_shape)
                finally:
                    self._building = False

    def _build(self, input_shape):
        if input_shape is not None:
            self._input_shape = tuple(input_shape)[1:] if len(input_shape) >= 1 and input_shape[0] is None \
                else tuple(input_shape)
        if self._input_shape is None:
            raise ValueError("the model's input shape is unknown: give the first layer "
                             "input_shape=..., start with layers.Input(shape=...), or call fit first.")
        with self._scope():
            nodes = self._program(tuple(self._input_shape))
        for i, node in enumerate(nodes):
            if i < len(nodes) - 1 and getattr(node.layer, "activation", None) == "softmax":
                raise NotImplementedError(f"softmax is supported on the last layer only ({node.layer.name!r}).")
            calls = sum(other.layer is node.layer for other in nodes)
            if calls > 1 and node.layer.training_state() is not None:
                raise NotImplementedError(
                    f"{type(node.layer).__name__} {node.layer.name!r} is called {calls} times in {self.name!r}: a "
                    f"layer that keeps training state (Dropout's mask counter) is called once per model "
                    f"here. Use a new layer for each call.")
        self.nodes = nodes
        variables = self.weights
        devices = [c.value().dev for c in components(variables[0])] if variables else \
            list(self._strategy.extended.devices)
        if any(len(components(v)) != len(devices) for v in variables) or \
                len(devices) != len(self._strategy.extended.worker_devices):
            self.nodes = None
            raise ValueError(f"the weights of {self.name!r} were created under another strategy than the "
                             f"model ({self._strategy!r}): create the inputs, the layers and the model "
                             f"inside one strategy.scope().")
        self._output_shape = nodes[-1].layer.output_shape
        with recording.initialization():     # built inside a @function's trace: never replayed
            self.step = self.step_type(self, devices, self._strategy.extended.cross_device_ops)
            self.step.packed_at = Layer.trainable_changes   # what fit compares (check_trainable)
        self.built = True

    def _program(self, input_shape):
        """A subclassed model's program: ``call`` traced on a symbolic input, for training and
        not; the two must agree but for Dropout layers (the identity outside training), as
        the step tells every layer at run time whether it trains (``fit``) or not."""
        if type(self).call is Model.call:
            raise NotImplementedError(f"{type(self).__name__} has no call(self, inputs, training=None): a "
                                      f"subclass of keras.Model defines it (or use keras.Model(inputs, "
                                      f"outputs) or Sequential).")
        scalars = self.__dict__.get("_scalar_call", False)         # x of shape (N,): accept_inputs
        if self.own_variables or scalars or model_call.untraceable(self, input_shape, InputLayer):
            return [Node(model_call.built(self, input_shape, scalars), (0,), False)]   # call as one node
        nodes, layers, _ = functional.call_symbolically(self, input_shape, True, InputLayer(shape=input_shape))
        other, _, _ = functional.call_symbolically(self, input_shape, False, InputLayer(shape=input_shape))
        if not functional.same_program(nodes, other, lambda layer: isinstance(layer, Dropout)):
            raise NotImplementedError(
                f"{type(self).__name__}.call builds a different model when training is True than when "
                f"it is False. Here a model is one program and every layer learns at run time whether "
                f"it trains: pass training=training to the layers (Dropout) instead of branching on it.")
        tracked = self.__dict__.setdefault("_tracked", [])
        tracked += [l for l in layers if all(l is not t for t in tracked)]
        return nodes

    def call(self, inputs, training=None):
        """Subclasses define it: the layers applied to ``inputs`` (traced, see ``_program``)."""
        raise NotImplementedError

    # -- a model used as a layer (Sequential([model, Softmax()]), model(keras.Input), in call())
    def nested_output_shape(self, input_shape):
        """Build for examples of ``input_shape`` (if need be) and check them; the shape of one
        output example. ``functional.call_layer`` records the call as one node."""
        input_shape = tuple(input_shape)
        if self.structured_io:
            raise NotImplementedError(f"{functional.user_line()}: the model {self.name!r} has several inputs or "
                                      f"outputs; such a model is not used as a layer of another here.")
        if self._input_shape is None:
            self._input_shape = input_shape
        if tuple(self._input_shape) != input_shape:
            raise ValueError(f"{functional.user_line()}: the model {self.name!r} takes examples of shape "
                             f"{tuple(self._input_shape)}, and is called on {input_shape}: a model used "
                             f"as a layer takes the shape it was built for.")
        self.build()
        return tuple(self._output_shape)

    output_shape_for = nested_output_shape          # a model in a Sequential, as a layer answers

    def nested_nodes(self):
        """This model's program, for the model it is used in (``functional.expand``): its
        layers run there with the same weights, which both models pack (``custom_loop.claim``)."""
        self.build()
        return list(self.nodes)

    def training_state(self):
        """A model used as a layer keeps its layers' state in its layers (saving reads them)."""
        return None

    # -- weights -------------------------------------------------------------------------
    @property
    def weights(self):
        """The layers' weights in Keras's order (layer by layer, each layer's ``weights``:
        trainable then non-trainable). A model whose input shape is known (the first layer's
        ``input_shape``, or ``layers.Input``) but not yet built is built here, on first use:
        Keras 3 builds it as soon as the shape is given, so ``summary()``, ``get_weights()``
        or a custom loop's ``model.trainable_variables`` after ``add`` find the weights there."""
        self.build_if_shape_known()
        return self.own_variables + [w for layer in self.layers for w in layer.weights]

    @property
    def trainable_variables(self):
        """The weights the optimizer updates (those of layers not frozen), in Keras's order."""
        self.build_if_shape_known()
        if not self.trainable:
            return []
        own = [v for v in self.own_variables if v.trainable]
        return own + [w for layer in self.layers for w in layer.trainable_weights]

    @property
    def non_trainable_variables(self):
        """Frozen layers' weights and layers' state (moving statistics), in Keras's order."""
        trainable = {id(w) for w in self.trainable_variables}
        return [w for w in self.weights if id(w) not in trainable]

    def build_if_shape_known(self):
        """Build the model now if its input shape is known and it is not built (nor being
        built: ``_build`` reads the weights too)."""
        if not self.built and not self._building and self._input_shape is not None:
            self.build()

    variables, trainable_weights, non_trainable_weights = weights, trainable_variables, non_trainable_variables

@saving.register_model_class
class Sequential(Model):
    """A stack of layers run in order (see layers.py for the layers there are): a chain of
    nodes, node i reading node i - 1's output."""

    def __init__(self, layers=None, name=None, **kwargs):
        trainable = _keras_defaults("Sequential", kwargs)
        self._setup(name or unique_name("sequential"))
        self._layers = []
        for layer in layers or []:
            self.add(layer)
        if not trainable:
            self.trainable = False
        if self._input_shape is not None:
            self.build()

    def add(self, layer):
        if self.built:
            raise RuntimeError("the model is already built; add every layer before it is first used.")
        if isinstance(layer, functional.KerasTensor) and isinstance(layer.node.layer, InputLayer):
            layer = layer.node.layer                    # keras.Input(shape): Keras 3 takes it here
        if isinstance(layer, InputLayer):
            self._input_shape = layer.input_shape_arg
            return
        if not isinstance(layer, (Layer, Model)):
            raise TypeError(f"Sequential takes mirrored.keras layers and models, got {layer!r}.")
        first_shape = layer.input_shape if isinstance(layer, Model) else layer.input_shape_arg
        if not self._layers and first_shape is not None:
            self._input_shape = tuple(first_shape[1:] if isinstance(layer, Model) else first_shape)
        self._layers.append(layer)

    def _program(self, input_shape):
        """Build the layers in turn (every shape checked before any weight exists: a bad
        layer leaves nothing half-built); the chain of their nodes."""
        shape = input_shape
        for layer in self._layers:
            if isinstance(layer, Model):            # a model used as a layer: built here, its nodes inlined
                shape = layer.nested_output_shape(shape)
                continue
            shape = layer.output_shape_for(shape)
        shape, nodes = input_shape, []
        for layer in self._layers:
            if not isinstance(layer, Model):
                layer.build(shape)
                shape = layer.output_shape
            else:
                shape = layer.nested_output_shape(shape)
            nodes += functional.expand(layer, (len(nodes),), False, len(nodes))
        return nodes


@saving.register_model_class
class Functional(Model):
    """``keras.Model(inputs, outputs)``: the layer calls between a ``keras.Input`` and an output,
    as ``functional.program`` orders them. The layers are built (they were called)."""

    def __init__(self, inputs, outputs, name=None, **kwargs):
        trainable = _keras_defaults("Model", kwargs)
        self.structured_io = functional.structured(inputs, outputs)     # several inputs/outputs: multi_io.py
        nodes, layers, symbolic, shape = (multi_io.engine_program(inputs, outputs) if self.structured_io
                                          else functional.program(inputs, outputs) + (None,))
        self._setup(name or unique_name("functional" if type(self) is Functional else snake_case(type(self).__name__)))
        self._layers = layers
        if not trainable:
            self.trainable = False
        self.symbolic_nodes = symbolic           # the recorded calls (saving, summary)
        self.inputs = functional.flat_tensors(inputs, "inputs")
        self.outputs = functional.flat_tensors(outputs, "outputs")
        self.input_structure, self.output_structure = inputs, outputs    # as written: one, a list, a dict
        if self.structured_io:
            self.step_type = multi_io.StructuredStep
        self._input_shape = self.engine_input_shape = shape or tuple(self.inputs[0].shape[1:])
        self._nodes_made = nodes
        self.build()

    def _program(self, input_shape):
        if tuple(input_shape) != tuple(self._input_shape):
            raise ValueError(f"the functional model {self.name!r} takes examples of shape "
                             f"{self._input_shape} (its keras.Input), not {input_shape}.")
        return self._nodes_made

    def call(self, inputs, training=None):
        raise NotImplementedError("a functional model runs its recorded layer calls; call the model, model(x).")

    @property
    def input_shape(self):
        """Keras 3's: ``(None,) + one example's shape``, in the inputs' structure if several."""
        return nest.map_structure(lambda t: t.shape, self.input_structure) if self.structured_io \
            else super().input_shape

    @property
    def output_shape(self):
        return nest.map_structure(lambda t: t.shape, self.output_structure) if self.structured_io \
            else super().output_shape

    input = property(lambda self: self.input_structure if self.structured_io else self.inputs[0])
    output = property(lambda self: self.output_structure if self.structured_io else self.outputs[0])
    #: Keras 3's: the names of the layers that make the outputs (what compile's dicts are keyed by)
    output_names = property(lambda self: [t.node.layer.name for t in self.outputs])


_FUNCTIONAL_SUBCLASSES = {}       # a Model subclass -> its functional twin (functional_subclass)


def _functional_arguments(args, kwargs):
    """Keras 3's ``functional_init_arguments``: a model made as ``M(inputs, outputs)``."""
    return len(args) == 2 or len(args) == 1 and "outputs" in kwargs or \
        "inputs" in kwargs and "outputs" in kwargs


def functional_subclass(cls):
    """``CustomModel(inputs, outputs)`` for ``class CustomModel(keras.Model)``: when ``Model.__init__``
    gets inputs and outputs (Keras 3's ``functional_init_arguments``), Keras 3 makes the class
    functional (its ``inject_functional_model_class``); here the instance becomes one of a
    subclass of both, made once (the user's class untouched), so the user's methods
    (``train_step``, ``metrics``) come first and ``Functional``'s build the program."""
    twin = _FUNCTIONAL_SUBCLASSES.get(cls)
    if twin is None:
        twin = type(cls.__name__, (cls, Functional), {"__module__": cls.__module__,
                                                       "__qualname__": cls.__qualname__})
        _FUNCTIONAL_SUBCLASSES[cls] = twin
    return twin


def _keras_defaults(what, kwargs):
    """Keras's model arguments that change nothing here (dtype float32) are accepted; any
    other refused by name. ``trainable`` is taken out (``Model._setup`` reads it back)."""
    kwargs["trainable_arg"] = kwargs.pop("trainable", True)
    dtype = kwargs.pop("dtype", None)
    if dtype not in (None, "float32"):
        raise NotImplementedError(f"{what}(dtype={dtype!r}): models compute in float32 here.")
    trainable = kwargs.pop("trainable_arg")
    if kwargs:
        raise TypeError(f"{what}: unexpected arguments {sorted(kwargs)}.")
    return trainable


def run_alone(layer, inputs, kwargs):
    """``layer(x)`` on data for a library layer, outside any model (TF's autodiff guide:
    ``layer = Dense(2, activation='relu'); y = layer(x)`` under a tape): a one-layer
    ``Sequential`` made on the first call and kept with the layer, so ``layer.weights`` and
    ``layer.trainable_variables`` are that model's, and a tape differentiates the call as any
    model call. Shapes after the first must have the same features (the layer is built)."""
    shape = tuple(np.shape(inputs)[1:])
    model = layer.__dict__.get("_alone")
    if model is None:
        model = Sequential([InputLayer(shape), layer])
        layer.__dict__["_alone"] = model   # private: saving walks public ones
    elif tuple(model.input_shape[1:]) != shape:
        raise ValueError(f"{type(layer).__name__} {layer.name!r} was first called on examples of shape "
                         f"{tuple(model.input_shape[1:])}, now on {shape}: call it on the same shape "
                         f"(it is built for it), or make another layer.")
    return model(inputs, training=bool(kwargs.get("training") or False))


Layer.run_alone = staticmethod(run_alone)
