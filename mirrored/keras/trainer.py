"""``fit``: Keras's loop around one training step, and what the loop asks of the model on
the way (``Trainer``, a base class of ``models.Model``; Keras 3 calls its own the same).

A student following one ``fit`` step reads this file, then ``step.py``: ``fit`` checks its
arguments, ``_fit`` runs the epochs (callbacks, the progress line, ``steps_per_execution``
batches per execution), ``_train_execution`` hands each execution's batches to the step
(``_train_on``: one batch, all or nothing), and ``_trainer`` picks what runs the passes:
the step itself (``run_eagerly=True``), or the step with its device parts recorded and
replayed (``mirrored/program/passes.py``'s ``CapturedStep``: CUDA graphs on a GPU). The loss
and accuracy stay on the devices and are read when the progress line is drawn
(``device_logs``). The model's inputs are checked here too (``accept_inputs``), as each
batch is prepared.

The model is three classes and one state (Keras 3's ``Model(Trainer, Layer)``, in our
words), each a file a student opens for one question:

* ``models.Model`` (``models.py``): what a model IS: made (``__init__``, ``_setup``, which
  makes every attribute below), built (its program of layer nodes, its weights, its
  ``step.Step``), used as a layer; ``Sequential`` and ``Functional``.
* ``Trainer`` (this file): what ``fit`` does with it.
* ``model_api.ModelAPI`` (``model_api.py``): the rest of Keras's methods (compile,
  evaluate, predict, ``model(x)``, weights, saving, summary).

The contract between them is ``Model._setup``'s attributes: ``step`` (the built
``Step``, None before), ``optimizer``, ``loss``, ``host_metrics`` and ``_metric_names``
(compile's), ``_run_eagerly``/``_graphs``/``_captured`` (the CUDA graphs), ``_strategy``,
``_lock`` (``model_api.serialised``), ``built``/``nodes``/``_input_shape``. Neither mixin
makes an attribute of its own, and neither is used without ``Model``.

Neighbours: ``models.py`` (build), ``step.py`` (the step), ``model_api.py`` (compile,
evaluate, predict), ``data_adapters.py`` (what fit accepts), ``callbacks.py``,
``progbar.py``, ``custom_step.py`` (a model's own ``train_step``), ``mirrored/program/`` (the graphs).
"""
import itertools
import warnings

import numpy as np

from mirrored import backends, strategy as _strategy
from mirrored.program.capture import StepGraphs
from mirrored.program.passes import CapturedStep
from mirrored.keras import callbacks as _callbacks
from mirrored.keras import custom_loop, custom_step, data_adapters, sample_weights
from mirrored.keras.layers import IMAGE_LAYERS, Layer
from mirrored.keras.model_api import (ModelAPI, check_keras_arguments, check_steps_per_execution,
                                      no_batches_error, serialised)
from mirrored.keras.progbar import Progbar
from mirrored.keras.step import check_compiled
from mirrored.values import Variable


