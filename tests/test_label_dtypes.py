"""Labels of any integer dtype train the same on CPU devices and on (simulated) GPUs.

``keras.datasets`` returns uint8 labels; TensorFlow accepts any integer labels on every
device. Here they are converted once per batch, where the batch is staged, to the one label
type every loss kernel takes (``kernels.softmax_xent.LABEL_DTYPE``). On an H200, uint8 labels
once failed every step ("labels must be int32 or int64") while the CPU trained: the
simulator runs a kernel on any type it is given, so the GPU-only failure went unseen.

So the simulator runs these with ``kernels.launch.check_signatures()``: every launch must
match a signature its kernel is registered (and compile-checked) for, the condition a real
GPU enforces. Claims: the weights after training with uint8, int16, uint32 (and float
whole-number) labels are BITWISE those of int64 labels (the same kernels on the same
numbers in the same order); a float label that is not a whole number is refused; and the
custom loop (``keras/tape.py``) converts what its data set holds the same way.
"""
import numpy as np
import pytest

import mirrored as tf
from kernels.launch import check_signatures

#: Beside int64: keras.datasets' uint8, a signed and an unsigned other width; on CPU devices
#: (fast) also int32 and whole-number floats.
GPU_DTYPES = [np.uint8, np.int16, np.uint32]
CPU_DTYPES = GPU_DTYPES + [np.int32, np.float32]


def _model(strategy, features, classes, seed_weights=None):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu", input_shape=(features,)),
                                     tf.keras.layers.Dense(classes, activation="softmax")])
        model.compile(loss="sparse_categorical_crossentropy", optimizer=tf.keras.optimizers.Adam(0.05),
                      metrics=["accuracy"])
    if seed_weights is not None:
        model.set_weights(seed_weights)
    return model


@pytest.mark.parametrize("kind", ["GPU", "CPU"])
def test_every_integer_dtype_trains_bitwise_as_int64(devices, rng, kind):
    """uint8 goes in as a data set (as a fashion_mnist pipeline has it), the others as arrays."""
    devices(cpus=2 if kind == "CPU" else 1, gpus=2 if kind == "GPU" else 0)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"])
    features, classes, n = 3, 4, 5                       # one batch of 5: 3 + 2 over 2 replicas
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = rng.integers(0, classes, n)
    start = _model(strategy, features, classes).get_weights()
    results = {}
    for dtype in [np.int64] + (GPU_DTYPES if kind == "GPU" else CPU_DTYPES):
        model = _model(strategy, features, classes, start)
        labels = y.astype(dtype)
        with check_signatures():
            if dtype is np.uint8:
                dataset = tf.data.Dataset.from_tensor_slices((x, labels)).batch(n)
                history = model.fit(dataset, epochs=1, verbose=0)
            else:
                history = model.fit(x, labels, batch_size=n, epochs=1, shuffle=False, verbose=0)
        results[np.dtype(dtype).name] = (model.get_weights(), history.history)
    want_weights, want_history = results.pop("int64")
    assert not np.array_equal(want_weights[0], start[0]), "did not train"
    for name, (weights, history) in results.items():
        for w, v in zip(weights, want_weights):
            np.testing.assert_array_equal(w, v, err_msg=f"{name} labels on {kind}")
        assert history == want_history, name


def test_float_labels_that_are_not_whole_numbers_are_refused(devices, rng):
    devices(cpus=1)
    model = _model(tf.distribute.MirroredStrategy(["CPU:0"]), 3, 4)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="not whole numbers"):
        model.fit(x, np.array([0.0, 1.5, 2.0, 3.0], np.float32), verbose=0)


def test_the_custom_loop_converts_labels_as_fit_does(devices, rng):
    """strategy.run + GradientTape with labels as the data set holds them (uint8 on the device:
    cast there; int16, which no cast kernel takes: via the host): the same weights as int64."""
    devices(cpus=1, gpus=2)
    strategy = tf.distribute.MirroredStrategy(["GPU:0", "GPU:1"])
    x = rng.standard_normal((6, 3)).astype(np.float32)
    y = rng.integers(0, 4, 6)
    start = _model(strategy, 3, 4).get_weights()
    weights = {}
    for labels in (y.astype(np.int64), y.astype(np.uint8), y.astype(np.int16)):
        model = _model(strategy, 3, 4, start)
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(reduction="none")

        def step(inputs):
            images, targets = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(targets, model(images, training=True)),
                                                  global_batch_size=6)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

        dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, labels)).batch(6))
        with check_signatures():
            for batch in dist:
                strategy.run(step, args=(batch,))
        weights[labels.dtype.name] = model.get_weights()
    for name in ("uint8", "int16"):
        for a, b in zip(weights[name], weights["int64"]):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} labels in the custom loop")


def test_the_simulator_refuses_a_launch_the_compiler_never_saw():
    """With check_signatures on, a launch with a type no signature of its kernel names (an
    int16 cast: CAST_DTYPES has no int16) fails in the simulator, as a GPU-only failure would
    otherwise hide; without it the simulator runs it."""
    from conftest import SIMULATOR
    if not SIMULATOR:
        pytest.skip("check_signatures checks simulated launches (a real GPU compiles any type)")
    from numba import cuda
    from kernels import elementwise
    x = cuda.to_device(np.arange(5, dtype=np.int16))
    out = cuda.to_device(np.zeros(5, np.int64))
    with check_signatures(), pytest.raises(TypeError, match=r"cast_kernel .*int16\[1d\]"):
        elementwise.cast(x, out)
    elementwise.cast(x, out)
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(5))


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_loss_ops_take_one_label_type_on_every_backend(devices, kind):
    """A path that forgot the conversion fails alike on the CPU, the simulator and a GPU."""
    found = devices(cpus=1, gpus=1 if kind == "GPU" else 0)
    dev = [d for d in found if kind in d.name][0]
    with dev.activate():
        logits, loss, correct = dev.empty((3, 4), np.float32), dev.empty((3,), np.float32), dev.empty((3,), np.float32)
        labels = dev.from_numpy(np.zeros(3, np.uint8))
        with pytest.raises(TypeError, match="labels reached the loss op as uint8, expected int64"):
            dev.ops.softmax_xent(logits, labels, loss, None, correct)
