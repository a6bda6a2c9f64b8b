"""Keras's EarlyStopping, ReduceLROnPlateau and CSVLogger; fit's validation_split and its
progress line for data sets of unknown length (issue 16).

The rules are Keras 3's (keras/src/callbacks/*.py); each test states the epoch-by-epoch
expectation it checks, worked out from those rules, and runs a real ``fit`` where the
rule involves the model (weights restored, learning rate changed, rows written).
"""
import csv

import numpy as np
import pytest

import mirrored as tf
from mirrored.keras import callbacks as cb_lib
from mirrored.keras import progbar


def small_model(optimizer="sgd", din=6, classes=3):
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu", input_shape=(din,)),
                                     tf.keras.layers.Dense(classes)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=optimizer, metrics=["accuracy"])
    return model


def data(rng, n=40, din=6, classes=3):
    return rng.standard_normal((n, din)).astype(np.float32), rng.integers(0, classes, n)


class _Model:
    """What a callback reads from a model: stop_training, weights, optimizer, metrics_names."""

    def __init__(self, lr=0.1):
        self.stop_training = False
        self.metrics_names = ["loss", "accuracy"]
        self.optimizer = tf.keras.optimizers.SGD(lr)
        self.w = [np.zeros(2)]

    def get_weights(self):
        return [w.copy() for w in self.w]

    def set_weights(self, w):
        self.w = [x.copy() for x in w]


def drive(callback, values, key="val_loss", model=None):
    """Feed ``values`` as epoch logs; returns (epochs run, the model)."""
    model = model or _Model()
    callback.set_model(model)
    callback.on_train_begin()
    ran = 0
    for epoch, value in enumerate(values):
        model.w = [np.full(2, float(epoch))]        # weights "of epoch" e
        callback.on_epoch_end(epoch, {key: value})
        ran += 1
        if model.stop_training:
            break
    callback.on_train_end()
    return ran, model


def test_early_stopping_patience_min_delta_and_mode():
    # Keras's docstring example: the loss stops improving after epoch 1; patience 3 -> 5 epochs
    # (wait counts 1, 2, 3 at epochs 2, 3, 4, and stops there).
    assert drive(cb_lib.EarlyStopping(monitor="loss", patience=3), [1.0, 0.9, 0.95, 0.95, 0.95, 0.95, 0.95],
                 key="loss")[0] == 5
    # patience 0 never stops at epoch 0 (Keras's `epoch > 0`), then stops at the first non-improvement
    assert drive(cb_lib.EarlyStopping(patience=0), [1.0, 1.0, 0.5])[0] == 2
    # an instance used again keeps its best (Keras sets it once): epoch 0 of the second fit is
    # no improvement, yet training never stops at epoch 0
    es = cb_lib.EarlyStopping(patience=0)
    drive(es, [1.0])
    assert drive(es, [2.0, 2.0, 2.0])[0] == 2
    # min_delta: 0.95 is not 0.1 better than 1.0, so it is no improvement
    assert drive(cb_lib.EarlyStopping(patience=1, min_delta=0.1), [1.0, 0.95, 0.5])[0] == 2
    assert drive(cb_lib.EarlyStopping(patience=1, min_delta=0.01), [1.0, 0.95, 0.5, 0.4])[0] == 4
    # accuracy goes up in "auto" mode (a metric of the model); an unknown name refuses
    assert drive(cb_lib.EarlyStopping(monitor="val_accuracy", patience=1), [0.5, 0.6, 0.55, 0.7],
                 key="val_accuracy")[0] == 3
    assert drive(cb_lib.EarlyStopping(monitor="val_accuracy", mode="min", patience=1), [0.5, 0.6, 0.4],
                 key="val_accuracy")[0] == 2
    with pytest.raises(ValueError, match="mode='max'"):
        drive(cb_lib.EarlyStopping(monitor="val_auc"), [0.5], key="val_auc")
    # start_from_epoch: epochs before it are not looked at
    assert drive(cb_lib.EarlyStopping(patience=0, start_from_epoch=3), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])[0] == 5
    with pytest.warns(UserWarning, match="not available"):
        drive(cb_lib.EarlyStopping(monitor="val_loss"), [1.0], key="loss")


