"""Keras callbacks: ``Callback``, ``History``, ``LambdaCallback``, ``ModelCheckpoint``,
``LearningRateScheduler``, ``EarlyStopping``, ``ReduceLROnPlateau``, ``CSVLogger``,
``TerminateOnNaN``, ``TensorBoard`` (per-epoch scalars; the event files come from tfevents.py).

``fit`` calls, in order: ``on_train_begin``; per epoch ``on_epoch_begin``,
per step ``on_train_batch_begin``/``on_train_batch_end``, then
``on_epoch_end(epoch, logs)`` with ``logs = {'loss': ..., 'accuracy': ...,
'val_loss': ..., 'val_accuracy': ...}``; finally ``on_train_end``.
``on_train_batch_end(batch, logs)`` gets Keras's batch logs, the epoch's running
``loss`` and ``accuracy`` so far: read from the devices (a sync) once per batch when a
user's callback gets them (it may keep them), else only when looked at (``LazyLogs``,
``batch_logs``), so a step nobody asks about costs nothing.
Under ``MultiWorkerMirroredStrategy`` they are this worker's running metrics
(reading them across workers would be a collective every worker must join);
the epoch's logs are over every worker.

``EarlyStopping``, ``ReduceLROnPlateau`` and ``CSVLogger`` follow Keras 3's
(keras/src/callbacks/*.py) rule for rule, quirks included: EarlyStopping counts
``wait`` before it compares, keeps ``best`` across fits of the same instance, and
never stops at epoch 0; ReduceLROnPlateau's "auto" mode maximises any name
containing "acc" and adds ``learning_rate`` to the epoch's logs; CSVLogger's
columns are ``epoch`` (0-based) then the log keys sorted, one flushed row per epoch.
ModelCheckpoint's ``save_best_only`` saves when the monitored value beats the best so far
(strictly; from ``initial_value_threshold`` if given), in the direction EarlyStopping uses
(``_monitor_op``: a loss goes down, an accuracy up, else say ``mode``).
"""
import csv
import math
import os
import warnings
from collections.abc import Iterable, MutableMapping

import numpy as np

from mirrored.keras.metrics import ACCURACY_NAMES
from mirrored.keras.tfevents import EventFileWriter


class Callback:
    def __init__(self):
        self.model = None
        self.params = {}

    def set_model(self, model):
        self.model = model

    def set_params(self, params):
        self.params = params

    def on_train_begin(self, logs=None): pass
    def on_train_end(self, logs=None): pass
    def on_epoch_begin(self, epoch, logs=None): pass
    def on_epoch_end(self, epoch, logs=None): pass
    def on_train_batch_begin(self, batch, logs=None): pass
    def on_train_batch_end(self, batch, logs=None): pass
    def on_test_begin(self, logs=None): pass
    def on_test_end(self, logs=None): pass


def batch_hooks(callbacks, name):
    """The ``name`` hooks ("on_train_batch_begin" or "on_train_batch_end") of ``callbacks``
    that do something: ``Callback``'s own no-op is left out, so a step that no callback
    watches calls none (Keras's ``CallbackList`` skips them likewise). ``fit`` asks once."""
    base = getattr(Callback, name)
    hooks = [getattr(cb, name) for cb in callbacks]
    return [hook for hook in hooks if getattr(hook, "__func__", hook) is not base]


def batch_logs(hooks, read):
    """``fit``'s logs for one batch's ``on_train_batch_end`` ``hooks`` (and the progress bar):
    the dict ``read()`` returns (the running metrics, read from the devices: a sync).

    Read now, once, if any hook is a user's (defined outside this library): a user's
    callback may keep the dict, and must find this batch's values in it later, not the
    values of whatever batch was last when it looked (``LazyLogs`` read late showed the
    last batch's loss in every kept dict). Else read only when looked at (``LazyLogs``):
    the library's hooks (``ModelCheckpoint``, ``TerminateOnNaN``, the lab's ``EpochTimer``,
    which must not add a sync per step to what it times) use the logs at once and keep
    nothing, and the progress bar reads them only when it redraws."""
    def users(hook):
        return not (getattr(getattr(hook, "__func__", hook), "__module__", None) or "").startswith("mirrored.")
    if any(users(hook) for hook in hooks):
        return dict(read())
    return LazyLogs(read)


