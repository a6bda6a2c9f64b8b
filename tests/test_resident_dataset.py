"""A data set kept on the devices (InputOptions(experimental_place_dataset_on_device=True)).

It must train exactly like the copied batches (same rows, same order, same math), upload
only row numbers per step once resident, keep the lab pipeline working (the first epoch of
a cache is copied, with a warning), and give custom loops the same batches.
"""
import warnings

import numpy as np
import pytest

import mirrored as tf
from kernels.optimizers import ADAM_HYPER_SIZE
from mirrored import input_lib

RESIDENT = tf.distribute.InputOptions(experimental_place_dataset_on_device=True)


def small_model(strategy, shape):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Flatten(input_shape=shape),
                                     tf.keras.layers.Dense(5, activation="relu"),
                                     tf.keras.layers.Dense(4)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(rng, n=37, shape=(3, 2, 1)):
    return rng.integers(0, 255, (n,) + shape).astype(np.uint8), rng.integers(0, 4, n)


#: The simulated GPU runs a Python thread per CUDA thread: fewer examples and epochs there.
CASES = [("CPU", 1, "lab"), ("CPU", 2, "lab"), ("CPU", 2, "uint8"), ("CPU", 1, "uint8"),
         ("GPU", 2, "lab"), ("GPU", 2, "uint8")]


@pytest.mark.parametrize("kind,n,pipeline", CASES)
def test_resident_training_equals_copied_batches(devices, rng, monkeypatch, kind, n, pipeline):
    monkeypatch.setattr(input_lib, "AUTO_PLACE_ON_GPUS", False)   # the plain Dataset: copied
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    # 37 examples in batches of 10: the last is 7 (4 + 3 over two replicas); GPU: 13 = 10 + 3
    x, y = data(rng, n=37 if kind == "CPU" else 13)
    epochs = 3 if kind == "CPU" else 2

    def pipe():
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if pipeline == "lab":                          # map + cache: resident from epoch 2
            ds = ds.map(lambda i, l: (i.astype(np.float32) / 255, l)).cache()
        return ds.shuffle(100, seed=3).batch(10)

    strategy = tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)])
    copied, resident = small_model(strategy, x.shape[1:]), small_model(strategy, x.shape[1:])
    resident.set_weights(copied.get_weights())
    dist = strategy.experimental_distribute_dataset(pipe(), RESIDENT)
    h1 = copied.fit(pipe(), epochs=epochs, verbose=0)             # (GPUs: tests/test_auto_resident.py)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h2 = resident.fit(dist, epochs=epochs, verbose=0)
    notes = [str(w.message) for w in caught if "experimental_place_dataset_on_device" in str(w.message)]
    assert len(notes) == (1 if pipeline == "lab" else 0), notes     # the cache-filling epoch only
    assert dist.resident is not None, "no epoch ran from the devices"
    for a, b in zip(copied.get_weights(), resident.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert h1.history == h2.history
    # evaluate: the same examples in another shuffle order (dist's next epoch): sums may round apart
    np.testing.assert_allclose(resident.evaluate(dist, verbose=0), copied.evaluate(pipe(), verbose=0),
                               rtol=1e-6)


def test_a_resident_epoch_uploads_row_numbers_only(devices, rng, monkeypatch):
    devs = devices(cpus=2)
    x, y = data(rng)
    x = x.astype(np.float32)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    model = small_model(strategy, x.shape[1:])
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8), RESIDENT)
    model.fit(dist, epochs=1, verbose=0)                # uploads the rows once, fills buffers
    before = [tf.config.experimental.get_memory_info(d.name)["current"] for d in devs]
    uploads = []
    for dev in devs:
        original = dev.upload_into
        monkeypatch.setattr(dev, "upload_into",
                            lambda dst, a, original=original: uploads.append(np.asarray(a)) or original(dst, a))
        monkeypatch.setattr(dev, "from_numpy", lambda a: pytest.fail("a step allocated a host copy"))
    model.fit(dist, epochs=1, verbose=0)
    # Per step and device: the replica's row numbers (once, for x and y), and Adam's 4
    # scalars for the step.
    rows = [a for a in uploads if a.dtype == np.int64 and a.ndim == 1]
    hyper = [a for a in uploads if a.dtype == np.float32 and a.shape == (ADAM_HYPER_SIZE,)]
    assert rows and len(rows) + len(hyper) == len(uploads), [(a.dtype, a.shape) for a in uploads]
    assert len(hyper) == len(rows) == 2 * -(-len(x) // 8)           # 2 devices x 5 steps
    after = [tf.config.experimental.get_memory_info(d.name)["current"] for d in devs]
    assert after == before                              # nothing new kept per epoch
    assert before[0] >= x.nbytes                        # the rows are charged to each device


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_custom_loop_gets_the_same_batches(devices, rng, kind):
    devices(cpus=2 if kind == "CPU" else 1, gpus=2 if kind == "GPU" else 0)
    x, y = data(rng, n=9)
    x = x.astype(np.float32)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"])
    ds = lambda: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(9, seed=5).batch(4)  # noqa: E731
    plain = list(strategy.experimental_distribute_dataset(ds()))
    kept = list(strategy.experimental_distribute_dataset(ds(), RESIDENT))
    assert len(plain) == len(kept) == 3                 # 4 + 4 + 1: the last leaves replica 1 empty
    for (px, py), (kx, ky) in zip(plain, kept):
        for a, b in ((px, kx), (py, ky)):
            for ca, cb in zip(a.values, b.values):
                assert ca.device == cb.device and ca.shape == cb.shape
                np.testing.assert_array_equal(ca.numpy(), cb.numpy())


def test_options_follow_tensorflow():
    with pytest.raises(ValueError, match="experimental_fetch_to_device"):
        tf.distribute.InputOptions(experimental_place_dataset_on_device=True,
                                   experimental_fetch_to_device=True)
    opts = tf.distribute.InputOptions(experimental_place_dataset_on_device=True)
    assert opts.experimental_fetch_to_device is False
    assert tf.distribute.InputOptions().experimental_fetch_to_device is True


def test_fit_refuses_a_dataset_of_another_strategy(devices, rng):
    devices(cpus=2)
    x, y = data(rng)
    model = small_model(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]), x.shape[1:])
    other = tf.distribute.MirroredStrategy(["CPU:0"])
    dist = other.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
    with pytest.raises(ValueError, match="different strategy|strategy whose scope"):
        model.fit(dist, epochs=1, verbose=0)
