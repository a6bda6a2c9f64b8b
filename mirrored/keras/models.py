"""``Sequential``: Keras's model API (compile, fit, evaluate, predict, weights, summary).

A model remembers the strategy in force when it was created (``with
strategy.scope(): model = Sequential([...])``): its weights are then
``MirroredVariable``s, and ``compile``, ``fit``, ``evaluate``, ``predict`` and
``save_weights`` may be called inside or outside the scope — the course lab
calls ``compile`` outside it with ``optimizers.Adam()`` created there.

This file is the Keras surface only. What happens in one training step is in
``step.py`` (split → forward/backward → all-reduce → update); ``fit`` here is
Keras's loop around it (epochs, callbacks, the progress line). The loss and
accuracy stay on the devices and are read when the progress line is drawn.

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

Neighbours: ``layers.py`` (what a model is made of), ``step.py`` (the step),
``data_adapters.py`` (what fit/evaluate/predict accept), ``saving.py``,
``losses.py``, ``optimizers.py``, ``callbacks.py``, ``progbar.py``,
``tape.py`` (``GradientTape`` custom loops use the same replica programs).
"""
import contextlib
import functools
import os
import tempfile
import threading
import warnings

import numpy as np

from mirrored import backends, context, strategy as _strategy
from mirrored.graphs import CapturedStep, StepGraphs
from mirrored.keras import callbacks as _callbacks
from mirrored.keras import data_adapters
from mirrored.keras import losses as _losses
from mirrored.keras import optimizers as _optimizers
from mirrored.keras import saving
from mirrored.keras.layers import IMAGE_LAYERS, InputLayer, Layer
from mirrored.keras.metrics import ACCURACY_NAMES, SparseCategoricalAccuracy
from mirrored.keras.progbar import Progbar
from mirrored.keras.step import Step, check_compiled
from mirrored.keras.tape import ModelOutput
from mirrored.tensor import Tensor
from mirrored.values import components


