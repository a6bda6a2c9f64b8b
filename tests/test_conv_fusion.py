"""Conv2D(activation='relu') + MaxPooling2D(2) run as one fused kernel on (simulated) GPUs
(``Conv2D.fuse_next`` asks ``ops.fuses_conv_relu_pool``; kernels/conv2d_v3.py
``conv2d_relu_pool``): the fused pair trains bit for bit like the two layers run apart, on
every replica; the CPU fuses through its own loops, never the GPU kernel. A second conv
after a pool makes its dX count; odd conv outputs make the pool drop a row and a column.

    python -m pytest -q tests/test_conv_fusion.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import backends
from tests.test_training import assert_replicas_bitwise_equal

layers = tf.keras.layers


def two_blocks():
    return [layers.Conv2D(4, 3, activation="relu", input_shape=(7, 9, 1)),  # 5 x 7: odd
            layers.MaxPooling2D(),                                           # 2 x 3
            layers.Conv2D(3, (1, 2), activation="relu", padding="same"),     # dX is used
            layers.MaxPooling2D(2),                                          # 1 x 1
            layers.Flatten(), layers.Dense(3)]


def train(kind, n, fuse, weights, xs, ys, monkeypatch):
    """Weights after len(xs) SGD steps, and how many fused launches ran."""
    calls = []
    real = backends.CudaOps.conv2d_relu_pool

    def counted(self, *args):
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(backends.CudaOps, "conv2d_relu_pool", counted)
    if not fuse:
        monkeypatch.setattr(backends.CudaOps, "fuses_conv_relu_pool", staticmethod(lambda *a: False))
    with tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)]).scope():
        model = tf.keras.Sequential(two_blocks())
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(0.2))
    model.set_weights(weights)
    for x, y in zip(xs, ys):
        model.train_step(x, y)
    assert_replicas_bitwise_equal(model)
    return model.get_weights(), len(calls)


def test_the_fused_pair_trains_exactly_like_the_two_layers(devices, rng, monkeypatch):
    devices(cpus=1, gpus=2)
    with tf.distribute.OneDeviceStrategy("CPU:0").scope():
        start = tf.keras.Sequential(two_blocks()).get_weights()
    start = [w + rng.uniform(0.05, 0.2, w.shape).astype(np.float32) for w in start]   # ReLUs alive
    xs = rng.standard_normal((2, 3, 7, 9, 1)).astype(np.float32)     # 2 steps of batch 3 (2 + 1)
    ys = rng.integers(0, 3, (2, 3))
    fused, n_fused = train("GPU", 2, True, start, xs, ys, monkeypatch)
    apart, n_apart = train("GPU", 2, False, start, xs, ys, monkeypatch)
    assert n_fused == 2 * 2 * 2 and n_apart == 0        # 2 pairs x 2 replicas x 2 steps
    for a, b, w0 in zip(fused, apart, start):
        assert np.array_equal(a, b), "the fused pair's gradients differ from the layers'"
        assert not np.array_equal(a, w0), "every weight trained"


def test_the_cpu_fuses_through_its_own_loops_not_the_gpu_kernel(devices, rng, monkeypatch):
    devices(cpus=2)
    with tf.distribute.OneDeviceStrategy("CPU:0").scope():
        start = tf.keras.Sequential(two_blocks()).get_weights()
    xs = rng.standard_normal((1, 3, 7, 9, 1)).astype(np.float32)
    _, calls = train("CPU", 2, True, start, xs, rng.integers(0, 3, (1, 3)), monkeypatch)
    assert calls == 0


@pytest.mark.parametrize("pool,conv", [
    (dict(pool_size=2, strides=1), dict(activation="relu")),          # windows overlap
    (dict(pool_size=3), dict(activation="relu")),                     # not 2x2
    (dict(pool_size=2, padding="same"), dict(activation="relu")),     # 'same'
    (dict(pool_size=2), dict(activation=None)),                       # no ReLU
])
def test_only_relu_then_2x2_stride_2_valid_pools_fuse(pool, conv):
    gpu = backends.CudaOps.__new__(backends.CudaOps)         # fuse_next asks only its staticmethod
    c = layers.Conv2D(2, 3, input_shape=(8, 8, 1), **conv)
    c.build((8, 8, 1))
    assert not c.fuse_next(layers.MaxPooling2D(**pool), gpu)
    r = layers.Conv2D(2, 3, activation="relu", input_shape=(8, 8, 1))
    r.build((8, 8, 1))
    assert r.fuse_next(layers.MaxPooling2D(), gpu) and not r.fuse_next(layers.Flatten(), gpu)
