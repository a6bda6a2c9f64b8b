"""TensorFlow's own tf.distribute pages, as a student runs them after the lab (issue 27).

Each test uses a name the way the custom-training, Keras and distributed-input tutorials
and the distributed-training guide use it, with tiny shapes, and checks the numbers
against float64 NumPy oracles (uneven global batches: 5 rows over 2 replicas).
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import devices as registry


@pytest.fixture
def no_gpu(monkeypatch, devices):
    """A machine without GPU (not even the CUDA simulator's): ``no_gpu(cpus=2)``."""
    monkeypatch.setattr(registry, "cuda_mode", lambda: "none")
    return devices


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _oracle_step(w, b, x, y, l2, lr):
    """One SGD step of mean sparse softmax cross-entropy + l2 * sum(w**2), in float64."""
    w, b, x = (np.asarray(a, np.float64) for a in (w, b, x))
    p = _softmax(x @ w + b)
    n = len(y)
    data_loss = -np.log(p[np.arange(n), y]).mean()
    d = p.copy()
    d[np.arange(n), y] -= 1.0
    d /= n
    gw = x.T @ d + 2.0 * l2 * w
    gb = d.sum(axis=0)
    return w - lr * gw, b - lr * gb, data_loss + l2 * (w ** 2).sum()


def _dense_model(strategy, l2, features=4, classes=3):
    with strategy.scope():
        reg = tf.keras.regularizers.L2(l2) if l2 else None
        return tf.keras.Sequential([tf.keras.layers.Dense(classes, input_shape=(features,),
                                                          kernel_regularizer=reg)])


# --- 2, 3: Reduction.NONE + compute_average_loss + scale_regularization_loss(model.losses) --------

@pytest.mark.parametrize("with_penalty", [True, False])
def test_custom_training_page_loop_matches_numpy(no_gpu, with_penalty):
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()               # every logical CPU, as TF
    assert strategy.num_replicas_in_sync == 2
    rng = np.random.default_rng()
    GLOBAL, l2, lr = 5, 0.05, 0.3
    x = rng.standard_normal((GLOBAL, 4)).astype(np.float32)
    y = rng.integers(0, 3, GLOBAL)
    model = _dense_model(strategy, l2)
    with strategy.scope():
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
        optimizer = tf.keras.optimizers.SGD(learning_rate=lr)
    model.build((None, 4))
    w0, b0 = model.get_weights()

    def compute_loss(labels, predictions, model_losses):
        per_example_loss = loss_object(labels, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL)
        if model_losses and with_penalty:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        return loss

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL))
    for batch in dist:
        per_replica = strategy.run(train_step, args=(batch,))
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    w1, b1, loss = _oracle_step(w0, b0, x, y, l2 if with_penalty else 0.0, lr)
    np.testing.assert_allclose(total, loss, rtol=1e-5)
    np.testing.assert_allclose(model.get_weights()[0], w1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], b1, rtol=1e-5, atol=1e-6)


def test_fit_trains_the_penalty_and_reports_it(no_gpu):
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.integers(0, 3, 5)
    model = _dense_model(strategy, 0.1)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(0.2))
    model.build((None, 4))
    w0, b0 = model.get_weights()
    history = model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    w1, b1, loss = _oracle_step(w0, b0, x, y, 0.1, 0.2)
    np.testing.assert_allclose(model.get_weights()[0], w1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], b1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"][0], loss, rtol=1e-5)
    (penalty,) = model.losses
    np.testing.assert_allclose(penalty.numpy(), 0.1 * (w1.astype(np.float64) ** 2).sum(), rtol=1e-5)


