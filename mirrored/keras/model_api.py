"""The rest of Keras's model API, what ``fit``'s step does not use: compile, evaluate,
predict, calling the model, weights, saving, summary (``ModelAPI``, a base class of
``models.Model`` beside ``trainer.Trainer``, hence of Sequential, functional and subclassed
models alike; every method here is a method of the model, as in Keras).

``models.py`` says what a model is (made, built), ``trainer.py`` what ``fit`` does with it;
this file holds the methods around them, so that a student following the step reads
``trainer.py`` alone. The three share one state, the attributes ``Model._setup`` makes
(``trainer.py``'s docstring lists the contract). ``evaluate`` and ``predict`` run the same
``step.Step`` (its evaluate and predict passes, on the same replica programs), captured as
CUDA graphs where ``fit``'s step is (``Trainer.captured_step``); calling the model
(``model(x)``) runs one replica's forward, remembered for ``GradientTape``.

Every public method that runs or changes the model holds the model's re-entrant lock
(``serialised``; ``models.py``'s docstring says why).

Neighbours: ``models.py`` (Model, Sequential, Functional: build), ``trainer.py`` (fit),
``step.py`` (the passes), ``saving.py`` (the files), ``data_adapters.py`` (what
evaluate/predict accept), ``tape.py`` (``ModelOutput``), ``progbar.py``.
"""
import functools
import itertools
import os
import tempfile
import warnings

import numpy as np

from mirrored import backends, context, ops
from mirrored.keras import call_layers, compile_utils, custom_loop, custom_step, data_adapters, functional, model_call
from mirrored.keras import custom_losses, multi_io
from mirrored.keras import metrics as _metrics
from mirrored.keras import losses as _losses
from mirrored.keras import optimizers as _optimizers
from mirrored.keras import functional_config, saving
from mirrored.keras.base_layer import Layer
from mirrored.keras.metrics import accuracy_name
from mirrored.keras.progbar import Progbar
from mirrored.keras.step import check_compiled
from mirrored.keras.tape import ModelOutput, input_link
from mirrored.tensor import Tensor
from mirrored.values import components


def serialised(method):
    """Run ``method`` holding the model's re-entrant lock (``models.py``'s docstring says why)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


#: Keras's arguments of fit, evaluate and predict that would change what is computed and
#: are not implemented here, each with its default (accepted: it means "not used").
NOT_IMPLEMENTED = {
    "fit": {"validation_steps": None, "validation_batch_size": None, "validation_freq": 1},
    "evaluate": {"steps": None, "callbacks": None},
    "predict": {"callbacks": None},
}


def check_keras_arguments(method, kwargs):
    """Refuse what ``method`` (fit, evaluate, predict) would otherwise ignore: an argument
    Keras does not have (Keras 3's errors: TypeError, for evaluate ValueError), or one of
    ``NOT_IMPLEMENTED`` set to anything but its default: ``fit(validation_freq=2)`` would
    otherwise validate every epoch, without a word."""
    known = NOT_IMPLEMENTED[method]
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown and method == "evaluate":
        raise ValueError(f"Arguments not recognized: { {k: kwargs[k] for k in unknown} }")
    if unknown:
        raise TypeError(f"{method}() got an unexpected keyword argument {unknown[0]!r}")
    for key, value in kwargs.items():
        empty = value is None or (isinstance(value, (list, tuple, dict)) and not value)
        if not (empty and known[key] is None) and not (type(value) is int and value == known[key]):
            raise NotImplementedError(f"{method}({key}=...) is not implemented here; leave {key} at its "
                                      f"default ({known[key]!r}).")


def check_steps_per_execution(value, what="compile(steps_per_execution=...)"):
    """Keras's ``steps_per_execution`` as a number of batches (None: 1, the default), or a
    clear error: anything but a positive whole number."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what}: the number of batches each execution runs must be a positive whole "
                         f"number (1, the default, runs one step per call), got {value!r}; pass e.g. "
                         f"steps_per_execution=8.")
    return int(value)


