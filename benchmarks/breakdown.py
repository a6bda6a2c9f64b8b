"""Where one CPU training step's time goes, layer by layer: the course lab's ConvNet.

    python -m benchmarks.breakdown                      # lab ConvNet, batch 64, 200 steps x 5 rounds
    python -m benchmarks.breakdown --model lab          # the dense lab model instead
    python -m benchmarks.breakdown --steps 50 --rounds 3 --out /tmp/breakdown.json

What runs: ``model.fit`` of the lab's ConvNet (Conv2D(32, 3, relu) -> MaxPooling2D ->
Flatten -> Dense(64, relu) -> Dense(10)) under ``MirroredStrategy(["CPU:0"])`` with Adam
and sparse cross-entropy from logits, on MNIST batches of 64 (the bundled subset when
the full set is not at hand). Every part of the step is wrapped with a
``time.perf_counter`` pair, on the instances of this one model (the library is not
changed):

    <layer> fwd / bwd    each layer's ``forward`` / ``backward`` (Conv2D's backward
                         includes its fused ReLU's backward; Dense's likewise)
    loss                 the fused softmax cross-entropy and its metric sums
    all-reduce           the SUM of the replicas' packed gradients
    optimizer            Adam's update of the packed weights
    input copy           the host part of the step: split, copy in, Adam's scalars
    step, other          what ``Step.train`` spends outside the parts above
    fit loop             what ``fit`` spends per step outside ``Step.train`` (the data
                         pipeline, callbacks, the progress bookkeeping)

The CPU backend computes synchronously, so a wrapped call's time is its work. (On a
GPU the same wrappers would time only the launches: this program runs on the CPU.)
Rounds of ``--steps`` steps are repeated (``--rounds``); each part reports its median
and minimum over the rounds, in ms per step, and its share of the median step. With
PyTorch importable, a PyTorch eager step of the same model (same weights, batches, Adam)
is timed in the same rounds, interleaved, as the reference the issue's target is
measured against (``benchmarks/training.py`` is the full comparison).

On a shared machine (other jobs on the cores), ``--clock cpu`` times with
``time.process_time`` (CPU seconds of this process) instead of ``perf_counter``: with
one BLAS thread (``OPENBLAS_NUM_THREADS=1``, and ``--torch-threads 1``) that is the
work done, whatever the load; with several threads it also counts their spinning.

The numbers of the wrapped run include the wrappers (~0.2 µs per call, ~20 calls per
step): negligible against a step of milliseconds. Writes JSON with ``--out`` only.

Neighbours: benchmarks/training.py (ms/step of whole epochs beside PyTorch and
TensorFlow), mirrored/keras/step.py (the step's parts), mirrored/backends.py (CpuOps).
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

from benchmarks import common, training

#: Steps per round and rounds: 200 steps of ~5-30 ms is 1-6 s per round.
STEPS = 200
ROUNDS = 5
BATCH = 64
LEARNING_RATE = 1e-3
ADAM_EPSILON = 1e-7
SEED = 0


#: The models of benchmarks/training.py this program can break down.
MODEL_NAMES = ("convnet", "lab")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


class Parts:
    """Seconds per named part, accumulated by wrappers around the model's methods."""

    def __init__(self):
        self.seconds = {}
        self.order = []

    def wrap(self, obj, attr, name):
        original = getattr(obj, attr)
        seconds = self.seconds
        if name not in seconds:
            seconds[name] = 0.0
            self.order.append(name)

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] += clock() - t0
        setattr(obj, attr, timed)              # an instance attribute: this model only

    def reset(self):
        for k in self.seconds:
            self.seconds[k] = 0.0


