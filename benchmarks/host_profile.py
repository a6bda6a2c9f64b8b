"""Where the host's time goes in ``fit``: cProfile of whole epochs, on a GPU or the CPU.

On a GPU a step's kernels take tens of microseconds; what a student's clock measures is
the Python that prepares and launches them. ``benchmarks/breakdown.py`` times the step's
parts; this program asks the profiler which *functions* hold the time, ours and numba-
cuda's, so the next fix is aimed at what costs most. It trains the lab's model on the
bundled subset as the lab does (``map(scale).cache().shuffle(10000).batch(64)``,
``MirroredStrategy()``, Adam, ``fit``), two warm-up epochs, then per mode:

    verbose=0 and verbose=1     ms/step of ``--epochs`` epochs, unprofiled: each measured
                                twice, in the order 0, 1, 1, 0, the better of the two kept
    the profile                 the same epochs under cProfile (slower: it adds ~1 µs per
                                Python call), sorted by own time and by cumulative time

    python -m benchmarks.host_profile --model conv --modes graph,eager --out /tmp/prof

Writes ``prof-<model>-<mode>.txt`` per mode into ``--out`` (default: print only); ``--json
FILE``: one file instead, each mode's two ms/step, their ratio (issue 40's target: verbose=0
no slower than verbose=1) and its profile's text (``benchmarks/gpu_session.sh``'s plan 40).
Session 7 (H100) found with it that three host-to-device uploads per step held most of a
captured step's 0.6 ms (numba's ``copy_to_device`` slices both arrays to check them):
``benchmarks/results/host-profile-*-before.txt`` and ``-after.txt``.

Why two warm-up epochs and both orders: whatever happens once in the first epochs lands in
whichever mode is measured first. With one warm-up epoch, verbose=0 (measured first) also
paid the first row-number shuffle of the ``.cache()``d data set, which set up numba's CPU
compiler (0.2 s on the H200's host): "verbose=0 at 0.567 ms/step, twice verbose=1" (issue
40) was that, not the quiet loop, which does the same work as the loud one minus the bar.

Neighbours: benchmarks/breakdown.py (ms per step part), benchmarks/training.py (ms/step
beside PyTorch), mirrored/devices.py (``CudaDevice.upload_into``).
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

BATCH = 64
STEPS_PER_EPOCH = 125          # the bundled subset's 8,000 images in batches of 64
QUIET_OVER_LOUD = 1.0          # issue 40's target: verbose=0 ms/step / verbose=1 ms/step <= 1


def lab_dataset(tf, tfds, batch=BATCH):
    """The lab's training pipeline over the bundled subset."""
    train = tfds.load("mnist", split="train", as_supervised=True)

    def scale(image, label):
        image = tf.cast(image, tf.float32)
        image /= 255
        return image, label
    return train.map(scale).cache().shuffle(10000).batch(batch)


def profile_fit(model_kind, mode, epochs, rows=45):
    """(summary line, profile text, {verbose: ms/step}) of ``epochs`` epochs of fit in
    ``mode`` ("graph"/"eager")."""
    import mirrored as tf
    import mirrored.datasets as tfds
    from mirrored.lab.workflow import make_model
    strategy = tf.distribute.MirroredStrategy()
    data = lab_dataset(tf, tfds)
    with strategy.scope():
        model = make_model(model_kind)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(), metrics=["accuracy"],
                  run_eagerly=(mode == "eager"))
    model.fit(data, epochs=2, verbose=0)          # compiles, captures, fills the cache, warms up
    times = {0: float("inf"), 1: float("inf")}
    for verbose in (0, 1, 1, 0):                 # both orders: see the module docstring
        start = time.perf_counter()
        model.fit(data, epochs=epochs, verbose=verbose)
        ms = (time.perf_counter() - start) / (epochs * STEPS_PER_EPOCH) * 1e3
        times[verbose] = min(times[verbose], ms)
    profiler = cProfile.Profile()
    profiler.enable()
    model.fit(data, epochs=epochs, verbose=0)
    profiler.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        text.write(f"\n=== sorted by {order}\n")
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(rows)
    line = (f"{model_kind} {mode}: verbose=0 {times[0]:.3f} ms/step, "
            f"verbose=1 {times[1]:.3f} ms/step")
    return line, text.getvalue(), times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="conv", help="conv (the lab's ConvNet) or dense")
    parser.add_argument("--modes", default="graph,eager",
                        help="comma-separated: graph (run_eagerly=False), eager")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", help="folder for prof-<model>-<mode>.txt")
    parser.add_argument("--json", help="one JSON file instead: per mode, both ms/step, their "
                                       "ratio and the profile's text (benchmarks/gpu_session.sh)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MIRRORED_OFFLINE", "1")
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in ("graph", "eager"):
            parser.error(f"unknown mode {mode!r}: expected graph or eager")
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    results = {}
    for mode in modes:
        line, text, times = profile_fit(args.model, mode, args.epochs)
        print(line, flush=True)
        results[mode] = {"verbose0_ms_per_step": times[0], "verbose1_ms_per_step": times[1],
                         "quiet_over_loud": times[0] / times[1], "summary": line, "profile": text}
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"prof-{args.model}-{mode}.txt"), "w") as f:
                f.write(line + "\n" + text)
    if args.json:
        from benchmarks import common
        payload = {"model": args.model, "epochs": args.epochs, "steps_per_epoch": STEPS_PER_EPOCH,
                   "batch": BATCH, "modes": results, "target": {"quiet_over_loud": QUIET_OVER_LOUD}}
        print(f"wrote {common.write_json('host_profile', payload, common.device_info(), out=args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
