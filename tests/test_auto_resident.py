"""fit and evaluate keep a plain Dataset on the GPUs by themselves (issue 40).

When the epoch can be planned by row number (``data.index_batches``) and the rows fit
(``input_lib.fits_on_devices``), ``model.fit(ds)`` on GPUs uploads the rows once and then
only row numbers, with bitwise the weights of the copied batches (the switch
``input_lib.AUTO_PLACE_ON_GPUS = False``). Otherwise it copies, silently: over the
budget, out of device memory, on CPUs, for a pipeline it cannot plan, or when the
dataset was distributed with options that do not ask for it. The copy leaves the
devices when fit returns, also when a step ran out of memory. It goes to the devices the
model's weights are on, whatever device scope ``fit`` is called in (issue 51).
"""
import contextlib
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import mirrored as tf
from kernels.optimizers import ADAM_HYPER_SIZE
from mirrored import input_lib
from mirrored.errors import ResourceExhaustedError

from test_resident_dataset import data, small_model

ROWS, BATCH, STEPS = 8, 4, 2                  # few steps: the simulator runs a thread per CUDA thread


def scale(image, label):
    return image.astype(np.float32) / 255, label


def lab_pipeline(x, y):
    """The lab's pipeline, tiny: map, cache, shuffle, batch."""
    return tf.data.Dataset.from_tensor_slices((x, y)).map(scale).cache().shuffle(100, seed=7).batch(BATCH)


class Uploads:
    """Every host-to-device transfer to ``devs``, one list per epoch: (method, [(dtype, shape) of
    each array the one call sends])."""

    def __init__(self, devs, monkeypatch):
        self.epochs = [[]]
        for dev in devs:
            for name in ("from_numpy", "upload_into", "upload_parts"):
                original = getattr(dev, name)

                def spy(*args, original=original, name=name):
                    arrays = args[-1] if name == "upload_parts" else (args[-1],)
                    self.epochs[-1].append((name, [(np.asarray(a).dtype, np.shape(a)) for a in arrays]))
                    return original(*args)
                monkeypatch.setattr(dev, name, spy)
        self.memory = []                          # bytes in use on devs at each epoch's end
        self.callback = tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: self.end_epoch(devs))

    def end_epoch(self, devs):
        self.epochs.append([])
        self.memory.append(bytes_on(devs))

    def placed(self):
        """The epochs (numbers) whose transfers include a whole data set's rows."""
        return [e for e, ups in enumerate(self.epochs) if any(m == "from_numpy" for m, _ in ups)]


def bytes_on(devs):
    return [tf.config.experimental.get_memory_info(d.name)["current"] for d in devs]


def gpus_of(devs):
    return [d for d in devs if d.device_type == "GPU"]


def twins(strategy, shape):
    a, b = small_model(strategy, shape), small_model(strategy, shape)
    b.set_weights(a.get_weights())
    return a, b


def fit_copied(model, ds, monkeypatch, epochs):
    monkeypatch.setattr(input_lib, "AUTO_PLACE_ON_GPUS", False)
    history = model.fit(ds, epochs=epochs, verbose=0)
    monkeypatch.setattr(input_lib, "AUTO_PLACE_ON_GPUS", True)
    return history


def assert_same_weights(a, b):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(wa, wb)


@pytest.mark.parametrize("gpus", [1, 2])
def test_fit_keeps_a_cached_pipeline_on_the_gpus_and_trains_bitwise_alike(devices, rng, monkeypatch, gpus):
    devs = gpus_of(devices(gpus=gpus))
    epochs = 3 if gpus == 1 else 2              # (the simulator is slow: a third epoch on one GPU)
    x, y = data(rng, n=ROWS)
    strategy = tf.distribute.MirroredStrategy([f"GPU:{i}" for i in range(gpus)])
    copied, kept = twins(strategy, x.shape[1:])
    h1 = fit_copied(copied, lab_pipeline(x, y), monkeypatch, epochs=epochs)
    uploads = Uploads(devs, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)            # an optimisation: never a warning
        h2 = kept.fit(lab_pipeline(x, y), epochs=epochs, verbose=0, callbacks=[uploads.callback])
    assert_same_weights(copied, kept)
    assert h1.history == h2.history
    first, resident = uploads.epochs[0], uploads.epochs[1:epochs]
    # epoch 1 fills the cache, copied: per step and device ONE copy, x, y and Adam's scalars
    assert [(m, [dt for dt, _ in arrays]) for m, arrays in first] == \
        [("upload_parts", [np.float32, np.int64, np.float32])] * STEPS * gpus, first
    assert all(arrays[2][1] == (ADAM_HYPER_SIZE,) for _, arrays in first)
    assert uploads.placed() == [1]                              # the rows go up once, before epoch 2
    rows = sorted((str(a[0][0]), a[0][1]) for m, a in resident[0] if m == "from_numpy")
    assert rows == sorted([("float32", (ROWS, 6)), ("int64", (ROWS, 1))] * gpus)
    for epoch in resident:                                      # then row numbers and Adam's scalars,
        steps = [(m, [(dt, len(shape)) for dt, shape in a]) for m, a in epoch if m != "from_numpy"]
        assert steps == [("upload_parts", [(np.int64, 1), (np.float32, 1)])] * STEPS * gpus, steps
        assert all(a[1][1] == (ADAM_HYPER_SIZE,) for m, a in epoch if m != "from_numpy")   # one copy a step
    # The rows were charged to the devices during the resident epochs, and are freed when
    # fit returns: the memory is then what the copied first epoch left (the step's buffers).
    rows_bytes = x[:, :, :, 0].size * 4 + ROWS * 8
    assert all(m2 >= m1 + rows_bytes for m1, m2 in zip(uploads.memory[0], uploads.memory[1]))
    assert bytes_on(devs) == uploads.memory[0]
    assert kept.step.resident_loader is None


