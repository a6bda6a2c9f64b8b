"""The course lab's first epoch on the host: µs per element at each stage of its input pipeline.

The lab's pipeline is ``train.map(scale).cache().shuffle(10000).batch(64)``, with ``scale``
casting each image to float32 and dividing it by 255. From epoch 2 the filled cache is played
by row numbers (mirrored/data.py's index plans: one NumPy gather per batch). Epoch 1 cannot
be: the map runs once per element, in order (TensorFlow's semantics), and what it returns is
what the cache keeps. So epoch 1 runs element by element in Python, and each microsecond per
element is 60 ms of the lab's first epoch over the full MNIST (issue 40: "epoch 1 is 0.8 s
longer than the others"). This program times that path stage by stage; each stage is the
pipeline before it plus one transformation, iterated once through ``as_numpy_iterator()``:

    source      train                        the loaded rows, one (image, label) at a time
    map         + .map(scale)                the lab's scale() on every element
    cache       + .cache()                   keep every element; stack them all at the end
    shuffle     + .shuffle(10000)            tf.data's buffer shuffle, element by element
    batch       + .batch(64)                 the lab's epoch 1
    epoch 2     the batch pipeline again     its filled cache, by row numbers (for contrast)

What a stage costs is its time minus the time of the stage before (``stage_cost_us``).

Clocks: wall (``time.perf_counter``) and this thread's CPU time (``time.thread_time``); all of
it is one thread's work, so on a shared machine the CPU time is the steadier of the two.
Each number is the median over ``--repeat`` passes (stages interleaved within a pass).

Before and after: ``--baseline DIR`` (another checkout of the library, e.g.
``git archive main | tar -x -C DIR``) times that code and this checkout's in alternating
fresh processes, ``--rounds`` of each, in a fresh order every round (a busy spell of a shared
machine lands on both), and reports medians over all rounds. Each process also hashes the
lab's epoch-1 batches (shuffle seeded, untimed): both sides must yield the same bits
(``same_output``), or the comparison is not of the same pipeline.

    python -m benchmarks.pipeline --data-dir /work/shared/data/mnist-full --out pipe.json
    python -m benchmarks.pipeline --data-dir ... --baseline /tmp/main --rounds 5 --out cmp.json
    python -m benchmarks.pipeline --smoke             # 512 elements of the bundled subset

``--data-dir`` is a folder holding the four MNIST ``.gz`` files (as ``benchmarks.course_lab``);
without it the bundled 8,000-image subset is used, and the JSON says which (``elements``).
A smoke run writes only where ``--out`` points.

Neighbours: mirrored/data.py (the pipeline timed here), benchmarks/course_lab.py (the whole
lab, of which this is part of epoch 1), benchmarks/host_profile.py (where ``fit``'s time goes).
"""
import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("source", "map", "cache", "shuffle", "batch", "epoch 2")
SHUFFLE_BUFFER, BATCH = 10000, 64      # the lab's
SEED = 40                              # the shuffle's seed: both sides of a comparison alike
SMOKE_ELEMENTS = 512


def lab_source(data_dir=None, limit=None):
    """The lab's training set as a ``mirrored.data.Dataset`` of (image, label) elements:
    the full MNIST from ``data_dir`` (a folder of the four .gz files), else the bundled
    subset; the first ``limit`` elements if given."""
    from mirrored import datasets
    datasets.disable_progress_bar()
    with tempfile.TemporaryDirectory() as scratch:              # <scratch>/mnist -> data_dir
        kwargs = {}
        if data_dir:
            os.symlink(Path(data_dir).expanduser().resolve(), Path(scratch) / "mnist")
            kwargs = {"data_dir": scratch}
        train = datasets.load("mnist", split="train", as_supervised=True, **kwargs)
    return train.take(limit) if limit else train


def lab_pipelines(tf, train):
    """{stage: a function that builds that stage's pipeline afresh} (see the docstring)."""
    def scale(image, label):                                    # the lab's, verbatim
        image = tf.cast(image, tf.float32)
        image /= 255
        return image, label
    return {
        "source": lambda: train,
        "map": lambda: train.map(scale),
        "cache": lambda: train.map(scale).cache(),
        "shuffle": lambda: train.map(scale).cache().shuffle(SHUFFLE_BUFFER, seed=SEED),
        "batch": lambda: train.map(scale).cache().shuffle(SHUFFLE_BUFFER, seed=SEED).batch(BATCH),
    }


def _timed_pass(dataset):
    """(wall s, CPU s) of one epoch of ``dataset``, after a full garbage collection: Python's
    first full collection after ``import mirrored`` (~80 ms here: 100k objects) would land
    in whichever pass happened to be running, and make it look ~1.3 µs an element slower."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in dataset.as_numpy_iterator():
        pass
    return time.perf_counter() - wall, time.thread_time() - cpu


def digest(dataset):
    """sha256 of one epoch's batches: every array's dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for batch in dataset.as_numpy_iterator():
        for array in batch:
            array = np.ascontiguousarray(array)
            h.update(f"{array.dtype}{array.shape}".encode())
            h.update(array.tobytes())
    return h.hexdigest()


def measure(data_dir=None, limit=None, repeat=3):
    """Time every stage ``repeat`` times in this process: {"elements", "code", "samples":
    {stage: {"wall_us": [...], "cpu_us": [...]}} (µs per element), "digest"}."""
    import mirrored as tf
    train = lab_source(data_dir, limit)
    n = len(train)
    makers = lab_pipelines(tf, train)
    samples = {stage: {"wall_us": [], "cpu_us": []} for stage in STAGES}

    def record(stage, times):
        for key, seconds in zip(("wall_us", "cpu_us"), times):
            samples[stage][key].append(seconds / n * 1e6)
    for _ in range(repeat):
        for stage, make in makers.items():
            dataset = make()                  # fresh: its cache (if any) fills in this pass
            record(stage, _timed_pass(dataset))
            if stage == "batch":              # the same pipeline's second epoch
                record("epoch 2", _timed_pass(dataset))
    return {"elements": n, "code": str(Path(tf.__file__).resolve().parent.parent),
            "samples": samples, "digest": digest(makers["batch"]())}