def test_l2_regularizer_api(devices):
    devices(cpus=1)
    w = np.random.default_rng().standard_normal((3, 7)).astype(np.float32)
    assert tf.keras.regularizers.l2 is tf.keras.regularizers.L2
    np.testing.assert_allclose(tf.keras.regularizers.L2(0.3)(w).numpy(), 0.3 * (w.astype(np.float64) ** 2).sum(),
                               rtol=1e-5)
    np.testing.assert_allclose(tf.keras.regularizers.L2()(tf.Variable(w)).numpy(),
                               0.01 * (w.astype(np.float64) ** 2).sum(), rtol=1e-5)   # Keras's default
    with pytest.raises(ValueError, match="l2"):
        tf.keras.regularizers.L2(-1.0)
    conv = tf.keras.layers.Conv2D(2, 3, kernel_regularizer=tf.keras.regularizers.L2(1e-3))
    assert conv.kernel_regularizer.l2 == 1e-3 and conv.losses == []       # nothing before build
    model = tf.keras.Sequential([tf.keras.layers.Input((5, 5, 1)), conv, tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(2)])
    (penalty,) = model.losses                                             # only the conv has one
    kernel = model.get_weights()[0].astype(np.float64)
    np.testing.assert_allclose(penalty.numpy(), 1e-3 * (kernel ** 2).sum(), rtol=1e-5)
    assert model.get_config()["layers"][1]["config"]["kernel_regularizer"]["config"] == {"l2": 1e-3}


@pytest.mark.parametrize("reduction", ["NONE", "SUM", "SUM_OVER_BATCH_SIZE"])
def test_reduction_enum_reduces_model_output_as_keras(devices, reduction):
    devices(cpus=1)
    rng = np.random.default_rng()
    x = rng.standard_normal((7, 4)).astype(np.float32)
    y = rng.integers(0, 3, 7)
    model = _dense_model(tf.distribute.get_strategy(), 0.0)
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=getattr(tf.keras.losses.Reduction, reduction))
    out = loss_object(y, model(x, training=True))
    w, b = model.get_weights()
    per_example = -np.log(_softmax(x.astype(np.float64) @ w + b)[np.arange(7), y])
    expected = {"NONE": per_example, "SUM": per_example.sum(), "SUM_OVER_BATCH_SIZE": per_example.mean()}
    np.testing.assert_allclose(out.numpy(), expected[reduction], rtol=1e-5)
    assert tf.keras.losses.Reduction.NONE == "none"
    with pytest.raises(ValueError, match="reduction"):
        tf.keras.losses.SparseCategoricalCrossentropy(reduction="mean")


# --- 1, 10, 11, 12: datasets ------------------------------------------------------------------------

def test_from_tensors_as_the_guide_uses_it(devices):
    devices(cpus=1)
    ds = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(10)
    batches = list(ds)
    assert len(batches) == len(ds) == 10
    for features, labels in batches:
        assert features.shape == labels.shape == (10, 1) and features.dtype == np.float32
        assert (features == 1).all() and (labels == 1).all()
    value = np.random.default_rng().standard_normal((2, 3))
    (only,) = list(tf.data.Dataset.from_tensors({"a": value, "b": 3}))
    np.testing.assert_array_equal(only["a"], value)            # the whole tensor, one element
    assert only["b"] == 3 and only["b"].dtype == np.int32
    assert ds.element_spec == (tf.TensorSpec((None, 1), tf.float32),) * 2
    assert repr(ds.element_spec[0]) == "TensorSpec(shape=(None, 1), dtype=tf.float32, name=None)"
    assert tf.data.Dataset.from_tensors([1, 2]).batch(3, drop_remainder=True).element_spec == \
        tf.TensorSpec((3, 2), tf.int32)


