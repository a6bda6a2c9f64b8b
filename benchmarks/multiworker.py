"""The ring across processes (``CollectiveAllReduce``) vs MPI's own ``MPI_Allreduce``.

    python -m benchmarks.multiworker                         # 2 and 4 processes, 1 KB .. 64 MB
    python -m benchmarks.multiworker --ns 2 --max-bytes 1M --repeat 5
    python -m benchmarks.multiworker --smoke --out /tmp/multiworker.json   # seconds: checks it runs
    python -m benchmarks.multiworker --mpi-algorithm ring --training-steps 0   # vs MPICH's own ring

This program launches ``mpiexec -n N`` itself (the mpiexec beside this Python, which
the mpich wheel of requirements.txt installs, else one on PATH), once per N; each
launch runs this file with ``--worker`` in every process. One worker per process,
one CPU replica per worker: what is timed is the hop *between* processes, the part of
``MultiWorkerMirroredStrategy``'s all-reduce that MPI carries (on CPU devices the
ring sends straight from the buffers; on GPUs each hop would add a device-host copy
on each side, not measured here).

What is timed, per buffer size S (bytes, float32, in place as nccl-tests'
all_reduce_perf): ``CollectiveAllReduce.all_reduce_flat("SUM", [buf], [cpu])`` and
``MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=SUM)``. Each is first checked
(worker r holds r+1 everywhere, so the sum N(N+1)/2 is exact), then timed on zeros:
a barrier, ``number`` calls, and the time of the SLOWEST worker (a collective is done
when its last worker is); medians over ``--repeat`` samples (perf_counter; CPU code),
the ring's and MPI's samples taken in turn.

What is reported:
    latency   the median time of one all-reduce of the smallest size (1 KB)
    algbw     S / time
    busbw     algbw * 2(N-1)/N (nccl-tests' bus bandwidth: what each process's link
              carries in a ring, per second; comparable across N)
    ratio     our busbw / MPI_Allreduce's busbw (the issue's target: >= 0.8 from 1 MB up)

Then the lab's ConvNet (Conv2D 32 → MaxPooling → Dense 64 → Dense 10, Adam, 64 examples
per replica, the bundled MNIST subset) trained by ``fit`` under
``MultiWorkerMirroredStrategy`` with 1, 2 and 4 workers of one CPU replica each:
samples/s over ``--training-steps`` steps after a warm-up, timed between two
barriers, and the scaling efficiency samples/s(W) / (W x samples/s(1)).

This machine's processes share its cores (and 4 processes on 2 cores take turns),
so the numbers are this machine's, not a network's; the JSON records the core count
and the load average before and after (other jobs on the machine skew both columns).
A smoke run (tiny sizes, 2 processes) writes only to ``--out``.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common

#: 1 KB .. 64 MB, x4 apart: the latency-bound end to the bandwidth-bound end.
SIZES = [1 << k for k in range(10, 27, 2)]
SMOKE_SIZES = [1 << 10, 1 << 14]
NS = (2, 4)
ITEMSIZE = 4                                      # float32, as gradients are
#: Calls per timed sample: enough that a sample lasts ~20 ms. A sample also times how the
#: workers leave the barrier before it: with ~2 ms samples (2 calls), the 1 MB row of 4
#: workers on 2 cores read 1,000-1,500 µs per call; with ~20 ms samples, ~650 µs.
TARGET_SAMPLE_S = 20e-3
MAX_NUMBER = 200
LAUNCH_TIMEOUT_S = 550
TRAIN_WORKERS = (1, 2, 4)
TRAIN_STEPS = 30
WARMUP_STEPS = 5
BATCH_PER_REPLICA = 64


# --- one worker (under mpiexec) ----------------------------------------------------------

def _slowest(comm, seconds):
    from mpi4py import MPI
    return comm.allreduce(seconds, op=MPI.MAX)


def _time(comm, fns, repeat, warmup=2):
    """Median over ``repeat`` samples of the slowest worker's time per call, for each of
    ``fns`` (a dict name -> callable). Their samples alternate (ring, MPI, ring, MPI, ...),
    so that both see the machine in the same state (other jobs, the cores' clocks): timed
    one block after the other, a change of load between the blocks lands in the ratio."""
    numbers = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        once = _slowest(comm, time.perf_counter() - t0)
        numbers[name] = int(min(MAX_NUMBER, max(1, TARGET_SAMPLE_S / max(once, 1e-9))))
    samples = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(numbers[name]):
                fn()
            samples[name].append(_slowest(comm, (time.perf_counter() - t0) / numbers[name]))
    return {name: {"median_s": float(np.median(got)), "min_s": float(min(got)),
                   "samples": repeat, "number": numbers[name]} for name, got in samples.items()}


def worker(sizes, repeat, out):
    from mpi4py import MPI
    from mirrored import devices as registry
    from mirrored.collective_all_reduce import CollectiveAllReduce
    from mirrored.workers import install_abort_hook, world
    comm, workers = MPI.COMM_WORLD, world()
    install_abort_hook(workers)
    rank, n = comm.Get_rank(), comm.Get_size()
    cpu = [d for d in registry.logical_devices() if d.device_type == "CPU"][0]
    ring = CollectiveAllReduce(workers)
    rows = []
    for nbytes in sizes:
        elems = nbytes // ITEMSIZE
        buf = cpu.from_numpy(np.full(elems, rank + 1, np.float32))     # (elems,) float32, host
        want = n * (n + 1) / 2
        ring.all_reduce_flat("SUM", [buf], [cpu])
        if not (buf == want).all():
            raise AssertionError(f"ring: wrong sum at {nbytes} bytes on worker {rank}")
        check = np.full(elems, rank + 1, np.float32)
        comm.Allreduce(MPI.IN_PLACE, check, op=MPI.SUM)
        if not (check == want).all():
            raise AssertionError(f"MPI_Allreduce: wrong sum at {nbytes} bytes on worker {rank}")
        buf[...] = 0
        check[...] = 0
        timed = _time(comm, {"ring": lambda: ring.all_reduce_flat("SUM", [buf], [cpu]),
                             "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, check, op=MPI.SUM)}, repeat)
        ours, theirs = timed["ring"], timed["mpi"]
        row = {"n": n, "bytes": nbytes, "ring": ours, "mpi": theirs}
        for name, t in (("ring", ours), ("mpi", theirs)):
            row[f"{name}_us"] = t["median_s"] * 1e6
            row[f"{name}_algbw"] = nbytes / t["median_s"] / 1e9                  # GB/s
            row[f"{name}_busbw"] = row[f"{name}_algbw"] * 2 * (n - 1) / n
        row["ratio"] = row["ring_busbw"] / row["mpi_busbw"]
        rows.append(row)
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(rows))


def train_worker(steps, out):
    """The lab's ConvNet under MultiWorkerMirroredStrategy; the chief writes samples/s."""
    import mirrored as tf
    import mirrored.datasets as tfds
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.extended.workers
    datasets, _ = tfds.load(name="mnist", with_info=True, as_supervised=True, download=False)

    def scale(image, label):
        return tf.cast(image, tf.float32) / 255, label

    global_batch = BATCH_PER_REPLICA * strategy.num_replicas_in_sync
    ds = datasets["train"].map(scale).cache().shuffle(10000, seed=1).batch(global_batch).repeat()
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
            tf.keras.layers.MaxPooling2D(), tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(10)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(), metrics=["accuracy"])
    model.fit(ds, epochs=1, steps_per_epoch=WARMUP_STEPS, verbose=0)
    workers.barrier()
    t0 = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    workers.barrier()
    seconds = time.perf_counter() - t0
    if workers.rank == 0:
        pathlib.Path(out).write_text(json.dumps({
            "workers": workers.size, "replicas": strategy.num_replicas_in_sync, "steps": steps,
            "global_batch": global_batch, "seconds": seconds,
            "samples_per_s": steps * global_batch / seconds, "ms_per_step": seconds / steps * 1e3}))


