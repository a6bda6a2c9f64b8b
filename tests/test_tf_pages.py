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
