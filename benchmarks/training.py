"""Training speed: our MirroredStrategy beside PyTorch and TensorFlow, in one run.

    python -m benchmarks.training                              # the GPU if there is one, else the CPU
    python -m benchmarks.training --tf-python /tmp/tfvenv/bin/python    # TF from another venv
    python -m benchmarks.training --smoke --out /tmp/training.json   # tiny; the test suite runs this
    python -m benchmarks.training --models convnet                  # the lab's ConvNet only
    python -m benchmarks.training --modes graph --no-resident       # GPU: the CUDA-graph rows only
    python -m benchmarks.training --models convnet --rows custom   # fit beside the custom loop

(where the time of one ConvNet step goes, layer by layer: python -m benchmarks.breakdown)

What is timed: one epoch of ``model.fit`` over MNIST (the bundled 8,000-image subset
offline, the full 60,000 when present), after one untimed warm-up epoch, for three
models with Adam and sparse cross-entropy from logits:

    lab      Flatten -> Dense 64 relu -> Dense 10     64 examples per replica (the dense lab model)
    wide     784 -> 1024 relu -> 1024 relu -> 10       256 examples per replica
    convnet  Conv2D(32, 3, relu) -> MaxPooling2D -> Flatten -> Dense 64 relu -> Dense 10
                                                       64 examples per replica (the course
                                                       lab's own model, issue 14)

The global batch is (examples per replica) x (replicas), TensorFlow's convention, so
samples/s compares replica counts fairly. Rows, each with the same initial weights:

    ours      no strategy; OneDeviceStrategy; MirroredStrategy on 1, 2 and 4 devices
              (logical CPUs without a GPU, logical GPUs carved from GPU:0 with one);
              MirroredStrategy 1 and 2 with the data set kept on the devices
              (InputOptions(experimental_place_dataset_on_device=True)); all compiled
              with run_eagerly=True (every kernel launched from Python). On a GPU also
              MirroredStrategy 1, 2 and 4 compiled with run_eagerly=False, Keras's default
              ("graph": the device part of each step replayed as one CUDA graph), copied,
              and 1 and 2 resident; on CPU devices, with ``--rows custom``, MirroredStrategy 1
              "graph" (there: the recorded launch list replayed, no CUDA graph, beside the
              custom loop's @function replay). ``--modes eager,graph`` picks which kinds run.
              With the eager rows, MirroredStrategy x1 trained by the tutorial's custom
              loop (strategy.run, GradientTape, apply_gradients, strategy.reduce) instead
              of fit: eagerly, and under @tf.function (traced, then replayed)
    torch     PyTorch eager, the same layers, weights, batches (the same mirrored.data
              pipeline and shuffle seed) and Adam (epsilon 1e-7 as Keras), CPU or CUDA;
              on a GPU also "cuda graph": the data set on the device, Adam capturable=True,
              the whole step captured as one CUDA graph and replayed (``TorchGraphRow``)
    tf        TensorFlow/Keras without a strategy, and MirroredStrategy on 1 and 2
              devices, run in a child process (``--tf-python``: an interpreter that has
              TensorFlow, e.g. a separate venv); same weights, data and batch sizes,
              tf.data's own shuffle order

A peer that cannot be imported is listed under "skipped" with the reason; it is not a
requirement of this project. Rows are timed in interleaved rounds (every row runs
its epoch 1, then every row its epoch 2..., each round in a new random order), so a
slow spell on a shared machine hits all rows alike; each row reports the median of its
epochs (at least 3 s of epochs per row, at most 40 epochs: 40 for the lab model on
the bundled subset, 5 for the wide one). Ratios ours/peer are taken
within this one run. Timing: perf_counter on the CPU; on a GPU, CUDA events on the
legacy default stream, which orders after every stream of the primary context (ours
and PyTorch's), recorded around each epoch after the warm-up.

The floor, per step of each row's global batch:

    FLOPs   2*B*sum(d_in*d_out) forward + the same for dW + 2*B*sum(d_in*d_out) for dX
            (not for the first layer)                  / the measured GEMM rate
            (the ConvNet: its conv as the im2col GEMM (B*OH*OW x KH*KW*Cin x Cout),
            forward and dW, no dX: it is the first layer; ~183 MFLOP at batch 64)
    bytes   input batch, bias/ReLU passes, loss, bias gradients, Adam (7 floats per
            parameter per device), ring all-reduce     / the measured copy bandwidth
    GPU     also launches per step x the measured cost of one launch (host-side)

Two GEMM rates are measured: the peak (a 1024^3 product) and this step's own GEMM
shapes, timed alone. ``peak_floor_ms`` = FLOPs at the peak rate + bytes; ``floor_ms``
(the table's) = the step's GEMMs as timed alone, times the replicas (they share the
cores, or the card) + bytes, and on a GPU at least launches x launch cost: what a
perfect implementation of this very step could reach. ``vs_floor`` = measured / floor.
Rates take the fastest of RATE_SAMPLES samples (a floor is what the machine can do).

Besides time: peak memory per device (ours: mirrored.config.experimental.
get_memory_info, measured over building the row and its warm-up epoch; PyTorch
CUDA: max_memory_allocated; TF GPU: its get_memory_info), and for our rows the ops
(kernel launches on a GPU), device allocations and host-to-device uploads per step,
counted in one extra untimed epoch.

Writes benchmarks/results/training-<device>-<date>.json (``--out`` to choose) and
prints a table; ``--smoke`` writes JSON only with ``--out``.
"""
import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]

#: The models: hidden/out units of the Dense layers, examples per replica, and for a
#: ConvNet its convs ``convs`` = ((filters, kernel size), ...), each Conv2D(relu) followed by
#: MaxPooling2D(2) (``conv`` = one pair: the older spelling, still read: ``conv_layers``).
MODELS = {
    "lab": {"units": (64, 10), "per_replica": 64, "what": "Flatten -> Dense 64 relu -> Dense 10"},
    "wide": {"units": (1024, 1024, 10), "per_replica": 256, "what": "784 -> 1024 -> 1024 -> 10"},
    "convnet": {"convs": ((32, 3),), "units": (64, 10), "per_replica": 64,
                "what": "Conv2D(32, 3, relu) -> MaxPooling2D -> Flatten -> Dense 64 relu -> Dense 10"},
    # TensorFlow's custom-training tutorial's model (issue 25): a second conv, 32 -> 64
    "two-conv": {"convs": ((32, 3), (64, 3)), "units": (64, 10), "per_replica": 64,
                 "what": "Conv2D(32, 3, relu) -> MaxPooling2D -> Conv2D(64, 3, relu) -> MaxPooling2D "
                         "-> Flatten -> Dense 64 relu -> Dense 10"},
}
#: --smoke: the same shapes of program, tiny sizes (it proves the program runs).
SMOKE_MODELS = {
    "lab": {"units": (16, 10), "per_replica": 16, "what": "smoke: 784 -> 16 -> 10"},
    "wide": {"units": (32, 32, 10), "per_replica": 32, "what": "smoke: 784 -> 32 -> 32 -> 10"},
    "convnet": {"convs": ((4, 3),), "units": (16, 10), "per_replica": 16,
                "what": "smoke: Conv2D(4, 3) -> MaxPooling2D -> 16 -> 10"},
    "two-conv": {"convs": ((2, 3), (4, 3)), "units": (8, 10), "per_replica": 16,
                 "what": "smoke: Conv2D(2, 3) -> MaxPooling2D -> Conv2D(4, 3) -> MaxPooling2D -> 8 -> 10"},
}
IMAGE = (28, 28, 1)
SMOKE_EXAMPLES = 512
#: Logical devices configured once at start (a process cannot reconfigure them).
LOGICAL_DEVICES = 4
REPLICA_COUNTS = (1, 2, 4)
RESIDENT_COUNTS = (1, 2)
GRAPH_COUNTS = (1, 2, 4)          # GPU only: compile(run_eagerly=False), the data copied ...
RESIDENT_GRAPH_COUNTS = (1, 2)    # ... and kept on the devices
MODES = ("eager", "graph")        # --modes: run_eagerly=True rows, run_eagerly=False (GPU) rows
TF_REPLICA_COUNTS = (1, 2)
#: Timed epochs per row: enough for ROW_SECONDS of timing per row (a lab epoch on the
#: bundled subset is ~50 ms: one slow spell of a shared machine must not decide the
#: median), at least EPOCHS, at most MAX_EPOCHS; --epochs fixes the number. Untimed
#: warm-up epochs come first.
EPOCHS = 5
MAX_EPOCHS = 40
ROW_SECONDS = 3.0
WARMUP_EPOCHS = 1
ROUND_ORDER_SEED = 0            # the rows' order in each timed round (a fixed shuffle)
#: The same shuffle for every row: mirrored.data seeds each epoch with (seed, epoch).
SHUFFLE_SEED = 1234
LEARNING_RATE = 1e-3
ADAM_EPSILON = 1e-7            # Keras's default; PyTorch's is 1e-8
#: TF logical GPUs need a memory limit (MiB each) when GPU:0 is split.
TF_LOGICAL_GPU_MIB = 4096
#: Floors: sizes of the rate measurements, and which sample they use. A floor is what
#: the machine CAN do, so it takes the fastest of its samples ("min_s"): on a shared
#: machine a median would let someone else's burst raise the floor above our step.
PEAK_GEMM = 1024
BANDWIDTH_BYTES = 64 * 2**20
BEST = "min_s"
RATE_SAMPLES = 15
#: Issue 25's targets on the CPU (ratios within one run, ``issue25_targets``): the lab
#: ConvNet's MirroredStrategy x1 against the faster of PyTorch eager and TensorFlow; the
#: two-conv model against TensorFlow; the lab ConvNet with one busy core against quiet.
TARGET_CONVNET_VS_PEERS = 0.70
TARGET_TWO_CONV_VS_TF = 1.0
TARGET_BUSY_VS_QUIET = 2.0
#: --busy-core: the competing process, pinned to one core (the last this process may use).
BUSY_LOOP = "while True: pass"
#: The targets on the CPU (ratios within one run).
TARGET_VS_TORCH = 1.0          # ours MirroredStrategy(1 CPU) ms/step / PyTorch eager, lab model
TARGET_OVERHEAD = 1.10         # ours MirroredStrategy(1) / ours no strategy
TARGET_TWO_REPLICAS = 0.8      # samples/s of 2 logical CPU replicas / 1 replica
#: ... and on one GPU: ours MirroredStrategy(1 GPU) / PyTorch eager, per model; overhead.
TARGET_GPU_VS_TORCH = {"lab": 1.0, "wide": 1.2}
TARGET_GPU_OVERHEAD = 1.05
#: Issue 41 on one GPU: the custom loop under @function (one captured graph per step) against
#: fit's graph row, and against PyTorch eager (--rows custom times exactly those rows).
TARGET_GPU_CUSTOM_VS_GRAPH = 1.2
TARGET_GPU_CUSTOM_VS_TORCH = 0.3