def summarise(samples):
    """Medians per stage, and each stage's cost (its median minus the stage before's)."""
    median = {stage: {clock: statistics.median(values) for clock, values in s.items()}
              for stage, s in samples.items()}
    cost = {}
    chain = STAGES[:STAGES.index("batch") + 1]                # source .. batch, each one more
    for before, stage in zip(chain, chain[1:]):
        cost[stage] = {clock: median[stage][clock] - median[before][clock]
                       for clock in ("wall_us", "cpu_us")}
    return {"median_us": median, "stage_cost_us": cost}


def _child(tree, data_dir, limit, repeat):
    """``measure`` in a fresh Python process whose ``mirrored`` is ``tree``'s."""
    env = dict(os.environ, PYTHONPATH=str(tree), MIRRORED_OFFLINE="1")
    # This file run as a program, but not as `python benchmarks/pipeline.py`: that would put
    # benchmarks/ first on sys.path, where kernels.py would hide the kernels package.
    run_this = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    args = [sys.executable, "-c", run_this, "--child", "--repeat", str(repeat)]
    args += ["--data-dir", data_dir] if data_dir else []
    args += ["--limit", str(limit)] if limit else []
    proc = subprocess.run(args, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"the timing process for {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def compare(baseline, data_dir, limit, repeat, rounds):
    """Baseline and this checkout, ``rounds`` fresh processes each, alternating in a fresh
    order every round; medians over every sample of every round."""
    trees = {"before": Path(baseline).resolve(), "after": ROOT}
    merged = {side: {s: {"wall_us": [], "cpu_us": []} for s in STAGES} for side in trees}
    digests, codes, log = {side: set() for side in trees}, {}, []
    order = np.random.default_rng(SEED)
    for r in range(rounds):
        for side in np.array(list(trees))[order.permutation(len(trees))]:
            result = _child(trees[side], data_dir, limit, repeat)
            log.append({"round": r + 1, "side": str(side), "load_1min": os.getloadavg()[0],
                        "batch_cpu_us": statistics.median(result["samples"]["batch"]["cpu_us"])})
            print(f"round {r + 1}/{rounds} {side}: batch {log[-1]['batch_cpu_us']:.2f} µs/element "
                  f"(CPU), load {log[-1]['load_1min']:.1f}", flush=True)
            for stage, s in result["samples"].items():
                for clock, values in s.items():
                    merged[side][stage][clock] += values
            digests[side].add(result["digest"])
            codes[side], elements = result["code"], result["elements"]
    out = {side: {"code": codes[side], **summarise(merged[side]), "samples": merged[side]}
           for side in trees}
    out["elements"], out["rounds_log"] = elements, log
    out["same_output"] = len(digests["before"] | digests["after"]) == 1
    out["speedup"] = {stage: {clock: out["before"]["median_us"][stage][clock] /
                              out["after"]["median_us"][stage][clock]
                              for clock in ("wall_us", "cpu_us")} for stage in STAGES}
    return out


def _table(summary, label=""):
    lines = [f"{label}{'stage':10s} {'wall µs/el':>10s} {'CPU µs/el':>10s} {'stage cost (CPU)':>17s}"]
    for stage in STAGES:
        m, c = summary["median_us"][stage], summary["stage_cost_us"].get(stage)
        cost = f"{c['cpu_us']:+17.2f}" if c else ""
        lines.append(f"{label}{stage:10s} {m['wall_us']:10.2f} {m['cpu_us']:10.2f} {cost}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="folder with the four MNIST .gz files")
    parser.add_argument("--limit", type=int, help="time the first LIMIT elements only")
    parser.add_argument("--repeat", type=int, default=None, help="passes per process (default 3)")
    parser.add_argument("--baseline", help="another checkout to compare with (see the docstring)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per side with --baseline")
    parser.add_argument("--smoke", action="store_true", help="512 elements, one pass")
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    limit = SMOKE_ELEMENTS if args.smoke else args.limit
    repeat = args.repeat or (1 if args.smoke else 3)
    if args.child:                       # one side of a comparison: print its result as JSON
        print(json.dumps(measure(args.data_dir, limit, repeat)))
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks import common
    load = [os.getloadavg()[0]]
    payload = {"command": " ".join(["python -m benchmarks.pipeline", *(argv or sys.argv[1:])]),
               "pipeline": "train.map(scale).cache().shuffle(10000).batch(64), epoch 1",
               "source": "full MNIST" if args.data_dir else "bundled subset",
               "repeat": repeat, "mode": "smoke" if args.smoke else "full"}
    if args.baseline:
        payload.update(compare(args.baseline, args.data_dir, limit, repeat, args.rounds),
                       rounds=args.rounds)
        for side in ("before", "after"):
            print(_table(payload[side], f"{side:6s} "))
        print("same output:", payload["same_output"])
        if not payload["same_output"]:
            print("the two checkouts yield different batches: not the same pipeline")
    else:
        result = measure(args.data_dir, limit, repeat)
        payload.update(result, **summarise(result["samples"]))
        print(_table(payload))
    load.append(os.getloadavg()[0])
    payload["machine"] = {"cpu_count": os.cpu_count(), "load_average_1min_start_end": load}
    status = common.save_results("pipeline", payload, common.device_info(), args.smoke, args.out)
    return status if payload.get("same_output", True) else 1


if __name__ == "__main__":
    sys.exit(main())