# --- the driver --------------------------------------------------------------------------

def _parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def launch(n, sizes, repeat, mpiexec, train_steps=None, mpi_algorithm=None):
    from mirrored.launcher import mpiexec_command     # what this mpiexec's MPI needs (Open MPI as root)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp, "rows.json")
        argv = [sys.executable, "-m", "benchmarks.multiworker"]
        if train_steps is None:
            argv += ["--worker", "--sizes", *map(str, sizes), "--repeat", str(repeat), "--out", str(out)]
        else:
            argv += ["--train-worker", "--training-steps", str(train_steps), "--out", str(out)]
        # the all-reduce uses CPU devices only (the simulator keeps CUDA away); training runs
        # on what the strategy finds: real GPUs, else the CPU (never the slow simulator)
        cmd, env = mpiexec_command(n, argv, mpiexec, dict(
            os.environ, NUMBA_ENABLE_CUDASIM="1" if train_steps is None else "0",
            MIRRORED_OFFLINE="1"))                         # the bundled MNIST subset
        if mpi_algorithm:                                  # MPICH's name for its choice
            env["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"] = mpi_algorithm
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env,
                              cwd=pathlib.Path(__file__).resolve().parents[1])
        if proc.returncode != 0:
            raise RuntimeError(f"mpiexec -n {n} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=list(NS))
    p.add_argument("--max-bytes", type=_parse_bytes, default=SIZES[-1])
    p.add_argument("--repeat", type=int, default=common.REPEAT)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 processes, 3 samples")
    p.add_argument("--out", help="write the JSON here (default benchmarks/results/)")
    p.add_argument("--training-steps", type=int, default=TRAIN_STEPS,
                   help="timed fit steps of the lab ConvNet per worker count (0: skip)")
    p.add_argument("--mpi-algorithm", metavar="NAME",
                   help="the algorithm MPICH's MPI_Allreduce must use (MPIR_CVAR_ALLREDUCE_INTRA_"
                        "ALGORITHM), e.g. 'ring' to race our ring against MPICH's own ring; "
                        "default: MPICH picks per size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.sizes, args.repeat, args.out)
        return 0
    if args.train_worker:
        train_worker(args.training_steps, args.out)
        return 0
    from mirrored.launcher import find_mpiexec
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print("no mpiexec beside this Python nor on PATH: python -m pip install mpi4py mpich")
        return 1
    sizes = SMOKE_SIZES if args.smoke else [s for s in SIZES if s <= args.max_bytes]
    ns = [2] if args.smoke else args.ns
    repeat = 3 if args.smoke else args.repeat
    rows = []
    load_before = os.getloadavg()
    for n in ns:
        rows += launch(n, sizes, repeat, mpiexec, mpi_algorithm=args.mpi_algorithm)
    training = []
    for w in ([] if args.smoke or not args.training_steps else TRAIN_WORKERS):
        training.append(launch(w, None, None, mpiexec, train_steps=args.training_steps))
    for t in training:
        t["efficiency"] = t["samples_per_s"] / (t["workers"] * training[0]["samples_per_s"])
    load_after = os.getloadavg()
    for r in rows:
        r["size"] = _human(r["bytes"])
    common.print_table(rows, [("n", "N", "d"), ("size", "size", "s"), ("ring_us", "ring µs", ".1f"),
                              ("mpi_us", "MPI µs", ".1f"), ("ring_busbw", "ring busbw GB/s", ".3f"),
                              ("mpi_busbw", "MPI busbw GB/s", ".3f"), ("ratio", "ring/MPI", ".2f")])
    if training:
        print("\nthe lab ConvNet, fit under MultiWorkerMirroredStrategy (1 CPU replica per worker):")
        common.print_table(training, [("workers", "workers", "d"), ("global_batch", "global batch", "d"),
                                      ("ms_per_step", "ms/step", ".1f"), ("samples_per_s", "samples/s", ".0f"),
                                      ("efficiency", "efficiency", ".2f")])
    info = common.device_info()
    info["device"] = "cpu"                          # the buffers are host memory (CPU devices)
    info.update(mpi_allreduce_algorithm=args.mpi_algorithm or "MPICH's default choice",
                cpus=os.cpu_count(), mpich=common._version("mpich"), mpi4py=common._version("mpi4py"),
                # the machine's load (1, 5, 15 min) before and after: other jobs share the cores
                load_average_before=load_before, load_average_after=load_after)
    latency = {str(n): {"ring_us": r["ring_us"], "mpi_us": r["mpi_us"]}
               for n in ns for r in rows if r["n"] == n and r["bytes"] == sizes[0]}
    from_1mb = [r["ratio"] for r in rows if r["bytes"] >= 1 << 20]
    summary = {"latency_at_smallest": latency,
               "min_ratio_from_1MB": min(from_1mb) if from_1mb else None,
               "target_ratio_from_1MB": 0.8}
    if from_1mb:
        print(f"\nring / MPI_Allreduce bus bandwidth from 1 MB up: min {min(from_1mb):.2f} (target 0.8)")
    return common.save_results("multiworker", {"mode": "smoke" if args.smoke else "full",
                                               "summary": summary, "results": rows,
                                               "training": training},
                               info, args.smoke, args.out)


def _human(nbytes):
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    sys.exit(main())
