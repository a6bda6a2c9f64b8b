"""The host's share of a training step, counted (issue 40): what the host asks of the driver
per step, and what happens once in the first epochs only.

Without a GPU the simulator stands in for the card: its contexts, streams and events are
Python objects, so the calls a step makes on them can be counted exactly, as on a GPU.

* context switches: ``CudaDevice.activate`` pushes a context only where the block's GPU is
  not already current in this thread (mirrored/devices.py, ``_Activation``): a captured step
  pushes one per step, whatever the number of replicas of its card (before: 8 with one
  replica and 24 with two here, where the stand-in replays by rerunning the device part's
  Python; 6 with one replica on a GPU, where the replay is one call);
* copies: a step's x, y and the optimizer's scalars (Adam's alpha) go to each replica's
  device in ONE host-to-device copy, from one pinned staging buffer (views of one
  allocation, ``CudaDevice.upload_parts``): one copy a step per replica, where there were
  three;
* waits: ``fit(verbose=0)`` waits on the devices no more often than ``fit(verbose=1)``
  (the issue measured the quiet run twice as slow; the cause was elsewhere: see
  benchmarks/host_profile.py);
* epoch 2: shuffling a ``.cache()``d data set by row number does not set up numba's CPU
  compiler (0.2-0.9 s once, in the lab's second epoch: mirrored/data.py).

    python -m pytest -q tests/test_lean_host.py
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mirrored as tf
from mirrored import devices as devices_mod
from mirrored.program import capture, passes
from conftest import ReplayByRerun

L = tf.keras.layers
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CountingGpus:
    """``numba.cuda.gpus`` whose context managers count their entries (context pushes)."""

    def __init__(self, gpus):
        self.gpus, self.pushes = gpus, 0

    def __getitem__(self, i):
        counter, gpu = self, self.gpus[i]

        class Counted:
            def __enter__(self):
                counter.pushes += 1
                return gpu.__enter__()

            def __exit__(self, *exc):
                return gpu.__exit__(*exc)

            def __getattr__(self, name):
                return getattr(gpu, name)
        return Counted()


class CountingCuda:
    """numba.cuda with ``gpus`` counted; everything else is numba's."""

    def __init__(self, cuda):
        self._cuda = cuda
        self.gpus = CountingGpus(cuda.gpus)

    def __getattr__(self, name):
        return getattr(self._cuda, name)


def lab_like(n_replicas, rng, rows, batch):
    x = rng.standard_normal((rows, 6)).astype(np.float32)
    y = rng.integers(0, 3, rows)
    strategy = tf.distribute.MirroredStrategy([f"GPU:{i}" for i in range(n_replicas)])
    with strategy.scope():
        model = tf.keras.Sequential([L.Dense(5, activation="relu", input_shape=(6,)), L.Dense(3)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01), metrics=["accuracy"])
    return model, x, y


@pytest.mark.parametrize("n_replicas", [1, 2])
def test_a_captured_step_makes_its_cards_context_current_once(devices, rng, monkeypatch, n_replicas):
    devices(gpus=n_replicas)
    monkeypatch.setattr(capture, "why_not_capturable", lambda devs, ops=None: None)
    monkeypatch.setattr(capture, "_Graph", ReplayByRerun)
    rows, batch = 8, 4
    model, x, y = lab_like(n_replicas, rng, rows, batch)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)   # buffers made, captured
    counting = CountingCuda(devices_mod.numba_cuda())
    monkeypatch.setattr(devices_mod, "numba_cuda", lambda: counting)
    per_step, copies_per_step, copies = [], [], []
    copy = devices_mod.copy_host_to_device
    monkeypatch.setattr(devices_mod, "copy_host_to_device",
                        lambda dst, host, stream: (copies.append(host.nbytes), copy(dst, host, stream)))
    train = passes.CapturedStep.train

    def counted_train(self, batch):
        before, copied = counting.gpus.pushes, len(copies)
        train(self, batch)
        per_step.append(counting.gpus.pushes - before)
        copies_per_step.append(len(copies) - copied)
    monkeypatch.setattr(passes.CapturedStep, "train", counted_train)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    assert model._step_graphs.last == "replayed"
    steps = rows // batch
    # host-to-device copies per replica: x, y and the optimizer's scalars in one (devices.py,
    # upload_parts; 3 before: x, y and the scalars each their own)
    assert copies_per_step == [n_replicas] * steps, copies_per_step
    # the fit outside its steps: the epoch's metrics zeroed and read, per replica
    assert counting.gpus.pushes - sum(per_step) <= 2 * n_replicas
    assert per_step == [1] * steps, per_step