def serialised(method):
    """Run ``method`` holding the model's re-entrant lock (the module docstring says why)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


@saving.register_model_class
class Sequential:
    """A stack of layers run in order (see layers.py for the layers there are)."""

    def __init__(self, layers=None, name=None):
        self._lock = threading.RLock()          # one caller at a time (module docstring)
        self._build_lock = threading.Lock()     # build exactly once, whoever calls first
        self.name = name or "sequential"
        self._strategy = _strategy.get_strategy()
        self.layers = []
        self._input_shape = None
        self.built = False
        self.step = None                 # the training step (step.Step), made by build
        self.optimizer = self.loss = None
        self._metric_names = []
        # compile(run_eagerly=...): False (Keras's default) replays each pass as CUDA graphs
        # on a GPU; _graphs: its StepGraphs, made on first use; _captured: the CapturedStep
        self._run_eagerly, self._graphs_asked, self._graphs, self._captured = False, False, None, None
        self.history = None
        self.stop_training = False
        for layer in layers or []:
            self.add(layer)
        if self._input_shape is not None:
            self.build()

    # -- building --------------------------------------------------------------------
    def add(self, layer):
        if self.built:
            raise RuntimeError("the model is already built; add every layer before it is first used.")
        if isinstance(layer, InputLayer):
            self._input_shape = layer.input_shape_arg
            return
        if not isinstance(layer, Layer):
            raise TypeError(f"Sequential takes mirrored.keras layers, got {layer!r}.")
        if not self.layers and layer.input_shape_arg is not None:
            self._input_shape = layer.input_shape_arg
        self.layers.append(layer)

    @property
    def distribute_strategy(self):
        """The strategy the model was created under (Keras's name)."""
        return self._strategy

    @property
    def input_shape(self):
        """``(None,) + one example's shape`` once known."""
        return None if self._input_shape is None else (None,) + tuple(self._input_shape)

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
                self._build(input_shape)

    def _build(self, input_shape):
        if input_shape is not None:
            self._input_shape = tuple(input_shape)[1:] if len(input_shape) > 1 and input_shape[0] is None \
                else tuple(input_shape)
        if self._input_shape is None:
            raise ValueError("the model's input shape is unknown: give the first layer "
                             "input_shape=..., start with layers.Input(shape=...), or call fit first.")
        shape = self._input_shape
        for layer in self.layers:                  # every shape checked before any weight exists:
            shape = layer.output_shape_for(shape)  # a bad layer leaves nothing half-built
        shape = self._input_shape
        with self._scope():
            for layer in self.layers:
                layer.build(shape)
                shape = layer.output_shape
        for layer in self.layers[:-1]:
            if getattr(layer, "activation", None) == "softmax":
                raise NotImplementedError(f"softmax is supported on the last layer only ({layer.name!r}).")
        if not self.trainable_variables:
            raise ValueError("a Sequential model here needs at least one layer with weights (a Dense layer).")
        self._output_shape = shape
        devices = [c.value().dev for c in components(self.trainable_variables[0])]
        self.step = Step(self, devices, self._strategy.extended.cross_device_ops)
        self.built = True

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
        first = self.layers[0]
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
    def trainable_variables(self):
        return [w for layer in self.layers for w in layer.trainable_weights]

    weights = trainable_weights = variables = trainable_variables

    @property
    def non_trainable_variables(self):
        return []

    @property
    def losses(self):
        """The layers' weight penalties as scalar tensors (``kernel_regularizer``; Keras's
        ``model.losses``), on this replica's copies inside ``strategy.run``."""
        return [loss for layer in self.layers for loss in layer.losses]

    def count_params(self):
        return int(sum(np.prod(v.shape) for v in self.trainable_variables))

    @serialised
    def get_weights(self):
        """NumPy copies in Keras's order: kernel (in, out), bias, layer by layer."""
        return [v.numpy() for v in self.trainable_variables]

    @serialised
    def set_weights(self, weights):
        variables = self.trainable_variables
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
        one zip archive, written atomically; ``mirrored.keras.models.load_model`` reads it."""
        self._save_on_chief(saving.save_model, filepath, overwrite)

    def get_config(self):
        """Keras's config of this Sequential (what ``model.save`` writes to config.json)."""
        return saving.model_config(self)["config"]

    # -- compile -------------------------------------------------------------------------
    @serialised
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                weighted_metrics=None, run_eagerly=None, steps_per_execution=None, jit_compile=None,
                cuda_graph=None, **kwargs):
        """Keras's ``compile``: optimizer, loss, ``metrics=['accuracy']``, ``run_eagerly``.

        ``run_eagerly=False`` (Keras's default; ``None`` means False, as in Keras): on a
        GPU, ``fit``, ``evaluate`` and ``predict`` capture the device part of each pass
        once per batch shape as a CUDA graph and replay it (``mirrored/graphs.py`` says
        how and why), as Keras compiles its step into a graph. ``run_eagerly=True``: every
        kernel is launched from Python, one by one (what labs 04 and 05 step through).
        Where there is nothing to capture (CPU devices, the CUDA simulator) both run the
        same launches eagerly, silently. The weights come out bitwise the same either way.

        ``cuda_graph=`` (this library's old option) is deprecated: ``cuda_graph=True`` is
        ``run_eagerly=False`` and ``cuda_graph=False`` is ``run_eagerly=True``, with a
        DeprecationWarning; ``cuda_graph=True`` still warns once where nothing can be captured.
        """
        self._check_strategy()
        run_eagerly = _eager_from(run_eagerly, cuda_graph)
        if optimizer == "rmsprop":
            raise NotImplementedError("RMSprop (Keras's default optimizer) is not implemented; "
                                      "pass optimizer='adam' or 'sgd'.")
        self.optimizer = _optimizers.get(optimizer)
        if loss is None:
            raise ValueError("compile needs a loss, e.g. loss='sparse_categorical_crossentropy'.")
        self.loss = _losses.get(loss)
        self._metric_names = []
        for m in metrics or []:
            if isinstance(m, str) and m in ACCURACY_NAMES:
                self._metric_names.append(m)
            elif isinstance(m, SparseCategoricalAccuracy):
                self._metric_names.append(m.name)
            else:
                raise NotImplementedError(f"metric {m!r} is not implemented; use metrics=['accuracy'].")
        if len(self._metric_names) > 1:
            raise NotImplementedError("one accuracy metric per model here.")
        if self._metric_names and _losses.takes_targets(self.loss):
            raise NotImplementedError(f"metrics={self._metric_names} with {type(self.loss).__name__}: the "
                                      f"accuracy metric here counts class indices; compile without metrics "
                                      f"(the loss is reported).")
        if self.built:
            self.step.loss_mode()                   # refuses a softmax layer with from_logits=True now
        self._graphs_asked = cuda_graph is True     # an explicit request: may warn (once)
        self.run_eagerly = run_eagerly              # drops the graphs: they hold the old optimizer's buffers

    @property
    def run_eagerly(self):
        """Keras's attribute: True launches every kernel from Python; False (the default)
        replays fit's, evaluate's and predict's device parts as CUDA graphs on a GPU."""
        return self._run_eagerly

    @run_eagerly.setter
    def run_eagerly(self, value):
        if self._graphs is not None:
            self._graphs.close()
        self._run_eagerly, self._graphs, self._captured = bool(value), None, None

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
        if graphs is None or not graphs.enabled:
            return self.step
        if self._captured is None or self._captured.graphs is not graphs:
            self._captured = CapturedStep(self.step, graphs)
        return self._captured

    @property
    def metrics_names(self):
        return ["loss"] + self._metric_names

    # -- one step ---------------------------------------------------------------------------
    @serialised
    def train_step(self, x, y):
        """One training step on a host batch x (B, ...), y (B,): split, forward/backward on
        every replica, all-reduce, update (``step.py``). ``fit`` runs this for every batch."""
        check_compiled(self, "training")
        self._check_strategy()
        self._train_on((x, y))

    def _train_on(self, batch):
        """One training step on a batch from ``data_adapters.batches``."""
        batch = data_adapters.prepare(self, batch)   # x (B, in) float32, y (B,), or row numbers
        with self.step.no_trace():                   # a step that raises changes nothing
            self._trainer().train(batch)

    def _logs(self, prefix="", across_workers=True):
        return self.step.logs(self._metric_names, prefix, across_workers)

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
        data set stays on the devices (``input_lib``'s docstring).
        """
        check_compiled(self, "training")
        self._check_strategy()
        data_adapters.check_batch_size(batch_size, "fit")
        with backends.blas_threads():        # the CPU's BLAS-thread policy (backends.blas_policy)
            return self._fit(x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
                             initial_epoch, steps_per_epoch, validation_split)

    def _fit(self, x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
             initial_epoch, steps_per_epoch, validation_split):
        if validation_split and validation_data is None:   # Keras: validation_data wins
            (x, y), validation_data = data_adapters.train_validation_split(x, y, validation_split)
        verbose = self._verbosity(verbose)
        batches, steps = data_adapters.batches(self, x, y, batch_size, shuffle)
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
        for epoch in range(initial_epoch, epochs):
            for cb in cbs:
                cb.on_epoch_begin(epoch, None)
            if verbose:
                print(f"Epoch {epoch + 1}/{epochs}")
            bar = Progbar(steps, verbose)
            if self.built:
                self.step.zero_metrics()
            step = 0
            for batch in batches:
                if steps_per_epoch is not None and step >= steps_per_epoch:
                    break
                for cb in cbs:
                    cb.on_train_batch_begin(step, None)
                self._train_on(batch)
                step += 1
                # Keras's batch logs: the epoch's running metrics, read only if asked for;
                # this worker's (no collective: the other workers may not ask, nor draw a bar)
                batch_logs = _callbacks.LazyLogs(lambda: self._logs(across_workers=False))
                for cb in cbs:
                    cb.on_train_batch_end(step - 1, batch_logs)
                if verbose and bar.wants_update(step):
                    bar.update(step, dict(batch_logs))   # the epoch's line is over every worker
                if self.stop_training:          # Keras checks after every batch too
                    break
            if not step:
                raise _no_batches("train_function", x, epoch)
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

    def _evaluate(self, data, batch_size, verbose, prefix=""):
        if isinstance(data, (tuple, list)) and len(data) == 2 and not hasattr(data, "batch"):
            x, y = data
        else:
            x, y = data, None
        batches, steps = data_adapters.batches(self, x, y, batch_size, shuffle=False)
        bar = Progbar(steps, verbose)
        if self.built:
            self.step.zero_metrics()
        step = 0
        for batch in batches:
            batch = data_adapters.prepare(self, batch)
            if step == 0:
                mode = self.step.loss_mode()            # the model is built by now
            with self.step.no_trace():                  # out of memory: nothing stays charged
                self._trainer().evaluate(batch, mode)
            step += 1
        if not step:
            raise _no_batches("test_function", x, None)
        logs = self._logs(prefix)
        if verbose:
            bar.finish(step, logs)
        return logs

    @serialised
    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", return_dict=False, **kwargs):
        """Loss (and accuracy) over the data: ``[loss, accuracy]``, a float, or a dict."""
        check_compiled(self, "evaluating")
        self._check_strategy()
        data_adapters.check_batch_size(batch_size, "evaluate")
        verbose = self._verbosity(verbose)
        with backends.blas_threads():
            logs = self._evaluate((x, y) if y is not None else x, batch_size, verbose)
        if return_dict:
            return logs
        values = list(logs.values())
        return values if len(values) > 1 else values[0]

    @serialised
    def predict(self, x, batch_size=None, verbose="auto", steps=None, **kwargs):
        """The model's outputs (probabilities after a softmax layer) as one NumPy array.
        The model need not be compiled (as in Keras): predict has no loss and no update."""
        self._check_strategy()
        data_adapters.check_batch_size(batch_size, "predict")
        with backends.blas_threads():
            return self._predict(x, batch_size, verbose)

    def _predict(self, x, batch_size, verbose):
        verbose = self._verbosity(verbose)
        if isinstance(x, (np.ndarray, list)):              # whole arrays: checked once, up front
            x = np.asarray(x)
            self.accept_inputs(x.shape, x.dtype)
        chunks, steps = data_adapters.predict_batches(x, batch_size)
        outs = []
        bar = Progbar(steps, verbose)
        done = 0
        for batch in chunks:
            xb = batch[0] if isinstance(batch, (tuple, list)) else batch
            xb = xb.numpy() if isinstance(xb, Tensor) else np.asarray(xb)
            self.accept_inputs(xb.shape, xb.dtype)
            xb = np.ascontiguousarray(xb, np.float32).reshape(xb.shape[0], -1)   # (B, in)
            with self.step.no_trace():                  # out of memory: nothing stays charged
                outs.extend(self._trainer().predict(xb))
            done += 1
        if verbose:
            bar.finish(done, {})
        if not outs:
            return np.zeros((0,) + tuple(self._output_shape), np.float32)
        return np.concatenate(outs, axis=0)

    # -- calling the model ------------------------------------------------------------------
    def __call__(self, inputs, training=False):
        """Forward on this replica's device (inside strategy.run) or the first one.

        Returns a Tensor: probabilities after a softmax layer, else the last
        layer's output. Inside a GradientTape it remembers the call for
        ``tape.gradient``. Outside ``strategy.run`` it holds the model's lock (two threads
        calling one model take turns); inside, each replica runs on its own program.
        """
        strategy, replica_ctx = context.top()
        if replica_ctx is not None and strategy is self._strategy:
            return self._call(inputs, training, replica_ctx.local_replica_id)
        with self._lock:
            return self._call(inputs, training, 0)

    def _call(self, inputs, training, r):
        if not isinstance(inputs, Tensor):
            inputs = np.asarray(inputs)
        shape = inputs.shape
        self.accept_inputs(shape, inputs.dtype, "inputs")
        features = int(np.prod(shape[1:], dtype=np.int64))   # Flatten; explicit, so 0 rows work
        p = self.step.programs[r]
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
        return Tensor(result, dev, ModelOutput(self, p, x))

    # -- summary ------------------------------------------------------------------------------------
    def summary(self, print_fn=None):
        """Keras's table of layers, output shapes and parameter counts."""
        print_fn = print_fn or print
        if not self.built:
            raise ValueError("This model has not yet been built: give the first layer an "
                             "input_shape or call fit() first.")
        rule, thick = "_" * 65, "=" * 65
        lines = [f'Model: "{self.name}"', rule,
                 f" {'Layer (type)':<27} {'Output Shape':<25} {'Param #':<10}", thick]
        shape = self._input_shape
        for i, layer in enumerate(self.layers):
            shape = layer.output_shape_for(shape)
            params = int(sum(np.prod(w.shape) for w in layer.trainable_weights))
            desc = f"{layer.name} ({type(layer).__name__})"
            lines.append(f" {desc:<27} {str((None,) + tuple(shape)):<25} {params:<10}")
            lines.append(" " * 65 if i < len(self.layers) - 1 else thick)
        total = self.count_params()
        lines += [f"Total params: {total:,}", f"Trainable params: {total:,}", "Non-trainable params: 0", rule]
        for line in lines:
            print_fn(line)


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


def _is_default(strategy):
    """True for the default (no-scope, one-replica) strategy."""
    return isinstance(strategy, _strategy.DefaultStrategy)


def _why_not_numbers(dtype):
    """For an error about a non-numeric ``dtype``: why (an object array usually holds None)."""
    if dtype.kind == "O":
        return " (an object array: it holds None or other entries that are not numbers)"
    return ""


def _no_batches(function, x, epoch):
    """Keras's error for data that yields no batch (an empty array or dataset), with why."""
    where = f" in epoch {epoch + 1}" if epoch is not None else ""
    what = (f"{len(x)} examples" if isinstance(x, (np.ndarray, list, tuple)) and not hasattr(x, "batch")
            else f"the dataset {type(x).__name__}")
    return ValueError(f"Unexpected result of `{function}` (Empty logs): the data ({what}) gave no "
                      f"batch{where}. Check that it is not empty (a filter that drops everything, a "
                      f"take(0), an exhausted iterator) and that x holds at least one example.")