class LazyLogs(MutableMapping):
    """A logs dict filled by ``read()`` the first time anyone looks into it (``fit``'s batch
    logs when no user's callback gets them, ``batch_logs``: reading the metrics syncs the
    devices, so it happens only when asked)."""

    def __init__(self, read):
        self._read, self._logs = read, None

    def _data(self):
        if self._logs is None:
            self._logs = dict(self._read())
        return self._logs

    def __getitem__(self, key):
        return self._data()[key]

    def __setitem__(self, key, value):
        self._data()[key] = value

    def __delitem__(self, key):
        del self._data()[key]

    def __iter__(self):
        return iter(self._data())

    def __len__(self):
        return len(self._data())

    def __bool__(self):
        return True      # they always hold the loss: ``logs = logs or {}`` needs no device read

    def __repr__(self):
        return repr(self._data())


class History(Callback):
    """What ``fit`` returns: ``history.history['loss']`` etc., one entry per epoch."""

    def __init__(self):
        super().__init__()
        self.history = {}
        self.epoch = []

    def on_train_begin(self, logs=None):
        self.epoch = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)


class LambdaCallback(Callback):
    def __init__(self, on_epoch_begin=None, on_epoch_end=None, on_train_begin=None, on_train_end=None,
                 on_train_batch_begin=None, on_train_batch_end=None, **kwargs):
        super().__init__()
        for name, fn in [("on_epoch_begin", on_epoch_begin), ("on_epoch_end", on_epoch_end),
                         ("on_train_begin", on_train_begin), ("on_train_end", on_train_end),
                         ("on_train_batch_begin", on_train_batch_begin),
                         ("on_train_batch_end", on_train_batch_end)]:
            if fn is not None:
                setattr(self, name, fn)


class TerminateOnNaN(Callback):
    """Stop training after the first batch whose loss is NaN or infinite, as Keras's does:
    prints ``Batch {batch}: Invalid loss, terminating training`` and sets
    ``model.stop_training`` (``fit`` ends the epoch there, calls ``on_epoch_end`` and stops).

    The loss is the batch logs' (the epoch's running mean, as Keras's batch logs: once a
    batch's loss is NaN, so is the mean). Under ``MultiWorkerMirroredStrategy`` each
    worker's batch logs are its own replicas', so the workers agree first (a sum across
    workers: every worker runs this callback): one stopping alone would leave the others
    waiting for it in the next all-reduce."""

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        invalid = not math.isfinite(float(loss))
        ext = self.model.distribute_strategy.extended
        if ext.num_workers > 1:
            invalid = ext.sum_across_workers([float(invalid)], "TerminateOnNaN's check of the loss")[0] > 0
        if invalid:
            if _is_chief(self.model):
                print(f"Batch {batch}: Invalid loss, terminating training")
            self.model.stop_training = True


class LearningRateScheduler(Callback):
    """Sets ``optimizer.learning_rate = schedule(epoch, lr)`` at each epoch's start."""

    def __init__(self, schedule, verbose=0):
        super().__init__()
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch, logs=None):
        opt = self.model.optimizer
        try:
            lr = self.schedule(epoch, float(opt.learning_rate))   # a float, as Keras 3 passes it
        except TypeError:
            lr = self.schedule(epoch)
        opt.learning_rate = float(lr)
        if self.verbose and _is_chief(self.model):
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.")


