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

Neighbours: ``layers.py`` (what a model is made of), ``step.py`` (the step),
``data_adapters.py`` (what fit/evaluate/predict accept), ``saving.py``,
``losses.py``, ``optimizers.py``, ``callbacks.py``, ``progbar.py``,
``tape.py`` (``GradientTape`` custom loops use the same replica programs).
"""
import contextlib
import os
import tempfile
import warnings

import numpy as np

from mirrored import backends, context, strategy as _strategy
from mirrored.graphs import CapturedStep, StepGraphs
from mirrored.keras import callbacks as _callbacks
from mirrored.keras import data_adapters
from mirrored.keras import losses as _losses
from mirrored.keras import optimizers as _optimizers
from mirrored.keras import saving
from mirrored.keras.layers import IMAGE_LAYERS, Dropout, InputLayer, Layer
from mirrored.keras.metrics import ACCURACY_NAMES, SparseCategoricalAccuracy
from mirrored.keras.progbar import Progbar
from mirrored.keras.step import Step, check_compiled
from mirrored.keras.tape import ModelOutput
from mirrored.tensor import Tensor
from mirrored.values import components


class Sequential:
    """A stack of layers run in order (see layers.py for the layers there are)."""

    def __init__(self, layers=None, name=None):
        self.name = name or "sequential"
        self._strategy = _strategy.get_strategy()
        self.layers = []
        self._input_shape = None
        self.built = False
        self.step = None                 # the training step (step.Step), made by build
        self.optimizer = self.loss = None
        self._metric_names = []
        self._cuda_graph, self._graphs, self._captured = False, None, None
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
        if isinstance(self._strategy, _strategy._DefaultStrategy):
            return contextlib.nullcontext()
        return self._strategy.scope()

    def build(self, input_shape=None):
        """Create the weights (under the model's strategy) for examples of ``input_shape``
        (with or without a leading ``None`` batch axis), then the training step."""
        if self.built:
            return
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
        devices = [c._tensor._device for c in components(self.trainable_variables[0])]
        self.step = Step(self, devices, self._strategy.extended.cross_device_ops)
        self.built = True

    def check_example_shape(self, shape):
        """Refuse examples of ``shape`` that the model would misread.

        The step copies each example in flat; a dense model takes any shape with the
        right number of features (as Flatten does), but a first Conv2D or MaxPooling2D
        reads the image's axes, so its examples must have exactly the input shape:
        MNIST as a 28x28 array is not a (28, 28, 1) image until its channel axis is added.
        """
        shape, want = tuple(shape), tuple(self._input_shape)
        if shape == want or not isinstance(self.layers[0], IMAGE_LAYERS):
            return
        first = self.layers[0]
        hint = (" Add the channel axis: x[..., None] (NumPy) or "
                "dataset.map(lambda image, label: (image[..., None], label))."
                if shape + (1,) == want else "")
        raise ValueError(f"the model's first layer, {type(first).__name__} {first.name!r}, takes images "
                         f"of shape {want} (height, width, channels), got examples of shape {shape}.{hint}")

    # -- weights -------------------------------------------------------------------------
    @property
    def trainable_variables(self):
        return [w for layer in self.layers for w in layer.trainable_weights]

    weights = trainable_weights = variables = trainable_variables

    @property
    def non_trainable_variables(self):
        return []

    def count_params(self):
        return int(sum(np.prod(v.shape) for v in self.trainable_variables))

    def get_weights(self):
        """NumPy copies in Keras's order: kernel (in, out), bias, layer by layer."""
        return [v.numpy() for v in self.trainable_variables]

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

    def load_weights(self, filepath, skip_mismatch=False, by_name=False, options=None):
        """Read a ``*.weights.h5`` file (ours or Keras 3's) or a ``*.keras`` model's weights,
        checked against the model before anything changes."""
        saving.load_weights(self, filepath)

    def save(self, filepath, overwrite=True, **kwargs):
        """Keras 3's ``model.save("m.keras")``: architecture, weights and optimizer state in
        one zip archive, written atomically; ``mirrored.keras.models.load_model`` reads it."""
        self._save_on_chief(saving.save_model, filepath, overwrite)

    def get_config(self):
        """Keras's config of this Sequential (what ``model.save`` writes to config.json)."""
        return saving.model_config(self)["config"]

    # -- compile -------------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                weighted_metrics=None, run_eagerly=None, steps_per_execution=None, jit_compile=None,
                cuda_graph=False, **kwargs):
        """Keras's ``compile``: optimizer, loss, ``metrics=['accuracy']``.

        ``cuda_graph=True`` (this library's own option, not Keras's): on a GPU, ``fit``
        captures the device part of its training step once as a CUDA graph and replays
        it every step (``mirrored/graphs.py`` says how and why). Where there is nothing
        to capture (CPU devices, the CUDA simulator) it warns once and runs eagerly;
        the weights come out the same either way.
        """
        dropouts = [l.name for l in self.layers if isinstance(l, Dropout) and l.rate > 0]
        if cuda_graph and dropouts:
            raise NotImplementedError(
                f"compile(cuda_graph=True) with dropout ({', '.join(dropouts)}): a CUDA graph replays "
                f"its launches with the arguments it captured, so every step would reuse the first "
                f"step's dropout mask. Compile without cuda_graph (each step then gets its own mask).")
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
        if self.built:
            self.step.loss_mode()                   # refuses a softmax layer with from_logits=True now
        if self._graphs is not None:
            self._graphs.close()                    # they hold the old optimizer's buffers
        self._cuda_graph, self._graphs, self._captured = bool(cuda_graph), None, None

    @property
    def _step_graphs(self):
        """The CUDA graphs of this model's step (``compile(cuda_graph=True)``), else None."""
        if not self._cuda_graph:
            return None
        if self._graphs is None:
            self._graphs = StepGraphs(self.step.devices, self._strategy.extended.cross_device_ops)
            if self._graphs.reason:
                warnings.warn(f"compile(cuda_graph=True): {self._graphs.reason}; every training "
                              f"step runs eagerly (the same launches, one by one).", stacklevel=5)
        return self._graphs

    def _trainer(self):
        """What runs a training step: the step itself, or the step with its device part
        captured as CUDA graphs (``compile(cuda_graph=True)``)."""
        graphs = self._step_graphs
        if graphs is None:
            return self.step
        if self._captured is None or self._captured.graphs is not graphs:
            self._captured = CapturedStep(self.step, graphs)
        return self._captured

    @property
    def metrics_names(self):
        return ["loss"] + self._metric_names

    # -- one step ---------------------------------------------------------------------------
    def train_step(self, x, y):
        """One training step on a host batch x (B, ...), y (B,): split, forward/backward on
        every replica, all-reduce, update (``step.py``). ``fit`` runs this for every batch."""
        check_compiled(self, "training")
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
                self.step.evaluate(batch, mode)
            step += 1
        if not step:
            raise _no_batches("test_function", x, None)
        logs = self._logs(prefix)
        if verbose:
            bar.finish(step, logs)
        return logs

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", return_dict=False, **kwargs):
        """Loss (and accuracy) over the data: ``[loss, accuracy]``, a float, or a dict."""
        check_compiled(self, "evaluating")
        verbose = self._verbosity(verbose)
        with backends.blas_threads():
            logs = self._evaluate((x, y) if y is not None else x, batch_size, verbose)
        if return_dict:
            return logs
        values = list(logs.values())
        return values if len(values) > 1 else values[0]

    def predict(self, x, batch_size=None, verbose="auto", steps=None, **kwargs):
        """The model's outputs (probabilities after a softmax layer) as one NumPy array."""
        with backends.blas_threads():
            return self._predict(x, batch_size, verbose)

    def _predict(self, x, batch_size, verbose):
        verbose = self._verbosity(verbose)
        chunks, steps = data_adapters.predict_batches(x, batch_size)
        outs = []
        bar = Progbar(steps, verbose)
        done = 0
        for batch in chunks:
            xb = batch[0] if isinstance(batch, (tuple, list)) else batch
            xb = xb.numpy() if isinstance(xb, Tensor) else np.asarray(xb)
            self.build((None,) + tuple(xb.shape[1:]))
            self.check_example_shape(xb.shape[1:])
            xb = np.ascontiguousarray(xb, np.float32).reshape(xb.shape[0], -1)   # (B, in)
            with self.step.no_trace():                  # out of memory: nothing stays charged
                outs.extend(self.step.predict(xb))
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
        ``tape.gradient``.
        """
        shape = inputs.shape if hasattr(inputs, "shape") else np.shape(inputs)
        self.build((None,) + tuple(shape[1:]))
        self.check_example_shape(shape[1:])
        features = int(np.prod(shape[1:], dtype=np.int64))   # Flatten; explicit, so 0 rows work
        strategy, replica_ctx = context.top()
        r = replica_ctx._replica_id if (replica_ctx is not None and strategy is self._strategy) else 0
        p = self.step.programs[r]
        dev = p.dev
        with dev.activate():
            if isinstance(inputs, Tensor):
                if inputs.dtype != np.float32:
                    raise TypeError(f"the model takes float32 inputs, got {inputs.dtype}; "
                                    f"use mirrored.cast(x, mirrored.float32).")
                buf = inputs._buf if inputs._device is dev else dev.copy_from(inputs._buf, inputs._device)
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


def _no_batches(function, x, epoch):
    """Keras's error for data that yields no batch (an empty array or dataset), with why."""
    where = f" in epoch {epoch + 1}" if epoch is not None else ""
    what = (f"{len(x)} examples" if isinstance(x, (np.ndarray, list, tuple)) and not hasattr(x, "batch")
            else f"the dataset {type(x).__name__}")
    return ValueError(f"Unexpected result of `{function}` (Empty logs): the data ({what}) gave no "
                      f"batch{where}. Check that it is not empty (a filter that drops everything, a "
                      f"take(0), an exhausted iterator) and that x holds at least one example.")
