"""What running TensorFlow's four tf.distribute pages and the two API pages end to end showed
(benchmarks/results/tf-pages-cpu-2026-11-24.json): each test uses a name as a page does and
checks what it prints or computes against NumPy (float64 oracles, fresh random values)."""
import numpy as np
import pytest

import mirrored as tf
from mirrored import devices as registry


@pytest.fixture
def two_cpus(monkeypatch, devices):
    """No GPU (not even the simulator's) and the CPU split in two, as the input tutorial does."""
    monkeypatch.setattr(registry, "cuda_mode", lambda: "none")
    devices(cpus=2)


def test_print_of_a_batch_starts_its_rows_on_a_new_line_as_tf(devices):
    """The input tutorial prints each batch (`print(train_step(inputs))`), the gather page
    shows `numpy=\\narray(...)`: multi-line values start on a new line in str and repr."""
    devices(cpus=1)
    rows = int(np.random.default_rng().integers(2, 7))
    arr = np.random.default_rng().standard_normal((rows, 1)).astype(np.float32)
    t = tf.constant(arr)
    assert str(t) == f"tf.Tensor(\n{arr}, shape=({rows}, 1), dtype=float32)"
    assert repr(t) == f"<tf.Tensor: shape=({rows}, 1), dtype=float32, numpy=\n{arr!r}>"
    one_row = tf.constant(arr[0])                              # one line: no new line
    assert str(one_row) == f"tf.Tensor({arr[0]}, shape=(1,), dtype=float32)"


def test_reduced_loss_prints_float32_digits_as_tf(two_cpus):
    """The guide prints `distributed_train_step(...)`, a reduced float32 loss: TF shows
    NumPy's shortest float32 text (0.19910677), not the float64 expansion of it."""
    strategy = tf.distribute.MirroredStrategy()
    v = np.random.default_rng().random(2).astype(np.float32)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(v[ctx.replica_id_in_sync_group]))
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    expected = np.float32(np.float64(v[0]) + np.float64(v[1]))
    assert str(total) == f"tf.Tensor({expected!s}, shape=(), dtype=float32)"
    assert repr(total) == f"<tf.Tensor: shape=(), dtype=float32, numpy={expected!s}>"


def test_print_per_replica_shows_str_of_components_repr_shows_repr(two_cpus):
    """`print("Loss is ", loss)` (input tutorial) shows each replica's tensor as print does;
    a tuple holding PerReplica values (`print(next(iter(dist_dataset)))`) shows their reprs."""
    strategy = tf.distribute.MirroredStrategy()
    x = np.random.default_rng().standard_normal((5, 1)).astype(np.float32)     # 3 + 2 rows
    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(5))
    batch = next(iter(dist))
    loss = strategy.run(lambda f: f * 2.0, args=(batch,))
    parts = [x[:3] * 2, x[3:] * 2]
    assert str(loss) == "PerReplica:{\n" + ",\n".join(
        f"  {i}: tf.Tensor(\n{p}, shape={p.shape}, dtype=float32)" for i, p in enumerate(parts)) + "\n}"
    assert repr(loss) == "PerReplica:{\n" + ",\n".join(
        f"  {i}: <tf.Tensor: shape={p.shape}, dtype=float32, numpy=\n{p!r}>" for i, p in enumerate(parts)) + "\n}"
    assert str((loss,)) == f"({loss!r},)"


def test_values_from_function_keeps_python_numbers_and_run_in_a_function_returns_a_tensor(two_cpus):
    """The Strategy API page: `value_fn` returning `ctx.num_replicas_in_sync` gives local
    results `(2, 2)` (Python ints, as TF keeps them); `strategy.run` of `input*2` inside a
    `tf.function` hands back one tensor, `<tf.Tensor: shape=(), dtype=int32, numpy=4>`."""
    strategy = tf.distribute.MirroredStrategy()
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    local = strategy.experimental_local_results(values)
    assert local == (2, 2) and all(type(v) is int for v in local)
    r = [float(f) for f in np.random.default_rng().random(2)]            # distinct per replica
    floats = strategy.experimental_distribute_values_from_function(lambda ctx: r[ctx.replica_id_in_sync_group])
    assert strategy.experimental_local_results(floats) == tuple(r)
    assert strategy.reduce("SUM", floats, axis=None).numpy() == pytest.approx(sum(r), rel=1e-6)

    @tf.function
    def run():
        return strategy.run(lambda v: v * 2, args=(values,))
    assert repr(run()) == "<tf.Tensor: shape=(), dtype=int32, numpy=4>"
    arrays = strategy.experimental_distribute_values_from_function(      # arrays still go to
        lambda ctx: np.full(3, ctx.replica_id_in_sync_group, np.float32))  # each replica's device
    assert [t.device for t in strategy.experimental_local_results(arrays)] == \
        list(strategy.extended.worker_devices)