class ModelCheckpoint(Callback):
    """Saves the model as training goes: ``model.save`` to a ``*.keras`` file, or with
    ``save_weights_only=True`` ``model.save_weights`` to a ``*.weights.h5`` file (Keras 3's
    rule; other names are refused when the callback is made, not after an epoch's work).

    ``save_freq="epoch"``: at each epoch's end, with the epoch's logs. ``save_freq=n`` (a
    positive int): after every n training batches, counted across epochs as Keras counts
    them (``_batches_seen_since_last_saving``: 2 epochs of 4 batches with n=3 save after
    batch 3 of epoch 1 and batch 2 of epoch 2), with that batch's logs (the epoch's running
    loss and accuracy so far, as Keras's batch logs; no ``val_*``). Anything else ("batch",
    0, -1, 2.5) is refused here, before training (Keras 3 itself accepts 0 and negative
    ints and then saves after every batch).

    ``filepath`` may contain ``{epoch}`` (1-based, as Keras), with ``save_freq=n`` also
    ``{batch}`` (the batch's 1-based number within its epoch), and log keys.
    ``save_best_only=True``: save only when ``monitor`` improved on the best value so far
    (``mode`` "auto"/"min"/"max"; ``initial_value_threshold`` the value to beat first),
    read from the logs of the epoch or batch where a save is due; logs without it (e.g.
    ``val_loss`` in a batch's logs) give a warning and a save, as Keras 3. Under
    ``MultiWorkerMirroredStrategy`` only the chief keeps the files and prints.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False,
                 save_weights_only=False, mode="auto", save_freq="epoch",
                 initial_value_threshold=None):
        super().__init__()
        if save_freq != "epoch" and (not isinstance(save_freq, int) or isinstance(save_freq, bool)
                                     or save_freq < 1):
            raise ValueError(f"Unrecognized save_freq: {save_freq!r}. Expected save_freq are 'epoch' "
                             f"or integer values: 'epoch' saves at the end of every epoch, a positive "
                             f"int n after every n training batches.")
        if mode not in ("auto", "min", "max"):
            warnings.warn(f"ModelCheckpoint mode '{mode}' is unknown, fallback to auto mode.", stacklevel=2)
            mode = "auto"
        self.filepath, self.verbose = os.fspath(filepath), verbose
        self.monitor, self.mode, self.save_best_only = monitor, mode, save_best_only
        self.save_weights_only = save_weights_only
        self.save_freq = save_freq
        self._batches_seen_since_last_saving = 0      # Keras's counters (kept across fits, as Keras)
        self._last_batch_seen = None
        self._current_epoch = 0
        self.monitor_op = None
        self.best = initial_value_threshold      # None until the direction is known
        suffix = ".weights.h5" if save_weights_only else ".keras"
        if not self.filepath.endswith(suffix):
            raise ValueError(f"ModelCheckpoint: with save_weights_only={save_weights_only}, the filepath "
                             f"must end in {suffix}, got {self.filepath!r}.")

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._should_save_on_batch(batch):
            self._save_model(self._current_epoch, batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save_model(epoch, None, logs)

    def _should_save_on_batch(self, batch):
        """Keras's count: ``batch`` is 0-based within its epoch, so a number not above the
        last one seen starts a new epoch (batch + 1 more batches), else the gap is added."""
        if self.save_freq == "epoch":
            return False
        if self._last_batch_seen is None or batch <= self._last_batch_seen:
            self._batches_seen_since_last_saving += batch + 1
        else:
            self._batches_seen_since_last_saving += batch - self._last_batch_seen
        self._last_batch_seen = batch
        if self._batches_seen_since_last_saving >= self.save_freq:
            self._batches_seen_since_last_saving = 0
            return True
        return False

    def _file_path(self, epoch, batch, logs):
        """Keras's ``_get_file_path``: ``{epoch}`` 1-based, ``{batch}`` 1-based when saving on a
        batch (unless the logs have their own ``batch``), then the logs' keys."""
        try:
            if batch is None or "batch" in logs:
                return self.filepath.format(epoch=epoch + 1, **logs)
            return self.filepath.format(epoch=epoch + 1, batch=batch + 1, **logs)
        except KeyError as err:
            raise KeyError(f'Failed to format this callback filepath: "{self.filepath}". Reason: {err}'
                           + (" ({batch} is only known with an integer save_freq)"
                              if err.args == ("batch",) else "")) from None

    def _save_model(self, epoch, batch, logs):
        logs = logs if logs is not None else {}
        path = self._file_path(epoch, batch, logs)
        talk = self.verbose and _is_chief(self.model)
        saying = f"\nEpoch {epoch + 1}: saving model to {path}"
        if self.save_best_only:
            if self.monitor_op is None:
                self.monitor_op = _monitor_op("ModelCheckpoint", self.monitor, self.mode, self.model)
                if self.best is None:
                    self.best = math.inf if self.monitor_op is _less else -math.inf
            current = logs.get(self.monitor)
            if current is None:
                # Keras 3 warns, then saves as if save_best_only were False
                warnings.warn(f"Can save best model only with {self.monitor} available.",
                              stacklevel=3)
            elif not self.monitor_op(current, self.best):
                if talk:
                    print(f"\nEpoch {epoch + 1}: {self.monitor} did not improve from {self.best:.5f}")
                return
            else:
                saying = (f"\nEpoch {epoch + 1}: {self.monitor} improved from {self.best:.5f} to "
                          f"{current:.5f}, saving model to {path}")
                self.best = current
        if talk:
            print(saying)
        if self.save_weights_only:
            self.model.save_weights(path)      # a non-chief worker keeps no file (see save_weights)
        else:
            self.model.save(path)


