"""``Sequential``: Keras's model API over the dense stack, mirrored across replicas.

A model remembers the strategy in force when it was created (``with
strategy.scope(): model = Sequential([...])``): its weights are then
``MirroredVariable``s, and ``compile``, ``fit``, ``evaluate``, ``predict`` and
``save_weights`` may be called inside or outside the scope — the course lab
calls ``compile`` outside it with ``optimizers.Adam()`` created there.

One training step (``fit``), with N replicas and a global batch of B examples:

    host      split the batch: replica r gets rows [r*k, (r+1)*k), k = ceil(B/N)
    replica r copy its slice into its device's input buffers (made once per batch
              size, reused every step); forward; loss scaled by 1/B; backward
              into its packed gradient buffer            (engine.ReplicaProgram)
    merge     all-reduce SUM of the N gradient buffers   (the ring, one buffer)
              one optimizer launch per device            (every copy, same update)

One host thread drives the replicas in turn (``_run_parts`` says why: it is what
TensorFlow's traced step does too); ``strategy.run`` in a custom loop gives each
replica its own thread instead.

With a data set kept on the devices (``fit(strategy.experimental_distribute_dataset(
ds, InputOptions(experimental_place_dataset_on_device=True)))``) the host sends
only row numbers and each replica gathers its rows on its device instead.

The loss and accuracy stay on the devices and are read when the progress line
is drawn. ``GradientTape`` custom loops use the same replica programs
(``tape.py``).

Neighbours: ``layers.py``, ``losses.py``, ``optimizers.py``, ``engine.py``,
``progbar.py``, ``callbacks.py``.
"""
import contextlib
import os
import tempfile
import warnings

import numpy as np

from mirrored import context, nest, strategy as _strategy
from mirrored.graphs import StepGraphs
from mirrored.input_lib import DistributedDataset, rebatch_bounds
from mirrored.keras import callbacks as _callbacks
from mirrored.keras import losses as _losses
from mirrored.keras import optimizers as _optimizers
from mirrored.keras.engine import (ALL_REDUCE, FORWARD_BACKWARD, INPUT_COPY, OPTIMIZER, UNTIMED,
                                   ParameterPack, ReplicaProgram, components)
from mirrored.keras.layers import Dense, Flatten, InputLayer, Layer
from mirrored.keras.metrics import ACCURACY_NAMES, SparseCategoricalAccuracy
from mirrored.keras.progbar import Progbar
from mirrored.keras.tape import _ModelOutput
from mirrored.tensor import Tensor