# --- the data ---------------------------------------------------------------------------

def load_mnist(limit=None):
    """x: (n, 28, 28, 1) float32 in [0, 1]; y: (n,) int64; and where they came from."""
    from mirrored import datasets
    (x, y), info = datasets.load("mnist", split="train", as_supervised=True, batch_size=-1,
                                 with_info=True)
    x = np.asarray(x, np.float32) / np.float32(255.0)          # (n, 28, 28, 1) float32
    y = np.asarray(y, np.int64)                                # (n,) int64
    if limit:
        x, y = x[:limit], y[:limit]
    return np.ascontiguousarray(x), y, str(getattr(info, "source", "unknown"))


def conv_layers(spec):
    """A spec's convs as ((filters, kernel size), ...): ``convs``, or the older ``conv`` (one)."""
    if "convs" in spec:
        return tuple(tuple(c) for c in spec["convs"])
    return (tuple(spec["conv"]),) if "conv" in spec else ()


def conv_geometry(spec):
    """For a ConvNet spec: one (cin, filters, k, conv output side, pooled side) per
    Conv2D + MaxPooling2D pair, in order; None for a dense model. 'valid' convs, each
    then a 2x2 pool (odd sizes drop a row)."""
    convs = conv_layers(spec)
    if not convs:
        return None
    geo, cin, side_in = [], IMAGE[2], IMAGE[0]
    for filters, k in convs:
        side = side_in - k + 1
        geo.append((cin, filters, k, side, side // 2))
        cin, side_in = filters, side // 2
    return geo


def dense_dims(spec):
    """The Dense layers' (in, out) sizes, from the input features on (after Flatten)."""
    geo = conv_geometry(spec)
    first = geo[-1][4] ** 2 * geo[-1][1] if geo else int(np.prod(IMAGE))
    return (first,) + tuple(spec["units"])


def keras_layers(tf, spec, keras_input=False):
    """The model's layers, for our library or TensorFlow's Keras (the same calls)."""
    shape = {} if keras_input else {"input_shape": IMAGE}
    first = [tf.keras.Input(IMAGE)] if keras_input else []
    for i, (filters, k) in enumerate(conv_layers(spec)):
        first += [tf.keras.layers.Conv2D(filters, k, activation="relu", **(shape if i == 0 else {})),
                  tf.keras.layers.MaxPooling2D()]
    first += [tf.keras.layers.Flatten()] if conv_layers(spec) else [tf.keras.layers.Flatten(**shape)]
    return (first + [tf.keras.layers.Dense(u, activation="relu") for u in spec["units"][:-1]]
            + [tf.keras.layers.Dense(spec["units"][-1])])


def initial_weights(spec, seed=0):
    """Keras's initialisers, computed once: glorot-uniform kernels (in, out), zero biases;
    a conv kernel (KH, KW, Cin, Cout) with Keras's fans (receptive field x channels)."""
    rng = np.random.default_rng(seed)
    dims = dense_dims(spec)
    weights = []
    for cin, filters, k, _, _ in conv_geometry(spec) or ():
        fan_in, fan_out = k * k * cin, k * k * filters
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        weights.append(rng.uniform(-limit, limit, (k, k, cin, filters)).astype(np.float32))
        weights.append(np.zeros(filters, np.float32))
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        limit = np.sqrt(6.0 / (d_in + d_out))
        weights.append(rng.uniform(-limit, limit, (d_in, d_out)).astype(np.float32))  # (in, out)
        weights.append(np.zeros(d_out, np.float32))                                  # (out,)
    return weights


# --- our rows ---------------------------------------------------------------------------

class OursRow:
    """One configuration of our library: a model, its strategy and its dataset."""

    framework = "ours"

    def __init__(self, tf, kind, strategy, n, resident, spec, x, y, weights, graph=False):
        self.n = n
        suffix = (" resident" if resident else "") + (" graph" if graph else "")
        self.strategy_label = {"none": "no strategy", "one": "OneDeviceStrategy"}.get(
            strategy, "MirroredStrategy" + suffix)
        self.name = {"none": "ours no strategy", "one": "ours OneDeviceStrategy"}.get(
            strategy, f"ours MirroredStrategy x{n}" + suffix)
        self.global_batch = spec["per_replica"] * n
        self.examples = len(x)
        if strategy == "none":
            self.strategy = tf.distribute.get_strategy()
        elif strategy == "one":
            self.strategy = tf.distribute.OneDeviceStrategy(f"{kind}:0")
        else:
            with contextlib.redirect_stdout(None):          # "Using MirroredStrategy with ..."
                self.strategy = tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)])
        scope = contextlib.nullcontext() if strategy == "none" else self.strategy.scope()
        with scope:
            self.model = tf.keras.Sequential(keras_layers(tf, spec))
        self.model.set_weights(weights)
        self.model.compile(optimizer=tf.keras.optimizers.Adam(LEARNING_RATE, epsilon=ADAM_EPSILON),
                           loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           metrics=["accuracy"], run_eagerly=not graph)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=SHUFFLE_SEED)
        ds = ds.batch(self.global_batch)
        if resident:
            options = tf.distribute.InputOptions(experimental_place_dataset_on_device=True)
            ds = self.strategy.experimental_distribute_dataset(ds, options)
        self.ds = ds
        self.devices = list(self.model.step.devices)

    def epoch(self):
        self.model.fit(self.ds, epochs=1, verbose=0)

    def final_loss(self):
        return float(self.model.history.history["loss"][-1])


class CustomLoopRow(OursRow):
    """The same model trained by the MirroredStrategy tutorial's custom loop instead of
    ``fit``: ``strategy.run`` of a step with a ``GradientTape`` and ``apply_gradients``,
    the losses summed by ``strategy.reduce``; eagerly, or under ``@tf.function`` (traced
    once per batch shape, then replayed: mirrored/traced_function.py). Issue 41."""

    def __init__(self, tf, kind, n, spec, x, y, weights, compiled):
        super().__init__(tf, kind, "mirrored", n, False, spec, x, y, weights)
        how = "custom loop @function" if compiled else "custom loop eager"
        self.name = f"ours MirroredStrategy x{n} {how}"
        self.strategy_label = f"MirroredStrategy {how}"
        self.dist = self.strategy.experimental_distribute_dataset(self.ds)
        self.step_fn = tutorial_step(tf, self.strategy, self.model, self.model.optimizer, compiled)
        self.last_loss = float("nan")

    def epoch(self):
        total, batches = 0.0, 0
        for batch in self.dist:
            rows = sum(int(v.shape[0]) for v in self.strategy.experimental_local_results(batch[1]))
            total += self.step_fn(batch, rows)          # on the device: no host read per step
            batches += 1
        self.last_loss = float(total) / max(batches, 1)

    def final_loss(self):
        return self.last_loss