def test_from_generator_enumerate_and_options(devices):
    devices(cpus=1)
    sizes = np.random.default_rng().integers(1, 5, 6)

    def gen():
        for i, n in enumerate(sizes):
            yield np.full(n, i, np.float64), i

    sig = (tf.TensorSpec(shape=(None,), dtype=tf.float32), tf.TensorSpec(shape=(), dtype=tf.int64))
    ds = tf.data.Dataset.from_generator(gen, output_signature=sig)
    for epoch in range(2):                                   # each epoch calls the generator again
        got = list(ds)
        assert [len(v) for v, _ in got] == list(sizes)
        assert all(v.dtype == np.float32 and i.dtype == np.int64 for v, i in got)
    assert ds.element_spec == sig and ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
    bad = tf.data.Dataset.from_generator(gen, output_signature=(tf.TensorSpec((2, 2)), sig[1]))
    with pytest.raises(TypeError, match="not compatible"):
        list(bad)
    pairs = list(tf.data.Dataset.range(3).enumerate(start=10))
    assert [(int(i), int(v)) for i, v in pairs] == [(10, 0), (11, 1), (12, 2)]
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    shaped = tf.data.Dataset.range(7).with_options(options)
    assert [int(v) for v in shaped] == list(range(7))
    assert shaped.options().experimental_distribute.auto_shard_policy is tf.data.experimental.AutoShardPolicy.DATA
    with pytest.raises(AttributeError, match="no option"):
        options.not_an_option = 1


# --- 4, 8, 10, 14: strategies and distributed iterators ------------------------------------------------

def test_mirrored_strategy_takes_every_logical_cpu_and_logs_to_stderr(no_gpu, capsys):
    no_gpu(cpus=3)
    strategy = tf.distribute.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "Using MirroredStrategy with devices" in captured.err


def test_distributed_iterator_get_next_optional_and_element_spec(no_gpu):
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()
    x = np.random.default_rng().standard_normal((5, 2)).astype(np.float32)
    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(3))
    spec = dist.element_spec
    assert repr(spec).startswith("PerReplicaSpec(TensorSpec(shape=(None, 2), dtype=tf.float32")
    it = iter(dist)
    assert iter(it) is it
    first = it.get_next()
    np.testing.assert_array_equal(np.concatenate([v.numpy() for v in first.values]), x[:3])
    opt = it.get_next_as_optional()
    assert bool(opt.has_value())
    np.testing.assert_array_equal(np.concatenate([v.numpy() for v in opt.get_value().values]), x[3:])
    end = it.get_next_as_optional()
    assert not bool(end.has_value())
    with pytest.raises(tf.errors.OutOfRangeError):
        it.get_next()
    with pytest.raises(tf.errors.OutOfRangeError):
        end.get_value()
    assert sum(1 for _ in dist) == 2                       # a fresh iterator per iter()


def test_named_gpus_without_gpus_run_on_logical_cpus(no_gpu):
    no_gpu(cpus=2)
    with pytest.warns(UserWarning, match="soft placement"):
        strategy = tf.distribute.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    assert strategy.num_replicas_in_sync == 2
    assert {d.device_type for d in strategy.extended.devices} == {"CPU"}
    no_gpu(cpus=1)                                          # the guide's machine: one CPU device
    with pytest.warns(UserWarning, match="soft placement"):
        strategy = tf.distribute.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    devs = strategy.extended.devices
    assert len({d.name for d in devs}) == 2 and {d.device_type for d in devs} == {"CPU"}
    assert tf.config.list_logical_devices("CPU") == [tf.config.list_logical_devices()[0]]   # unchanged
    value = np.random.default_rng().standard_normal(4).astype(np.float32)
    with strategy.scope():
        v = tf.Variable(value)
    assert [c.numpy().tobytes() for c in v.values] == [value.tobytes()] * 2
    got = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", v.value()))
    for part in strategy.experimental_local_results(got):
        np.testing.assert_allclose(part.numpy(), 2 * value.astype(np.float64), rtol=1e-6)
    with pytest.warns(UserWarning, match="soft placement"):
        one = tf.distribute.OneDeviceStrategy(device="/gpu:0")            # the guide's example
    assert one.extended.devices[0].device_type == "CPU" and one.num_replicas_in_sync == 1


# --- 9: tensor functions ---------------------------------------------------------------------------