def test_evaluate_of_slices_goes_resident_with_the_same_result(devices, rng, monkeypatch):
    devs = gpus_of(devices(gpus=1))
    x, y = data(rng, n=ROWS)
    strategy = tf.distribute.MirroredStrategy(["GPU:0"])
    model = small_model(strategy, x.shape[1:])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)     # uint8 images: cast on the device
    monkeypatch.setattr(input_lib, "AUTO_PLACE_ON_GPUS", False)
    want = model.evaluate(ds, verbose=0)
    monkeypatch.setattr(input_lib, "AUTO_PLACE_ON_GPUS", True)
    uploads = Uploads(devs, monkeypatch)
    assert model.evaluate(ds, verbose=0) == want
    assert uploads.placed() == [0]                              # planned from the first pass


def resident_rows_fail(*args):
    raise AssertionError("the data set was placed on the devices")


def slices(x, y):
    """A data set planned from its first epoch (shuffled: a second draw would show)."""
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(100, seed=7).batch(BATCH)


@contextlib.contextmanager
def one_small_gpu(memory_limit_mib):
    """The first GPU as one logical GPU of ``memory_limit_mib`` for the block (the device
    registry reset before and after); skips without a GPU or the simulator."""
    from mirrored import devices as registry
    registry._reset()
    phys = tf.config.list_physical_devices("GPU")
    if not phys:
        pytest.skip("needs a CUDA GPU or the CUDA simulator")
    tf.config.set_logical_device_configuration(
        phys[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mib)])
    try:
        yield
    finally:
        registry._reset()


@pytest.mark.parametrize("why", ["over the budget", "out of memory"])
def test_a_data_set_that_does_not_fit_is_copied(rng, monkeypatch, why):
    """The budget is a share of the device's free memory: patched small here (the
    simulator reports unlimited memory, so the GPU gets a memory_limit of 1 MiB). The
    epoch is then played from the plan already drawn, on the host: bitwise the weights
    of the copied fit, whose shuffle drew once."""
    from mirrored import devices as registry
    with one_small_gpu(1):
        devs = gpus_of(registry.logical_devices())
        x, y = data(rng, n=ROWS)
        x = x.astype(np.float32)
        strategy = tf.distribute.MirroredStrategy(["GPU:0"])
        copied, kept = twins(strategy, x.shape[1:])
        fit_copied(copied, slices(x, y), monkeypatch, epochs=1)
        if why == "over the budget":
            free = devs[0].memory_info()[0]
            monkeypatch.setattr(input_lib, "AUTO_SHARE_OF_FREE_MEMORY", 250 / free)   # the rows: 256 bytes
        else:
            def no_memory(*args):
                raise ResourceExhaustedError("OOM on GPU:0 (the test's)")
            monkeypatch.setattr(input_lib, "ResidentRows", no_memory)
        uploads = Uploads(devs, monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            kept.fit(slices(x, y), epochs=1, verbose=0, callbacks=[uploads.callback])
        assert uploads.placed() == []
        assert sum(m == "upload_parts" for m, _ in uploads.epochs[0]) == STEPS
        assert_same_weights(copied, kept)


def test_the_budget_counts_logical_gpus_of_one_card_together():
    rows = SimpleNamespace(columns=(np.zeros((10, 4), np.float32), np.zeros(10, np.int64)))   # 240 bytes
    share = input_lib.AUTO_SHARE_OF_FREE_MEMORY

    def gpu(card, free, limit=None):
        return SimpleNamespace(device_type="GPU", gpu_id=card, memory_limit=limit,
                               memory_info=lambda: (free, limit))
    assert input_lib.fits_on_devices(rows, [gpu(0, 240 / share)])
    assert not input_lib.fits_on_devices(rows, [gpu(0, 239 / share)])
    assert not input_lib.fits_on_devices(rows, [gpu(0, 400 / share), gpu(0, 400 / share)])   # 480 on one card
    assert input_lib.fits_on_devices(rows, [gpu(0, 400 / share), gpu(1, 400 / share)])
    assert input_lib.fits_on_devices(rows, [gpu(0, 240 / share, 1000), gpu(0, 240 / share, 1000)])  # own limits


def test_cpu_devices_never_go_resident(devices, rng, monkeypatch):
    devices(cpus=2)
    x, y = data(rng, n=ROWS)
    model = small_model(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]), x.shape[1:])
    monkeypatch.setattr(input_lib, "ResidentRows", resident_rows_fail)
    model.fit(tf.data.Dataset.from_tensor_slices((x.astype(np.float32), y)).batch(BATCH), epochs=2, verbose=0)
    model.evaluate(lab_pipeline(x, y), verbose=0)