def test_early_stopping_baseline_and_restore_best_weights():
    # baseline 0.5 never beaten: wait is not reset, so training stops after `patience` epochs,
    # and the best epoch within them (epoch 1, 0.8) is restored
    es = cb_lib.EarlyStopping(patience=3, baseline=0.5, restore_best_weights=True, verbose=1)
    ran, model = drive(es, [0.9, 0.8, 0.85, 0.9, 0.1])
    assert ran == 3 and es.stopped_epoch == 2 and es.best_epoch == 1
    np.testing.assert_array_equal(model.w[0], [1.0, 1.0])
    # beating the baseline resets the count as usual
    assert drive(cb_lib.EarlyStopping(patience=2, baseline=0.5), [0.9, 0.4, 0.3, 0.35, 0.36, 0.2])[0] == 5


def test_early_stopping_in_fit_restores_the_best_epochs_weights(devices, rng, capsys):
    devices(cpus=2)
    x, y = data(rng)
    model = small_model()
    after = []
    record = cb_lib.LambdaCallback(on_epoch_end=lambda e, logs: after.append(model.get_weights()))
    # min_delta 100 in "max" mode: only epoch 0 (against -inf) improves, and it does not beat
    # the baseline, so wait is not reset: fit stops at epoch 1 (wait 2 >= patience 2) and
    # puts back epoch 0's weights, whatever the losses are
    es = cb_lib.EarlyStopping(monitor="val_loss", mode="max", min_delta=100, baseline=100, patience=2,
                              restore_best_weights=True)
    history = model.fit(x, y, epochs=10, validation_data=(x, y), callbacks=[record, es], verbose=0)
    assert len(history.history["loss"]) == 2 and len(after) == 2
    assert not np.array_equal(after[0][0], after[1][0]), "the second epoch trained"
    for a, b in zip(model.get_weights(), after[0]):
        np.testing.assert_array_equal(a, b)


def test_reduce_lr_on_plateau(devices, rng):
    # min_delta 10: only the first epoch (against +inf) counts as an improvement; patience 1
    # then reduces after every later epoch; logs carry the rate the epoch trained with.
    devices(cpus=2)
    x, y = data(rng)
    model = small_model(tf.keras.optimizers.SGD(0.1))
    rl = cb_lib.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=10, min_lr=0.02)
    history = model.fit(x, y, epochs=5, callbacks=[rl], verbose=0)
    np.testing.assert_allclose(history.history["learning_rate"], [0.1, 0.1, 0.05, 0.025, 0.02])
    assert model.optimizer.learning_rate == pytest.approx(0.02)          # min_lr holds it there
    # cooldown 2: after a reduction, two epochs are not counted
    rl = cb_lib.ReduceLROnPlateau(factor=0.5, patience=1, min_delta=10, cooldown=2)
    _, fake = drive(rl, [1.0] * 7)
    # Keras counts the cooldown down before it compares, in the same epoch: reductions at
    # epochs 1, 3, 5 (2, 4, 6 in cooldown) -> 0.1 / 8; with no cooldown it would be 0.1 / 64
    assert fake.optimizer.learning_rate == pytest.approx(0.0125)
    # "acc" in the name maximises
    _, fake = drive(cb_lib.ReduceLROnPlateau(monitor="val_acc", patience=1, factor=0.5),
                    [0.5, 0.6, 0.7], key="val_acc")
    assert fake.optimizer.learning_rate == pytest.approx(0.1)
    with pytest.raises(ValueError, match="factor"):
        cb_lib.ReduceLROnPlateau(factor=1.0)


def test_csv_logger_writes_kerass_columns_and_flushes_every_epoch(devices, rng, tmp_path):
    devices(cpus=2)
    x, y = data(rng)
    model = small_model()
    path = tmp_path / "log.csv"
    seen_rows = []
    peek = cb_lib.LambdaCallback(on_epoch_end=lambda e, logs: seen_rows.append(path.read_text().count("\n")))
    history = model.fit(x, y, epochs=3, validation_data=(x[:10], y[:10]),
                        callbacks=[cb_lib.CSVLogger(path), peek], verbose=0)
    assert seen_rows == [2, 3, 4], "a row (after the header) is on disk at each epoch's end"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["epoch", "accuracy", "loss", "val_accuracy", "val_loss"]
    for e, row in enumerate(rows[1:]):
        assert row[0] == str(e)
        for name, text in zip(rows[0][1:], row[1:]):
            assert float(text) == history.history[name][e]
    # append=True continues the file with no second header; separator is honoured
    model.fit(x, y, epochs=1, callbacks=[cb_lib.CSVLogger(path, append=True)], verbose=0)
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and lines[4].startswith("0,") and lines.count(lines[0]) == 1
    semi = tmp_path / "semi.csv"
    model.fit(x, y, epochs=1, callbacks=[cb_lib.CSVLogger(semi, separator=";")], verbose=0)
    assert semi.read_text().splitlines()[0] == "epoch;accuracy;loss"