class Trainer:
    """``fit`` and what it asks of the model (the module docstring); the state is
    ``models.Model._setup``'s."""

    @serialised
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_data=None, shuffle=True, initial_epoch=0, steps_per_epoch=None,
            validation_split=0.0, **kwargs):
        """Train for ``epochs`` epochs; prints Keras's progress line; returns a ``History``.

        ``x``: arrays (with ``y``), a batched ``mirrored.data.Dataset``, or
        ``strategy.experimental_distribute_dataset(ds, options)`` (TensorFlow accepts
        it too); with ``InputOptions(experimental_place_dataset_on_device=True)`` the
        data set stays on the devices (``input_lib``'s docstring). ``sample_weight=`` (arrays: one
        weight per example; a data set yields (x, y, sample_weight) triples instead) and
        ``class_weight={class: weight}`` weigh each example's loss as Keras 3 does
        (``sample_weights.py``). Keras's ``validation_steps``/``_batch_size``/``_freq`` are refused
        unless left at their defaults (``model_api.NOT_IMPLEMENTED``), as is an argument Keras lacks.

        ``compile(steps_per_execution=N)``: N batches per execution (``_train_execution``),
        with the batch callbacks called once per execution, as Keras 3 calls them.
        """
        self._custom_train = self._runs_keras_step()           # its own step, or Keras's
        if self._custom_train and self.optimizer is None:
            raise RuntimeError("You must call `compile()` before `fit()`: model.compile(optimizer=...).")
        if not self._custom_train:
            check_compiled(self, "training")
        if self.built and self.step.packed_at != Layer.trainable_changes:   # a layer's trainable was set
            self.check_trainable("fit")
        weights = {k: kwargs.pop(k, None) for k in ("sample_weight", "class_weight")}   # Keras's weighting
        if kwargs:                                   # Keras's arguments not implemented here
            check_keras_arguments("fit", kwargs)
        self._check_strategy()
        data_adapters.check_batch_size(batch_size, "fit")
        with backends.blas_threads():        # the CPU's BLAS-thread policy (backends.blas_policy)
            return self._fit(x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
                             initial_epoch, steps_per_epoch, validation_split, **weights)

    def _fit(self, x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
             initial_epoch, steps_per_epoch, validation_split, sample_weight=None, class_weight=None):
        if validation_split and validation_data is None:   # Keras: validation_data wins
            w = None if sample_weight is None else sample_weights.check(sample_weight, len(x))
            (x, y), validation_data = data_adapters.train_validation_split(x, y, validation_split,
                                                                              self.structured_io)
            if w is not None:                              # Keras splits the weights alike
                sample_weight, validation_data = w[:len(x)], validation_data + (w[len(x):],)
        verbose = self._verbosity(verbose)
        per_execution = self.steps_per_execution
        if self._custom_train:
            batches, steps = custom_step.batches(self, x, y, batch_size, shuffle, sample_weight, class_weight)
        else:
            batches, steps = data_adapters.batches(self, x, y, batch_size, shuffle, sample_weight, class_weight)
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

    def _runs_keras_step(self):
        """``custom_step.runs_keras_step`` for fit, asked again only when the model was built or
        compiled since (its layers are known then): the lab's fused step never leaves this file."""
        known = getattr(self, "_keras_step_known", None)
        if known is None or known[0] != self.built:
            known = self._keras_step_known = (self.built, custom_step.runs_keras_step(self, "train_step"))
        return known[1]

    def _train_execution(self, batches):
        """One execution of ``compile(steps_per_execution=N)``: the training steps of
        ``batches`` (1 to N), in order. On a GPU with graphs, one program runs them all
        (``CapturedStep.train_steps``); elsewhere they run one after the other, each all or
        nothing, so a failure keeps the steps before it (counted, every copy updated).
        A model with its own ``train_step`` runs that on each (``custom_step.py``)."""
        if self._custom_train:
            return custom_step.train(self, batches)
        captured = self.captured_step() if self.built else None   # the first batch builds the model
        if self.built and self._claimed != custom_loop.MOVES[0]:
            self.use_own_weights()
        if self.runs_as_one_program(captured, batches):
            captured.train_steps([data_adapters.prepare(self, batch) for batch in batches])
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

    @property
    def _step_graphs(self):
        """This model's CUDA graphs (``mirrored.program.capture.StepGraphs``, made on first use), or
        None when it runs eagerly (``run_eagerly=True``). Their ``reason`` says why not
        where there is nothing to capture; only ``compile(cuda_graph=True)`` warns of it."""
        if self._run_eagerly or self.step is None:
            return None
        if self._graphs is None:
            self._graphs = StepGraphs(self.step.devices, self._strategy.extended.cross_device_ops)
            if self._graphs.reason and self._graphs_asked:
                warnings.warn(f"compile(cuda_graph=True): {self._graphs.reason}; fit, evaluate and "
                              f"predict replay their recorded launches one by one.", stacklevel=5)
        return self._graphs

    def _trainer(self):
        """What runs fit's, evaluate's and predict's passes: the step itself, or the step
        with its device parts recorded and replayed (``captured_step``)."""
        return self.captured_step() or self.step

    def captured_step(self):
        """The step with its device parts recorded and replayed (``mirrored/program/passes.py``'s
        ``CapturedStep``, which also runs ``steps_per_execution`` batches as one graph), or
        None where the passes run eagerly (``run_eagerly=True``). Where nothing can be captured
        (CPU devices, the simulator) its programs replay as lists."""
        graphs = self._step_graphs
        if graphs is None:                                  # run_eagerly=True
            return None
        if self._captured is None or self._captured.graphs is not graphs:
            self._captured = CapturedStep(self.step, graphs)
        return self._captured

    def runs_as_one_program(self, captured, batches):
        """True where an execution of ``batches`` runs as ONE program (``CapturedStep.train_steps``
        / ``evaluate_steps``): several batches, graphs captured (a GPU), no host metrics (they read
        each step's outputs). Elsewhere each batch runs on its own, all or nothing."""
        return len(batches) > 1 and captured is not None and captured.graphs.enabled and not self.host_metrics

    def forget_programs(self):
        """Drop the recorded programs of fit's, evaluate's and predict's passes (a buffer they
        read is going: ``data_adapters``' resident data set released); the next runs record."""
        if self._captured is not None:
            self._captured.forget()

    # -- the model's side of the loop -------------------------------------------------------
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

    def __setattr__(self, name, value):
        """Layers and models set as attributes (one, or a list of them) are the model's, in the
        order set (Keras tracks them so: ``model.layers`` of a subclassed model). Here, not in
        ``models.py``, because ``fit`` sets attributes (``history``, ``stop_training``) on
        every call: a student following ``fit`` stays in this file."""
        found = value if isinstance(value, (list, tuple)) else [value]
        if not name.startswith("_") and found and all(isinstance(v, (Layer, ModelAPI)) for v in found):
            tracked = self.__dict__.setdefault("_tracked", [])
            tracked += [v for v in found if all(v is not t for t in tracked)]
        if not name.startswith("_") and found and all(isinstance(v, Variable) for v in found):
            own = self.__dict__.setdefault("_own_variables", [])    # its tf.Variables (model_call.py)
            own += [v for v in found if all(v is not t for t in own)]
        super().__setattr__(name, value)

    # -- the inputs, checked as each batch is prepared ------------------------------------------
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
        if len(shape) == 1 and self.scalar_examples():     # call takes x of shape (b,): model_call.py
            self.__dict__["_scalar_call"], keras_expands = True, True
            shape = shape + (1,)
        if len(shape) < 2 and not keras_expands:     # (B,) for input shape (1,): Keras adds the axis
            want = "(batch, features)" if self._input_shape is None else str((None,) + self._input_shape)
            raise ValueError(f"{what} of shape {shape} has no batch axis: the model takes a batch of "
                             f"examples, shape {want}. For one example use {what}[None] "
                             f"(shape {(1,) + shape}).")
        if not self.built:
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
        if is_default_strategy(current) or current is self._strategy:
            return
        if not self.built and is_default_strategy(self._strategy):
            self._strategy = current
            return
        raise ValueError(
            f"the model's variables were not created in the scope of {current!r}, the strategy in force "
            f"now: the model was created under {self._strategy!r}. Create the model inside the scope of "
            f"the strategy that trains it:\n  with strategy.scope():\n    model = create_model()\n"
            f"  model.compile(...)\n  model.fit(...)   # inside or outside the scope")


#: Keras 3's warning (trainers/epoch_iterator.py) when steps_per_epoch is more than the data has.
RAN_OUT_OF_DATA = ("Your input ran out of data; interrupting training. Make sure that your dataset or "
                   "generator can generate at least `steps_per_epoch * epochs` batches. You may need to "
                   "use the `.repeat()` function when building your dataset.")


def is_default_strategy(strategy):
    """True for the default (no-scope, one-replica) strategy."""
    return isinstance(strategy, _strategy.DefaultStrategy)


def _why_not_numbers(dtype):
    """For an error about a non-numeric ``dtype``: why (an object array usually holds None)."""
    if dtype.kind == "O":
        return " (an object array: it holds None or other entries that are not numbers)"
    return ""