@pytest.mark.parametrize("case", ["map after cache", "explicit InputOptions()", "float64 images"])
def test_what_cannot_go_resident_trains_as_before_without_a_warning(devices, rng, monkeypatch, case):
    devices(gpus=1)
    x, y = data(rng, n=ROWS)
    strategy = tf.distribute.MirroredStrategy(["GPU:0"])
    model = small_model(strategy, x.shape[1:])
    epochs = 1                                             # slices: planned from the first epoch
    if case == "map after cache":                          # a cache: the second epoch would be
        ds, epochs = tf.data.Dataset.from_tensor_slices((x, y)).cache().map(scale).batch(BATCH), 2
    elif case == "explicit InputOptions()":
        ds = strategy.experimental_distribute_dataset(slices(x, y), tf.distribute.InputOptions())
    else:                                                  # the resident loader takes float32 or uint8
        ds = slices(x / 255.0, y)
    monkeypatch.setattr(input_lib, "ResidentRows", resident_rows_fail)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        history = model.fit(ds, epochs=epochs, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and int(model.optimizer.iterations) == epochs * STEPS


def test_an_out_of_memory_step_leaves_the_memory_as_before(rng, monkeypatch):
    """The rows go up before the epoch, outside any step; the first step then runs out of
    memory (tests/test_faults.py's case: Dense(64) at a batch of 256 on a 64 KiB GPU). The
    error comes, and the weights, the optimizer and every device's bytes are as before."""
    from test_faults import assert_same_state, labelled, state_of
    from test_faults import small_model as dense_model
    with one_small_gpu(0.0625):
        x, y = labelled(rng, n=256, features=4)
        model = dense_model(tf.distribute.MirroredStrategy(["GPU:0"]), hidden=64, features=4)
        model.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)      # the optimizer's slots exist
        before = state_of(model)
        placed, original = [], input_lib.ResidentRows
        monkeypatch.setattr(input_lib, "ResidentRows", lambda *a: placed.append(a) or original(*a))
        with pytest.raises(ResourceExhaustedError):
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(256), verbose=0)
        assert len(placed) == 1                                  # the rows (6 KiB) were placed first
        assert_same_state(before, state_of(model))


def plain_model(shape):
    """``small_model`` with no strategy: where its weights go is the current device's business."""
    model = tf.keras.Sequential([tf.keras.layers.Flatten(input_shape=shape),
                                 tf.keras.layers.Dense(5, activation="relu"),
                                 tf.keras.layers.Dense(4)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("model_on,fit_under", [("CPU:0", None), ("GPU:0", "CPU:0")])
def test_the_data_goes_where_the_model_runs_not_where_fit_is_called(devices, rng, monkeypatch,
                                                                     model_on, fit_under):
    """Issue 51: lab 01's "no strategy" model is built under ``tf.device(devices[0])``, a CPU
    in the simulator, on a machine with a GPU; ``fit`` is called outside that scope, where
    the current device is GPU:0. The cached data set was uploaded to GPU:0 unasked and the
    step refused it ("the resident data set lives on ...GPU:0 but replica 0 runs on
    ...CPU:0"). The data goes where the model's weights are: nowhere for a CPU model (a
    gather on a CPU costs what a copy costs), to GPU:0 for a GPU model fitted under a CPU
    scope. Either way bitwise the weights of the copied batches. (The lab's cached pipeline,
    resident from its second epoch, for the CPU model; on the simulated GPU, slices, resident
    from the first: one epoch, a few seconds less.)"""
    devs = devices(cpus=1, gpus=1)
    x, y = data(rng, n=ROWS)
    pipeline, epochs = (lab_pipeline, 2) if model_on == "CPU:0" else (slices, 1)
    with tf.device(model_on):
        copied, kept = plain_model(x.shape[1:]), plain_model(x.shape[1:])
    kept.set_weights(copied.get_weights())
    assert kept.trainable_variables[0].device.endswith(model_on)

    def scope():
        return tf.device(fit_under) if fit_under else contextlib.nullcontext()
    with scope():
        fit_copied(copied, pipeline(x, y), monkeypatch, epochs=epochs)
    placed, original = [], input_lib.ResidentRows
    monkeypatch.setattr(input_lib, "ResidentRows", lambda rows, where: placed.append(where) or original(rows, where))
    with scope(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        kept.fit(pipeline(x, y), epochs=epochs, verbose=0)
    assert_same_weights(copied, kept)
    want = [] if model_on == "CPU:0" else [[d.name for d in gpus_of(devs)]]
    assert [[d.name for d in where] for where in placed] == want