def tutorial_step(tf, strategy, model, optimizer, compiled=True):
    """The distributed step of TensorFlow's custom-training tutorial, for ``tf`` = ours or
    TensorFlow alike: ``strategy.run`` of a GradientTape step (sparse cross-entropy from
    logits, averaged over the global batch), the replicas' losses summed by
    ``strategy.reduce``; wrapped in ``tf.function`` when ``compiled``."""
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs, global_batch):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, predictions), global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    def distributed_step(batch, global_batch):
        losses = strategy.run(train_step, args=(batch, global_batch))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return tf.function(distributed_step) if compiled else distributed_step


class Counter:
    """Counts our device ops, kernel launches, allocations and uploads during one epoch.

    It wraps methods of the device objects (and ``launch`` in every kernel module),
    which costs time: counting happens in an extra epoch, never in a timed one.
    """

    def __init__(self, devices):
        import threading
        self.devices = devices
        self.counts = {"ops": 0, "launches": 0, "allocations": 0, "uploads": 0}
        self._undo = []
        self._lock = threading.Lock()           # replica threads count at the same time

    def _wrap(self, obj, name, key):
        original = getattr(obj, name, None)
        if original is None:                    # an older library without this method
            return
        counts, lock = self.counts, self._lock

        def counted(*args, **kwargs):
            with lock:
                counts[key] += 1
            return original(*args, **kwargs)
        had = name in vars(obj)
        setattr(obj, name, counted)
        self._undo.append((obj, name, original if had else None))

    def __enter__(self):
        for dev in self.devices:
            for op in [m for m in vars(type(dev.ops)) if not m.startswith("_")]:
                self._wrap(dev.ops, op, "ops")
            self._wrap(dev, "empty", "allocations")
            self._wrap(dev, "from_numpy", "allocations")
            self._wrap(dev, "upload_into", "uploads")
        import kernels.launch as launch_mod
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("kernels.") and mod is not launch_mod \
                    and getattr(mod, "launch", None) is launch_mod.launch:
                self._wrap(mod, "launch", "launches")
        return self

    def __exit__(self, *exc):
        for obj, name, original in reversed(self._undo):
            if original is None:
                delattr(obj, name)               # back to the class's method
            else:
                setattr(obj, name, original)


# --- PyTorch --------------------------------------------------------------------------------

def torch_status():
    try:
        import torch
        return torch, None
    except Exception as exc:  # not installed, or broken
        return None, f"PyTorch not importable ({type(exc).__name__}: {exc})"[:200]


class TorchRow:
    """PyTorch eager: the same layers, initial weights, batches and Adam."""

    framework = "torch"

    def __init__(self, torch, tf, gpu, spec, x, y, weights):
        self.torch = torch
        self.name = f"PyTorch {torch.__version__} eager" + (" (CUDA)" if gpu else " (CPU)")
        self.strategy_label = "eager"
        self.n = 1
        self.global_batch = spec["per_replica"]
        self.examples = len(x)
        self.device = torch.device("cuda" if gpu else "cpu")
        self.net = torch_net(torch, spec, weights).to(self.device)
        self.conv = conv_geometry(spec) is not None
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=SHUFFLE_SEED)
        self.ds = self.ds.batch(self.global_batch)
        self.devices = []
        self.last_loss = None

    def epoch(self):
        torch, dev = self.torch, self.device
        loss = None
        for xb, yb in self.ds:                                  # NumPy batches, as ours get
            xt = torch.from_numpy(xb)                                  # (B, 28, 28, 1) float32
            # NCHW for a conv (a free view: C = 1), else (B, 784)
            xt = (xt.permute(0, 3, 1, 2) if self.conv else xt.reshape(len(xb), -1)).to(dev)
            yt = torch.from_numpy(yb).to(dev)                          # (B,) int64
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.net(xt), yt)
            loss.backward()
            self.opt.step()
        self.last_loss = loss

    def final_loss(self):
        return float(self.last_loss.detach()) if self.last_loss is not None else None


class TorchGraphRow(TorchRow):
    """PyTorch as its own users make a small model fast on a GPU (issue 40): the data set kept
    on the device and shuffled there (``torch.randperm``, its own seeded generator), Adam with
    ``capturable=True``, and the whole step (forward, loss, backward, Adam) captured as one CUDA
    graph per batch size (the epoch's last batch may be smaller) and replayed; each step only
    gathers its batch into the graph's input buffers, on the device. PyTorch's "whole-network
    capture" (torch.cuda.graphs' documentation): the warm-up it asks for runs on a side stream
    before capture, and the weights and Adam's state are then put back, so the row starts from
    the same weights as every other row. GPU only."""

    def __init__(self, torch, tf, gpu, spec, x, y, weights):
        if not gpu:
            raise ValueError("TorchGraphRow captures a CUDA graph: it needs a GPU")
        super().__init__(torch, tf, gpu, spec, x, y, weights)
        self.name = f"PyTorch {torch.__version__} CUDA graph (CUDA)"
        self.strategy_label = "cuda graph"
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON,
                                    capturable=True)
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))     # (N, 28, 28, 1)
        xt = xt.permute(0, 3, 1, 2) if self.conv else xt.reshape(len(x), -1)
        self.x_dev = xt.contiguous().to(self.device)                # (N, 1, 28, 28) or (N, 784)
        self.y_dev = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(self.device)    # (N,)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(SHUFFLE_SEED)
        n, b = len(x), self.global_batch
        start = {k: v.clone() for k, v in self.net.state_dict().items()}
        self.graphs = {size: self._capture(size) for size in sorted({b, n % b} - {0})}
        self.net.load_state_dict(start)                  # copies in place: the graphs' tensors
        for state in self.opt.state.values():            # Adam's moments and step, from zero
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()

    def _step(self, xb, yb):
        loss = self.loss_fn(self.net(xb), yb)
        loss.backward()
        self.opt.step()
        return loss

    def _capture(self, size):
        """(graph, its input x, its labels, its loss) for batches of ``size``."""
        torch = self.torch
        xb = self.x_dev[:size].clone()
        yb = self.y_dev[:size].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                    # warm-up, as PyTorch asks
            for _ in range(3):
                self.opt.zero_grad(set_to_none=True)
                self._step(xb, yb)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)             # grads from the graph's own pool
        with torch.cuda.graph(graph):
            loss = self._step(xb, yb)
        return graph, xb, yb, loss

    def epoch(self):
        torch = self.torch
        n, b = len(self.y_dev), self.global_batch
        order = torch.randperm(n, device=self.device, generator=self.generator)
        loss = None
        for start in range(0, n, b):
            rows = order[start:start + b]
            graph, xb, yb, loss = self.graphs[len(rows)]
            torch.index_select(self.x_dev, 0, rows, out=xb)      # the batch, gathered in place
            torch.index_select(self.y_dev, 0, rows, out=yb)
            graph.replay()
        self.last_loss = loss


def torch_net(torch, spec, weights):
    """The model as a PyTorch ``Sequential`` holding ``weights`` (Keras's layouts): Linear
    keeps (out, in); a conv kernel HWIO becomes OIHW; and since Keras flattens NHWC in
    (h, w, c) order and PyTorch NCHW in (c, h, w), the first Dense kernel's rows are
    permuted to match, so both compute the same function."""
    nn = torch.nn
    layers, i = [], 0
    geo = conv_geometry(spec)
    with torch.no_grad():
        for cin, filters, k, _, _ in geo or ():
            conv = nn.Conv2d(cin, filters, k)
            conv.weight.copy_(torch.from_numpy(weights[i].transpose(3, 2, 0, 1).copy()))
            conv.bias.copy_(torch.from_numpy(weights[i + 1]))
            layers += [conv, nn.ReLU(), nn.MaxPool2d(2)]
            i += 2
        if geo:
            layers.append(nn.Flatten())
        for j in range(i, len(weights), 2):
            kernel, bias = weights[j], weights[j + 1]         # Keras: (in, out), (out,)
            if geo and j == i:                                 # rows (h, w, c) -> (c, h, w)
                pooled, filters = geo[-1][4], geo[-1][1]
                kernel = (kernel.reshape(pooled, pooled, filters, -1).transpose(2, 0, 1, 3)
                          .reshape(kernel.shape))
            lin = nn.Linear(kernel.shape[0], kernel.shape[1])
            lin.weight.copy_(torch.from_numpy(kernel.T.copy()))     # PyTorch keeps (out, in)
            lin.bias.copy_(torch.from_numpy(bias))
            layers.append(lin)
            if j + 2 < len(weights):
                layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# --- TensorFlow, in a child process ----------------------------------------------------------