def test_nested_activations_of_another_card_push_it_and_put_the_first_back(monkeypatch):
    """A block of GPU 1 inside a block of GPU 0 pushes GPU 1's context; after it, GPU 0 is
    current again (as far as this thread's record goes), and a GPU 0 block inside finds it so."""
    events = []

    class Gpu:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            events.append(("push", self.i))

        def __exit__(self, *exc):
            events.append(("pop", self.i))

    fake = type("FakeCuda", (), {"gpus": [Gpu(0), Gpu(1)]})()
    monkeypatch.setattr(devices_mod, "numba_cuda", lambda: fake)
    A = devices_mod._Activation
    with A(0):
        with A(0):
            with A(1):
                with A(1):
                    pass
                with A(0):
                    pass
            with A(0):
                pass
    assert events == [("push", 0), ("push", 1), ("push", 0), ("pop", 0), ("pop", 1), ("pop", 0)]
    with pytest.raises(KeyError):
        with A(1):
            raise KeyError("inside")
    assert events[-2:] == [("push", 1), ("pop", 1)]
    with A(0):                              # the record was put back after the error
        pass
    assert events[-2:] == [("push", 0), ("pop", 0)]


def test_a_quiet_fit_waits_on_the_devices_no_more_than_a_loud_one(devices, rng, monkeypatch, capsys):
    devices(gpus=1)
    from numba.cuda.simulator import api as sim
    waits = {"event": 0, "stream": 0}

    def counted(kind, original):
        def wait(self):
            waits[kind] += 1
            return original(self)
        return wait
    monkeypatch.setattr(sim.Event, "synchronize", counted("event", sim.Event.synchronize))
    monkeypatch.setattr(sim.stream, "synchronize", counted("stream", sim.stream.synchronize))
    rows, batch = 8, 4
    model, x, y = lab_like(1, rng, rows, batch)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    seen = {}
    for verbose in (0, 1):
        waits.update(event=0, stream=0)
        model.fit(x, y, batch_size=batch, epochs=1, verbose=verbose)
        seen[verbose] = dict(waits)
    capsys.readouterr()
    steps = rows // batch
    quiet, loud = seen[0], seen[1]
    assert sum(quiet.values()) <= sum(loud.values()), seen
    # per step: one wait for its one upload (x, y and the optimizer's scalars) per replica,
    # on a staging buffer's event (bounded back-pressure, devices.py); streams only to read
    # the metrics
    assert quiet["event"] <= steps, seen
    assert quiet["stream"] <= 1, seen                  # the epoch's metrics, read at its end