def test_print_range_reshape_and_tensor_repr(devices, capsys):
    devices(cpus=1)
    r = tf.range(10)
    assert r.dtype == tf.int32 and list(r.numpy()) == list(range(10))
    assert tf.range(1.0, 2.0, 0.5).dtype == tf.float32
    tf.print(r)
    tf.print("loss:", tf.constant(2.5))
    out = capsys.readouterr()
    assert out.out == "" and out.err == "[0 1 2 ... 7 8 9]\nloss: 2.5\n"   # TF's tf.print: stderr
    m = tf.reshape(tf.range(6), (2, -1))
    assert m.shape == (2, 3) and m.numpy()[1, 0] == 3
    with pytest.raises(ValueError):
        tf.reshape(tf.range(6), (4, -1))
    assert repr(tf.constant(1.0)) == "<tf.Tensor: shape=(), dtype=float32, numpy=1.0>"
    shape = tf.TensorShape([None, 28])
    assert shape == (None, 28) and shape.rank == 2 and shape.as_list() == [None, 28]
    assert shape.is_compatible_with((5, 28)) and not shape.is_compatible_with((5, 27))


# --- 5, 6: checkpoints and the learning rate as a variable ----------------------------------------------

def _trained(strategy, x, y, lr=0.01):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
        optimizer = tf.keras.optimizers.Adam(lr)
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer)
    return model, optimizer


def test_checkpoint_manager_restores_bitwise_and_resumes_identically(no_gpu, tmp_path):
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()
    rng = np.random.default_rng()
    x = rng.standard_normal((7, 4)).astype(np.float32)
    y = rng.integers(0, 3, 7)
    model, optimizer = _trained(strategy, x, y)
    model.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)
    manager = tf.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2)
    paths = [manager.save() for _ in range(3)]
    assert paths == [str(tmp_path / f"ckpt-{i}") for i in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-2.npz", "ckpt-3.npz"]
    assert tf.train.latest_checkpoint(str(tmp_path)) == paths[-1] == manager.latest_checkpoint
    assert manager.checkpoints == paths[1:]
    assert tf.train.latest_checkpoint(str(tmp_path / "empty")) is None
    new_model, new_optimizer = _trained(strategy, x, y, lr=0.5)      # not built, another rate
    status = tf.train.Checkpoint(optimizer=new_optimizer, model=new_model).restore(
        tf.train.latest_checkpoint(str(tmp_path)))
    status.assert_consumed()
    for a, b in zip(new_model.get_weights(), model.get_weights()):
        assert a.tobytes() == b.tobytes()
    assert new_optimizer.learning_rate.numpy() == np.float32(0.01)
    assert int(new_optimizer.iterations) == int(optimizer.iterations) == 3
    for m in (model, new_model):                                   # the same Adam state: the same next steps
        m.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(new_model.get_weights(), model.get_weights()):
        assert a.tobytes() == b.tobytes()
    for replica in new_model.trainable_variables[0].values:           # every replica's copy restored
        np.testing.assert_array_equal(replica.numpy(), model.get_weights()[0])


def test_checkpoint_save_restore_variables_and_refuses_other_architectures(devices, tmp_path):
    devices(cpus=1)
    v = tf.Variable(np.random.default_rng().standard_normal(3).astype(np.float32))
    ckpt = tf.train.Checkpoint(v=v)
    path = ckpt.save(str(tmp_path / "ckpt"))
    saved = v.numpy().copy()
    v.assign(np.zeros(3, np.float32))
    ckpt.restore(path)
    assert v.numpy().tobytes() == saved.tobytes() and int(ckpt.save_counter) == 1
    small = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(4,))])
    small.build((None, 4))
    tf.train.Checkpoint(model=small).save(str(tmp_path / "m"))
    other = tf.keras.Sequential([tf.keras.layers.Dense(5, input_shape=(4,))])
    other.build((None, 4))
    before = other.get_weights()
    with pytest.raises(ValueError, match="architecture"):
        tf.train.Checkpoint(model=other).restore(str(tmp_path / "m-1"))
    for a, b in zip(other.get_weights(), before):                     # nothing changed
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="latest_checkpoint"):
        ckpt.restore(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="max_to_keep"):
        tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=0)