def test_validation_split_takes_the_last_fraction_before_shuffling(devices, rng):
    devices(cpus=2)
    x, y = data(rng, n=50)
    a, b = small_model(), small_model()
    b.set_weights(a.get_weights())
    ha = a.fit(x, y, epochs=2, batch_size=8, validation_split=0.2, shuffle=False, verbose=0)
    hb = b.fit(x[:40], y[:40], epochs=2, batch_size=8, validation_data=(x[40:], y[40:]), shuffle=False,
               verbose=0)
    assert ha.history == hb.history
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(wa, wb)
    assert ha.history["val_loss"][-1] == pytest.approx(a.evaluate(x[40:], y[40:], verbose=0)[0])
    # validation_data wins over validation_split (Keras)
    hc = small_model().fit(x, y, epochs=1, validation_split=0.5, validation_data=(x[:3], y[:3]), verbose=0)
    assert "val_loss" in hc.history
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.raises(ValueError, match="only supported for NumPy arrays"):
        a.fit(ds, validation_split=0.2, verbose=0)
    with pytest.raises(ValueError, match="not sufficient to split"):
        a.fit(x[:1], y[:1], validation_split=0.5, verbose=0)        # floor(1 * 0.5) = 0 left to train
    with pytest.raises(ValueError, match="between 0 and 1"):
        a.fit(x, y, validation_split=1.5, verbose=0)


def test_unknown_length_shows_the_step_count_growing(devices, rng, capsys, monkeypatch):
    devices(cpus=2)
    x, y = data(rng)
    model = small_model()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()     # infinite: Keras runs for ever
    monkeypatch.setattr(progbar, "UNKNOWN_LOG_S", 0.0)    # captured output: a line per step here

    def stop_after_7(batch, logs):
        if batch == 6:
            model.stop_training = True
        if batch > 50:                        # not stopped: fail rather than run for ever
            raise RuntimeError("fit went on after stop_training was set")
    model.fit(ds, epochs=3, callbacks=[cb_lib.LambdaCallback(on_train_batch_end=stop_after_7)])
    out = capsys.readouterr().out
    counts = [int(line.split("/Unknown")[0]) for line in out.splitlines() if "/Unknown" in line]
    assert counts == list(range(1, 8)), out
    assert "Epoch 1/3" in out and "Epoch 2/3" not in out       # stop_training ends it after the batch
    assert "7/7 [" in out


class _SavingModel(_Model):
    """A _Model that records which epoch's weights each save_weights call wrote."""

    def __init__(self):
        super().__init__()
        self.saved = []

    def save_weights(self, path):
        self.saved.append((path, float(self.w[0][0])))


def test_model_checkpoint_save_best_only_saves_only_improvements():
    # val_loss: epochs 0, 1, 3 improve (auto mode: a loss goes down); 2 and 4 do not
    ckpt = cb_lib.ModelCheckpoint("best-{epoch}.weights.h5", save_weights_only=True, save_best_only=True)
    _, model = drive(ckpt, [3.0, 2.0, 2.5, 1.0, 1.0], model=_SavingModel())
    assert model.saved == [("best-1.weights.h5", 0.0), ("best-2.weights.h5", 1.0), ("best-4.weights.h5", 3.0)]
    assert ckpt.best == 1.0
    # accuracy goes up (the model computes it); a threshold must be beaten first
    ckpt = cb_lib.ModelCheckpoint("a.weights.h5", monitor="val_accuracy", save_weights_only=True,
                                  save_best_only=True, initial_value_threshold=0.5)
    _, model = drive(ckpt, [0.4, 0.6, 0.55, 0.7], key="val_accuracy", model=_SavingModel())
    assert [epoch for _, epoch in model.saved] == [1.0, 3.0]
    # mode="min" on an accuracy is obeyed as given
    ckpt = cb_lib.ModelCheckpoint("m.weights.h5", monitor="val_accuracy", mode="min",
                                  save_weights_only=True, save_best_only=True)
    _, model = drive(ckpt, [0.4, 0.6, 0.3], key="val_accuracy", model=_SavingModel())
    assert [epoch for _, epoch in model.saved] == [0.0, 2.0]