def _monitor_op(who, monitor, mode, model):
    """Keras's rule for which way a monitored value improves: ``_less`` or ``_greater``.
    mode "min"/"max" says it; "auto": a loss goes down, an accuracy the model computes goes
    up, anything else is an error (Keras 3's MonitorCallback)."""
    if mode == "min":
        return _less
    if mode == "max":
        return _greater
    name = monitor.removeprefix("val_")
    if name == "loss":
        return _less
    if name in ACCURACY_NAMES and name in getattr(model, "metrics_names", ()):
        return _greater                          # Keras: the metric's direction is "up"
    raise ValueError(f"{who} callback received monitor={monitor} but cannot tell whether that "
                     f"metric should be maximized or minimized (the model's metrics are "
                     f"{getattr(model, 'metrics_names', [])}). Pass mode='max' to use the highest "
                     f"value, or mode='min' to use the lowest value.")


def _is_chief(model):
    """Whether this worker prints (``MultiWorkerMirroredStrategy``: worker 0 only; else always)."""
    return model.distribute_strategy.extended.should_checkpoint


class TensorBoard(Callback):
    """Per-epoch scalars for TensorBoard, as Keras 3's: ``epoch_loss``, ``epoch_accuracy``, ...
    and ``epoch_learning_rate`` in ``<log_dir>/train``, the ``val_`` ones (without the prefix) in ``<log_dir>/validation``,
    step = epoch (event files written by tfevents.py). Histograms, graphs, images, profiling
    and per-batch logs (``update_freq``) are not written; those arguments are accepted (they
    change what is logged, not what is trained), and a keyword Keras's lacks is a TypeError."""

    def __init__(self, log_dir="logs", histogram_freq=0, write_graph=True, write_images=False,
                 write_steps_per_second=False, update_freq="epoch", profile_batch=0, embeddings_freq=0,
                 embeddings_metadata=None):
        super().__init__()
        self.log_dir = os.fspath(log_dir)
        self._writers = {}

    def _writer(self, split):
        if split not in self._writers:
            self._writers[split] = EventFileWriter(os.path.join(self.log_dir, split))
        return self._writers[split]

    def on_epoch_end(self, epoch, logs=None):
        if not _is_chief(self.model):           # MultiWorkerMirroredStrategy: the chief writes
            return
        logs = dict(logs or {})
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and "learning_rate" not in logs:       # as Keras 3 adds it
            logs["learning_rate"] = np.asarray(optimizer.learning_rate)
        for key, value in logs.items():
            split, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self._writer(split).scalar(f"epoch_{name}", value, epoch)

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


def _less(a, b):
    return a < b


