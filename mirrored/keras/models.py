"""Keras's models (``Model``, ``Sequential``, ``Functional``), built, and ``fit``: the loop
around one training step.

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

This file is what ``fit``'s step passes through on the Keras side: building the model
(its program, its weights and its ``step.Step``) and ``fit``, Keras's loop around the step (epochs,
callbacks, the progress line). What happens in one training step is in ``step.py``
(split → forward/backward → all-reduce → update). The loss and accuracy stay on the
devices and are read when the progress line is drawn. The rest of Keras's model API
(compile, evaluate, predict, ``model(x)``, weights, saving, summary) is the base class,
``model_api.ModelAPI``: methods of the model all the same.

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

Neighbours: ``model_api.py`` (the rest of the model's methods), ``layers.py`` (what a
model is made of), ``step.py`` (the step),
``data_adapters.py`` (what fit/evaluate/predict accept), ``saving.py``,
``losses.py``, ``optimizers.py``, ``callbacks.py``, ``progbar.py``,
``tape.py`` (``GradientTape`` custom loops use the same replica programs).
"""
import contextlib
import itertools
import threading
import warnings

import numpy as np

from mirrored import backends, recording, strategy as _strategy
from mirrored.graphs import CapturedStep, StepGraphs
from mirrored.keras import callbacks as _callbacks
from mirrored.keras import custom_loop, custom_step, data_adapters
from mirrored.keras import saving
from mirrored.keras import functional
from mirrored.keras.base_layer import snake_case
from mirrored.keras.dropout import Dropout
from mirrored.keras.engine import Node
from mirrored.keras.layers import IMAGE_LAYERS, InputLayer, Layer
from mirrored.keras.model_api import (ModelAPI, check_keras_arguments, check_steps_per_execution,
                                      no_batches_error, serialised)
from mirrored.keras.progbar import Progbar
from mirrored.keras.step import Step, check_compiled
from mirrored.values import components