def test_learning_rate_is_a_variable_read_by_callbacks(devices, capsys):
    devices(cpus=1)
    rng = np.random.default_rng()
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.integers(0, 3, 6)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam())
    seen = []

    class PrintLR(tf.keras.callbacks.Callback):                       # the Keras tutorial's callback
        def on_epoch_end(self, epoch, logs=None):
            seen.append(self.model.optimizer.learning_rate.numpy())

    def decay(epoch):
        return 1e-3 if epoch < 1 else 1e-4 if epoch < 2 else 1e-5

    model.fit(x, y, batch_size=3, epochs=3, verbose=0,
              callbacks=[tf.keras.callbacks.LearningRateScheduler(decay), PrintLR()])
    assert seen == [np.float32(1e-3), np.float32(1e-4), np.float32(1e-5)]
    lr = model.optimizer.learning_rate
    assert lr.numpy().dtype == np.float32 and float(lr * 2) == 2e-5
    lr.assign(0.5)
    assert model.optimizer.learning_rate.numpy() == np.float32(0.5)
    model.optimizer.learning_rate = 0.25                               # Keras 3 allows this too
    assert lr.numpy() == np.float32(0.25) and "numpy=0.25>" in repr(lr)
    with pytest.raises(ValueError, match="finite"):
        lr.assign(float("nan"))


# --- 13: the guide's other cross-device ops and strategies -----------------------------------------------

def test_hierarchical_copy_runs_as_the_ring_and_central_storage_as_mirrored(no_gpu, monkeypatch):
    no_gpu(cpus=2)
    from mirrored import distribute
    monkeypatch.setattr(distribute, "_HIERARCHICAL_NOTED", [])     # the note comes once per process
    with pytest.warns(UserWarning, match="RingAllReduce"):
        ops = tf.distribute.HierarchicalCopyAllReduce()
    assert isinstance(ops, tf.distribute.RingAllReduce)
    strategy = tf.distribute.MirroredStrategy(cross_device_ops=ops)
    values = np.random.default_rng().standard_normal((2, 3)).astype(np.float32)

    def fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(values[int(r)]))

    result = strategy.run(fn)
    for component in strategy.experimental_local_results(result):
        np.testing.assert_allclose(component.numpy(), values.astype(np.float64).sum(axis=0), rtol=1e-6)
    with pytest.warns(UserWarning, match="runs as MirroredStrategy"):    # tests/test_tf_pages.py
        central = tf.distribute.experimental.CentralStorageStrategy()      # checks what it computes
    assert central.num_replicas_in_sync == 1                          # TF's default: CPU:0 alone


# --- 7: MSE and binary cross-entropy: the kernel, fit, and the guide's custom loop ----------------------

def _target_loss_oracle(kind, z, y):
    """Per-example loss and d(sum of losses)/dz, float64."""
    z, y = np.asarray(z, np.float64), np.asarray(y, np.float64)
    c = z.shape[1]
    if kind == "mse":
        return ((z - y) ** 2).mean(axis=1), 2 * (z - y) / c
    if kind == "bce_logits":
        s = 1 / (1 + np.exp(-z))
        return (-(y * np.log(s) + (1 - y) * np.log(1 - s))).mean(axis=1), (s - y) / c
    return (-(y * np.log(z) + (1 - y) * np.log(1 - z))).mean(axis=1), ((z - y) / (z * (1 - z))) / c