class Sequential:
    """A stack of layers: ``Flatten`` then ``Dense`` layers (see layers.py)."""

    def __init__(self, layers=None, name=None):
        self.name = name or "sequential"
        self._strategy = _strategy.get_strategy()
        self.layers = []
        self._input_shape = None
        self.built = False
        self.optimizer = self.loss = None
        self._metric_names = []
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

    def _scope(self):
        if isinstance(self._strategy, _strategy._DefaultStrategy):
            return contextlib.nullcontext()
        return self._strategy.scope()

    def build(self, input_shape=None):
        """Create the weights (under the model's strategy) for examples of ``input_shape``."""
        if self.built:
            return
        if input_shape is not None:
            self._input_shape = tuple(input_shape)[1:] if len(input_shape) > 1 and input_shape[0] is None \
                else tuple(input_shape)
        if self._input_shape is None:
            raise ValueError("the model's input shape is unknown: give the first layer "
                             "input_shape=..., start with layers.Input(shape=...), or call fit first.")
        shape = self._input_shape
        dense = []
        with self._scope():
            for layer in self.layers:
                if isinstance(layer, Dense):
                    if len(shape) != 1:
                        raise ValueError(f"layer {layer.name!r} gets examples of shape {shape}; "
                                         f"put layers.Flatten() before the first Dense layer.")
                    layer.build(shape)
                    dense.append(layer)
                elif not isinstance(layer, Flatten):
                    raise NotImplementedError(f"layer {layer!r} is not supported in this dense stack.")
                shape = layer.output_shape_for(shape)
        if not dense:
            raise ValueError("a Sequential model here needs at least one Dense layer.")
        for layer in dense[:-1]:
            if layer.activation == "softmax":
                raise NotImplementedError(f"softmax is supported on the last layer only ({layer.name!r}).")
        self._dense = dense
        self._output_shape = shape
        variables = self.trainable_variables
        devices = [c._tensor._device for c in components(variables[0])]
        self._pack = ParameterPack(variables, devices)
        self._programs = [ReplicaProgram(dense, self._pack, r) for r in range(len(devices))]
        self.built = True

    def _ensure_built(self, x_shape):
        if not self.built:
            self.build(tuple(x_shape[1:]))

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

    def _variable_index(self, var):
        for k, v in enumerate(self.trainable_variables):
            if var is v or any(var is c for c in components(v)):
                return k
        return None

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
        """Write the weights atomically: a temporary file beside ``filepath``, then a rename.

        The format is NumPy's ``.npz`` (one array per weight, Keras's order), written
        to exactly ``filepath``. A failed save leaves any previous file intact.
        """
        filepath = os.fspath(filepath)
        if not overwrite and os.path.exists(filepath):
            raise FileExistsError(f"{filepath} exists and overwrite=False.")
        folder = os.path.dirname(os.path.abspath(filepath))
        os.makedirs(folder, exist_ok=True)
        arrays = self.get_weights()
        names = np.array([v.name for v in self.trainable_variables])
        fd, tmp = tempfile.mkstemp(prefix=".weights-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, names=names, *arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, filepath)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def load_weights(self, filepath, skip_mismatch=False, by_name=False, options=None):
        """Read weights written by ``save_weights`` (checked against the model first)."""
        filepath = os.fspath(filepath)
        if not os.path.exists(filepath):
            raise FileNotFoundError(f"no weights file at {filepath}; save one with model.save_weights(path).")
        try:
            with np.load(filepath, allow_pickle=False) as data:
                n = len([k for k in data.files if k.startswith("arr_")])
                arrays = [data[f"arr_{i}"] for i in range(n)]
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"{filepath} is not a weights file written by save_weights ({err}).") from err
        self.set_weights(arrays)

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
            self._loss_mode(self.loss)
        if getattr(self, "_graphs", None) is not None:
            self._graphs.close()                    # they hold the old optimizer's buffers
        self._cuda_graph, self._graphs = bool(cuda_graph), None

    @property
    def _step_graphs(self):
        """The CUDA graphs of this model's step (``compile(cuda_graph=True)``), else None."""
        if not getattr(self, "_cuda_graph", False):
            return None
        if self._graphs is None:
            self._graphs = StepGraphs(self._pack.devices, self._strategy.extended._cross_device_ops)
            if self._graphs.reason:
                warnings.warn(f"compile(cuda_graph=True): {self._graphs.reason}; every training "
                              f"step runs eagerly (the same launches, one by one).", stacklevel=4)
        return self._graphs

    def _loss_mode(self, loss_obj):
        """Which fused loss kernel applies to this model's output (see losses.py)."""
        last = self._dense[-1].activation
        if last == "softmax":
            if loss_obj.from_logits:
                raise NotImplementedError(
                    "the last layer has activation='softmax' but the loss says from_logits=True: "
                    "drop the softmax (the lab's Dense(10) outputs logits) or use from_logits=False.")
            return "logits"     # Keras also uses the softmax layer's logits here
        return "logits" if loss_obj.from_logits else "probs"

    @property
    def metrics_names(self):
        return ["loss"] + self._metric_names

    # -- data ----------------------------------------------------------------------------
    def _batches(self, x, y, batch_size, shuffle):
        """An epoch-iterable of (x, y) host batches, and its length (None if unknown)."""
        if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)) and not hasattr(x, "batch"):
            if y is None:
                raise ValueError("fit/evaluate with arrays needs y (the labels).")
            x, y = np.asarray(x), np.asarray(y)
            if len(x) != len(y):
                raise ValueError(f"x has {len(x)} examples but y has {len(y)}.")
            batches = _ArrayBatches(x, y, batch_size or 32, shuffle)
            return batches, len(batches)
        if y is not None:
            raise ValueError("y must be None when x is a dataset (it yields (x, y) pairs).")
        if isinstance(x, DistributedDataset):
            return self._distributed_batches(x)
        if not hasattr(x, "__iter__"):
            raise TypeError(f"x must be a NumPy array or a mirrored.data.Dataset, got {type(x).__name__}.")
        try:
            steps = len(x)
        except TypeError:
            steps = None
        return _DatasetBatches(x), steps

    def _distributed_batches(self, dist):
        """fit/evaluate on ``strategy.experimental_distribute_dataset(ds, options)``.

        Plain: the same as passing ``ds`` (fit splits each global batch itself, into
        its reusable device buffers). With ``experimental_place_dataset_on_device``:
        epochs the data set can plan by row number yield ``_ResidentBatch``es,
        gathered on the devices from the copy kept there (``input_lib.ResidentRows``).
        """
        if dist._strategy is not self._strategy:
            raise ValueError(f"this distributed dataset was made by {dist._strategy!r}, but the model "
                             f"was built under {self._strategy!r}: distribute the dataset with the "
                             f"strategy whose scope created the model.")
        try:
            steps = len(dist._dataset)
        except TypeError:
            steps = None
        return _DistributedBatches(dist), steps

    def _host_batch(self, batch):
        if isinstance(batch, dict):
            batch = (batch.get("image"), batch.get("label"))
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError("each dataset element must be an (x, y) pair: load with "
                             "as_supervised=True or map to (image, label).")
        if len(batch) > 2:
            raise NotImplementedError("sample weights are not implemented.")
        xb, yb = (b.numpy() if isinstance(b, Tensor) else np.asarray(b) for b in batch)
        self._ensure_built(xb.shape)
        xb = np.ascontiguousarray(xb, np.float32).reshape(xb.shape[0], -1)     # Flatten: (B, in)
        if xb.shape[1] != self._dense[0].input_dim:
            raise ValueError(f"examples have {xb.shape[1]} features, the model expects "
                             f"{self._dense[0].input_dim} (input shape {self._input_shape}).")
        yb = yb.reshape(-1)
        if yb.dtype.kind not in "iu":
            yb = yb.astype(np.int64)
        return xb, np.ascontiguousarray(yb)

    # -- one step --------------------------------------------------------------------------
    def _n(self):
        return len(self._programs)

    def _split(self, xb, yb):
        """Each replica's share of a host batch: TensorFlow's rebatching rule, as views."""
        return [(xb[lo:hi], yb[lo:hi]) for lo, hi in rebatch_bounds(xb.shape[0], self._n())]

    def _load_parts(self, parts, load, timer=UNTIMED):
        """Replica r puts ``parts[r]`` (its share of the batch) on its device with
        ``load(program, part) -> (x_dev, y_dev)``: (b, in) float32 and (b,) labels in
        buffers made once per batch size and reused every step.

        This thread drives every replica in turn, here and in every phase of a step.
        On a GPU each call only queues work on that device's stream, so the devices
        still work at the same time. Logical CPU devices share the cores: there the
        replicas' work runs one after the other, and NumPy's BLAS spreads each large
        product over all cores. TensorFlow's ``fit`` does the same in effect: its step
        is a traced ``tf.function``, one graph holding every replica's ops, with no
        replica threads once traced. A thread per replica (``strategy.run``, used by
        custom loops) would only add hand-offs here: the step is a few hundred
        microseconds of Python, which holds the GIL, so two replica threads measured
        0.6-0.7x of one replica's samples/s on 2 cores, against 0.95x for this loop.
        """
        inputs = []
        for r, part in enumerate(parts):
            p = self._programs[r]
            with p.dev.activate(), timer.phase(INPUT_COPY, r, p.dev):
                inputs.append(load(p, part))
        return inputs

    def _run_parts(self, fn, parts, load, *extra):
        """Load every replica's part, then ``fn(program, x_dev, y_dev, *extra)`` on each."""
        inputs = self._load_parts(parts, load)
        out = []
        for p, (x_dev, y_dev) in zip(self._programs, inputs):
            with p.dev.activate():
                out.append(fn(p, x_dev, y_dev, *extra))
        return out

    # -- the training step: a host part, then a device part ---------------------------------
    def _train_parts(self, parts, load, scale, timer=UNTIMED):
        """One training step on the replicas' shares ``parts`` of a global batch.

        Host part: every share onto its device (``load``), and the optimizer's scalars
        for this step onto every device (``begin_step``). Device part
        (``_device_step``): launches only, so with ``compile(cuda_graph=True)`` on a GPU
        it is captured once and replayed as one CUDA graph (``mirrored/graphs.py``).
        """
        inputs = self._load_parts(parts, load, timer)
        self.optimizer.begin_step(self._pack.devices)
        mode = self._loss_mode(self.loss)
        graphs = self._step_graphs if timer is UNTIMED else None    # a timed step stays eager
        if graphs is None:
            self._device_step(inputs, mode, scale, timer)
        else:
            key = (mode, scale) + tuple((_address(x), _address(y)) for x, y in inputs)
            graphs.run(key, self._device_step, inputs, mode, scale)

    def _device_step(self, inputs, mode, scale, timer=UNTIMED):
        """Forward, loss and backward on every replica, then the all-reduce SUM of the
        packed gradients and one optimizer launch per device (the merge)."""
        for r, (p, (x_dev, y_dev)) in enumerate(zip(self._programs, inputs)):
            with p.dev.activate(), timer.phase(FORWARD_BACKWARD, r, p.dev):
                p.forward(x_dev)
                p.loss_and_backward(y_dev, mode, scale)
        pack = self._pack
        if self._n() == 1:
            with timer.phase(OPTIMIZER, 0, pack.devices[0]):
                self.optimizer.update_packed(pack)
            return
        cross_ops = self._strategy.extended._cross_device_ops
        updates = []

        def all_reduce(buffers, devices):
            with timer.collective(ALL_REDUCE, devices):
                cross_ops.all_reduce_flat("SUM", buffers, devices)
            updates.extend(timer.begin_all(OPTIMIZER, devices))    # the updates start now
        self.optimizer.update_packed(pack, all_reduce)
        timer.end_all(updates)

    def train_step(self, xb, yb, timer=UNTIMED):
        """One step on a host batch (x (B, ...), y (B,)): forward, backward, all-reduce, update.

        ``timer`` (a ``mirrored.timing.PhaseTimer``) records each phase of each
        replica; ``mirrored.timing.step_breakdown`` passes one.
        """
        xb, yb = self._host_batch((xb, yb))        # x: (B, in) float32, y: (B,) ints; builds the model
        self._train_parts(self._split(xb, yb), _upload, 1.0 / max(xb.shape[0], 1), timer)

    def _step_on(self, batch, fn, *extra):
        """Run ``fn`` on one batch from ``_batches``: a host batch or a ``_ResidentBatch``."""
        if isinstance(batch, _ResidentBatch):
            return self._run_parts(fn, *self._resident_parts(batch), *extra)
        return self._run_parts(fn, self._split(*self._host_batch(batch)), _upload, *extra)

    def _resident_parts(self, batch):
        """(each replica's row numbers, the loader that gathers them on its device)."""
        loader = batch.loader(self)
        bounds = rebatch_bounds(len(batch.idx), self._n())
        return [batch.idx[lo:hi] for lo, hi in bounds], loader.load

    def _train_on(self, batch):
        """One training step on a batch from ``_batches``."""
        if isinstance(batch, _ResidentBatch):
            parts, load = self._resident_parts(batch)
            return self._train_parts(parts, load, 1.0 / max(len(batch.idx), 1))
        xb, yb = self._host_batch(batch)
        self._train_parts(self._split(xb, yb), _upload, 1.0 / max(xb.shape[0], 1))

    def _eval_program(self, p, x_dev, y_dev, mode):
        p.forward(x_dev)
        p.loss_and_backward(y_dev, mode, 1.0, with_grad=False)

    def _logs(self, prefix=""):
        loss = correct = seen = 0.0
        for p in self._programs:
            l, c, s = p.read_metrics()
            loss, correct, seen = loss + l, correct + c, seen + s
        logs = {prefix + "loss": loss / seen if seen else float("nan")}
        for name in self._metric_names:
            logs[prefix + name] = correct / seen if seen else float("nan")
        return logs

    def _zero_metrics(self):
        for p in self._programs:
            with p.dev.activate():
                p.zero_metrics()

    def _check_compiled(self, what):
        if self.optimizer is None or self.loss is None:
            raise RuntimeError(f"You must compile your model before {what}: call "
                               f"model.compile(optimizer=..., loss=..., metrics=['accuracy']).")

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
        self._check_compiled("training")
        return self._fit(x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
                             initial_epoch, steps_per_epoch, validation_split)

    def _fit(self, x, y, batch_size, epochs, verbose, callbacks, validation_data, shuffle,
             initial_epoch, steps_per_epoch, validation_split):
        if validation_split:
            raise NotImplementedError("validation_split is not implemented; pass validation_data.")
        verbose = 1 if verbose == "auto" else int(verbose)
        batches, steps = self._batches(x, y, batch_size, shuffle)
        if steps_per_epoch is not None:
            steps = steps_per_epoch
        history = _callbacks.History()
        cbs = list(callbacks or []) + [history]
        params = {"verbose": verbose, "epochs": epochs, "steps": steps}
        for cb in cbs:
            cb.set_model(self)
            cb.set_params(params)
        self.stop_training = False
        for cb in cbs:
            cb.on_train_begin()
        for epoch in range(initial_epoch, epochs):
            for cb in cbs:
                cb.on_epoch_begin(epoch)
            if verbose:
                print(f"Epoch {epoch + 1}/{epochs}")
            bar = Progbar(steps, verbose)
            self._zero_metrics()
            step = 0
            for batch in batches:
                if steps_per_epoch is not None and step >= steps_per_epoch:
                    break
                for cb in cbs:
                    cb.on_train_batch_begin(step)
                self._train_on(batch)
                step += 1
                for cb in cbs:
                    cb.on_train_batch_end(step - 1)
                if verbose and bar.wants_update(step):
                    bar.update(step, self._logs())
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
            cb.on_train_end()
        history.params = params
        self.history = history
        return history

    def _evaluate(self, data, batch_size, verbose, prefix=""):
        if isinstance(data, (tuple, list)) and len(data) == 2 and not hasattr(data, "batch"):
            x, y = data
        else:
            x, y = data, None
        batches, steps = self._batches(x, y, batch_size, shuffle=False)
        mode = self._loss_mode(self.loss)
        bar = Progbar(steps, verbose)
        self._zero_metrics()
        step = 0
        for batch in batches:
            self._step_on(batch, self._eval_program, mode)
            step += 1
        logs = self._logs(prefix)
        if verbose:
            bar.finish(step, logs)
        return logs

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", return_dict=False, **kwargs):
        """Loss (and accuracy) over the data: ``[loss, accuracy]``, a float, or a dict."""
        self._check_compiled("evaluating")
        verbose = 1 if verbose == "auto" else int(verbose)
        logs = self._evaluate((x, y) if y is not None else x, batch_size, verbose)
        if return_dict:
            return logs
        values = list(logs.values())
        return values if len(values) > 1 else values[0]

    def predict(self, x, batch_size=None, verbose="auto", steps=None, **kwargs):
        """The model's outputs (probabilities after a softmax layer) as one NumPy array."""
        return self._predict(x, batch_size, verbose)

    def _predict(self, x, batch_size, verbose):
        verbose = 1 if verbose == "auto" else int(verbose)
        if isinstance(x, (np.ndarray, list)):
            arr = np.asarray(x)
            bs = batch_size or 32
            chunks = [(arr[i:i + bs],) for i in range(0, len(arr), bs)]
            steps_n = len(chunks)
        else:
            chunks = x
            try:
                steps_n = len(x)
            except TypeError:
                steps_n = None
        outs = []
        bar = Progbar(steps_n, verbose)
        done = 0
        for batch in chunks:
            xb = batch[0] if isinstance(batch, (tuple, list)) else batch
            xb = xb.numpy() if isinstance(xb, Tensor) else np.asarray(xb)
            self._ensure_built(xb.shape)
            xb = np.ascontiguousarray(xb, np.float32).reshape(xb.shape[0], -1)
            dummy = np.zeros(xb.shape[0], np.int32)
            outs.extend(self._run_parts(self._predict_program, self._split(xb, dummy), _upload))
            done += 1
        if verbose:
            bar.finish(done, {})
        if not outs:
            return np.zeros((0,) + tuple(self._output_shape), np.float32)
        return np.concatenate(outs, axis=0)

    def _predict_program(self, p, x_dev, y_dev):
        out = p.forward(x_dev, probabilities=True)
        return p.dev.to_numpy(out)

    # -- calling the model ------------------------------------------------------------------
    def __call__(self, inputs, training=False):
        """Forward on this replica's device (inside strategy.run) or the first one.

        Returns a Tensor: probabilities after a softmax layer, else the last
        layer's output. Inside a GradientTape it remembers the call for
        ``tape.gradient``.
        """
        shape = inputs.shape if hasattr(inputs, "shape") else np.shape(inputs)
        self._ensure_built(shape)
        features = int(np.prod(shape[1:], dtype=np.int64))   # Flatten; explicit, so 0 rows work
        strategy, replica_ctx = context.top()
        r = replica_ctx._replica_id if (replica_ctx is not None and strategy is self._strategy) else 0
        p = self._programs[r]
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
            out = p.forward(x, probabilities=True)
            result = dev.copy_from(out, dev)           # the program reuses `out` next call
        return Tensor(result, dev, _ModelOutput(self, p, x))

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