def test_function_returns_python_numbers_as_tensors_as_tf():
    """A `@tf.function` returning Python numbers or NumPy scalars gives tensors (int32,
    float32, bool, the NumPy dtype); tensors, None and strings come back as they are."""
    k = int(np.random.default_rng().integers(-50, 50))
    t = tf.constant([1.0, 2.0])
    out = tf.function(lambda: {"i": k, "f": k / 4, "b": k > 0, "n": np.float64(k), "t": t,
                               "none": None, "s": "text"})()
    assert (out["i"].dtype, out["f"].dtype, out["b"].dtype, out["n"].dtype) == \
        (np.int32, np.float32, np.bool_, np.float64)
    assert (out["i"].numpy(), out["f"].numpy(), out["b"].numpy(), out["n"].numpy()) == \
        (k, np.float32(k / 4), k > 0, float(k))
    assert out["t"] is t and out["none"] is None and out["s"] == "text"

    @tf.function(input_signature=[tf.TensorSpec(shape=(None,), dtype=tf.float32)])
    def double(x):
        return x * 2
    np.testing.assert_array_equal(double(t).numpy(), [2.0, 4.0])


def test_central_storage_strategy_trains_as_the_guide_builds_it(two_cpus):
    """The guide's `CentralStorageStrategy()` runs (as MirroredStrategy, said once): a Keras
    model built in its scope and fit with 'mse'/'sgd' over two compute devices takes
    TensorFlow's step (float64 NumPy oracle, 5 rows: an uneven split)."""
    with pytest.warns(UserWarning, match="runs as MirroredStrategy"):
        strategy = tf.distribute.experimental.CentralStorageStrategy(compute_devices=["CPU:0", "CPU:1"])
    assert strategy.num_replicas_in_sync == 2
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 3)).astype(np.float32)
    y = rng.standard_normal((5, 1)).astype(np.float32)
    w0 = rng.standard_normal((3, 1)).astype(np.float32)
    b0 = rng.standard_normal(1).astype(np.float32)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
        model.compile(loss="mse", optimizer="sgd")
    model.set_weights([w0, b0])
    model.fit(x, y, batch_size=5, epochs=1, verbose=0)
    xd, yd, wd, bd = (a.astype(np.float64) for a in (x, y, w0, b0))
    err = xd @ wd + bd - yd
    w1, b1 = wd - 0.01 * 2 * xd.T @ err / 5, bd - 0.01 * 2 * err.sum(axis=0) / 5
    np.testing.assert_allclose(model.get_weights()[0], w1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], b1, rtol=1e-5, atol=1e-6)


def _crc32c_bitwise(data):
    """CRC-32C one bit at a time (independent of the library's table)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 * (crc & 1))
    return crc ^ 0xFFFFFFFF


def _read_events(path):
    """Decode a TensorBoard event file: TFRecords (CRCs checked), then Event protobufs."""
    import struct

    def masked(data):
        c = _crc32c_bitwise(data)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    def varint(buf, i):
        """(value, next index) of the base-128 integer starting at buf[i]."""
        value, shift = 0, 0
        while True:
            b = buf[i]; i += 1
            value |= (b & 0x7F) << shift; shift += 7
            if not b & 0x80:
                return value, i

    def fields(buf):
        i, out = 0, []
        while i < len(buf):
            key, i = varint(buf, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = varint(buf, i)
            elif wire == 1:
                value, i = buf[i:i + 8], i + 8
            elif wire == 5:
                value, i = buf[i:i + 4], i + 4
            else:                                   # wire 2: a length, then that many bytes
                n, i = varint(buf, i)
                value, i = buf[i:i + n], i + n
            out.append((number, value))
        return out

    raw, events, i = open(path, "rb").read(), [], 0
    while i < len(raw):
        header = raw[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[i + 8:i + 12])[0] == masked(header)
        data = raw[i + 12:i + 12 + n]
        assert struct.unpack("<I", raw[i + 12 + n:i + 16 + n])[0] == masked(data)
        i += 16 + n
        ev = dict(fields(data))
        out = {"step": ev.get(2, 0), "version": ev.get(3)}
        if 5 in ev:
            value = dict(fields(dict(fields(ev[5]))[1]))
            out["tag"], out["value"] = value[1].decode(), struct.unpack("<f", value[2])[0]
        events.append(out)
    return events


def test_tensorboard_callback_writes_the_epoch_scalars_tensorboard_reads(devices, tmp_path):
    """The Keras tutorial's `TensorBoard(log_dir='./logs')` then `!ls ./logs`: a `train` and a
    `validation` folder of event files whose epoch_loss / epoch_accuracy are fit's History."""
    devices(cpus=1)
    assert _crc32c_bitwise(b"123456789") == 0xE3069283            # the standard check value
    rng = np.random.default_rng()
    x = rng.standard_normal((31, 4)).astype(np.float32)
    y = rng.integers(0, 3, 31)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=8, epochs=3, validation_data=(x[:9], y[:9]), verbose=0,
                        callbacks=[tf.keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs"))])
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["train", "validation"]
    for split, prefix in (("train", ""), ("validation", "val_")):
        (path,) = (tmp_path / "logs" / split).iterdir()
        assert path.name.startswith("events.out.tfevents.") and path.name.endswith(".v2")
        events = _read_events(path)
        assert events[0]["version"] == b"brain.Event:2"
        for name in ("loss", "accuracy"):
            logged = [(e["step"], e["value"]) for e in events if e.get("tag") == f"epoch_{name}"]
            assert logged == [(epoch, np.float32(v)) for epoch, v in enumerate(history.history[prefix + name])]
    rates = [(e["step"], e["value"]) for e in _read_events(next((tmp_path / "logs" / "train").iterdir()))
             if e.get("tag") == "epoch_learning_rate"]
    assert rates == [(epoch, np.float32(0.01)) for epoch in range(3)]          # 'sgd': Keras's 0.01