class ModelAPI:
    """Keras's model methods that are not ``fit``'s step (the module docstring); a base
    class of ``models.Model``, whose ``_setup`` makes the state they use (the contract:
    ``trainer.py``'s docstring)."""

    # -- weights -------------------------------------------------------------------------
    @property
    def trainable(self):
        """Keras's flag: ``model.trainable = False`` freezes every layer (each layer's
        ``trainable`` is set, as Keras 3 does); call ``compile`` after changing it, as Keras asks:
        ``compile`` repacks the weights the optimizer updates (``non_trainable.py``)."""
        return self.__dict__.get("trainable_flag", True)

    @trainable.setter
    def trainable(self, value):
        self.__dict__["trainable_flag"] = bool(value)
        for layer in self.layers:
            layer.trainable = value

    def check_trainable(self, what):
        """Refuse to train with weights packed for another ``trainable`` setting: a layer frozen
        (or unfrozen) after ``compile`` would train as before, silently."""
        if self.built and [id(v) for v in self.step.pack.variables] != [id(v) for v in self.trainable_variables]:
            raise RuntimeError(f"{what}: a layer's trainable flag changed since the model was compiled: "
                               f"call model.compile(...) again after setting trainable (Keras asks the "
                               f"same), so that the optimizer updates the weights that are trainable now.")

    def repack_if_trainable_changed(self):
        """``compile``: a new step (weights repacked, new optimizer slots) when the trainable
        weights are no longer the packed ones."""
        if self.built and [id(v) for v in self.step.pack.variables] != [id(v) for v in self.trainable_variables]:
            self.step = type(self.step)(self, self.step.devices, self.step.cross_device_ops)
        if self.built:
            self.step.packed_at = Layer.trainable_changes

    @property
    def losses(self):
        """The layers' weight penalties as scalar tensors (``kernel_regularizer``; Keras's
        ``model.losses``), on this replica's copies inside ``strategy.run``; then the values the
        last ``model(x)`` gave ``add_loss`` (the model's own ``self.add_loss`` first, as Keras)."""
        own = call_layers.added_eagerly(self)          # this replica's (call_layers.added_eagerly)
        return own + [loss for layer in self.layers for loss in layer.losses]

    def add_loss(self, loss):
        """Keras's ``self.add_loss(value)`` in a subclassed model's ``call`` (``call_layers.add_loss``)."""
        call_layers.add_loss(self, loss)

    def use_own_weights(self):
        """Make this model's packed buffers the storage of its weights again, where a model
        sharing a layer with it took them since (``custom_loop.claim``); every pass that
        runs the model's program calls it first."""
        if self.built and self._claimed != custom_loop.MOVES[0]:
            self._claimed = custom_loop.claim(self.step.pack)

    def count_params(self):
        """Every weight's numbers, trainable or not (Keras's)."""
        return int(sum(np.prod(v.shape) for v in self.weights))

    @serialised
    def get_weights(self):
        """NumPy copies in Keras's order: layer by layer, each layer's trainable weights
        (kernel (in, out), bias), then its non-trainable ones (moving mean, variance)."""
        return [v.numpy() for v in self.weights]

    @serialised
    def set_weights(self, weights):
        variables = self.weights
        weights = list(weights)
        if len(weights) != len(variables):
            raise ValueError(f"set_weights: the model has {len(variables)} weight arrays, got {len(weights)}.")
        arrays = []
        for v, w in zip(variables, weights):
            w = np.asarray(w, np.float32)
            if w.shape != v.shape:
                raise ValueError(f"set_weights: {v.name} has shape {v.shape}, got an array of shape {w.shape}.")
            arrays.append(w)
        for v, w in zip(variables, arrays):           # validated first: nothing half-set
            for c in components(v):
                c.assign(w)

    @serialised
    def save_weights(self, filepath, overwrite=True, save_format=None, options=None):
        """Write the weights atomically to ``filepath``, a ``*.weights.h5`` file in Keras 3's
        layout (``saving.py``), which Keras reads; a failed save leaves any previous file intact.
        Under ``MultiWorkerMirroredStrategy`` only the chief keeps the file (``_save_on_chief``)."""
        self._save_on_chief(saving.save_weights, filepath, overwrite)

    def _save_on_chief(self, write, filepath, overwrite):
        """``write(self, filepath, overwrite)`` on the chief; on any other worker into a
        temporary ``workertemp_<task_id>`` directory, deleted at once, as Keras's callbacks do
        on non-chief workers (so only the chief's file remains; one machine: the chief)."""
        if self._strategy.extended.should_checkpoint:
            return write(self, filepath, overwrite)
        task = self._strategy.cluster_resolver.task_id
        with tempfile.TemporaryDirectory(prefix=f"workertemp_{task}_") as tmp:
            return write(self, os.path.join(tmp, os.path.basename(os.fspath(filepath))), True)

    @serialised
    def load_weights(self, filepath, skip_mismatch=False, by_name=False, options=None):
        """Read a ``*.weights.h5`` file (ours or Keras 3's) or a ``*.keras`` model's weights,
        checked against the model before anything changes."""
        saving.load_weights(self, filepath)

    @serialised
    def save(self, filepath, overwrite=True, **kwargs):
        """Keras 3's ``model.save("m.keras")``: architecture, weights and optimizer state in
        one zip archive, written atomically; ``mirrored.keras.models.load_model`` reads it.
        Keras 3's other arguments as it takes them: ``include_optimizer`` does not apply to a
        ``.keras`` file, ``save_format`` is deprecated (a warning), ``zipped=False`` (a folder)
        is not implemented, anything else is refused."""
        kwargs.pop("include_optimizer", None)
        if kwargs.pop("save_format", None):
            warnings.warn("The `save_format` argument is deprecated in Keras 3; the format follows "
                          "the file name (.keras).", stacklevel=3)
        if kwargs.pop("zipped", None) is False:
            raise NotImplementedError("save(zipped=False) (an unzipped folder) is not implemented; "
                                      "a .keras file is always one zip archive here.")
        if kwargs:
            raise ValueError(f"The following argument(s) are not supported: {list(kwargs)}")
        self._save_on_chief(saving.save_model, filepath, overwrite)

    def get_config(self):
        """Keras's config of this model (what ``model.save`` writes to config.json): a
        Sequential's layers, a functional model's layers and calls; a subclassed model
        defines its own (Keras 3's rule), else ``model.save`` refuses it."""
        return saving.model_config(self)["config"]

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The model a ``get_config`` describes: Keras's Sequential and Functional configs, or
        ``cls(**config)`` for a subclassed model (the arguments of its ``__init__``)."""
        if isinstance(config, dict) and "layers" in config:
            kind = "Functional" if "input_layers" in config else "Sequential"
            return saving.model_from_config({"class_name": kind, "config": config}, custom_objects)
        return cls(**config)

    # -- compile -------------------------------------------------------------------------
    @serialised
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                weighted_metrics=None, run_eagerly=None, steps_per_execution=None, jit_compile=None,
                cuda_graph=None, **kwargs):
        """Keras's ``compile``: optimizer, loss, ``metrics=['accuracy']``, ``run_eagerly``.

        ``run_eagerly=False`` (Keras's default; ``None`` means False, as in Keras): ``fit``,
        ``evaluate`` and ``predict`` record the device part of each pass once per batch
        shape and replay it (``mirrored/program/passes.py`` says how and why), as Keras
        compiles its step into a graph: on a GPU captured as a CUDA graph, on CPU devices
        and in the CUDA simulator the launch list. ``run_eagerly=True``: the step's Python
        runs every step, each kernel launched from it (what labs 04 and 05 step through).
        The weights come out bitwise the same either way.

        ``steps_per_execution=N`` (Keras's; default 1): ``fit`` and ``evaluate`` run N batches
        per execution. On a GPU with graphs the N steps are ONE graph replay (``program/passes.py``,
        ``CapturedStep.train_steps``); elsewhere they run one after the other. The weights are
        bitwise those of N single steps. As in Keras, ``on_train_batch_begin``/``_end`` are
        called once per execution, with its first and last batch index (begin + N - 1),
        ``stop_training`` is checked once per execution, and an execution never runs past the
        epoch's end. ``predict`` runs one batch at a time.

        ``jit_compile`` is accepted and changes nothing (it tunes Keras's speed, not its
        results); ``weighted_metrics`` is refused. A model of several outputs takes a loss, metrics
        and ``loss_weights`` per output, as lists or dicts keyed by output names (``compile_utils.py``).

        ``cuda_graph=`` (this library's old option) is deprecated: ``cuda_graph=True`` is
        ``run_eagerly=False`` and ``cuda_graph=False`` is ``run_eagerly=True``, with a
        DeprecationWarning; ``cuda_graph=True`` still warns once where nothing can be captured.
        """
        if kwargs:
            raise TypeError(f"compile() got an unexpected keyword argument {sorted(kwargs)[0]!r}")
        several = len(getattr(self, "outputs", ())) > 1          # outputs: compile_utils.py
        if (loss_weights is not None and not several) or weighted_metrics:
            raise NotImplementedError("compile(weighted_metrics=...), and loss_weights for a model of one "
                                      "output, are not implemented here; leave them out.")
        per_execution = check_steps_per_execution(steps_per_execution)   # before anything changes
        self._check_strategy()
        run_eagerly = _eager_from(run_eagerly, cuda_graph)
        own_step = custom_step.overrides(self, "train_step")     # the user's train_step: Keras's rules
        if optimizer == "rmsprop" and not own_step:
            raise NotImplementedError("RMSprop (Keras's default optimizer) is not implemented; "
                                      "pass optimizer='adam' or 'sgd'.")
        if loss is None and not own_step:            # Keras: the add_loss terms alone (custom_losses.py)
            loss = custom_losses.AddedLossesOnly(self)
        new_optimizer = custom_step.NoRMSprop() if optimizer == "rmsprop" else _optimizers.get(optimizer)
        if several and loss is not None:                    # Keras 3's CompileLoss / CompileMetrics
            new_loss = compile_utils.CompileLoss(loss, loss_weights, self)
            device, host = [], compile_utils.OutputMetrics(metrics, self)
        else:
            if self.structured_io:                          # one output: [loss] or {name: loss}, as Keras
                loss, metrics = (compile_utils.of_one_output(v, self, w) for v, w in ((loss, "loss"),
                                                                                      (metrics, "metrics")))
            new_loss = None if loss is None else _losses.get(loss)
            keras_step = custom_step.runs_keras_step(self, "train_step")   # own step, cross-replica layer, several outputs
            device, host = compiled_metric_split(metrics, new_loss, keras_step)   # checked first
        self.optimizer, self.loss = new_optimizer, new_loss
        self._keras_step_known = None               # fit asks custom_step.runs_keras_step again
        self._metric_names = device
        self.host_metrics = getattr(host, "metrics", host)
        custom_step.compile_metrics(self, host)
        if self.built:
            self.repack_if_trainable_changed()      # a layer frozen since the model was built
        if self.built and self.loss is not None and not several:
            self.step.loss_mode()                   # refuses a softmax layer with from_logits=True now
        self.steps_per_execution = per_execution
        self._graphs_asked = cuda_graph is True     # an explicit request: may warn (once)
        self.run_eagerly = run_eagerly              # drops the graphs: they hold the old optimizer's buffers

    def get_compile_config(self):
        """Keras's: the arguments ``compile`` was given, serialised (what a .keras file
        records, ``steps_per_execution`` included); ``{}`` before ``compile``."""
        return saving.compile_config(self) or {}

    def compile_from_config(self, config):
        """Keras's: ``compile`` with a ``get_compile_config()``'s arguments."""
        saving.compile_from_config(self, config)

    @property
    def run_eagerly(self):
        """Keras's attribute: True launches every kernel from Python; False (the default)
        replays fit's, evaluate's and predict's recorded device parts (CUDA graphs on a GPU)."""
        return self._run_eagerly

    @run_eagerly.setter
    def run_eagerly(self, value):
        if self._graphs is not None:
            self._graphs.close()
        self._run_eagerly, self._graphs, self._captured = bool(value), None, None
        self.train_function = None                  # Keras's traced train_step (traced_step.py)

    @property
    def metrics_names(self):
        if custom_step.overrides(self, "train_step") or self.structured_io:
            return [m.name for m in self.metrics]
        return ["loss"] + self._metric_names + [m.name for m in self.host_metrics]

    # -- Keras 3's pieces of a step (for a train_step of one's own: custom_step.py) -----------------
    @property
    def metrics(self):
        """Keras 3's ``model.metrics``: the loss tracker (named "loss") and the compiled metrics
        once compiled, then any metric set as an attribute of the model."""
        return custom_step.model_metrics(self)

    def reset_metrics(self):
        custom_step.reset_metrics(self)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Keras 3's: the compiled loss of ``y_pred`` against ``y`` plus ``model.losses``, as this
        replica's share of the global batch's loss (``custom_step.compute_loss``)."""
        return custom_step.compute_loss(self, y, y_pred, sample_weight)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Keras 3's: the compiled metrics updated with ``(y, y_pred)``; every metric's result."""
        compiled = custom_step.compiled_metrics(self)
        if compiled is not None:
            compiled.update_state(y, y_pred, sample_weight=sample_weight)
        return custom_step.metric_results(self)

    @custom_step.default
    def test_step(self, data):
        """Keras 3's default ``test_step`` (what a ``train_step`` of one's own is evaluated with
        when the model defines no ``test_step``, runs only if called): forward, loss, metrics."""
        x, y, sample_weight = custom_step.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        self.metrics[0].update_state(loss, sample_weight=custom_step.rows(x))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @custom_step.default
    def predict_step(self, data):
        """Keras 3's default ``predict_step``: the model's output."""
        x = data[0] if isinstance(data, tuple) else data
        return self(x, training=False)

    # -- evaluate / predict -----------------------------------------------------------
    def _evaluate(self, data, batch_size, verbose, prefix="", sample_weight=None):
        if isinstance(data, (tuple, list)) and len(data) in (2, 3) and not hasattr(data, "batch"):
            x, y, sample_weight = (tuple(data) + (sample_weight,))[:3]     # Keras: (x, y[, sample_weight])
        else:
            x, y = data, None
        if custom_step.runs_keras_step(self, "test_step"):       # the user's test_step (custom_step.py)
            batches, steps = custom_step.batches(self, x, y, batch_size, False, sample_weight)   # triples
            logs, step = custom_step.evaluate(self, batches)
            if not step:
                raise no_batches_error("test_function", x, None)
            logs = {prefix + k: v for k, v in logs.items()}
            if verbose:
                Progbar(steps, verbose).finish(step, logs)
            return logs
        batches, steps = data_adapters.batches(self, x, y, batch_size, False, sample_weight)
        bar = Progbar(steps, verbose)
        if self.built:
            self.step.zero_metrics()
        custom_step.reset_compiled(self)
        per_execution = self.steps_per_execution
        step, data = 0, iter(batches)
        while True:                                     # executions of up to N batches (fit's)
            chunk = [data_adapters.prepare(self, batch) for batch in itertools.islice(data, per_execution)]
            if not chunk:
                break
            mode, captured = self.step.loss_mode(), self.captured_step()   # the model is built by now
            self.use_own_weights()
            if self.runs_as_one_program(captured, chunk):
                with self.step.rolled_back_on_error():              # out of memory: nothing stays charged
                    captured.evaluate_steps(chunk, mode)   # one graph (program/passes.py)
            else:
                for batch in chunk:
                    with self.step.rolled_back_on_error():
                        (captured or self.step).evaluate(batch, mode)
                    if self.host_metrics:
                        custom_step.update_from_programs(self, batch)
            step += len(chunk)
        if not step:
            raise no_batches_error("test_function", x, None)
        logs = self.device_logs(prefix)
        if verbose:
            bar.finish(step, logs)
        return logs

    @serialised
    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, return_dict=False,
                 **kwargs):
        """Loss (and accuracy) over the data: ``[loss, accuracy]``, a float, or a dict.
        ``sample_weight``: one weight per example of arrays (``sample_weights.py``; a data set
        yields (x, y, sample_weight) triples instead), Keras's weighted loss and metrics."""
        check_compiled(self, "evaluating")
        if kwargs:                                   # Keras's arguments not implemented here
            check_keras_arguments("evaluate", kwargs)
        self._check_strategy()
        data_adapters.check_batch_size(batch_size, "evaluate")
        verbose = self._verbosity(verbose)
        with backends.blas_threads():
            logs = self._evaluate((x, y) if y is not None else x, batch_size, verbose, sample_weight=sample_weight)
        if return_dict:
            return logs
        values = custom_step.in_keras_order(self, logs) if custom_step.runs_keras_step(self, "test_step") \
            else list(logs.values())
        return values if len(values) > 1 else values[0]

    @serialised
    def predict(self, x, batch_size=None, verbose="auto", steps=None, **kwargs):
        """The model's outputs (probabilities after a softmax layer) as one NumPy array.
        The model need not be compiled (as in Keras): predict has no loss and no update.
        ``steps``: at most this many batches (Keras's; needed for a data set that repeats)."""
        if kwargs:                                   # Keras's arguments not implemented here
            check_keras_arguments("predict", kwargs)
        if steps is not None and (not isinstance(steps, (int, np.integer)) or isinstance(steps, bool)
                                  or steps < 1):
            raise ValueError(f"predict: steps must be a positive whole number of batches or None, got {steps!r}.")
        self._check_strategy()
        data_adapters.check_batch_size(batch_size, "predict")
        with backends.blas_threads():
            if custom_step.runs_keras_step(self, "predict_step"):     # the user's predict_step
                batches, _ = custom_step.batches(self, x, None, batch_size, shuffle=False)
                return custom_step.predict(self, batches, steps)
            return self._predict(x, batch_size, verbose, steps)

    def predict_on_batch(self, x):
        """Keras's ``predict_on_batch``: the outputs for ``x``, taken as one batch."""
        rows = custom_step.rows(x) if self.structured_io else len(x)     # several inputs: a list or dict
        return self.predict(x, batch_size=max(rows, 1), verbose=0)

    def get_layer(self, name=None, index=None):
        """Keras's ``get_layer``: the layer called ``name``, or at ``index``."""
        if index is not None:
            if name is not None:
                raise ValueError("get_layer: give name or index, not both.")
            if not -len(self.layers) <= index < len(self.layers):
                raise ValueError(f"get_layer: index {index} is out of range; the model has {len(self.layers)} layers.")
            return self.layers[index]
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise ValueError(f"No such layer: {name}. Existing layers are: {[l.name for l in self.layers]}.")

    def _predict(self, x, batch_size, verbose, most=None):
        verbose = self._verbosity(verbose)
        if isinstance(x, (np.ndarray, list)):              # whole arrays: checked once, up front
            x = np.asarray(x)
            self.accept_inputs(x.shape, x.dtype)
        chunks, steps = data_adapters.predict_batches(x, batch_size)
        if most is not None:
            steps = most if steps is None else min(steps, most)
        outs = []
        bar = Progbar(steps, verbose)
        done = 0
        for batch in chunks:
            if most is not None and done >= most:
                break
            xb = batch[0] if isinstance(batch, (tuple, list)) else batch
            xb = xb.numpy() if isinstance(xb, Tensor) else np.asarray(xb)
            self.accept_inputs(xb.shape, xb.dtype)
            self.use_own_weights()                      # a model sharing a layer may hold its weights
            xb = np.ascontiguousarray(xb, np.float32).reshape(xb.shape[0], -1)   # (B, in)
            with self.step.rolled_back_on_error():                  # out of memory: nothing stays charged
                outs.extend(self._trainer().predict(xb))
            done += 1
        if verbose:
            bar.finish(done, {})
        if not outs:
            return np.zeros((0,) + tuple(self._output_shape), np.float32)
        y = np.concatenate(outs, axis=0)
        return y.reshape(-1) if self.__dict__.get("_scalar_call") else y         # x (N,): y (N,)

    # -- calling the model ------------------------------------------------------------------
    def __call__(self, inputs, training=False):
        """Forward on this replica's device (inside strategy.run) or the first one.

        Returns a Tensor: probabilities after a softmax layer, else the last
        layer's output (a model of several outputs: its outputs as it was written, a list or a
        dict; several inputs come as a list or a dict keyed by their names: ``multi_io.py``).
        Inside a GradientTape it remembers the call for ``tape.gradient``. Outside
        ``strategy.run`` it holds the model's lock (two threads calling one model take turns);
        inside, each replica runs on its own program.
        """
        if functional.is_symbolic(inputs):           # inside another model's definition
            return self.call_symbolic(inputs)
        strategy, replica_ctx = context.top()
        # The CPU's BLAS-thread policy, as fit's: an eager loop (keras.io's guide) calls the
        # model outside strategy.run; inside one, or fit, this is nothing (backends.call_block).
        with backends.call_block():
            if replica_ctx is not None and strategy is self._strategy:
                return self._call(inputs, training, replica_ctx.local_replica_id)
            with self._lock:
                return self._call(inputs, training, 0)

    def call_symbolic(self, inputs):
        """The model called on a symbolic tensor (inside another model's definition or a
        subclassed model's ``call``): ONE node of the outer model, as Keras records it, whose
        layers run in the outer model's program with the same weights (``functional.expand``)."""
        return functional.call_layer(self, inputs, {})

    def _call(self, inputs, training, r):
        if self.structured_io:                       # several inputs or outputs (multi_io.py)
            return multi_io.call(self, inputs, training, r)
        if not isinstance(inputs, Tensor):
            inputs = np.asarray(inputs)
        shape = inputs.shape
        self.accept_inputs(shape, inputs.dtype, "inputs")
        features = int(np.prod(shape[1:], dtype=np.int64))   # Flatten; explicit, so 0 rows work
        self.use_own_weights()
        if model_call.runs_eagerly(self):           # a call of layers and ops: op by op (model_call.py)
            return model_call.call_eagerly(self, inputs, training, r, self.step.programs[r].dev)
        link = input_link(inputs)                  # tapes that follow the input: they want d loss / d x
        p = self.step.programs[r] if not link else multi_io.input_grad_program(self, r)
        dev = p.dev
        with dev.activate():
            if isinstance(inputs, Tensor):
                if inputs.dtype != np.float32:
                    raise TypeError(f"the model takes float32 inputs, got {inputs.dtype}; "
                                    f"use mirrored.cast(x, mirrored.float32).")
                buf = inputs.buf if inputs.dev is dev else dev.copy_from(inputs.buf, inputs.dev)
                x = buf.reshape(shape[0], features)
            else:
                x = dev.from_numpy(np.ascontiguousarray(inputs, np.float32).reshape(shape[0], features))
            out = p.forward(x, training=training, probabilities=True)
            result = dev.copy_from(out, dev)           # the program reuses `out` next call
        y = Tensor(result, dev, ModelOutput(self, p, x, inputs, link))
        return ops.squeeze(y, -1) if self.__dict__.get("_scalar_call") else y    # x (N,): y (N,)

    # -- summary ------------------------------------------------------------------------------------
    def summary(self, print_fn=None):
        """Keras's table of layers, output shapes and parameter counts; a functional model's
        has Keras's "Connected to" column (each call's inputs as ``layer[node][tensor]``) and
        its input layer first."""
        print_fn = print_fn or print
        self.build_if_shape_known()
        if not self.built:
            raise ValueError("This model has not yet been built: give the first layer an "
                             "input_shape or call fit() first.")
        connected = getattr(self, "symbolic_nodes", None)        # functional: its recorded calls
        rows = [(layer, None) for layer in self.layers] if connected is None else \
            functional_config.connections(self)                # [(layer, inputs)], input layers first
        widths = (27, 25, 10) if connected is None else (33, 22, 12, 31)
        width = sum(widths) + len(widths)                    # a space before each column
        rule, thick = "_" * width, "=" * width
        head = ("Layer (type)", "Output Shape", "Param #", "Connected to")[:len(widths)]
        lines = [f'Model: "{self.name}"', rule, " " + " ".join(f"{h:<{w}}" for h, w in zip(head, widths)), thick]
        for i, (layer, inputs) in enumerate(rows):
            shape = (layer.output_shape if hasattr(layer, "nested_nodes") else   # a model: one row, as Keras
                     [(None,) + s for s in layer.output_shape] if isinstance(layer.output_shape, list) else
                     (None,) + tuple(layer.output_shape if layer.built else layer.input_shape_arg))
            params = int(sum(np.prod(w.shape) for w in layer.weights))
            cells = [f"{layer.name} ({type(layer).__name__})", str(shape), str(params)]
            extra = []
            if connected is not None:
                cells.append(inputs[0] if inputs else "-")
                extra = inputs[1:]
            lines.append(" " + " ".join(f"{c:<{w}}" for c, w in zip(cells, widths)))
            lines += [" " * (width - widths[-1]) + f"{more:<{widths[-1]}}" for more in extra]
            lines.append(" " * width if i < len(rows) - 1 else thick)
        total = self.count_params()
        trainable = int(sum(np.prod(v.shape) for v in self.trainable_variables))
        lines += [f"Total params: {total:,}", f"Trainable params: {trainable:,}",
                  f"Non-trainable params: {total - trainable:,}", rule]
        for line in lines:
            print_fn(line)


def compiled_metric_split(metrics, loss, keras_step):
    """``compile(metrics=[...])`` as (the accuracy names the loss kernel counts on the devices,
    the other metric objects, kept on the host: ``metrics.get``). A model whose fit runs a
    ``train_step`` (its own, or Keras's for a model with a cross-replica layer:
    ``custom_step.runs_keras_step``) keeps them all on the host (that step updates them)."""
    device, host = [], []
    counts = loss is not None and _losses.counts_accuracy(loss)
    categorical = isinstance(loss, _losses.CategoricalCrossentropy) if counts else None
    for m in metrics or []:
        kernel_kind = isinstance(m, str) and m in _metrics.ACCURACY_NAMES or \
            type(m) in (_metrics.SparseCategoricalAccuracy, _metrics.CategoricalAccuracy)
        if kernel_kind and counts and not keras_step and not device:
            device.append(accuracy_name(m, categorical))
        else:
            host.append(_metrics.get(m))
    return device, host


def _eager_from(run_eagerly, cuda_graph):
    """``run_eagerly`` as a bool from compile's arguments (``cuda_graph=``: deprecated alias)."""
    if cuda_graph is None:
        return bool(run_eagerly)                    # None: False, as in Keras
    warnings.warn(f"compile(cuda_graph={cuda_graph!r}) is deprecated: use Keras's run_eagerly "
                  f"(cuda_graph=True is run_eagerly=False, the default: fit, evaluate and predict "
                  f"replay CUDA graphs on a GPU; cuda_graph=False is run_eagerly=True).",
                  DeprecationWarning, stacklevel=3)
    if run_eagerly is not None and bool(run_eagerly) == bool(cuda_graph):
        raise ValueError(f"compile(run_eagerly={run_eagerly!r}, cuda_graph={cuda_graph!r}) asks for "
                         f"both eager launches and CUDA graphs; pass run_eagerly alone.")
    return not cuda_graph



def no_batches_error(function, x, epoch):
    """Keras's error for data that yields no batch (an empty array or dataset), with why."""
    where = f" in epoch {epoch + 1}" if epoch is not None else ""
    what = (f"{len(x)} examples" if isinstance(x, (np.ndarray, list, tuple)) and not hasattr(x, "batch")
            else f"the dataset {type(x).__name__}")
    return ValueError(f"Unexpected result of `{function}` (Empty logs): the data ({what}) gave no "
                      f"batch{where}. Check that it is not empty (a filter that drops everything, a "
                      f"take(0), an exhausted iterator) and that x holds at least one example.")
