"""Where one training step's time goes, layer by layer: the course lab's ConvNet.

    python -m benchmarks.breakdown                      # lab ConvNet on the CPU, batch 64, 200 steps x 5 rounds
    python -m benchmarks.breakdown --model two-conv     # TF's tutorial model (two Conv2D + MaxPooling2D)
    python -m benchmarks.breakdown --model lab          # the dense lab model instead
    python -m benchmarks.breakdown --steps 50 --rounds 3 --out /tmp/breakdown.json
    python -m benchmarks.breakdown --device gpu         # on GPU:0: CUDA-event time per part
    python -m benchmarks.breakdown --smoke              # simulator, tiny: 1 step x 1 round

What runs: ``model.fit`` of the lab's ConvNet (Conv2D(32, 3, relu) -> MaxPooling2D ->
Flatten -> Dense(64, relu) -> Dense(10)) under ``MirroredStrategy(["CPU:0"])`` (or
``["GPU:0"]`` with ``--device gpu``) with Adam and sparse cross-entropy from logits, on
MNIST batches of 64 (``--batch``; the bundled subset when the full set is not at hand).
Every part of the step is wrapped with a ``time.perf_counter`` pair, on the instances
of this one model (the library is not changed):

    <layer> fwd / bwd    each layer's ``forward`` / ``backward`` (Conv2D's backward
                         includes its fused ReLU's backward; Dense's likewise; on the CPU
                         a ReLU Conv2D runs the MaxPooling2D after it in the same op,
                         both ways, so that pool's parts are ~0 and the conv's hold it)
    loss                 the fused softmax cross-entropy and its metric sums
    all-reduce           the SUM of the replicas' packed gradients
    optimizer            Adam's update of the packed weights
    input copy           the host part of the step: split, copy in, Adam's scalars
    step, other          what ``Step.train`` spends outside the parts above
    fit loop             what ``fit`` spends per step outside ``Step.train`` (the data
                         pipeline, callbacks, the progress bookkeeping)

On the CPU the backend computes synchronously, so a wrapped call's host time is its work.
On a GPU a call only queues kernels and returns: its host time is the cost of launching
them. So ``--device gpu`` also times every part on the GPU: a CUDA event is recorded
on the replica's stream before and after each wrapped call (``mirrored.lab.timing.
PhaseTimer``, the library's per-phase timer), the step ends with a synchronisation (so
steps do not overlap), and each part's GPU time is the sum of its event intervals.
An interval is what the stream spent between the two marks: the part's kernels, plus
any time the stream sat idle waiting for the host to launch them. Read the two columns
together: GPU time close to host time means the part is bound by its launches (Python
and driver overhead); GPU time well above host time means the kernels themselves take
that long (benchmarks/profile.py and Nsight Compute then say why). "step, other" on
the GPU is the stream time between the parts (host work between wrapped calls), and
"step" includes the final synchronisation, so the GPU parts add up to the step's wall time.
In Numba's CUDA simulator events do not time and launches run synchronously, so
there the "GPU" column is the host clock (``--smoke``: it proves the program runs).

Rounds of ``--steps`` steps are repeated (``--rounds``); each part reports its median
and minimum over the rounds, in ms per step, and its share of the median step. With
PyTorch importable, a PyTorch eager step of the same model (same weights, batches, Adam;
on the GPU with ``--device gpu``, synchronised at the end of each round) is timed in the
same rounds, interleaved, as the reference the issue's target is measured against
(``benchmarks/training.py`` is the full comparison).

On a shared machine (other jobs on the cores), ``--clock cpu`` times with
``time.process_time`` (CPU seconds of this process) instead of ``perf_counter``: with
one BLAS thread (``OPENBLAS_NUM_THREADS=1``, and ``--torch-threads 1``) that is the
work done, whatever the load; with several threads it also counts their spinning.
(CPU only: on a GPU the wait for the device is part of the step.)

The numbers of the wrapped run include the wrappers (~0.2 µs per call on the host, a
few µs more for the two event records on a GPU, ~20 calls per step): small against a
step of milliseconds. Writes JSON with ``--out`` only.

Neighbours: benchmarks/training.py (ms/step of whole epochs beside PyTorch and
TensorFlow), mirrored/keras/step.py (the step's parts), mirrored/lab/timing.py (the phase
timer; ``step_breakdown`` times the four phases of every replica), mirrored/backends.py
(CpuOps, CudaOps), benchmarks/profile.py (inside the kernels).
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

from benchmarks import common, training

#: Steps per round and rounds: 200 steps of ~5-30 ms is 1-6 s per round.
STEPS = 200
ROUNDS = 5
BATCH = 64
#: --smoke: 2 images per step through a ConvNet smaller still than benchmarks/training.py's
#: smoke models (2 filters, 4 hidden units): the simulator runs a Python thread per CUDA
#: thread, and the first Dense layer's backward (13*13*filters x units) dominates there.
SMOKE_BATCH = 2
#: --smoke: one step, one round after the warm-up (it checks the program, in well under 60 s)
SMOKE_STEPS, SMOKE_ROUNDS = 1, 1
SMOKE_MODELS = {"convnet": {"convs": ((2, 3),), "units": (4, 10), "per_replica": SMOKE_BATCH,
                            "what": "smoke: Conv2D(2, 3) -> MaxPooling2D -> 4 -> 10"},
                "two-conv": {"convs": ((2, 3), (2, 3)), "units": (4, 10), "per_replica": SMOKE_BATCH,
                             "what": "smoke: Conv2D(2, 3) -> MaxPooling2D -> Conv2D(2, 3) -> MaxPooling2D "
                                     "-> 4 -> 10"},
                "lab": {"units": (4, 10), "per_replica": SMOKE_BATCH, "what": "smoke: 784 -> 4 -> 10"}}
LEARNING_RATE = 1e-3
ADAM_EPSILON = 1e-7
SEED = 0


#: The models of benchmarks/training.py this program can break down.
MODEL_NAMES = ("convnet", "two-conv", "lab")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


class Parts:
    """Seconds per named part, accumulated by wrappers around the model's methods.

    With a ``timer`` (a ``mirrored.lab.timing.PhaseTimer``) and the replica's ``device``,
    each wrapped call is also recorded as a phase on the device's stream (CUDA events
    on a GPU): ``gpu_seconds()`` sums them per part."""

    def __init__(self, timer=None, device=None):
        self.seconds = {}
        self.order = []
        self.timer, self.device = timer, device

    def wrap(self, obj, attr, name):
        original = getattr(obj, attr)
        seconds = self.seconds
        timer, device = self.timer, self.device
        if name not in seconds:
            seconds[name] = 0.0
            self.order.append(name)

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                if timer is None:
                    return original(*args, **kwargs)
                with timer.phase(name, 0, device):     # an event before and after, on its stream
                    return original(*args, **kwargs)
            finally:
                seconds[name] += clock() - t0
        setattr(obj, attr, timed)              # an instance attribute: this model only

    def reset(self):
        for k in self.seconds:
            self.seconds[k] = 0.0
        if self.timer is not None:
            self.timer.reset()

    def gpu_seconds(self):
        """Per part, the sum of its intervals on the device's stream since ``reset``
        (waits for the events)."""
        summary = self.timer.summary()
        return {name: summary[name]["total_s"] if name in summary else 0.0 for name in self.order}


def build_ours(tf, spec, device="CPU:0", weights=None):
    with contextlib.redirect_stdout(None):                 # "Using MirroredStrategy with ..."
        strategy = tf.distribute.MirroredStrategy([device])
    with strategy.scope():
        model = tf.keras.Sequential(training.keras_layers(tf, spec))
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=tf.keras.optimizers.Adam(LEARNING_RATE, epsilon=ADAM_EPSILON),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"],
                  # Eager launches: the parts are Python calls that each launch kernels. With
                  # Keras's default (run_eagerly=False) a GPU replays the whole device part
                  # as one captured CUDA graph, and every part but the input copy reads 0
                  # (benchmarks/results/breakdown-*-2026-11-24-graph.json shows it).
                  run_eagerly=True)
    return model


def instrument(model, timer=None):
    """Wrap every part of ``model``'s training step; returns the Parts.

    ``timer`` (a PhaseTimer, for a GPU): every part is also timed on the replica's
    stream, and each step ends by synchronising the device, so that a step's parts are
    timed on the stream that step filled, not overlapped with the next step's."""
    step = model.step
    device = step.devices[0] if timer is not None else None
    parts = Parts(timer, device)
    if device is not None:
        train = step.train

        def train_then_wait(batch):
            train(batch)
            device.synchronize()                           # the end of the step, on the GPU too
        step.train = train_then_wait
    parts.wrap(step, "train", "step")                      # the whole step (parts nest inside)
    parts.wrap(step, "host_part", "input copy")
    for layer in model.layers:
        parts.wrap(layer, "forward", f"{layer.name} fwd")
    for program in step.programs:
        parts.wrap(program, "loss", "loss")
    for layer in reversed(model.layers):
        parts.wrap(layer, "backward", f"{layer.name} bwd")
    parts.wrap(step, "all_reduce", "all-reduce")
    parts.wrap(step, "update", "optimizer")
    return parts