@pytest.mark.parametrize("kind", ["mse", "bce_logits", "bce_probs"])
@pytest.mark.parametrize("shape", [(1, 1), (33, 3), (31, 1)])
def test_regression_loss_kernel_and_reference_match_float64(kind, shape):
    from numba import cuda
    from kernels.regression_losses import regression_loss, regression_loss_ref
    rng = np.random.default_rng()
    z = (rng.uniform(0.05, 0.95, shape) if kind == "bce_probs" else rng.standard_normal(shape) * 3).astype(np.float32)
    y = (rng.random(shape) if kind != "mse" else rng.standard_normal(shape)).astype(np.float32)
    loss, grad = _target_loss_oracle(kind, z, y)
    ref_loss, ref_grad = regression_loss_ref(kind, z, y, np.full(shape[0], np.nan, np.float32),
                                             np.full(shape, np.nan, np.float32), scale=0.5)
    np.testing.assert_allclose(ref_loss, loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(ref_grad, 0.5 * grad, rtol=2e-5, atol=1e-6)
    out_loss = cuda.to_device(np.full(shape[0], np.nan, np.float32))       # poisoned outputs
    out_grad = cuda.to_device(np.full(shape, np.nan, np.float32))
    regression_loss(kind, cuda.to_device(z), cuda.to_device(y), out_loss, out_grad, scale=0.5)
    np.testing.assert_allclose(out_loss.copy_to_host(), loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(out_grad.copy_to_host(), 0.5 * grad, rtol=2e-5, atol=1e-6)


def test_fit_with_mse_matches_numpy_over_two_replicas(no_gpu):
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 3)).astype(np.float32)
    t = rng.standard_normal((5, 2)).astype(np.float32)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
        model.compile(loss="mse", optimizer=tf.keras.optimizers.SGD(0.1))
    model.build((None, 3))
    w, b = (a.astype(np.float64) for a in model.get_weights())
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, t)).batch(5), epochs=1, verbose=0)
    loss, dz = _target_loss_oracle("mse", x @ w + b, t)
    np.testing.assert_allclose(history.history["loss"][0], loss.mean(), rtol=1e-5)
    np.testing.assert_allclose(model.get_weights()[0], w - 0.1 * x.T @ dz / 5, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], b - 0.1 * dz.sum(axis=0) / 5, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, t, batch_size=2, verbose=0),
                               _target_loss_oracle("mse", x @ model.get_weights()[0] + model.get_weights()[1], t)[0].mean(),
                               rtol=1e-5)
    with pytest.raises(ValueError, match="targets of shape"):
        model.fit(x, t[:, :1], verbose=0)
    # "accuracy" with MSE (issue 49): Keras's kind from the shapes, here categorical (targets of
    # the outputs' shape), computed on the host from the outputs
    model.compile(loss=tf.keras.losses.MeanSquaredError(), optimizer="sgd", metrics=["accuracy"])
    got = model.evaluate(x, t, batch_size=2, verbose=0, return_dict=True)
    p = x @ model.get_weights()[0] + model.get_weights()[1]
    assert got["accuracy"] == pytest.approx((p.argmax(-1) == t.argmax(-1)).mean())