def build_ours(tf, model_name, weights=None):
    with contextlib.redirect_stdout(None):                 # "Using MirroredStrategy with ..."
        strategy = tf.distribute.MirroredStrategy(["CPU:0"])
    with strategy.scope():
        model = tf.keras.Sequential(training.keras_layers(tf, training.MODELS[model_name]))
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=tf.keras.optimizers.Adam(LEARNING_RATE, epsilon=ADAM_EPSILON),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def instrument(model):
    """Wrap every part of ``model``'s training step; returns the Parts and the step."""
    parts = Parts()
    step = model.step
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
    weights, batches and Adam; one ``run(batches)`` call per round."""

    def __init__(self, torch, model_name, weights):
        self.torch = torch
        spec = training.MODELS[model_name]
        self.net = training.torch_net(torch, spec, weights)
        self.nchw = training.conv_geometry(spec) is not None
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def run(self, batches):
        torch = self.torch
        for xb, yb in batches:
            xt = torch.from_numpy(xb)                              # (B, 28, 28, 1)
            xt = xt.permute(0, 3, 1, 2) if self.nchw else xt.reshape(len(xb), -1)  # NCHW (C = 1: free)
            yt = torch.from_numpy(yb)
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.net(xt), yt)
            loss.backward()
            self.opt.step()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.breakdown", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODEL_NAMES, default="convnet",
                        help="convnet: the course lab's ConvNet; lab: its dense stand-in")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per round")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed rounds (after one warm-up)")
    parser.add_argument("--no-peers", action="store_true", help="do not time PyTorch")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: perf_counter; cpu: process_time (robust to other jobs with 1 thread)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads (default: PyTorch's own choice)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")

    global clock
    clock = CLOCKS[args.clock]
    common.choose_cuda(smoke=False)
    os.environ.setdefault("MIRRORED_OFFLINE", "1")
    import mirrored as tf
    from mirrored import backends

    x, y, source = training.load_mnist(args.steps * BATCH)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x) - BATCH + 1, BATCH)]
    steps = len(batches)
    tf.random.set_seed(SEED)
    model = build_ours(tf, args.model)
    weights = model.get_weights()
    ds = tf.data.Dataset.from_tensor_slices((x[:steps * BATCH], y[:steps * BATCH])).batch(BATCH)
    model.fit(ds, epochs=1, verbose=0)                     # warm-up (buffers made here)
    model.set_weights(weights)
    parts = instrument(model)

    torch_step, skipped = None, []
    if args.no_peers:
        skipped.append({"name": "PyTorch", "reason": "--no-peers"})
    else:
        try:
            import torch
            if args.torch_threads:
                torch.set_num_threads(args.torch_threads)
            torch_step = TorchStep(torch, args.model, weights)
            torch_step.run(batches[:10])                   # warm-up
        except Exception as exc:                           # noqa: BLE001 (reported)
            skipped.append({"name": "PyTorch", "reason": f"{type(exc).__name__}: {exc}"[:200]})
            torch_step = None

    print(f"{args.model}: {steps} steps of batch {BATCH} per round, {args.rounds} rounds "
          f"(data: {source}); clock: {args.clock}; BLAS: {backends.blas_info()}"
          + (f"; torch threads: {torch.get_num_threads()}" if torch_step is not None else ""))
    per_round = {}           # part -> [ms per step, per round]
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
            elif torch_step is not None:
                t0 = clock()
                torch_step.run(batches)
                torch_ms.append((clock() - t0) / steps * 1e3)

    total = statistics.median(per_round["total (fit)"])
    rows = []
    for k, v in per_round.items():
        med = statistics.median(v)
        rows.append({"part": k, "ms_per_step": med, "min_ms": min(v), "max_ms": max(v),
                     "share": med / total})
    if torch_ms:
        rows.append({"part": f"PyTorch {torch.__version__} eager (whole step)",
                     "ms_per_step": statistics.median(torch_ms), "min_ms": min(torch_ms),
                     "max_ms": max(torch_ms), "share": None})
    common.print_table(rows, [("part", "part", ""), ("ms_per_step", "median ms/step", ".3f"),
                              ("min_ms", "min", ".3f"), ("max_ms", "max", ".3f"),
                              ("share", "share of step", ".1%")])
    if torch_ms:
        print(f"ours / PyTorch (median ms/step): {total / statistics.median(torch_ms):.2f}; "
              f"min/min {min(per_round['total (fit)']) / min(torch_ms):.2f}")
    for s in skipped:
        print(f"skipped: {s['name']}: {s['reason']}")
    if args.out:
        info = common.device_info()
        info["device"] = "CPU"
        info["cpu_model"] = training.cpu_model()
        info["threads"] = training.thread_settings(torch if torch_step is not None else None)
        payload = {"model": args.model, "clock": args.clock, "batch": BATCH, "steps_per_round": steps, "rounds": args.rounds,
                   "data": source, "rows": rows, "rounds_ms": per_round, "torch_rounds_ms": torch_ms,
                   "skipped": skipped}
        common.write_json("breakdown", payload, info, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