def _greater(a, b):
    return a > b


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has stopped improving (Keras's rules, see the module
    docstring): after ``patience`` epochs with no improvement of at least ``min_delta``
    (counted from ``start_from_epoch``), or, with ``baseline``, without beating it.
    ``restore_best_weights``: at the end of training, set the weights of the best epoch."""

    def __init__(self, monitor="val_loss", min_delta=0, patience=0, verbose=0, mode="auto",
                 baseline=None, restore_best_weights=False, start_from_epoch=0):
        super().__init__()
        self.monitor, self.patience, self.verbose = monitor, patience, verbose
        self.baseline = baseline
        self.min_delta = abs(min_delta)
        self.wait = self.stopped_epoch = 0
        self.restore_best_weights = restore_best_weights
        self.best_weights = None
        self.best_epoch = 0
        self.start_from_epoch = start_from_epoch
        if mode not in ("auto", "min", "max"):
            warnings.warn(f"EarlyStopping mode {mode} is unknown, fallback to auto mode.", stacklevel=2)
            mode = "auto"
        self.mode = mode
        self.monitor_op = None

    def _set_monitor_op(self):
        self.monitor_op = _monitor_op("EarlyStopping", self.monitor, self.mode, self.model)
        if self.monitor_op is _less:
            self.min_delta *= -1
        self.best = math.inf if self.monitor_op is _less else -math.inf

    def on_train_begin(self, logs=None):
        self.wait = self.stopped_epoch = 0
        self.best_weights = None
        self.best_epoch = 0

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor_op is None:
            self._set_monitor_op()
        current = self.get_monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = self.model.get_weights()
            self.best_epoch = epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0           # only beating both the baseline and the best resets it
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0 and self.verbose > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self.model.set_weights(self.best_weights)

    def get_monitor_value(self, logs):
        logs = logs or {}
        value = logs.get(self.monitor)
        if value is None:
            warnings.warn(f"Early stopping conditioned on metric `{self.monitor}` which is not available. "
                          f"Available metrics are: {','.join(list(logs.keys()))}", stacklevel=2)
        return value

    def _is_improvement(self, value, reference):
        return self.monitor_op(value - self.min_delta, reference)


class ReduceLROnPlateau(Callback):
    """Multiply the learning rate by ``factor`` (not below ``min_lr``) after ``patience``
    epochs in which ``monitor`` did not improve by more than ``min_delta``; then wait
    ``cooldown`` epochs before counting again. Adds ``learning_rate`` to the epoch's logs."""

    def __init__(self, monitor="val_loss", factor=0.1, patience=10, verbose=0, mode="auto",
                 min_delta=1e-4, cooldown=0, min_lr=0.0, **kwargs):
        super().__init__()
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau does not support a factor >= 1.0. Received factor={factor}")
        self.monitor, self.factor, self.min_lr = monitor, factor, min_lr
        self.min_delta, self.patience, self.verbose, self.cooldown = min_delta, patience, verbose, cooldown
        self.cooldown_counter = self.wait = 0
        self.best = 0
        self.mode = mode
        self.monitor_op = None
        self._reset()

    def _reset(self):
        if self.mode not in {"auto", "min", "max"}:
            warnings.warn(f"Learning rate reduction mode {self.mode} is unknown, fallback to auto mode.",
                          stacklevel=2)
            self.mode = "auto"
        if self.mode == "min" or (self.mode == "auto" and "acc" not in self.monitor):
            self.monitor_op = lambda a, b: a < b - self.min_delta
            self.best = math.inf
        else:
            self.monitor_op = lambda a, b: a > b + self.min_delta
            self.best = -math.inf
        self.cooldown_counter = self.wait = 0

    def on_train_begin(self, logs=None):
        self._reset()

    def in_cooldown(self):
        return self.cooldown_counter > 0

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        logs["learning_rate"] = float(self.model.optimizer.learning_rate)
        current = logs.get(self.monitor)
        if current is None:
            warnings.warn(f"Learning rate reduction is conditioned on metric `{self.monitor}` which is not "
                          f"available. Available metrics are: {','.join(list(logs.keys()))}.", stacklevel=2)
            return
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if self.monitor_op(current, self.best):
            self.best, self.wait = current, 0
        elif not self.in_cooldown():
            self.wait += 1
            if self.wait >= self.patience:
                old_lr = float(self.model.optimizer.learning_rate)
                if old_lr > float(np.float32(self.min_lr)):
                    new_lr = max(old_lr * self.factor, self.min_lr)
                    self.model.optimizer.learning_rate = new_lr
                    if self.verbose > 0:
                        print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new_lr}.")
                    self.cooldown_counter = self.cooldown
                    self.wait = 0


class CSVLogger(Callback):
    """One CSV row per epoch: ``epoch`` (0-based), then the epoch's logs by sorted key.

    ``append=True`` continues an existing file (without a second header); the file is
    flushed after every row, so a run cut short keeps the epochs it finished."""

    def __init__(self, filename, separator=",", append=False):
        super().__init__()
        self.sep = separator
        self.filename = os.fspath(filename)
        self.append = append
        self.writer = self.keys = self.csv_file = None
        self.append_header = True

    def on_train_begin(self, logs=None):
        if self.csv_file and not self.csv_file.closed:
            self.csv_file.close()
        if not _is_chief(self.model):           # MultiWorkerMirroredStrategy: the chief writes the file
            self.csv_file = open(os.devnull, "w", newline="")
            self.writer = self.keys = None
            return
        if self.append:
            if os.path.exists(self.filename):
                with open(self.filename) as f:
                    self.append_header = not bool(len(f.readline()))
            mode = "a"
        else:
            mode = "w"
        if self.csv_file and not self.csv_file.closed:
            self.csv_file.close()
        self.csv_file = open(self.filename, mode, newline="")
        self.writer = self.keys = None

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}

        def handle_value(k):
            if isinstance(k, str):
                return k
            if isinstance(k, Iterable) and not (isinstance(k, np.ndarray) and k.ndim == 0):
                return f'"[{", ".join(map(str, k))}]"'
            return k

        if self.keys is None:
            self.keys = sorted(logs.keys())
            for name in getattr(self.model, "metrics_names", ()):
                if name.startswith("val_") and name not in self.keys:
                    self.keys.append(name)
        if not self.writer:
            class Dialect(csv.excel):
                delimiter = self.sep
            self.writer = csv.DictWriter(self.csv_file, fieldnames=["epoch"] + self.keys, dialect=Dialect)
            if self.append_header:
                self.writer.writeheader()
        row = {"epoch": epoch}
        row.update((key, handle_value(logs.get(key, "NA"))) for key in self.keys)
        self.writer.writerow(row)
        self.csv_file.flush()

    def on_train_end(self, logs=None):
        if self.csv_file and not self.csv_file.closed:
            self.csv_file.close()
        self.writer = None