def test_guide_custom_loop_with_binary_crossentropy(no_gpu):
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()
    rng = np.random.default_rng()
    GLOBAL, l2 = 6, 0.01      # compute_average_loss's default divides by each replica's rows x 2: even here
    x = rng.standard_normal((GLOBAL, 1)).astype(np.float32)
    t = rng.integers(0, 2, (GLOBAL, 1)).astype(np.float32)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,),
                                                           kernel_regularizer=tf.keras.regularizers.L2(l2))])
        optimizer = tf.keras.optimizers.SGD()                               # Keras's 0.01
    loss_object = tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
    model.build((None, 1))
    w, b = (a.astype(np.float64) for a in model.get_weights())

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, predictions))
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, t)).batch(GLOBAL))
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(train_step, args=(next(iter(dist)),)), axis=None)
    loss, dz = _target_loss_oracle("bce_logits", x @ w + b, t)
    np.testing.assert_allclose(total, loss.mean() + l2 * (w ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(model.get_weights()[0], w - 0.01 * (x.T @ dz / GLOBAL + 2 * l2 * w), rtol=1e-5)
    np.testing.assert_allclose(model.get_weights()[1], b - 0.01 * dz.sum(axis=0) / GLOBAL, rtol=1e-5, atol=1e-7)


# --- 15: the types the API pages print ---------------------------------------------------------------------

def test_dataset_elements_are_tensors_and_numpy_code_still_works(devices):
    devices(cpus=1)
    images = np.random.default_rng().integers(0, 256, (4, 2, 2, 1), dtype=np.uint8)
    labels = np.arange(4, dtype=np.int64)
    ds = tf.data.Dataset.from_tensor_slices((images, labels))
    image, label = next(iter(ds))
    assert isinstance(image.numpy(), np.ndarray) and type(image.numpy()) is np.ndarray
    np.testing.assert_array_equal(image.numpy(), images[0])
    assert label.numpy() == 0 and type(label.numpy()) is np.int64
    assert repr(label) == "<tf.Tensor: shape=(), dtype=int64, numpy=0>"
    assert [int(v) for v in tf.data.Dataset.range(3)] == [0, 1, 2]

    def scale(image, label):                            # the course lab's map function
        image = tf.cast(image, tf.float32)
        image /= 255
        return image, label

    for x, y in ds.map(scale).batch(3):
        assert x.dtype == np.float32 and float(np.max(x.numpy())) <= 1.0
    assert all(type(v) is np.int64 for v in tf.data.Dataset.range(2).as_numpy_iterator())   # NumPy, as TF


def test_all_reduce_results_come_back_per_replica(no_gpu):
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()

    def step_fn():
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(tf.constant(1.)))

    result = strategy.run(step_fn)
    assert isinstance(result, tf.distribute.PerReplica)       # TensorFlow's regroup: a PerReplica
    assert [t.numpy() for t in strategy.experimental_local_results(result)] == [2.0, 2.0]
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, result, axis=None)
    assert repr(total) == "<tf.Tensor: shape=(), dtype=float32, numpy=4.0>" and total.numpy() == 4.0


def test_options_merge_keeps_what_each_set_and_reshape_checks_sizes(devices):
    devices(cpus=1)
    first, second = tf.data.Options(), tf.data.Options()
    first.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    second.deterministic = False
    merged = tf.data.Dataset.range(3).with_options(first).with_options(second).options()
    assert merged.experimental_distribute.auto_shard_policy is tf.data.experimental.AutoShardPolicy.OFF
    assert merged.deterministic is False
    values = np.random.default_rng().standard_normal(12).astype(np.float32)
    t = tf.constant(values)
    for shape, expected in [((3, -1), (3, 4)), ((-1,), (12,)), ((2, 2, 3), (2, 2, 3)), ((12, 1), (12, 1))]:
        out = tf.reshape(t, shape)
        assert out.shape == expected
        np.testing.assert_array_equal(out.numpy(), values.reshape(expected))
    for bad in [(5, -1), (-1, -1), (13,), (0, -1)]:
        with pytest.raises(ValueError, match="cannot reshape"):
            tf.reshape(t, bad)
    assert tf.reshape(values, (4, 3)).shape == (4, 3)          # NumPy stays NumPy