class TorchStep:
    """PyTorch eager: the same model (``training.torch_net``: Keras's layouts converted),
    weights, batches and Adam; one ``run(batches)`` call per round (on a GPU it ends by
    synchronising, so the round's time is the work done)."""

    def __init__(self, torch, spec, weights, gpu=False):
        self.torch = torch
        self.gpu = gpu
        self.device = torch.device("cuda" if gpu else "cpu")
        self.net = training.torch_net(torch, spec, weights).to(self.device)
        self.nchw = training.conv_geometry(spec) is not None
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def run(self, batches):
        torch, dev = self.torch, self.device
        for xb, yb in batches:
            xt = torch.from_numpy(xb)                              # (B, 28, 28, 1)
            xt = xt.permute(0, 3, 1, 2) if self.nchw else xt.reshape(len(xb), -1)  # NCHW (C = 1: free)
            yt = torch.from_numpy(yb)
            xt, yt = xt.to(dev), yt.to(dev)
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.net(xt), yt)
            loss.backward()
            self.opt.step()
        if self.gpu:
            torch.cuda.synchronize()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.breakdown", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODEL_NAMES, default="convnet",
                        help="convnet: the course lab's ConvNet; lab: its dense stand-in")
    parser.add_argument("--device", choices=("cpu", "gpu"), default=None,
                        help="cpu (default): MirroredStrategy(['CPU:0']), host clock; gpu: "
                             "['GPU:0'], each part also timed with CUDA events on its stream")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"examples per step (default {BATCH}; --smoke: {SMOKE_BATCH})")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per round (default {STEPS}; --smoke: {SMOKE_STEPS})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"timed rounds after one warm-up (default {ROUNDS}; --smoke: {SMOKE_ROUNDS})")
    parser.add_argument("--no-peers", action="store_true", help="do not time PyTorch")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: perf_counter; cpu: process_time (robust to other jobs with 1 "
                             "thread; CPU only)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads (default: PyTorch's own choice)")
    parser.add_argument("--smoke", action="store_true",
                        help="--device gpu in the CUDA simulator with a tiny ConvNet and batch "
                             "(checks the program runs; times mean nothing)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = SMOKE_STEPS if args.smoke else STEPS
    if args.rounds is None:
        args.rounds = SMOKE_ROUNDS if args.smoke else ROUNDS
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    if args.smoke and args.device == "cpu":
        parser.error("--smoke runs the GPU path in the CUDA simulator; drop --device cpu")
    gpu = args.smoke or args.device == "gpu"
    if gpu and args.clock == "cpu":
        parser.error("--clock cpu counts this process's CPU seconds, not the GPU's work: "
                     "with --device gpu use the default wall clock")
    batch = args.batch if args.batch is not None else (SMOKE_BATCH if args.smoke else BATCH)
    if batch < 1:
        parser.error(f"--batch must be at least 1, got {batch}")

    global clock
    clock = CLOCKS[args.clock]
    common.choose_cuda(smoke=args.smoke)
    if gpu and not args.smoke:
        if common.no_gpu("benchmarks.breakdown --device gpu",
                         "Without a GPU, `python -m benchmarks.breakdown` breaks a CPU step down; "
                         "`python -m benchmarks.breakdown --smoke` checks the GPU path in the simulator."):
            return 0
    os.environ.setdefault("MIRRORED_OFFLINE", "1")
    import mirrored as tf
    from mirrored import backends
    from mirrored.lab.timing import PhaseTimer

    spec = (SMOKE_MODELS if args.smoke else training.MODELS)[args.model]
    x, y, source = training.load_mnist(args.steps * batch)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x) - batch + 1, batch)]
    steps = len(batches)
    tf.random.set_seed(SEED)
    model = build_ours(tf, spec, "GPU:0" if gpu else "CPU:0")
    weights = model.get_weights()
    ds = tf.data.Dataset.from_tensor_slices((x[:steps * batch], y[:steps * batch])).batch(batch)
    model.fit(ds, epochs=1, verbose=0)                     # warm-up (buffers made, kernels compiled)
    model.set_weights(weights)
    parts = instrument(model, timer=PhaseTimer() if gpu else None)

    torch_step, skipped = None, []
    if args.no_peers:
        skipped.append({"name": "PyTorch", "reason": "--no-peers"})
    else:
        try:
            import torch
            if gpu and not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
            if args.torch_threads:
                torch.set_num_threads(args.torch_threads)
            torch_step = TorchStep(torch, spec, weights, gpu=gpu)
            torch_step.run(batches[:10])                   # warm-up
        except Exception as exc:                           # noqa: BLE001 (reported)
            skipped.append({"name": "PyTorch", "reason": f"{type(exc).__name__}: {exc}"[:200]})
            torch_step = None

    where = (f"device: {common.device_info()['device']} (GPU:0), CUDA events per part" if gpu
             else f"BLAS: {backends.blas_info()}")
    print(f"{args.model}: {steps} steps of batch {batch} per round, {args.rounds} rounds "
          f"(data: {source}); clock: {args.clock}; {where}"
          + (f"; torch threads: {torch.get_num_threads()}" if torch_step is not None else ""))
    per_round = {}           # part -> [host ms per step, per round]
    gpu_round = {}           # part -> [GPU ms per step, per round] (--device gpu)
    torch_ms = []
    for r in range(args.rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]           # interleaved, alternating who goes first
        for who in order:
            if who == 0:
                parts.reset()
                t0 = clock()
                model.fit(ds, epochs=1, verbose=0)
                epoch = clock() - t0
                s = dict(parts.seconds)
                inner = sum(v for k, v in s.items() if k != "step")
                ms = {k: v / steps * 1e3 for k, v in s.items() if k != "step"}
                ms["step, other"] = (s["step"] - inner) / steps * 1e3
                ms["fit loop"] = (epoch - s["step"]) / steps * 1e3
                ms["total (fit)"] = epoch / steps * 1e3
                for k, v in ms.items():
                    per_round.setdefault(k, []).append(v)
                if gpu:
                    g = parts.gpu_seconds()
                    g_inner = sum(v for k, v in g.items() if k != "step")
                    g_ms = {k: v / steps * 1e3 for k, v in g.items() if k != "step"}
                    g_ms["step, other"] = (g["step"] - g_inner) / steps * 1e3
                    g_ms["step"] = g["step"] / steps * 1e3
                    for k, v in g_ms.items():
                        gpu_round.setdefault(k, []).append(v)
            elif torch_step is not None:
                t0 = clock()
                torch_step.run(batches)
                torch_ms.append((clock() - t0) / steps * 1e3)

    total = statistics.median(per_round["total (fit)"])
    gpu_step = statistics.median(gpu_round["step"]) if gpu else None
    rows = []
    for k, v in per_round.items():
        med = statistics.median(v)
        row = {"part": k, "ms_per_step": med, "min_ms": min(v), "max_ms": max(v), "share": med / total}
        if k in gpu_round:
            g = gpu_round[k]
            row.update(gpu_ms_per_step=statistics.median(g), gpu_min_ms=min(g), gpu_max_ms=max(g),
                       gpu_share=statistics.median(g) / gpu_step if gpu_step else None)
        rows.append(row)
    if gpu:
        g = gpu_round["step"]
        rows.append({"part": "step (GPU, synchronised)", "ms_per_step": None, "min_ms": None,
                     "max_ms": None, "share": None, "gpu_ms_per_step": gpu_step, "gpu_min_ms": min(g),
                     "gpu_max_ms": max(g), "gpu_share": 1.0 if gpu_step else None})
    if torch_ms:
        rows.append({"part": f"PyTorch {torch.__version__} eager (whole step)",
                     "ms_per_step": statistics.median(torch_ms), "min_ms": min(torch_ms),
                     "max_ms": max(torch_ms), "share": None})
    columns = [("part", "part", ""), ("ms_per_step", "host ms/step" if gpu else "median ms/step", ".3f"),
               ("min_ms", "min", ".3f"), ("max_ms", "max", ".3f"), ("share", "share of step", ".1%")]
    if gpu:
        columns += [("gpu_ms_per_step", "GPU ms/step", ".3f"), ("gpu_min_ms", "min", ".3f"),
                    ("gpu_share", "share of GPU step", ".1%")]
    common.print_table(rows, columns)
    if gpu:
        print("host: time in the call (on a GPU, launching); GPU: CUDA events on the replica's stream "
              "(kernels, and idle gaps waiting for launches)"
              + ("; simulator: host clock, means nothing" if args.smoke else ""))
    if torch_ms:
        print(f"ours / PyTorch (median ms/step): {total / statistics.median(torch_ms):.2f}; "
              f"min/min {min(per_round['total (fit)']) / min(torch_ms):.2f}")
    for s in skipped:
        print(f"skipped: {s['name']}: {s['reason']}")
    if args.out:
        info = common.device_info()
        if not gpu:
            info["device"] = "CPU"
        info["cpu_model"] = training.cpu_model()
        info["threads"] = training.thread_settings(torch if torch_step is not None else None)
        payload = {"model": args.model, "spec": spec, "device_mode": "gpu" if gpu else "cpu",
                   "smoke": args.smoke, "clock": args.clock, "batch": batch,
                   "steps_per_round": steps, "rounds": args.rounds,
                   "gpu_timer": ("CUDA events on the replica's stream, one pair per part call, "
                                 "device synchronised at the end of each step" if gpu and not args.smoke
                                 else "host clock (simulator)" if gpu else None),
                   "data": source, "rows": rows, "rounds_ms": per_round, "gpu_rounds_ms": gpu_round,
                   "torch_rounds_ms": torch_ms, "skipped": skipped}
        common.write_json("breakdown", payload, info, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