def test_model_checkpoint_save_best_only_without_the_monitored_value():
    ckpt = cb_lib.ModelCheckpoint("b.weights.h5", save_weights_only=True, save_best_only=True)
    with pytest.warns(UserWarning, match="Can save best model only with val_loss available"):
        _, model = drive(ckpt, [0.9, 0.8], key="loss", model=_SavingModel())
    assert [epoch for _, epoch in model.saved] == [0.0, 1.0]     # Keras 3: warn, then save anyway
    ckpt = cb_lib.ModelCheckpoint("c.weights.h5", monitor="val_f1", save_weights_only=True, save_best_only=True)
    with pytest.raises(ValueError, match="maximized or minimized"):
        drive(ckpt, [0.5], key="val_f1", model=_SavingModel())


def test_model_checkpoint_in_fit_keeps_the_best_epochs_weights(devices, rng, tmp_path, capsys):
    devices(cpus=2)
    x, y = data(rng)
    model = small_model()
    seen = []
    record = cb_lib.LambdaCallback(on_epoch_end=lambda e, logs: seen.append((logs["val_loss"],
                                                                              model.get_weights())))
    path = tmp_path / "best.weights.h5"
    ckpt = cb_lib.ModelCheckpoint(str(path), save_weights_only=True, save_best_only=True, verbose=1)
    model.fit(x, y, epochs=4, validation_data=(x[:9], y[:9]), callbacks=[record, ckpt], verbose=0)
    best = min(range(len(seen)), key=lambda e: seen[e][0])
    fresh = small_model()
    fresh.load_weights(path)
    for a, b in zip(fresh.get_weights(), seen[best][1]):
        np.testing.assert_array_equal(a, b)
    out = capsys.readouterr().out
    assert f"Epoch {best + 1}: val_loss improved from" in out and "saving model to" in out


# -- ModelCheckpoint(save_freq=n): Keras's batch count -----------------------------------------
def test_model_checkpoint_save_freq_counts_batches_across_epochs(devices, rng, tmp_path):
    """3 epochs of 4 batches, save_freq=3: Keras 3.15 (run on its JAX backend) writes
    c-1-3, c-2-2, c-3-1, c-3-4 ({batch} 1-based within the epoch): the count runs on across
    epochs. Each file holds the weights right after its batch; a .keras path with only
    {epoch} is overwritten within an epoch, so k-3 holds batch 12's model."""
    devices(cpus=2)
    x, y = data(rng, n=16)
    model = small_model()
    after = []                                    # weights after global batch 1, 2, ...
    record = cb_lib.LambdaCallback(on_train_batch_end=lambda batch, logs: after.append(model.get_weights()))
    ckpts = [cb_lib.ModelCheckpoint(tmp_path / "c-{epoch}-{batch}.weights.h5", save_weights_only=True,
                                    save_freq=3),
             cb_lib.ModelCheckpoint(str(tmp_path / "k-{epoch}.keras"), save_freq=3)]
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, callbacks=[record] + ckpts, verbose=0)
    assert len(after) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c-1-3.weights.h5", "c-2-2.weights.h5", "c-3-1.weights.h5", "c-3-4.weights.h5",
        "k-1.keras", "k-2.keras", "k-3.keras"]
    fresh = small_model()
    for name, batch in [("c-1-3", 3), ("c-2-2", 6), ("c-3-1", 9), ("c-3-4", 12)]:
        fresh.load_weights(tmp_path / f"{name}.weights.h5")
        for a, b in zip(fresh.get_weights(), after[batch - 1]):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: not the weights after batch {batch}")
    assert not np.array_equal(after[8][0], after[11][0])       # so the next check can fail
    with model.distribute_strategy.scope():
        whole = tf.keras.models.load_model(tmp_path / "k-3.keras")
    for a, b in zip(whole.get_weights(), after[11]):
        np.testing.assert_array_equal(a, b)