@saving.register_model_class
class Model(ModelAPI):
    """Keras's ``Model``: one program of layer nodes (``engine.Node``) and everything Keras's
    model API does with it (compile, evaluate, predict, weights and saving are the base
    class's, ``model_api.py``). Three ways to make one, one engine:

    * ``keras.Model(inputs, outputs)``: a ``Functional`` model, the nodes between them;
    * ``Sequential([...])``: a chain of nodes;
    * ``class M(keras.Model)`` with ``call(self, inputs, training=None)``: ``call`` traced
      with a symbolic input on first use (``functional.trace``), as tf.function traces it.
    """

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
        self._setup(name or snake_case(type(self).__name__))
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

    def __setattr__(self, name, value):
        """Layers and models set as attributes (one, or a list of them) are the model's, in the
        order set (Keras tracks them so: ``model.layers`` of a subclassed model)."""
        found = value if isinstance(value, (list, tuple)) else [value]
        if not name.startswith("_") and found and all(isinstance(v, (Layer, ModelAPI)) for v in found):
            tracked = self.__dict__.setdefault("_tracked", [])
            tracked += [v for v in found if all(v is not t for t in tracked)]
        super().__setattr__(name, value)

    @property
    def layers(self):
        """The model's layers in Keras's order (that of ``model.weights``)."""
        return list(self._layers if self._layers is not None else self.__dict__.get("_tracked", []))

    @property
    def steps_per_execution(self):
        """Keras's: how many batches ``fit`` and ``evaluate`` run per execution (the callbacks'
        batch hooks are called once per execution); ``compile(steps_per_execution=N)`` sets it."""
        return self._steps_per_execution

    @steps_per_execution.setter
    def steps_per_execution(self, value):
        self._steps_per_execution = check_steps_per_execution(value, "model.steps_per_execution")

    @property
    def distribute_strategy(self):
        """The strategy the model was created under (Keras's name)."""
        return self._strategy

    @property
    def input_shape(self):
        """``(None,) + one example's shape`` once known."""
        return None if self._input_shape is None else (None,) + tuple(self._input_shape)

    @property
    def output_shape(self):
        return None if self.nodes is None else (None,) + tuple(self.nodes[-1].layer.output_shape)

    def _scope(self):
        if _is_default(self._strategy):
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
            self._input_shape = tuple(input_shape)[1:] if len(input_shape) > 1 and input_shape[0] is None \
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
        if not variables:
            raise ValueError(f"a model here needs at least one layer with weights (a Dense layer); "
                             f"{self.name!r} has none.")
        devices = [c.value().dev for c in components(variables[0])]
        if any(len(components(v)) != len(devices) for v in variables) or \
                len(devices) != len(self._strategy.extended.worker_devices):
            self.nodes = None
            raise ValueError(f"the weights of {self.name!r} were created under another strategy than the "
                             f"model ({self._strategy!r}): create the inputs, the layers and the model "
                             f"inside one strategy.scope().")
        self._output_shape = nodes[-1].layer.output_shape
        with recording.initialization():     # built inside a @function's trace: never replayed
            self.step = Step(self, devices, self._strategy.extended.cross_device_ops)
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
        nodes, layers, _ = functional.trace(self, input_shape, True, InputLayer(shape=input_shape))
        other, _, _ = functional.trace(self, input_shape, False, InputLayer(shape=input_shape))
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

    def accept_inputs(self, shape, dtype, what="x"):
        """Check a batch of inputs of ``shape`` (batch axis first) and ``dtype``, build the
        model from it if need be, and check it against the model's input shape
        (``check_example_shape``). Raises before anything is computed or changed."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        if dtype.kind not in "biuf":
            raise TypeError(f"{what} has dtype {dtype}{_why_not_numbers(dtype)}; the model takes "
                            f"numbers (float32): convert it with np.asarray({what}, np.float32) after "
                            f"removing or filling the missing entries.")
        keras_expands = self._input_shape is not None and shape[1:] + (1,) == tuple(self._input_shape)
        if len(shape) < 2 and not keras_expands:     # (B,) for input shape (1,): Keras adds the axis
            want = "(batch, features)" if self._input_shape is None else str((None,) + self._input_shape)
            raise ValueError(f"{what} of shape {shape} has no batch axis: the model takes a batch of "
                             f"examples, shape {want}. For one example use {what}[None] "
                             f"(shape {(1,) + shape}).")
        self.build((None,) + shape[1:])
        self.check_example_shape(shape[1:], what)

    def check_example_shape(self, shape, what="x"):
        """Refuse examples of ``shape`` that the model would misread, as Keras 3 does.

        The examples must have the model's input shape. Keras 3 also accepts a last axis
        of size 1 added or missing ((28, 28) for (28, 28, 1) and back), and so do we for
        every first layer but an image layer (Conv2D, MaxPooling2D), which reads the
        image's axes: MNIST as a 28x28 array is not a (28, 28, 1) image until its
        channel axis is added, and saying so beats a silent reshape. Anything else,
        such as (784,) for (28, 28, 1), is refused, as Keras refuses it: the step would
        copy the numbers in and train on them silently.
        """
        shape, want = tuple(shape), tuple(self._input_shape)
        if shape == want:
            return
        readers = [node.layer for node in self.nodes if 0 in node.inputs]     # the input's layers
        first = next((layer for layer in readers if isinstance(layer, IMAGE_LAYERS)), readers[0])
        if isinstance(first, IMAGE_LAYERS):
            hint = (" Add the channel axis: x[..., None] (NumPy) or "
                    "dataset.map(lambda image, label: (image[..., None], label))."
                    if shape + (1,) == want else "")
            raise ValueError(f"the model's first layer, {type(first).__name__} {first.name!r}, takes images "
                             f"of shape {want} (height, width, channels), got examples of shape {shape}.{hint}")
        if shape + (1,) == want or shape == want + (1,):    # Keras 3's last-axis squeeze
            return
        raise ValueError(f"the model expects inputs of shape {(None,) + want}, got {what} with examples of "
                         f"shape {shape} ((batch,) + {shape}). Reshape {what} to (batch,) + {want}, or build "
                         f"the model for this shape (input_shape={shape}).")

    def _check_strategy(self):
        """Refuse to run under the scope of a strategy other than the model's, as TensorFlow
        refuses variables created outside the scope they are used in. Outside every scope
        (the course lab's ``compile``/``fit`` after the ``with`` block) the model's own
        strategy is used. A model not yet built and created outside any scope adopts the
        strategy whose scope it is first used in (its weights do not exist yet)."""
        current = _strategy.get_strategy()
        if _is_default(current) or current is self._strategy:
            return
        if not self.built and _is_default(self._strategy):
            self._strategy = current
            return
        raise ValueError(
            f"the model's variables were not created in the scope of {current!r}, the strategy in force "
            f"now: the model was created under {self._strategy!r}. Create the model inside the scope of "
            f"the strategy that trains it:\n  with strategy.scope():\n    model = create_model()\n"
            f"  model.compile(...)\n  model.fit(...)   # inside or outside the scope")

    # -- weights -------------------------------------------------------------------------
    @property
    def weights(self):
        """The layers' weights in Keras's order (layer by layer, each layer's ``weights``:
        trainable then non-trainable). A model whose input shape is known (the first layer's
        ``input_shape``, or ``layers.Input``) but not yet built is built here, on first use:
        Keras 3 builds it as soon as the shape is given, so ``summary()``, ``get_weights()``
        or a custom loop's ``model.trainable_variables`` after ``add`` find the weights there."""
        self.build_if_shape_known()
        return [w for layer in self.layers for w in layer.weights]

    @property
    def trainable_variables(self):
        """The weights the optimizer updates (those of layers not frozen), in Keras's order."""
        self.build_if_shape_known()
        if not self.trainable:
            return []
        return [w for layer in self.layers for w in layer.trainable_weights]

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

    variables = weights
    trainable_weights = trainable_variables
    non_trainable_weights = non_trainable_variables

    @property
    def _step_graphs(self):
        """This model's CUDA graphs (``mirrored.graphs.StepGraphs``, made on first use), or
        None when it runs eagerly (``run_eagerly=True``). Their ``reason`` says why not
        where there is nothing to capture; only ``compile(cuda_graph=True)`` warns of it."""
        if self._run_eagerly or self.step is None:
            return None
        if self._graphs is None:
            self._graphs = StepGraphs(self.step.devices, self._strategy.extended.cross_device_ops)
            if self._graphs.reason and self._graphs_asked:
                warnings.warn(f"compile(cuda_graph=True): {self._graphs.reason}; fit, evaluate and "
                              f"predict run eagerly (the same launches, one by one).", stacklevel=5)
        return self._graphs

    def _trainer(self):
        """What runs fit's, evaluate's and predict's passes: the step itself, or the step
        with its device parts captured as CUDA graphs (``mirrored/graphs.py``)."""
        graphs = self._step_graphs
        if graphs is None or graphs.reason is not None:     # None: graphs are used
            return self.step
        if self._captured is None or self._captured.graphs is not graphs:
            self._captured = CapturedStep(self.step, graphs)
        return self._captured

    # -- one step ---------------------------------------------------------------------------
    @custom_step.default
    @serialised
    def train_step(self, x, y):
        """One training step on a host batch x (B, ...), y (B,): split, forward/backward on
        every replica, all-reduce, update (``step.py``). ``fit`` runs this for every batch."""
        check_compiled(self, "training")
        if self.built and self.step.packed_at != Layer.trainable_changes:
            self.check_trainable("train_step")
        self._check_strategy()
        self._train_on((x, y))

    def _train_on(self, batch):
        """One training step on a batch from ``data_adapters.batches``."""
        batch = data_adapters.prepare(self, batch)   # x (B, in) float32, y (B,), or row numbers
        if self._claimed != custom_loop.MOVES[0]:    # a model sharing a layer may hold its weights
            self.use_own_weights()
        with self.step.rolled_back_on_error():                   # a step that raises changes nothing
            self._trainer().train(batch)
        if self.host_metrics:                        # compile(metrics=["mae", fn, Metric()])
            custom_step.update_from_programs(self, batch)

    def _train_execution(self, batches):
        """One execution of ``compile(steps_per_execution=N)``: the training steps of
        ``batches`` (1 to N), in order. On a GPU with graphs, one replay runs them all
        (``CapturedStep.train_steps``); elsewhere they run one after the other, each all or
        nothing, so a failure keeps the steps before it (counted, every copy updated).
        A model with its own ``train_step`` runs that on each (``custom_step.py``)."""
        if self._custom_train:
            return custom_step.train(self, batches)
        trainer = self._trainer() if self.built else None       # the first batch builds the model
        if trainer is not None and self._claimed != custom_loop.MOVES[0]:
            self.use_own_weights()
        if len(batches) > 1 and trainer is not None and trainer is not self.step and not self.host_metrics:
            trainer.train_steps([data_adapters.prepare(self, batch) for batch in batches])
            return
        for batch in batches:
            self._train_on(batch)

    def _logs(self, prefix="", across_workers=True):
        if self._custom_train:                       # the user's step: what it returned
            return dict(self.step_logs or {})
        return self.device_logs(prefix, across_workers)

    def device_logs(self, prefix="", across_workers=True):
        """The logs of fit's and evaluate's own step: the loss (and accuracy) summed on the
        devices, and the compiled metrics kept on the host."""
        logs = self.step.logs(self._metric_names, prefix, across_workers)
        if self.host_metrics:                        # read on the host (this worker's)
            logs.update(custom_step.host_logs(self, prefix))
        return logs

    def _verbosity(self, verbose):
        """Keras's ``verbose`` ("auto" = 1); 0 on a worker that is not the chief, which
        trains in silence (``MultiWorkerMirroredStrategy``: only the chief prints)."""
        verbose = 1 if verbose == "auto" else int(verbose)
        return verbose if self._strategy.extended.should_checkpoint else 0

    # -- fit / evaluate / predict -------------------------------------------------------------
    @serialised
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_data=None, shuffle=True, initial_epoch=0, steps_per_epoch=None,
            validation_split=0.0, **kwargs):
        """Train for ``epochs`` epochs; prints Keras's progress line; returns a ``History``.

        ``x``: arrays (with ``y``), a batched ``mirrored.data.Dataset``, or
        ``strategy.experimental_distribute_dataset(ds, options)`` (TensorFlow accepts
        it too); with ``InputOptions(experimental_place_dataset_on_device=True)`` the
        data set stays on the devices (``input_lib``'s docstring). Keras's ``class_weight``,
        ``sample_weight`` and ``validation_steps``/``_batch_size``/``_freq`` are refused unless
        left at their defaults (``model_api.NOT_IMPLEMENTED``), as is an argument Keras lacks.

        ``compile(steps_per_execution=N)``: N batches per execution (``_train_execution``),
        with the batch callbacks called once per execution, as Keras 3 calls them.
        """
        self._custom_train = type(self).train_step is not Model.train_step   # the user's own step
        if self._custom_train and self.optimizer is None:
            raise RuntimeError("You must call `compile()` before `fit()`: model.compile(optimizer=...).")
        if not self._custom_train:
            check_compiled(self, "training")
        if self.built and self.step.packed_at != Layer.trainable_changes:   # a layer's trainable was set
            self.check_trainable("fit")
        if kwargs:                                   # Keras's arguments not implemented here
            check_keras_arguments("fit", kwargs)
        self._check_strategy()
        data_adapters.check_batch_size(batch_size, "fit")
        with backends.blas_threads():        # the CPU's BLAS-thread policy (backends.blas_policy)
            return self._fit(x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
                             initial_epoch, steps_per_epoch, validation_split)

    def _fit(self, x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
             initial_epoch, steps_per_epoch, validation_split):
        if validation_split and validation_data is None:   # Keras: validation_data wins
            (x, y), validation_data = data_adapters.train_validation_split(x, y, validation_split)
        if isinstance(validation_data, tuple) and len(validation_data) == 3:   # Keras: (x, y, sample weights)
            if validation_data[2] is not None:
                raise NotImplementedError("fit(validation_data=(x, y, sample_weight)): sample weights are not "
                                          "implemented here; pass (x, y).")
            validation_data = validation_data[:2]
        verbose = self._verbosity(verbose)
        per_execution = self.steps_per_execution
        batches, steps = (custom_step.batches if self._custom_train else data_adapters.batches)(
            self, x, y, batch_size, shuffle)
        if steps_per_epoch is not None:
            steps = steps_per_epoch
        history = _callbacks.History()
        cbs = list(callbacks or []) + [history]
        params = {"verbose": verbose, "epochs": epochs, "steps": steps}
        for cb in cbs:
            cb.set_model(self)
            cb.set_params(params)
        self.stop_training = False
        logs = None
        for cb in cbs:
            cb.on_train_begin(None)          # Keras passes logs to every hook: lambdas take them
        begin_hooks = _callbacks.batch_hooks(cbs, "on_train_batch_begin")   # no-ops left out
        end_hooks = _callbacks.batch_hooks(cbs, "on_train_batch_end")
        for epoch in range(initial_epoch, epochs):
            for cb in cbs:
                cb.on_epoch_begin(epoch, None)
            if verbose:
                print(f"Epoch {epoch + 1}/{epochs}")
            bar = Progbar(steps, verbose) if verbose else None     # verbose=0 draws nothing
            if self._custom_train:
                self.reset_metrics()                 # Keras: every metric, each epoch
            else:
                if self.built:
                    self.step.zero_metrics()
                if self.host_metrics:
                    custom_step.reset_compiled(self)
            step, data = 0, iter(batches)
            while steps_per_epoch is None or step < steps_per_epoch:
                # One execution (Keras's steps_per_execution=N; N=1 by default): up to N
                # batches, never past the epoch's end, as Keras documents it ("truncated to
                # the size of the epoch"; its TensorFlow loop runs a last execution whole
                # when the data goes on past steps_per_epoch). The batch hooks see its first
                # index and begin + N - 1 (Keras's, even for a last execution of fewer batches).
                n = per_execution if steps_per_epoch is None else min(per_execution, steps_per_epoch - step)
                chunk = list(itertools.islice(data, n))
                if not chunk:
                    break
                for hook in begin_hooks:
                    hook(step, None)
                self._train_execution(chunk)
                last, step = step + per_execution - 1, step + len(chunk)
                if end_hooks or verbose:
                    # Keras's batch logs: the epoch's running metrics, read only if asked for;
                    # this worker's (no collective: the other workers may not ask, nor draw a bar)
                    batch_logs = _callbacks.batch_logs(end_hooks, lambda: self._logs(across_workers=False))
                    for hook in end_hooks:
                        hook(last, batch_logs)
                    if verbose and bar.wants_update(step):
                        bar.update(step, dict(batch_logs))   # the epoch's line is over every worker
                if self.stop_training:          # Keras checks after every execution too
                    break
            if not step:
                raise no_batches_error("train_function", x, epoch)
            if steps_per_epoch is not None and step < steps_per_epoch and not self.stop_training:
                warnings.warn(RAN_OUT_OF_DATA, stacklevel=4)    # Keras 3: the next epoch starts the data again
            logs = self._logs()
            if validation_data is not None:
                logs.update(self._evaluate(validation_data, batch_size, verbose=0, prefix="val_"))
            if verbose:
                bar.target = bar.target if bar.target is not None else step
                bar.finish(step, logs)
            for cb in cbs:
                cb.on_epoch_end(epoch, logs)
            if self.stop_training:
                break
        for cb in cbs:
            cb.on_train_end(logs)
        history.params = params
        self.history = history
        return history