def tf_worker(spec_path, out_path):
    """Run the TensorFlow rows (in an interpreter that has TensorFlow) and write JSON."""
    spec = json.loads(Path(spec_path).read_text())
    arrays = np.load(spec["arrays"])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    gpu = spec["gpu"]
    kind = "GPU" if gpu else "CPU"
    phys = tf.config.list_physical_devices(kind)
    nmax = max(spec["replicas"])
    if gpu:
        tf.config.set_logical_device_configuration(
            phys[0], [tf.config.LogicalDeviceConfiguration(memory_limit=TF_LOGICAL_GPU_MIB)] * nmax)
    else:
        tf.config.set_logical_device_configuration(phys[0], [tf.config.LogicalDeviceConfiguration()] * nmax)
    x, y = arrays["x"], arrays["y"]
    # One strategy per replica count, shared by both models: two MirroredStrategy
    # objects over the same devices can draw the same collective-op keys in TF and
    # then abort with "Shape mismatch in the collective instance".
    strategies = {n: tf.distribute.MirroredStrategy([f"/{kind.lower()}:{i}" for i in range(n)])
                  for n in spec["replicas"]}
    strategies[0] = tf.distribute.get_strategy()
    results = []
    for model_name, m in spec["models"].items():
        weights = [arrays[f"{model_name}_w{i}"] for i in range(m["n_weights"])]
        rows = []
        for label, n in [("no strategy", 0)] + [(f"MirroredStrategy x{n}", n) for n in spec["replicas"]]:
            strategy = strategies[n]
            with strategy.scope():
                model = tf.keras.Sequential(keras_layers(tf, m, keras_input=True))
                model.compile(optimizer=tf.keras.optimizers.Adam(LEARNING_RATE, epsilon=ADAM_EPSILON),
                              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              metrics=["accuracy"])
            model.set_weights(weights)
            batch = m["per_replica"] * max(n, 1)
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=SHUFFLE_SEED)
            ds = ds.batch(batch).prefetch(tf.data.AUTOTUNE)
            rows.append({"label": label, "n": max(n, 1), "model": model, "ds": ds, "batch": batch})
        # Interleaved rounds, as in the parent; one fit() per epoch, timed by callbacks
        # at epoch begin/end so that fit's own per-call setup is not counted.
        times = {id(r["model"]): [] for r in rows}

        class EpochTimer(tf.keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.t0 = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds = time.perf_counter() - self.t0
                self.loss = float(logs["loss"])

        for r in rows:
            r["timer"] = EpochTimer()
            for _ in range(spec["warmup"]):
                r["model"].fit(r["ds"], epochs=1, verbose=0, callbacks=[r["timer"]])
            if gpu:
                r["peak_bytes"] = [tf.config.experimental.get_memory_info(f"GPU:{i}")["peak"]
                                   for i in range(r["n"])]
        for _ in range(m["epochs"]):
            for r in rows:
                r["model"].fit(r["ds"], epochs=1, verbose=0, callbacks=[r["timer"]])
                times[id(r["model"])].append(r["timer"].seconds)
        for r in rows:
            results.append({"model": model_name, "framework": "tf", "row": f"TensorFlow {tf.__version__} "
                            f"{r['label']}", "strategy": r["label"], "replicas": r["n"],
                            "global_batch": r["batch"], "epoch_seconds": times[id(r["model"])],
                            "peak_bytes_per_device": r.get("peak_bytes"),
                            "final_loss": r["timer"].loss})
        if spec.get("custom"):
            results.append(tf_custom_loop_row(tf, strategies[1], m, x, y, weights, spec["warmup"], model_name))
    info = {"tensorflow": tf.__version__, "keras": getattr(tf.keras, "__version__", None),
            "python": platform.python_version(),
            "tf_threads": {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                           "inter_op": tf.config.threading.get_inter_op_parallelism_threads()}}
    Path(out_path).write_text(json.dumps({"info": info, "results": results}))


def tf_custom_loop_row(tf, strategy, m, x, y, weights, warmup, model_name):
    """TensorFlow's own custom loop: ``tutorial_step`` (the one ``CustomLoopRow`` runs on
    ours) under TensorFlow's ``tf.function``, on its MirroredStrategy x1; the row issue 41
    compares with."""
    with strategy.scope():
        model = tf.keras.Sequential(keras_layers(tf, m, keras_input=True))
        optimizer = tf.keras.optimizers.Adam(LEARNING_RATE, epsilon=ADAM_EPSILON)
    model.set_weights(weights)
    batch = m["per_replica"]
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=SHUFFLE_SEED)
    dist = strategy.experimental_distribute_dataset(ds.batch(batch).prefetch(tf.data.AUTOTUNE))
    distributed_step = tutorial_step(tf, strategy, model, optimizer)

    def epoch():
        t0, total, steps = time.perf_counter(), 0.0, 0
        for inputs in dist:
            total += distributed_step(inputs, int(inputs[1].shape[0]))   # a Python int, as ours
            steps += 1
        loss = float(total) / max(steps, 1)            # reads the device: the epoch is done
        return time.perf_counter() - t0, loss

    for _ in range(warmup):
        epoch()
    seconds, loss = [], float("nan")
    for _ in range(m["epochs"]):
        s, loss = epoch()
        seconds.append(s)
    label = "MirroredStrategy x1 custom loop tf.function"
    return {"model": model_name, "framework": "tf", "row": f"TensorFlow {tf.__version__} {label}",
            "strategy": label, "replicas": 1, "global_batch": batch, "epoch_seconds": seconds,
            "peak_bytes_per_device": None, "final_loss": loss}