def _address(buf):
    """Where a device buffer's data starts (what a captured graph reads)."""
    cai = getattr(buf, "__cuda_array_interface__", None)
    return cai["data"][0] if cai is not None else id(buf)


def _upload(p, part):
    """Put a host slice ``(x (b, in) float32, y (b,))`` into program p's input buffers."""
    x, y = part
    return p.upload(x, y)


class _DistributedBatches:
    """Epochs of a DistributedDataset as fit sees them: host batches, or resident ones."""

    def __init__(self, dist):
        self.dist = dist

    def __iter__(self):
        epoch = self.dist.resident_epoch() if self.dist.place_on_device else None
        if epoch is None:
            return iter(self.dist._dataset)            # host batches: fit splits and uploads them
        resident, batches = epoch
        return (_ResidentBatch(resident, idx) for idx in batches)


class _ResidentBatch:
    """One global batch of a data set kept on the devices: its row numbers, (B,) int64."""

    __slots__ = ("resident", "idx")

    def __init__(self, resident, idx):
        self.resident, self.idx = resident, idx

    def loader(self, model):
        loader = getattr(model, "_resident_loader", None)
        if loader is None or loader.resident is not self.resident:
            loader = model._resident_loader = _ResidentLoader(model, self.resident)
        return loader


class _ResidentLoader:
    """Gathers a replica's rows of a resident data set into its program's input buffers.

    Per step and replica: the row numbers go up (b int64), then one gather for x
    and one for y on the device; a cast follows only when the stored dtype is not
    what the model takes (uint8 images: float32; float labels: int64).
    """

    def __init__(self, model, resident):
        self.resident = resident
        leaf = nest.pack_sequence_as(resident.rows.columns, list(range(len(resident.dtypes))))
        if isinstance(leaf, dict):
            leaf = (leaf.get("image"), leaf.get("label"))
        if not (isinstance(leaf, (tuple, list)) and len(leaf) == 2 and all(isinstance(k, int) for k in leaf)):
            raise ValueError("each dataset element must be an (x, y) pair: load with "
                             "as_supervised=True or map to (image, label).")
        self.kx, self.ky = leaf
        model._ensure_built((0,) + tuple(resident.shapes[self.kx]))
        in_dim = model._dense[0].input_dim
        if resident.row_sizes[self.kx] != in_dim:
            raise ValueError(f"examples have {resident.row_sizes[self.kx]} features, the model expects "
                             f"{in_dim} (input shape {model._input_shape}).")
        for p, dev in zip(model._programs, resident.devices):
            if p.dev is not dev:
                raise ValueError(f"the resident data set lives on {dev.name} but replica {p.r} runs on "
                                 f"{p.dev.name}: distribute the dataset with the model's strategy.")
        y_dtype = np.dtype(resident.dtypes[self.ky])
        self.y_dtype = y_dtype if y_dtype.kind in "iu" else np.dtype(np.int64)
        self._scratch = {}                      # (replica, leaf, b) -> (b, row) in the stored dtype

    def load(self, p, idx):
        x_dev, y_dev = p.input_buffers(len(idx), self.y_dtype)   # (b, in) float32, (b,) labels
        wanted = [(self.kx, x_dev), (self.ky, y_dev)]
        landing = [(k, self._landing(p, k, len(idx), out)) for k, out in wanted]
        self.resident.gather(p.r, idx, landing)                  # one upload of b row numbers
        for (_, out), (_, land) in zip(wanted, landing):
            if land is not out and len(idx):
                p.dev.ops.cast(land.reshape(out.shape), out)     # e.g. uint8 images -> float32
        return x_dev, y_dev

    def _landing(self, p, k, b, out):
        """Where leaf k's rows are gathered: ``out`` itself when the stored dtype is
        what the model takes, else a scratch buffer in the stored dtype (cast after)."""
        if np.dtype(self.resident.dtypes[k]) == np.dtype(out.dtype):
            return out
        key = (p.r, k, b)
        tmp = self._scratch.get(key)
        if tmp is None:
            tmp = self._scratch[key] = p.dev.empty((b, self.resident.row_sizes[k]), self.resident.dtypes[k])
        return tmp


class _ArrayBatches:
    """Batches of in-memory arrays, reshuffled every epoch when ``shuffle`` (Keras's fit)."""

    def __init__(self, x, y, batch_size, shuffle):
        self.x, self.y, self.bs, self.shuffle = x, y, int(batch_size), shuffle

    def __iter__(self):
        from mirrored import random as _random
        n = len(self.x)
        order = _random.generator().permutation(n) if self.shuffle else None
        for i in range(0, n, self.bs):
            idx = order[i:i + self.bs] if order is not None else slice(i, i + self.bs)
            yield self.x[idx], self.y[idx]

    def __len__(self):
        return -(-len(self.x) // self.bs)


class _DatasetBatches:
    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)