#: Keras 3's warning (trainers/epoch_iterator.py) when steps_per_epoch is more than the data has.
RAN_OUT_OF_DATA = ("Your input ran out of data; interrupting training. Make sure that your dataset or "
                   "generator can generate at least `steps_per_epoch * epochs` batches. You may need to "
                   "use the `.repeat()` function when building your dataset.")


@saving.register_model_class
class Sequential(Model):
    """A stack of layers run in order (see layers.py for the layers there are): a chain of
    nodes, node i reading node i - 1's output."""

    def __init__(self, layers=None, name=None, **kwargs):
        trainable = _keras_defaults("Sequential", kwargs)
        self._setup(name or "sequential")
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
        nodes, layers, symbolic = functional.program(inputs, outputs)
        self._setup(name or ("functional" if type(self) is Functional else snake_case(type(self).__name__)))
        self._layers = layers
        if not trainable:
            self.trainable = False
        self.symbolic_nodes = symbolic           # the recorded calls (saving, summary)
        self.inputs = [functional.single(inputs, "inputs")]
        self.outputs = [functional.single(outputs, "outputs")]
        self._input_shape = tuple(self.inputs[0].shape[1:])
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
    def input(self):
        return self.inputs[0]

    @property
    def output(self):
        return self.outputs[0]

    def connections(self):
        """[(layer, ['name[node][tensor]' of each input of each of its calls])], the input layer
        first: summary's "Connected to" column (calls numbered within this model, as Keras)."""
        x = self.inputs[0]
        own = [x.node] + list(self.symbolic_nodes)
        own_ids = {id(n) for n in own}

        def ref(t):
            calls = [n for n in t.node.layer.inbound_nodes if id(n) in own_ids]
            return f"{t.node.layer.name}[{next(i for i, n in enumerate(calls) if n is t.node)}][0]"
        rows = [(x.node.layer, [])]
        for layer in self.layers:
            rows.append((layer, [ref(t) for n in layer.inbound_nodes if id(n) in own_ids
                                 for t in n.input_tensors]))
        return rows


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


def _is_default(strategy):
    """True for the default (no-scope, one-replica) strategy."""
    return isinstance(strategy, _strategy.DefaultStrategy)


def _why_not_numbers(dtype):
    """For an error about a non-numeric ``dtype``: why (an object array usually holds None)."""
    if dtype.kind == "O":
        return " (an object array: it holds None or other entries that are not numbers)"
    return ""
