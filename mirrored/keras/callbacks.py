"""Keras callbacks: ``Callback``, ``History``, ``LambdaCallback``, ``ModelCheckpoint``,
``LearningRateScheduler``.

``fit`` calls, in order: ``on_train_begin``; per epoch ``on_epoch_begin``,
per step ``on_train_batch_begin``/``on_train_batch_end``, then
``on_epoch_end(epoch, logs)`` with ``logs = {'loss': ..., 'accuracy': ...,
'val_loss': ..., 'val_accuracy': ...}``; finally ``on_train_end``. The
per-step hooks get no metric values (reading them would cost a device sync
every step); epoch logs carry them.
"""
import warnings


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


class LearningRateScheduler(Callback):
    """Sets ``optimizer.learning_rate = schedule(epoch, lr)`` at each epoch's start."""

    def __init__(self, schedule, verbose=0):
        super().__init__()
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch, logs=None):
        opt = self.model.optimizer
        try:
            lr = self.schedule(epoch, opt.learning_rate)
        except TypeError:
            lr = self.schedule(epoch)
        opt.learning_rate = float(lr)
        if self.verbose and _is_chief(self.model):
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.")


class ModelCheckpoint(Callback):
    """Saves the weights at each epoch's end (``save_weights_only=True`` only).

    ``filepath`` may contain ``{epoch}`` (1-based, as Keras) and log keys.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False,
                 save_weights_only=False, **kwargs):
        super().__init__()
        if not save_weights_only:
            raise NotImplementedError("ModelCheckpoint saves weights only here: pass save_weights_only=True.")
        if save_best_only:
            raise NotImplementedError("ModelCheckpoint(save_best_only=True) is not implemented.")
        self.filepath, self.verbose = str(filepath), verbose

    def on_epoch_end(self, epoch, logs=None):
        path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        self.model.save_weights(path)          # a non-chief worker keeps no file (save_weights)
        if self.verbose and _is_chief(self.model):
            print(f"\nEpoch {epoch + 1}: saving model to {path}")


def _is_chief(model):
    """Whether this worker prints (``MultiWorkerMirroredStrategy``: worker 0 only; else always)."""
    return model.distribute_strategy.extended.should_checkpoint


class TensorBoard(Callback):
    """Accepted so tutorial code runs; it writes nothing (there is no TensorBoard writer here)."""

    def __init__(self, log_dir="logs", **kwargs):
        super().__init__()
        warnings.warn("mirrored.keras.callbacks.TensorBoard writes no logs: TensorBoard is not "
                      "supported here. Read the History that fit returns instead.", stacklevel=2)