def test_custom_training_page_flow_end_to_end(no_gpu, tmp_path, monkeypatch):
    """The page's structure: a model with no input shape, first called inside strategy.run
    (built once, by one replica), penalties on every layer, a checkpoint after the first
    epoch, a NEW model outside the scope restored from it scoring that epoch's accuracy."""
    no_gpu(cpus=2)
    import time
    conv_build = tf.keras.layers.Conv2D.build

    def slow_build(self, input_shape):        # widen the window in which both replicas could build
        time.sleep(0.2)
        conv_build(self, input_shape)

    monkeypatch.setattr(tf.keras.layers.Conv2D, "build", slow_build)
    strategy = tf.distribute.MirroredStrategy()
    rng = np.random.default_rng()
    images = rng.random((20, 6, 6, 1), dtype=np.float32)
    labels = rng.integers(0, 3, 20)
    GLOBAL = 6
    train = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(20).batch(GLOBAL))
    test = tf.data.Dataset.from_tensor_slices((images, labels)).batch(GLOBAL)

    def create_model():
        regularizer = tf.keras.regularizers.L2(1e-3)
        return tf.keras.Sequential([
            tf.keras.layers.Conv2D(2, 3, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.MaxPooling2D(), tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(3, kernel_regularizer=regularizer)])

    with strategy.scope():
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
        model = create_model()
        optimizer = tf.keras.optimizers.Adam(learning_rate=0.01)
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            loss = tf.nn.compute_average_loss(loss_object(y, predictions), global_batch_size=GLOBAL)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    def accuracy(m):
        metric = tf.keras.metrics.SparseCategoricalAccuracy()
        for x, y in test:
            metric(y, m(x, training=False))
        return float(metric.result())

    for epoch in range(2):
        for batch in train:
            strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(train_step, args=(batch,)), axis=None)
        if epoch == 0:
            path = checkpoint.save(str(tmp_path / "ckpt"))
            after_first = accuracy(model)
            first_weights = model.get_weights()
    assert len(model.losses) == 2
    for var in model.trainable_variables:                    # one build: the copies never drift
        a, b = (c.numpy() for c in var.values)
        assert a.tobytes() == b.tobytes()
    new_model, new_optimizer = create_model(), tf.keras.optimizers.Adam()
    tf.train.Checkpoint(optimizer=new_optimizer, model=new_model).restore(tf.train.latest_checkpoint(str(tmp_path)))
    assert tf.train.latest_checkpoint(str(tmp_path)) == path
    for a, b in zip(new_model.get_weights(), first_weights):
        assert a.tobytes() == b.tobytes()
    assert accuracy(new_model) == after_first


def test_tf_print_of_structures_and_looping_over_tf_range(no_gpu, capsys):
    """The input tutorial: ``for _ in tf.range(n)`` with ``get_next_as_optional``, then
    ``tf.print(strategy.experimental_local_results(...))`` of an uneven last batch."""
    no_gpu(cpus=2)
    strategy = tf.distribute.MirroredStrategy()
    capsys.readouterr()
    it = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(9).batch(4)))
    steps = 0
    for _ in tf.range(5):
        optional = it.get_next_as_optional()
        if not optional.has_value():
            break
        results = strategy.run(lambda x: x, args=(optional.get_value(),))
        tf.print(strategy.experimental_local_results(results))
        steps += 1
    assert steps == 3
    assert capsys.readouterr().err == "([0 1], [2 3])\n([4 5], [6 7])\n([8], [])\n"
    tf.print({"a": tf.constant([1, 2])}, [tf.constant(3)], "x", output_stream=__import__("sys").stdout)
    assert capsys.readouterr().out == "{'a': [1 2]} [3] x\n"
    assert [int(t) for t in tf.range(2, 5)] == [2, 3, 4]
    with pytest.raises(TypeError, match="scalar"):
        iter(tf.constant(1.0))


@pytest.mark.parametrize("loss", ["mse", "binary_crossentropy"])
def test_save_and_load_model_with_the_new_losses(devices, tmp_path, loss):
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,),
                                                       kernel_regularizer=tf.keras.regularizers.L2(0.5))])
    model.compile(loss=loss, optimizer="sgd")
    x = np.random.default_rng().random((4, 2), dtype=np.float32)
    model.fit(x, np.ones((4, 1), np.float32), verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = tf.keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.loss) is type(model.loss) and loaded.layers[0].kernel_regularizer.l2 == 0.5
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        assert a.tobytes() == b.tobytes()