def run_tf_rows(python, gpu, models, x, y, weights, epochs, warmup, custom=False):
    """The TF rows from a child process: (rows, info) or (None, why skipped)."""
    if python is None:
        return None, ("TensorFlow is not importable here; give --tf-python PATH, an interpreter "
                      "with TensorFlow (e.g. a separate venv)")
    with tempfile.TemporaryDirectory() as tmp:
        arrays = {"x": x, "y": y}
        spec_models = {}
        for name, m in models.items():
            for i, w in enumerate(weights[name]):
                arrays[f"{name}_w{i}"] = w
            spec_models[name] = {"units": list(m["units"]), "per_replica": m["per_replica"],
                                 "convs": [list(c) for c in conv_layers(m)],
                                 "n_weights": len(weights[name]), "epochs": epochs[name]}
        np.savez(Path(tmp) / "arrays.npz", **arrays)
        spec = {"arrays": str(Path(tmp) / "arrays.npz"), "gpu": gpu, "models": spec_models,
                "replicas": list(TF_REPLICA_COUNTS), "warmup": warmup, "custom": custom}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        out = Path(tmp) / "tf.json"
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        try:
            proc = subprocess.run([python, "-m", "benchmarks.training", "--tf-worker",
                                   str(Path(tmp) / "spec.json"), "--out", str(out)],
                                  cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"the TensorFlow child process failed to run: {exc}"[:300]
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"the TensorFlow child process failed (rc {proc.returncode}): {' | '.join(tail)}"[:400]
        doc = json.loads(out.read_text())
    return doc["results"], doc["info"]


def find_tf_python(arg):
    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("tensorflow") else None


# --- floors ----------------------------------------------------------------------------------

def step_flops(spec, batch):
    """FLOPs of one training step on a batch: forward, dW, and dX below the first layer
    with weights (a ConvNet's conv is that layer: its Dense layers all need dX)."""
    dims = dense_dims(spec)
    pairs = [d_in * d_out for d_in, d_out in zip(dims[:-1], dims[1:])]
    geo = conv_geometry(spec)
    if geo is None:
        return 2 * batch * (2 * sum(pairs) + sum(pairs[1:]))
    convs = [side * side * k * k * cin * filters for cin, filters, k, side, _ in geo]  # multiply-adds per example
    return 2 * batch * (2 * sum(convs) + sum(convs[1:]) + 3 * sum(pairs))


def step_gemm_shapes(spec, batch):
    """(M, N, K, trans_a, trans_b) of every GEMM of one replica's step, as the layers run
    them (mirrored/keras/layers.py; a conv as its im2col GEMM, kernels/conv2d.py)."""
    dims = dense_dims(spec)
    geo = conv_geometry(spec)
    shapes = []
    for j, (cin, filters, k, side, _) in enumerate(geo or ()):
        rows, taps = batch * side * side, k * k * cin
        shapes.append((rows, filters, taps, False, False))      # out = cols @ W
        shapes.append((taps, filters, rows, True, False))        # dW = cols^T dz
        if j:
            shapes.append((rows, taps, filters, False, True))    # dcols = dz W^T (then col2im)
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        shapes.append((batch, d_out, d_in, False, False))       # z = a @ W
        shapes.append((d_in, d_out, batch, True, False))         # dW = a^T dz
        if i or geo:
            shapes.append((batch, d_in, d_out, False, True))     # da = dz W^T
    return shapes


def step_bytes(spec, batch, n_devices):
    """Bytes the non-GEMM work of one step moves (all devices together), float32."""
    units = spec["units"]
    dims = dense_dims(spec)
    params = sum(d_in * d_out + d_out for d_in, d_out in zip(dims[:-1], dims[1:]))
    hidden = sum(units[:-1])
    classes = units[-1]
    conv = 0
    geo = conv_geometry(spec)
    for j, (cin, filters, k, side, pooled) in enumerate(geo or ()):
        params += k * k * cin * filters + filters
        conv_out, pool_out = side * side * filters, pooled * pooled * filters
        taps = side * side * k * k * cin
        conv += (taps * (3 if j else 1)          # im2col's columns (and for dX: dcols, written, read by col2im)
                 + 2 * conv_out                   # bias + ReLU on the conv output (read, write)
                 + conv_out + 2 * pool_out        # pooling: read it, write max and arg-max
                 + conv_out + 2 * pool_out        # pooling backward: write dx, read dy and arg
                 + 3 * conv_out                   # ReLU backward (read dy and y, write)
                 + conv_out                       # conv bias gradient: column sums
                 + (2 * (side + k - 1) ** 2 * cin if j else 0))   # col2im: dX written (zeroed, added)
    per_example = (conv + 2 * 784           # the input batch: read on the host, written on the device
                   + 2 * hidden + 3 * hidden   # bias+ReLU (read, write); ReLU backward (read 2, write)
                   + 2 * classes            # bias add on the logits
                   + 3 * classes            # softmax cross-entropy: read logits, write gradient, loss
                   + sum(units))            # bias gradients: column sums read dz
    floats = batch * per_example + 7 * params * n_devices     # Adam: read w, g, m, v; write w, m, v
    if n_devices > 1:                       # ring: 2(N-1)/N of the buffer read + written per device
        floats += 3 * params * 2 * (n_devices - 1)
    return 4 * floats


def measure_rates(gpu, models, smoke, torch=None):
    """GEMM peak rate, GEMM time of each (model, replicas) step's shapes, copy bandwidth,
    and (GPU) the host cost of one kernel launch."""
    timer = ((lambda f: common.time_gpu(f, repeat=RATE_SAMPLES)) if gpu
             else (lambda f: common.time_host(f, repeat=RATE_SAMPLES)))
    n = 256 if smoke else PEAK_GEMM
    rates = {}
    if gpu:
        from numba import cuda

        from kernels import elementwise
        from kernels.gemm import gemm
        a = cuda.to_device(np.random.rand(n, n).astype(np.float32))
        c = cuda.device_array((n, n), np.float32)
        t = timer(lambda: gemm(a, a, c))
        rates["gemm_peak_gflops"] = 2 * n ** 3 / t[BEST] / 1e9
        rates["gemm_peak_impl"] = f"our GEMM ({n}^3)"
        if torch is not None:                 # cuBLAS FP32 (no TF32): the card's real ceiling
            torch.backends.cuda.matmul.allow_tf32 = False
            ta = torch.as_tensor(a, device="cuda")
            tc = torch.as_tensor(c, device="cuda")
            t = timer(lambda: torch.matmul(ta, ta, out=tc))
            cublas = 2 * n ** 3 / t[BEST] / 1e9
            rates["gemm_cublas_gflops"] = cublas
            if cublas > rates["gemm_peak_gflops"]:
                rates["gemm_peak_gflops"], rates["gemm_peak_impl"] = cublas, f"cuBLAS via PyTorch ({n}^3)"
        gbps, _ = common.copy_bandwidth(BANDWIDTH_BYTES if not smoke else 2**20)
        rates["copy_gbps"] = gbps
        one = cuda.device_array(1, np.float32)
        t = common.time_host(lambda: elementwise.fill(one, 0.0), repeat=RATE_SAMPLES, number=200,
                             sync=cuda.synchronize)
        rates["launch_us"] = t[BEST] * 1e6
    else:
        a = np.random.rand(n, n).astype(np.float32)
        c = np.empty((n, n), np.float32)
        t = timer(lambda: np.matmul(a, a, out=c))
        rates["gemm_peak_gflops"] = 2 * n ** 3 / t[BEST] / 1e9
        rates["gemm_peak_impl"] = f"NumPy matmul ({n}^3, BLAS's default threads)"
        big = np.ones((BANDWIDTH_BYTES if not smoke else 2**20) // 4, np.float32)
        dst = np.empty_like(big)
        t = timer(lambda: np.copyto(dst, big))
        rates["copy_gbps"] = 2 * big.nbytes / t[BEST] / 1e9
    shape_ms = {}
    for name, m in models.items():
        total = 0.0
        for (mm, nn, kk, ta, tb) in step_gemm_shapes(m, m["per_replica"]):
            if gpu:
                from numba import cuda

                from kernels.gemm import gemm
                A = cuda.device_array((kk, mm) if ta else (mm, kk), np.float32)
                B = cuda.device_array((nn, kk) if tb else (kk, nn), np.float32)
                C = cuda.device_array((mm, nn), np.float32)
                t = timer(lambda A=A, B=B, C=C, ta=ta, tb=tb: gemm(A, B, C, ta, tb))
            else:
                A = np.random.rand(*((kk, mm) if ta else (mm, kk))).astype(np.float32)
                B = np.random.rand(*((nn, kk) if tb else (kk, nn))).astype(np.float32)
                C = np.empty((mm, nn), np.float32)
                opA, opB = (A.T if ta else A), (B.T if tb else B)
                t = timer(lambda opA=opA, opB=opB, C=C: np.matmul(opA, opB, out=C))
            total += t[BEST]
        shape_ms[name] = total * 1e3               # one replica's GEMMs, alone on the machine
    rates["step_gemm_ms_one_replica"] = shape_ms
    return rates


def floor_for(row, model, spec, rates, gpu, launches_per_step=None):
    """The floors of one step of this row, and how its median compares.

    ``peak_floor_ms``: FLOPs at the peak GEMM rate + bytes at the copy bandwidth.
    ``floor_ms``: the GEMMs at this step's own shapes as measured (one replica's,
    times the replicas: they share the same cores, or the same card) + the bytes;
    on a GPU, at least the launches x the cost of one launch (the host issues them
    while the GPU works, so the larger of the two bounds the step).
    """
    flops = step_flops(spec, row["global_batch"])
    nbytes = step_bytes(spec, row["global_batch"], row["replicas"])
    compute_ms = flops / (rates["gemm_peak_gflops"] * 1e9) * 1e3
    memory_ms = nbytes / (rates["copy_gbps"] * 1e9) * 1e3
    shapes_ms = rates["step_gemm_ms_one_replica"][model] * row["replicas"]
    out = {"flops_per_step": flops, "bytes_per_step": nbytes, "compute_ms_at_peak": compute_ms,
           "gemm_ms_at_step_shapes": shapes_ms, "memory_ms": memory_ms,
           "peak_floor_ms": compute_ms + memory_ms, "floor_ms": shapes_ms + memory_ms}
    if gpu and launches_per_step:
        out["launch_ms"] = launches_per_step * rates["launch_us"] / 1e3
        out["floor_ms"] = max(out["floor_ms"], out["launch_ms"])
    out["vs_peak_floor"] = row["ms_per_step"] / out["peak_floor_ms"]
    out["vs_floor"] = row["ms_per_step"] / out["floor_ms"]
    return out


# --- a competing process (--busy-core) ----------------------------------------------------------

class BusyCore:
    """``python -c "while True: pass"`` pinned to one core, started once and paused
    (SIGSTOP) until a busy row's epoch resumes it (SIGCONT): quiet and busy epochs of
    the same configuration then alternate in the interleaved rounds, and their ratio is
    measured in one run. A context manager: the process is killed on exit."""

    def __init__(self):
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        self.core = cores[-1]
        self.proc = None

    def __enter__(self):
        import signal
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(self.proc.pid, {self.core})
        os.kill(self.proc.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        return False

    @contextlib.contextmanager
    def running(self):
        import signal
        os.kill(self.proc.pid, signal.SIGCONT)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGSTOP)


class BusyRow:
    """Another row's epochs with the competing process running (``BusyCore``)."""

    def __init__(self, row, busy):
        self.row, self.busy = row, busy
        self.framework, self.n = row.framework, row.n
        self.name = f"{row.name} +busy core"
        self.strategy_label = f"{row.strategy_label} +busy core"
        self.global_batch, self.examples, self.devices = row.global_batch, row.examples, row.devices

    def epoch(self):
        with self.busy.running():
            self.row.epoch()

    def final_loss(self):
        return self.row.final_loss()


def busy_makers(makers, busy):
    """For ``--busy-core``: a maker of a busy twin for every maker given (built anew:
    its own model and weights, so the quiet row's state is not shared)."""
    return [lambda make=make: BusyRow(make(), busy) for make in makers]


# --- timing ------------------------------------------------------------------------------------

def epoch_timer(gpu):
    """A function timing one call of ``fn`` in seconds: CUDA events on a GPU, else perf_counter."""
    if not gpu:
        def host(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return host
    from numba import cuda
    start, end = cuda.event(timing=True), cuda.event(timing=True)

    def events(fn):
        start.record(0)             # legacy default stream: after all earlier work of every stream
        fn()
        end.record(0)
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / 1e3
    return events


def peak_per_device(tf, devices, baselines):
    return [tf.config.experimental.get_memory_info(d.name)["peak"] - base
            for d, base in zip(devices, baselines)]


def time_rows(makers, tf, epochs, warmup, timer, gpu, torch, skipped=None):
    """Build and warm up each row in turn (its peak memory is measured over both:
    weights, optimizer slots, buffers, the resident data), then time interleaved rounds.
    A row whose maker is marked ``optional`` and fails while building or warming up is
    left out and listed in ``skipped`` with its error, so the other rows still run.

    ``epochs=None``: as many as give every row at least ROW_SECONDS of timing (from the
    fastest row's warm-up epoch), within [EPOCHS, MAX_EPOCHS]. Returns (rows, epochs).
    """
    import mirrored.devices as registry
    from mirrored.lab import timing     # (not at the top: the TF worker runs this file in TF's venv)
    all_devices = registry.logical_devices()
    rows = []
    for make in makers:
        for d in all_devices:
            tf.config.experimental.reset_memory_stats(d.name)
        baselines = {d.name: d.bytes_in_use for d in all_devices}
        if gpu and torch is not None:
            torch.cuda.reset_peak_memory_stats()
        try:
            row = make()
            # Optional (graph) rows warm up 2 epochs: a graph is captured the second time
            # its batch size comes up, and the last, smaller batch comes once per epoch.
            n_warm = max(warmup, 2 if getattr(make, "optional", False) else 1)
            row.warmup_seconds = [timer(row.epoch) for _ in range(n_warm)]
        except Exception as err:                       # noqa: BLE001 (reported, not hidden)
            if not getattr(make, "optional", False) or skipped is None:
                raise
            skipped.append({"name": getattr(make, "label", "a row"), "reason": f"{type(err).__name__}: {err}"})
            print(f"  skipped {getattr(make, 'label', 'a row')}: {type(err).__name__}: {err}")
            continue
        if row.framework == "ours":
            row.peak = peak_per_device(tf, row.devices, [baselines[d.name] for d in row.devices])
        elif row.framework == "torch" and gpu:
            row.peak = [int(torch.cuda.max_memory_allocated())]
        else:
            row.peak = None               # PyTorch on the CPU keeps no per-device count
        row.seconds = []
        rows.append(row)
    if epochs is None:                  # the fastest row gets ROW_SECONDS too
        fastest = min(r.warmup_seconds[-1] for r in rows)
        epochs = int(min(MAX_EPOCHS, max(EPOCHS, -(-ROW_SECONDS // fastest))))
    # Each round in a fresh random order (mirrored.lab.timing.interleaved_rounds, which
    # python -m mirrored uses too): what a row leaves behind (PyTorch's OpenMP threads
    # still spinning, a cold cache) must not always land on the same next row.
    timing.interleaved_rounds(len(rows), epochs,
                              lambda k, _: rows[k].seconds.append(timer(rows[k].epoch)),
                              seed=ROUND_ORDER_SEED)
    return rows, epochs


def summarise(model, row_name, framework, strategy, replicas, global_batch, examples, seconds, peak,
              final_loss):
    from mirrored.lab import timing     # (not at the top: the TF worker runs this file in TF's venv)
    steps = -(-examples // global_batch)
    median = statistics.median(seconds)
    return {"model": model, "row": row_name, "framework": framework, "strategy": strategy,
            "replicas": replicas, "global_batch": global_batch, "steps_per_epoch": steps,
            "epoch_seconds": seconds, "ms_per_step": median / steps * 1e3,
            "epoch_spread": timing.epoch_spread(seconds),          # > timing.SPREAD_LIMIT: busy
            "ms_per_step_min": min(seconds) / steps * 1e3,
            "samples_per_s": examples / median, "peak_bytes_per_device": peak,
            "final_loss": final_loss}


# --- ratios and targets ------------------------------------------------------------------------

def find(results, model, framework, strategy, replicas=1):
    for r in results:
        if (r["model"], r["framework"], r["strategy"], r["replicas"]) == (model, framework, strategy, replicas):
            return r
    return None


def ratios_and_targets(results, models, gpu):
    ratios, targets = [], []
    for model in models:
        ours1 = find(results, model, "ours", "MirroredStrategy")
        none = find(results, model, "ours", "no strategy")
        torch_row = find(results, model, "torch", "eager")
        tf_none = find(results, model, "tf", "no strategy")
        tf1 = find(results, model, "tf", "MirroredStrategy x1")

        def add(what, a, b, key="ms_per_step"):
            if a and b:
                ratios.append({"model": model, "ratio": what, "value": a[key] / b[key]})
                return a[key] / b[key]
            return None

        vs_torch = add("ours MirroredStrategy x1 / PyTorch eager (ms/step)", ours1, torch_row)
        overhead = add("ours MirroredStrategy x1 / ours no strategy (ms/step)", ours1, none)
        add("ours no strategy / PyTorch eager (ms/step)", none, torch_row)
        add("ours no strategy / TensorFlow no strategy (ms/step)", none, tf_none)
        add("ours MirroredStrategy x1 / TensorFlow MirroredStrategy x1 (ms/step)", ours1, tf1)
        add("TensorFlow MirroredStrategy x1 / TensorFlow no strategy (ms/step)", tf1, tf_none)
        scaling = None
        for n in REPLICA_COUNTS[1:]:
            v = add(f"ours MirroredStrategy x{n} / x1 (samples/s)",
                    find(results, model, "ours", "MirroredStrategy", n), ours1, "samples_per_s")
            if n == 2:
                scaling = v
        for n in RESIDENT_COUNTS:
            add(f"ours MirroredStrategy x{n} resident / x{n} copied (ms/step)",
                find(results, model, "ours", "MirroredStrategy resident", n),
                find(results, model, "ours", "MirroredStrategy", n))
        tf2 = find(results, model, "tf", "MirroredStrategy x2", 2)
        add("TensorFlow MirroredStrategy x2 / x1 (samples/s)", tf2, tf1, "samples_per_s")
        # issue 41: the custom loop beside fit, and beside TensorFlow's own custom loop
        custom = find(results, model, "ours", "MirroredStrategy custom loop @function")
        add("ours custom loop @function / ours fit, MirroredStrategy x1 (ms/step)", custom, ours1)
        add("ours custom loop eager / ours fit, MirroredStrategy x1 (ms/step)",
            find(results, model, "ours", "MirroredStrategy custom loop eager"), ours1)
        add("ours custom loop @function / TensorFlow custom loop tf.function, MirroredStrategy x1 (ms/step)",
            custom, find(results, model, "tf", "MirroredStrategy x1 custom loop tf.function"))
        graph1 = find(results, model, "ours", "MirroredStrategy graph")
        for n in GRAPH_COUNTS:
            add(f"ours MirroredStrategy x{n} graph / x{n} eager (ms/step)",
                find(results, model, "ours", "MirroredStrategy graph", n),
                find(results, model, "ours", "MirroredStrategy", n))
        graph_vs_torch = add("ours MirroredStrategy x1 graph / PyTorch eager (ms/step)", graph1, torch_row)
        custom_vs_graph = add("ours custom loop @function / ours fit graph, MirroredStrategy x1 (ms/step)",
                              custom, graph1)
        custom_vs_torch = add("ours custom loop @function, MirroredStrategy x1 / PyTorch eager (ms/step)",
                              custom, torch_row)
        torch_graph = find(results, model, "torch", "cuda graph")
        add("ours MirroredStrategy x1 graph / PyTorch CUDA graph (ms/step)", graph1, torch_graph)
        add("PyTorch CUDA graph / PyTorch eager (ms/step)", torch_graph, torch_row)
        if gpu:
            for what, value, threshold in (
                    (f"ours MirroredStrategy on 1 GPU / PyTorch eager, {model} model (ms/step)",
                     vs_torch, TARGET_GPU_VS_TORCH.get(model)),
                    (f"ours MirroredStrategy on 1 GPU, CUDA graph / PyTorch eager, {model} model (ms/step)",
                     graph_vs_torch, TARGET_GPU_VS_TORCH.get(model)),
                    (f"ours MirroredStrategy x1 / ours no strategy on 1 GPU, {model} model (ms/step)",
                     overhead, TARGET_GPU_OVERHEAD),
                    (f"ours custom loop @function / fit graph on 1 GPU, {model} model (ms/step)",
                     custom_vs_graph, TARGET_GPU_CUSTOM_VS_GRAPH),
                    (f"ours custom loop @function on 1 GPU / PyTorch eager, {model} model (ms/step)",
                     custom_vs_torch, TARGET_GPU_CUSTOM_VS_TORCH)):
                if value is not None and threshold is not None:
                    targets.append({"target": what, "measured": value, "threshold": threshold,
                                    "want": "<=", "met": value <= threshold})
            continue
        if model == "convnet" and vs_torch is not None:
            targets.append({"target": "ours MirroredStrategy on 1 CPU / PyTorch eager, lab ConvNet (ms/step)",
                            "measured": vs_torch, "threshold": TARGET_VS_TORCH, "want": "<=",
                            "met": vs_torch <= TARGET_VS_TORCH})
        if model != "lab":
            continue
        for what, value, threshold, better in (
                ("ours MirroredStrategy on 1 CPU / PyTorch eager, lab model (ms/step)", vs_torch,
                 TARGET_VS_TORCH, "<="),
                ("ours MirroredStrategy x1 / ours no strategy, lab model (ms/step)", overhead,
                 TARGET_OVERHEAD, "<="),
                ("2 logical CPU replicas / 1 replica, lab model (samples/s)", scaling,
                 TARGET_TWO_REPLICAS, ">=")):
            if value is not None:
                met = value <= threshold if better == "<=" else value >= threshold
                targets.append({"target": what, "measured": value, "threshold": threshold,
                                "want": better, "met": met})
    return ratios, targets


def issue25_targets(results):
    """Issue 25's CPU targets, from the rows of this run (absent rows: no entry)."""
    targets = []

    def fastest(model, rows):
        """The fastest of ``rows``; None unless each peer framework named there has a row
        (a "faster of PyTorch and TensorFlow" without TensorFlow's rows is not that target)."""
        found = [r for r in (find(results, model, fw, st) for fw, st in rows) if r]
        frameworks = {fw for fw, _ in rows}
        if not found or any(not any(find(results, model, fw, st) for f, st in rows if f == fw)
                            for fw in frameworks):
            return None
        return min(found, key=lambda r: r["ms_per_step"])

    def target(what, a, b, threshold):
        if a and b:
            value = a["ms_per_step"] / b["ms_per_step"]
            targets.append({"target": what, "measured": value, "threshold": threshold, "want": "<=",
                            "met": value <= threshold, "against": b["row"]})

    tf_rows = [("tf", "no strategy"), ("tf", "MirroredStrategy x1")]
    target("ours MirroredStrategy x1 / the faster of PyTorch eager and TensorFlow, lab ConvNet (ms/step)",
           find(results, "convnet", "ours", "MirroredStrategy"),
           fastest("convnet", [("torch", "eager")] + tf_rows), TARGET_CONVNET_VS_PEERS)
    target("ours MirroredStrategy x1 / the faster TensorFlow row, two-conv model (ms/step)",
           find(results, "two-conv", "ours", "MirroredStrategy"), fastest("two-conv", tf_rows),
           TARGET_TWO_CONV_VS_TF)
    target("ours MirroredStrategy x1 with one busy core / quiet, lab ConvNet (ms/step)",
           find(results, "convnet", "ours", "MirroredStrategy +busy core"),
           find(results, "convnet", "ours", "MirroredStrategy"), TARGET_BUSY_VS_QUIET)
    return targets


# --- machine description -----------------------------------------------------------------------

def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def thread_settings(torch):
    from mirrored import backends
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    blas = getattr(backends, "blas_info", None)         # absent in older versions of the library
    out = {"cpu_count": os.cpu_count(), "env": env, "numpy_blas": blas() if blas else None,
           "python_switch_interval_s": sys.getswitchinterval(),
           "fit_replicas": "driven in turn by one host thread",
           "blas_policy": (backends.blas_policy()[1] if hasattr(backends, "blas_policy")
                           else "BLAS threads not changed")}
    if torch is not None:
        out["torch_threads"] = torch.get_num_threads()
    try:            # which BLAS kernel runs (OpenBLAS's "architecture"), where threadpoolctl is
        import threadpoolctl      # installed (not a dependency of this project)
        out["threadpoolctl"] = [{k: p.get(k) for k in ("internal_api", "prefix", "version",
                                                        "architecture", "num_threads", "filepath")}
                                for p in threadpoolctl.threadpool_info()]
    except ImportError:
        out["threadpoolctl"] = None
    out["openblas_env"] = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    return out


# --- the program ---------------------------------------------------------------------------------

def time_models(args, tf, kind, gpu, models, x, y, weights, torch, timer, fixed_epochs, warmup,
                skipped, busy=None):
    """Our rows and PyTorch's for every model, interleaved per model: (results, epochs).
    ``args.rows == "x1"``: only no strategy and MirroredStrategy x1 of ours; ``busy`` (a
    ``BusyCore``): those two and PyTorch again, with the competing process running."""
    results, epochs = [], {}
    modes = set(str(getattr(args, "modes", ",".join(MODES))).split(","))   # --modes
    no_resident = getattr(args, "no_resident", False)
    for model_name, m in models.items():
        w = weights[model_name]
        makers = [lambda: OursRow(tf, kind, "none", 1, False, m, x, y, w),
                  lambda: OursRow(tf, kind, "one", 1, False, m, x, y, w)]
        makers += [lambda n=n: OursRow(tf, kind, "mirrored", n, False, m, x, y, w) for n in REPLICA_COUNTS]
        base = [makers[0], makers[2]]           # ours no strategy, Mirrored x1
        if "eager" not in modes:
            makers, base = [], []
        elif args.rows == "x1":
            makers = list(base)
        elif args.rows == "custom":
            makers, base = [makers[2]], [makers[2]]
        elif no_resident:
            pass
        elif hasattr(tf.distribute, "InputOptions"):
            makers += [lambda n=n: OursRow(tf, kind, "mirrored", n, True, m, x, y, w) for n in RESIDENT_COUNTS]
        elif model_name == next(iter(models)):
            skipped.append({"name": "resident rows", "reason": "this mirrored has no InputOptions"})
        if "eager" in modes and hasattr(tf, "GradientTape"):     # the custom loop beside fit (issue 41)
            for compiled in (False, True):
                make = lambda c=compiled: CustomLoopRow(tf, kind, 1, m, x, y, w, compiled=c)  # noqa: E731
                if gpu:                                  # a failed capture must not cost the other rows
                    make.optional = True
                    make.label = f"{model_name} ours MirroredStrategy x1 custom loop " + (
                        "@function" if compiled else "eager")
                makers.append(make)
        custom = args.rows == "custom"          # fit's graph x1 alone: what the custom loop is held to
        if (gpu or custom) and "graph" in modes and (hasattr(tf, "program") or hasattr(tf, "graphs")):
            for r in (False,) if no_resident or custom else (False, True):
                for n in RESIDENT_GRAPH_COUNTS if r else (1,) if custom else GRAPH_COUNTS:
                    make = lambda n=n, r=r: OursRow(tf, kind, "mirrored", n, r, m, x, y, w, graph=True)  # noqa: E731
                    make.optional = True                 # a failed capture must not cost the other rows
                    make.label = f"{model_name} ours MirroredStrategy x{n}{' resident' if r else ''} graph"
                    makers.append(make)
        elif gpu and "graph" in modes and model_name == next(iter(models)):
            skipped.append({"name": "graph rows", "reason": "this mirrored has no CUDA-graph capture (mirrored.program)"})
        if torch is not None:
            makers.append(lambda: TorchRow(torch, tf, gpu, m, x, y, w))
            base.append(makers[-1])
        if torch is not None and gpu:           # PyTorch at its fastest: a CUDA graph (issue 40)
            make = lambda: TorchGraphRow(torch, tf, gpu, m, x, y, w)  # noqa: E731
            make.optional = True
            make.label = f"{model_name} PyTorch CUDA graph"
            makers.append(make)
        if busy is not None:                    # no strategy, Mirrored x1, PyTorch: busy twins
            makers += busy_makers(base, busy)
        print(f"\n{model_name}: {m['what']}, {m['per_replica']} per replica: warm-up {warmup}, "
              f"then {fixed_epochs or 'calibrated'} timed epoch(s) per row, interleaved")
        rows, epochs[model_name] = time_rows(makers, tf, fixed_epochs, warmup, timer, gpu, torch, skipped)
        for row in rows:
            results.append(summarise(model_name, row.name, row.framework, row.strategy_label, row.n,
                                     row.global_batch, row.examples, row.seconds, row.peak,
                                     row.final_loss()))
            if row.framework == "ours":
                with Counter(row.devices) as counter:
                    row.epoch()
                steps = results[-1]["steps_per_epoch"]
                results[-1].update({f"{k}_per_step": v / steps for k, v in counter.counts.items()})
                if not gpu:
                    results[-1]["launches_per_step"] = None     # no kernels on the CPU backend
        del rows
    return results, epochs


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models and data on logical CPU devices (checks the program runs)")
    parser.add_argument("--out", help="where to write the JSON (default benchmarks/results/"
                                      "training-<device>-<date>.json; --smoke writes only with --out)")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"timed epochs per row (default: at least {ROW_SECONDS:g} s of timing per row, "
                             f"{EPOCHS} to {MAX_EPOCHS} epochs; 1 with --smoke)")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: GPU:0 when a real GPU is usable, else the CPU")
    parser.add_argument("--models", default="lab,wide,convnet,two-conv",
                        help="comma-separated: lab, wide, convnet, two-conv")
    parser.add_argument("--rows", choices=("all", "x1", "custom"), default="all",
                        help="our rows: all (no strategy, OneDevice, Mirrored x1/x2/x4, resident), "
                             "x1 (no strategy and Mirrored x1 only: the peer comparison, faster), or "
                             "custom (Mirrored x1 by fit and by the custom loop, eager and @function; on a "
                             "GPU fit's graph row x1 only)")
    parser.add_argument("--busy-core", action="store_true",
                        help="also time our no-strategy and Mirrored x1 rows and PyTorch with "
                             f"`python -c \"{BUSY_LOOP}\"` running pinned to one core (paused "
                             "between those epochs, so quiet and busy rounds interleave)")
    parser.add_argument("--tf-python", help="an interpreter with TensorFlow for the TF rows "
                                            "(default: this one, if it can import tensorflow)")
    parser.add_argument("--no-peers", action="store_true", help="time our rows only")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated: eager (our rows compiled with run_eagerly=True), graph "
                             "(MirroredStrategy rows with run_eagerly=False: CUDA graphs, GPU only)")
    parser.add_argument("--no-resident", action="store_true",
                        help="leave out the rows that keep the data set on the devices")
    parser.add_argument("--tf-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.tf_worker:                      # the child process: TensorFlow only, no numba
        tf_worker(args.tf_worker, args.out)
        return 0

    common.choose_cuda(smoke=False)         # real CUDA or none: never the simulator here
    if args.smoke:
        os.environ.setdefault("MIRRORED_OFFLINE", "1")     # the bundled subset: no download
    gpu = False
    skipped = []
    if args.device != "cpu" and not args.smoke:
        gpu, why = common.gpu_status()
        if not gpu:
            if args.device == "gpu":
                print(f"benchmarks.training: --device gpu, but {why}. Nothing was timed.")
                return 1
            skipped.append({"name": "GPU rows", "reason": why})
    kind = "GPU" if gpu else "CPU"
    if args.epochs is not None and args.epochs < 1:
        parser.error("--epochs must be at least 1")
    fixed_epochs = args.epochs or (1 if args.smoke else None)     # None: calibrated per model
    warmup = WARMUP_EPOCHS
    models = SMOKE_MODELS if args.smoke else MODELS
    models = {k: models[k] for k in args.models.split(",")}
    modes = set(args.modes.split(","))
    if not modes or not modes <= set(MODES):
        parser.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    if "graph" in modes and not gpu and args.rows != "custom":
        skipped.append({"name": "graph rows", "reason": "no GPU: there are no CUDA graphs to replay "
                        "(run_eagerly=False replays the recorded launch list on CPU devices: "
                        "--rows custom times it, MirroredStrategy x1 graph)"})

    import mirrored as tf
    phys = tf.config.list_physical_devices(kind)[0]
    tf.config.set_logical_device_configuration(
        phys, [tf.config.LogicalDeviceConfiguration() for _ in range(LOGICAL_DEVICES)])
    print(f"devices: {[d.name.rsplit('/', 1)[-1] for d in tf.config.list_logical_devices(kind)]} "
          f"(logical, carved from {phys.name})")

    x, y, source = load_mnist(SMOKE_EXAMPLES if args.smoke else None)
    print(f"data: {len(x):,} MNIST training images ({source})")
    weights = {name: initial_weights(m) for name, m in models.items()}

    torch, why = (None, "--no-peers") if args.no_peers else torch_status()
    if gpu and torch is not None and not torch.cuda.is_available():
        torch, why = None, "PyTorch has no CUDA here (torch.cuda.is_available() is False)"
    if torch is None:
        skipped.append({"name": "PyTorch rows", "reason": why})

    timer = epoch_timer(gpu)
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    busy = BusyCore() if args.busy_core else None
    with busy if busy else contextlib.nullcontext():
        results, epochs = time_models(args, tf, kind, gpu, models, x, y, weights, torch, timer,
                                      fixed_epochs, warmup, skipped, busy)

    tf_python = None if args.no_peers or (args.smoke and not args.tf_python) else find_tf_python(args.tf_python)
    tf_info = None
    if args.smoke and not args.tf_python:
        skipped.append({"name": "TensorFlow rows", "reason": "smoke run (give --tf-python to include them)"})
    elif args.no_peers:
        skipped.append({"name": "TensorFlow rows", "reason": "--no-peers"})
    else:
        print("\nTensorFlow rows (child process) ...")
        tf_rows, tf_info = run_tf_rows(tf_python, gpu, models, x, y, weights, epochs, warmup,
                                       custom=args.rows == "custom")
        if tf_rows is None:
            skipped.append({"name": "TensorFlow rows", "reason": tf_info})
            tf_info = None
        else:
            for r in tf_rows:
                results.append(summarise(r["model"], r["row"], "tf", r["strategy"], r["replicas"],
                                         r["global_batch"], len(x), r["epoch_seconds"],
                                         r["peak_bytes_per_device"], r["final_loss"]))

    print("\nmeasuring the floors (GEMM rate, copy bandwidth) ...")
    rates = measure_rates(gpu, models, args.smoke, torch if gpu else None)
    for r in results:
        r["floor"] = floor_for(r, r["model"], models[r["model"]], rates, gpu,
                               r.get("launches_per_step"))
    ratios, targets = ratios_and_targets(results, models, gpu)
    if not gpu:
        targets += issue25_targets(results)

    for model_name in models:
        print(f"\n{model_name}: {models[model_name]['what']}")
        common.print_table([dict(r, peak_mib=(max(r["peak_bytes_per_device"]) / 2**20
                                              if r["peak_bytes_per_device"] else None),
                                 vs_floor=r["floor"]["vs_floor"], floor_ms=r["floor"]["floor_ms"])
                            for r in results if r["model"] == model_name], [
            ("row", "row", ""), ("global_batch", "batch", "d"), ("ms_per_step", "ms/step", ".3f"),
            ("samples_per_s", "samples/s", ",.0f"), ("peak_mib", "peak MiB/dev", ".2f"),
            ("ops_per_step", "ops/step", ".1f"), ("launches_per_step", "launches/step", ".1f"),
            ("allocations_per_step", "allocs/step", ".2f"), ("floor_ms", "floor ms", ".3f"),
            ("vs_floor", "/ floor", ".1f")])
    print()
    for r in ratios:
        print(f"ratio [{r['model']}] {r['ratio']}: {r['value']:.2f}")
    for t in targets:
        print(f"target: {t['target']}: {t['measured']:.2f} (want {t['want']} {t['threshold']:.2f}) "
              f"{'met' if t['met'] else 'NOT met'}")
    for s in skipped:
        print(f"skipped: {s['name']}: {s['reason']}")

    info = common.device_info()
    if gpu:
        info["gpu_name"] = info["device"]
    else:
        info["device_note"] = info.get("device_note")
        info["device"] = "CPU"
    info["cpu_model"] = cpu_model()
    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    info["loadavg_start"] = load_at_start
    info["busy_core"] = {"core": busy.core, "loop": BUSY_LOOP} if busy else None
    info["threads"] = thread_settings(torch)
    info["tensorflow"] = tf_info
    payload = {
        "mode": "smoke" if args.smoke else "full",
        "method": {"timer": "CUDA events (legacy default stream)" if gpu else "time.perf_counter",
                   "statistic": "median over timed epochs of (epoch seconds / steps)",
                   "epochs": epochs, "warmup_epochs": warmup,
                   "rounds": "interleaved, each round in a new random order",
                   "epochs_rule": (f"--epochs {fixed_epochs}" if fixed_epochs else
                                   f"at least {ROW_SECONDS} s of timing per row, within [{EPOCHS}, {MAX_EPOCHS}]"),
                   "examples": len(x), "data": source, "shuffle_seed": SHUFFLE_SEED,
                   "optimizer": f"Adam(lr={LEARNING_RATE}, epsilon={ADAM_EPSILON})",
                   "logical_devices": LOGICAL_DEVICES, "backend": kind,
                   "modes": sorted(modes), "resident_rows": not args.no_resident},
        "models": {k: {"units": list(v["units"]), "per_replica": v["per_replica"], "what": v["what"],
                       "convs": [list(c) for c in conv_layers(v)]}
                   for k, v in models.items()},
        "rates": rates, "results": results, "ratios": ratios, "targets": targets, "skipped": skipped,
    }
    return common.save_results("training", payload, info, args.smoke, args.out)


if __name__ == "__main__":
    sys.exit(main())