def test_shuffling_a_cached_data_set_by_row_number_sets_up_no_cpu_compiler():
    """The lab's pipeline, three epochs (the second and third shuffle row numbers): numba's
    CPU compiler, 0.2-0.9 s to set up once even with its code cached, stays untouched."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from mirrored import data
        x = np.random.default_rng(0).random((300, 4, 4, 1)).astype(np.float32)
        ds = data.Dataset.from_tensor_slices((x, np.arange(300) % 10)).cache().shuffle(100).batch(16)
        labels = [np.concatenate([y for _, y in ds]) for _ in range(3)]
        assert all(sorted(l.tolist()) == sorted((np.arange(300) % 10).tolist()) for l in labels)
        assert not np.array_equal(labels[1], labels[2])
        print(sorted(m for m in ("numba.core.typing.arraydecl", "numba.core.typing.cffi_utils")
                      if m in sys.modules))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, MIRRORED_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_building_the_lab_model_launches_no_kernel(devices, monkeypatch):
    """Building a model allocates and copies; it launches nothing. On a GPU the first kernel
    launch of a process loads it (and sets up numba-cuda's dispatcher): that belongs to the
    first step, not to the ``with strategy.scope():`` cell (0.8 s on the H200, issue 40).
    The zeros (packed gradients, metric sums) are copied from the host instead of filled by
    a kernel; fit's weights are unchanged (tests/test_one_step.py, test_training.py)."""
    devices(gpus=1)
    from numba.cuda.simulator import kernel as sim_kernel
    from mirrored.lab.workflow import make_model
    launches = []
    call = sim_kernel.FakeCUDAKernel.__call__

    def counted(self, *args):
        launches.append(getattr(self, "fn", self))
        return call(self, *args)
    monkeypatch.setattr(sim_kernel.FakeCUDAKernel, "__call__", counted)
    strategy = tf.distribute.MirroredStrategy(["GPU:0"])
    with strategy.scope():
        model = make_model("conv")
    assert launches == []
    program = model.step.programs[0]
    assert np.array_equal(model.step.pack.grads[0].copy_to_host(), np.zeros(model.step.pack.total, np.float32))
    assert program.read_metrics() == (0.0, 0.0, 0, 0.0)
    program.zero_metrics()                      # an epoch's start: a fill kernel
    assert len(launches) == 1, "the counter counts launches"


@pytest.mark.parametrize("b, label_shape, label_dtype", [(3, (), np.int64), (1, (4,), np.float32),
                                                         (7, (), np.int32)])
def test_upload_parts_fills_the_views_of_one_allocation_with_one_copy(devices, rng, monkeypatch,
                                                                        b, label_shape, label_dtype):
    (dev,) = [d for d in devices(gpus=1) if d.device_type == "GPU"]
    copies = []
    copy = devices_mod.copy_host_to_device
    monkeypatch.setattr(devices_mod, "copy_host_to_device",
                        lambda dst, host, stream: (copies.append(host.nbytes), copy(dst, host, stream)))
    in_dim = int(rng.integers(1, 40))
    before = dev.bytes_in_use
    x_dev, y_dev = dev.empty_parts([((b, in_dim), np.float32), ((b,) + label_shape, label_dtype)])
    assert dev.bytes_in_use - before == 256 * -(-b * in_dim * 4 // 256) + 256 * -(-y_dev.nbytes // 256)
    for _ in range(3):                                    # the staging buffers take turns
        x = rng.standard_normal((b, in_dim)).astype(np.float32)
        y = (rng.integers(-9, 9, (b,) + label_shape)).astype(label_dtype)
        dev.upload_parts((x_dev, y_dev), (x, y))
        assert np.array_equal(x_dev.copy_to_host(), x) and np.array_equal(y_dev.copy_to_host(), y)
    assert len(copies) == 3
    other = dev.empty((b,) + label_shape, label_dtype)    # not one allocation: a copy each
    dev.upload_parts((x_dev, other), (x, y))
    assert len(copies) == 5 and np.array_equal(other.copy_to_host(), y)
    with pytest.raises(ValueError, match="does not fit"):
        dev.upload_parts((x_dev, y_dev), (x, y.astype(np.float64)))
    assert np.array_equal(y_dev.copy_to_host(), y), "a refused upload changes nothing"
    del x_dev, y_dev, other
    assert dev.bytes_in_use == before, "the allocation goes with its views"


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_distributed_batch_goes_to_each_replica_in_one_copy(devices, rng, monkeypatch, replicas):
    """A custom loop's input (``experimental_distribute_dataset``, and
    ``distribute_datasets_from_function``): each replica's share of an (images, labels) batch
    lands in ONE host-to-device copy, as views of one allocation (an allocation and a copy per
    leaf before), with the host's values and dtypes, a short last batch included; a batch of
    one leaf goes as before (``from_numpy``)."""
    devs = [d for d in devices(gpus=replicas) if d.device_type == "GPU"]
    strategy = tf.distribute.MirroredStrategy([f"GPU:{i}" for i in range(replicas)])
    rows, batch = 10, 4
    x = rng.standard_normal((rows, 3, 2)).astype(np.float32)
    y = rng.integers(0, 7, rows).astype(np.int32)
    copies, singles = [], []
    copy = devices_mod.copy_host_to_device
    monkeypatch.setattr(devices_mod, "copy_host_to_device",
                        lambda dst, host, stream: (copies.append(host.nbytes), copy(dst, host, stream)))
    for dev in devs:
        monkeypatch.setattr(dev, "from_numpy", lambda a, original=dev.from_numpy:
                            (singles.append(np.shape(a)), original(a))[1])

    def local(value):
        return [t.numpy() for t in strategy.experimental_local_results(value)]

    pairs = tf.data.Dataset.from_tensor_slices((x, y))
    for dist in (strategy.experimental_distribute_dataset(pairs.batch(batch)),
                 strategy.distribute_datasets_from_function(lambda ctx: pairs.batch(batch // 2))):
        copies.clear()
        got_x, got_y = [], []
        for step, (xb, yb) in enumerate(dist, start=1):
            assert len(copies) == replicas * step and not singles, (step, copies, singles)
            got_x += local(xb)
            got_y += local(yb)
        assert [a.dtype for a in got_x + got_y] == [np.float32] * len(got_x) + [np.int32] * len(got_y)
        np.testing.assert_array_equal(np.concatenate(got_x), x[:len(np.concatenate(got_x))])
        np.testing.assert_array_equal(np.concatenate(got_y), y[:len(np.concatenate(got_y))])
        assert len(np.concatenate(got_x)) >= rows - batch // 2 * (replicas - 1)   # (a step needs one
    alone = [t for b in strategy.experimental_distribute_dataset(                   #  batch per replica)
        tf.data.Dataset.from_tensor_slices(x).batch(batch)) for t in local(b)]
    np.testing.assert_array_equal(np.concatenate(alone), x)
    assert len(singles) == replicas * -(-rows // batch)