def test_model_checkpoint_save_best_only_on_batches_reads_the_batch_logs(devices, rng, tmp_path):
    """save_freq=2, save_best_only on the batch logs' loss: a save is due after batches 2, 4,
    ... (global), and happens when the running loss then beats the best saved so far. The
    batch logs are Keras's: the epoch's running mean, ending at the epoch's own loss."""
    devices(cpus=2)
    x, y = data(rng, n=16)
    model = small_model(tf.keras.optimizers.SGD(0.5))          # a big step: a loss that jumps about
    seen = []                                                  # (weights, batch logs) per batch
    record = cb_lib.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(
        (model.get_weights(), dict(logs))))
    ckpt = cb_lib.ModelCheckpoint(tmp_path / "b-{epoch}-{batch}.weights.h5", monitor="loss",
                                  save_weights_only=True, save_best_only=True, save_freq=2)
    history = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, callbacks=[record, ckpt], verbose=0)
    assert [sorted(logs) for _, logs in seen] == [["accuracy", "loss"]] * 12
    for epoch in range(3):                        # the last batch's running mean is the epoch's
        np.testing.assert_allclose(seen[4 * epoch + 3][1]["loss"], history.history["loss"][epoch],
                                   rtol=1e-6)
    best, want = np.inf, {}
    for g in range(2, 13, 2):                     # Keras's rule, worked out from the logs seen
        loss = seen[g - 1][1]["loss"]
        if loss < best:
            best = loss
            want[f"b-{(g - 1) // 4 + 1}-{(g - 1) % 4 + 1}.weights.h5"] = seen[g - 1][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(want)
    assert ckpt.best == best
    fresh = small_model()
    for name, weights in want.items():
        fresh.load_weights(tmp_path / name)
        for a, b in zip(fresh.get_weights(), weights):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_model_checkpoint_save_freq_skips_a_batch_that_did_not_improve():
    """The same rule driven batch by batch (no fit): due after batches 2, 4 and 6; the
    loss at batch 4 (0.9) does not beat batch 2's (0.8), so only two files."""
    ckpt = cb_lib.ModelCheckpoint("s-{epoch}-{batch}.weights.h5", monitor="loss", save_weights_only=True,
                                  save_best_only=True, save_freq=2)
    model = _SavingModel()
    ckpt.set_model(model)
    ckpt.on_train_begin()
    losses = [1.0, 0.8, 0.7, 0.9, 0.5, 0.4]
    for epoch in range(2):
        ckpt.on_epoch_begin(epoch)
        for batch in range(3):
            g = 3 * epoch + batch
            model.w = [np.full(2, float(g + 1))]       # weights "after global batch g + 1"
            ckpt.on_train_batch_end(batch, {"loss": losses[g]})
    assert model.saved == [("s-1-2.weights.h5", 2.0), ("s-2-3.weights.h5", 6.0)]
    assert ckpt.best == 0.4


@pytest.mark.parametrize("save_freq", ["batch", "10", 0, -3, 2.5, True, None])
def test_model_checkpoint_refuses_a_bad_save_freq(save_freq):
    with pytest.raises(ValueError, match=r"Unrecognized save_freq.*'epoch' or integer"):
        cb_lib.ModelCheckpoint("d.weights.h5", save_weights_only=True, save_freq=save_freq)


def test_model_checkpoint_batch_in_the_path_needs_an_integer_save_freq():
    ckpt = cb_lib.ModelCheckpoint("e-{batch}.weights.h5", save_weights_only=True)
    model = _SavingModel()
    ckpt.set_model(model)
    with pytest.raises(KeyError, match="Failed to format this callback filepath.*integer save_freq"):
        ckpt.on_epoch_end(0, {"loss": 1.0})
    assert model.saved == []


def test_batch_logs_are_read_from_the_devices_only_when_a_callback_looks(devices, rng, monkeypatch, tmp_path):
    """fit's batch logs are Keras's (the running loss and accuracy), but reading them syncs
    the devices: a step whose logs only our own hooks get, and they do not open, reads
    nothing (ModelCheckpoint saving per epoch has a batch hook). A user's hook may keep the
    logs, so they are read for it once per step, however many hooks look
    (tests/test_faults_round4_runtime.py: kept logs hold their own batch's values)."""
    devices(cpus=2)
    x, y = data(rng, n=16)
    model = small_model()
    reads = []
    real = model.step.logs
    monkeypatch.setattr(model.step, "logs", lambda *a: reads.append(a) or real(*a))   # (names, prefix, across_workers)
    ours = cb_lib.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True)
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[ours], verbose=0)
    assert len(reads) == 2                                   # the two epochs' logs only
    quiet = cb_lib.LambdaCallback(on_train_batch_end=lambda batch, logs: (logs or {}) and None)
    seen = []
    looking = cb_lib.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(logs["loss"]))
    reads.clear()
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[quiet, looking, looking], verbose=0)
    assert len(reads) == 2 + 8 and len(seen) == 16           # once per step, however many look
    assert [a[2] for a in reads].count(False) == 8          # this worker's: no collective
