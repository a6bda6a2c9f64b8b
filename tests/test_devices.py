"""Devices: physical and logical listings, TF device strings, memory limits, copies."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mirrored as tf
from mirrored import devices as registry

LONG = "/job:localhost/replica:0/task:0/device:"


def test_physical_devices_list_cpu_first_and_simulated_gpu(devices):
    devices()
    phys = tf.config.list_physical_devices()
    assert phys[0] == tf.config.PhysicalDevice("/physical_device:CPU:0", "CPU")
    assert tf.config.list_physical_devices("cpu") == [phys[0]]
    for p in tf.config.list_physical_devices("GPU"):
        assert p.device_type == "GPU" and p.name.startswith("/physical_device:GPU:")


def test_split_gpu_into_four_logical_gpus(devices):
    devs = devices(cpus=1, gpus=4)
    gpus = tf.config.list_logical_devices("GPU")
    assert [g.name for g in gpus] == [f"{LONG}GPU:{i}" for i in range(4)]
    assert all(isinstance(g, tf.config.LogicalDevice) for g in gpus)
    streams = [d.stream for d in devs if d.device_type == "GPU"]
    assert len(set(map(id, streams))) == 4, "each logical GPU needs its own stream"


def test_split_cpu_into_logical_cpus(devices):
    devices(cpus=3)
    assert [d.name for d in tf.config.list_logical_devices("CPU")] == [f"{LONG}CPU:{i}" for i in range(3)]


def test_configuration_after_first_use_is_a_runtime_error(devices):
    devices(cpus=2)
    cpu = tf.config.list_physical_devices("CPU")[0]
    with pytest.raises(RuntimeError, match="cannot be modified after being initialized"):
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()])


@pytest.mark.parametrize("spec", ["CPU:1", "cpu:1", "/cpu:1", "/CPU:1", "/device:CPU:1",
                                  "device:cpu:1", f"{LONG}CPU:1", "/job:localhost/device:CPU:1"])
def test_every_tf_spelling_names_the_same_device(devices, spec):
    devices(cpus=2)
    assert registry.canonical_name(spec) == f"{LONG}CPU:1"
    assert registry.get_device(spec).name == f"{LONG}CPU:1"
    with tf.device(spec):
        assert tf.constant([1.0]).device == f"{LONG}CPU:1"


@pytest.mark.parametrize("spec", ["GPU:9", "cpu:5", "TPU:0", "gpu", "/device:XLA:0", ""])
def test_unknown_device_lists_the_devices_there_are(devices, spec):
    devices(cpus=2)
    with pytest.raises(ValueError) as err:
        registry.get_device(spec)
    assert f"{LONG}CPU:1" in str(err.value)


def test_memory_limit_gives_a_clear_out_of_memory_error(devices):
    registry._reset()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1)] * 2)
    dev = registry.get_device("CPU:1")
    keep = tf.constant(np.zeros(200_000, np.float32), device="CPU:1")  # 800 KB of 1 MiB
    with pytest.raises(tf.errors.ResourceExhaustedError) as err:
        tf.constant(np.zeros(100_000, np.float32), device="CPU:1")      # +400 KB
    msg = str(err.value)
    assert f"{LONG}CPU:1" in msg and "1,048,576" in msg and "400,000" in msg
    assert dev.bytes_in_use == keep._buf.nbytes, "a refused allocation must not be charged"
    del keep
    import gc
    gc.collect()
    assert dev.bytes_in_use == 0, "freed tensors give their bytes back"
    assert dev.peak_bytes_in_use >= 800_000


def test_memory_limit_on_a_logical_gpu(devices):
    registry._reset()
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        pytest.skip("needs a CUDA GPU or the CUDA simulator")
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=1)] * 2)
    keep = tf.constant(np.zeros(200_000, np.float32), device="GPU:1")
    with pytest.raises(tf.errors.ResourceExhaustedError, match="GPU:1"):
        tf.constant(np.zeros(100_000, np.float32), device="GPU:1")
    # the other logical GPU on the same card keeps its own budget
    tf.constant(np.zeros(200_000, np.float32), device="GPU:0")
    assert keep.shape == (200_000,)


def test_bad_configurations_are_refused(devices):
    registry._reset()
    cpu = tf.config.list_physical_devices("CPU")[0]
    with pytest.raises(ValueError, match="memory_limit"):
        tf.config.LogicalDeviceConfiguration(memory_limit=-5)
    with pytest.raises(TypeError):
        tf.config.set_logical_device_configuration(cpu, ["not a configuration"])
    with pytest.raises(ValueError, match="empty"):
        tf.config.set_logical_device_configuration(cpu, [])
    with pytest.raises(ValueError, match="not a physical device"):
        tf.config.set_logical_device_configuration(tf.config.PhysicalDevice("/physical_device:GPU:7", "GPU"), [])


def test_copies_between_every_pair_of_devices(devices, rng):
    devs = devices(cpus=2, gpus=2)
    host = rng.standard_normal((3, 5)).astype(np.float32)
    for src in devs:
        t = tf.constant(host, device=src)
        for dst in devs:
            c = tf.identity(t, device=dst)
            assert c.device == dst.name
            np.testing.assert_array_equal(c.numpy(), host)


def test_download_into_fills_the_host_array_it_is_given(devices, rng):
    """download_into: to_numpy into an existing array (the cross-worker ring's send
    buffer), on a CPU and a simulated GPU; a misfit refused before anything is copied."""
    for dev in devices(cpus=1, gpus=1):
        want = rng.standard_normal(7).astype(np.float32)
        buf = dev.from_numpy(want)
        host = np.full(7, np.nan, np.float32)                      # poisoned
        assert dev.download_into(host, buf) is host
        np.testing.assert_array_equal(host, want)
        part = np.full(3, np.nan, np.float32)
        dev.download_into(part, buf[2:5])                          # a slice of the device array
        np.testing.assert_array_equal(part, want[2:5])
        for bad in (np.zeros(6, np.float32), np.zeros(7, np.float64)):
            before = bad.copy()
            with pytest.raises(ValueError, match="does not fit the host array"):
                dev.download_into(bad, buf)
            np.testing.assert_array_equal(bad, before)


def test_info_lists_four_logical_gpus_after_splitting():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", "1"))
    out = subprocess.run([sys.executable, "-m", "mirrored", "info", "--logical-gpus", "4"],
                         capture_output=True, text=True, env=env, timeout=120, check=True).stdout
    assert "numba-cuda" in out and "numba " in out
    for i in range(4):
        assert f"{LONG}GPU:{i}" in out
    assert f"{LONG}GPU:4" not in out
    assert "peer access" in out
    assert ("simulator" in out) == (env["NUMBA_ENABLE_CUDASIM"] == "1")


def test_bad_flag_gets_usage():
    out = subprocess.run([sys.executable, "-m", "mirrored", "--no-such-flag"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "usage:" in out.stderr


def test_a_refund_from_the_garbage_collector_inside_an_allocation_does_not_deadlock(devices):
    """The garbage collector runs a dead buffer's refund wherever it happens to collect,
    also inside ``_account`` while this device's lock is held (the suite once hung there
    for good). Simulated here by refunding from inside the locked region."""
    import threading
    import numpy as np
    dev = devices(cpus=1)[0]
    keep = dev.empty((1000,), np.float32)                       # 4,000 bytes charged
    real_check = dev._check_fits

    def check_then_collect(nbytes):
        real_check(nbytes)
        dev._refund(4_000)                                      # as if `keep` died just now
    dev._check_fits = check_then_collect
    done, made = threading.Event(), []
    worker = threading.Thread(target=lambda: (made.append(dev.empty((10,), np.float32)), done.set()),
                              daemon=True)
    worker.start()
    assert done.wait(10), "an allocation deadlocked on a refund that ran inside it"
    del dev._check_fits
    assert dev.bytes_in_use == 40, "the refund and the new charge must both be counted"
    del keep
