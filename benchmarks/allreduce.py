"""Ring all-reduce vs reduce-to-one-device on logical GPUs of one card.

    python -m benchmarks.allreduce                       # real GPU: N = 2, 4, 8; 1 KB .. 256 MB
    python -m benchmarks.allreduce --ns 2 4 --max-bytes 64M
    python -m benchmarks.allreduce --smoke --out /tmp/allreduce.json   # no GPU needed

What is timed: ``CrossDeviceOps._sum_in_place(buffers, devices)`` on flat float32
buffers already on the devices (in place, as nccl-tests' all_reduce_perf), for
``RingAllReduce`` and ``ReductionToOneDevice``, and on a GPU the ring once more captured
as a CUDA graph and replayed (``mirrored.program.capture``, as ``fit`` runs it by default,
``compile(run_eagerly=False)``: the same kernels and events, without Python's cost per
launch, which dominates the eager ring on logical GPUs); medians of CUDA-event timings after
warm-up (``benchmarks/common.py``). Each algorithm's result is checked first
(buffer i holds i+1 everywhere, so the sum N(N+1)/2 is exact in float32); the timed
calls then run on zeros, which keeps the values from growing to inf and costs the
same.

What is reported, per N and buffer size S (bytes):
    algbw   S / time                         (the all-reduce's "speed" as a user sees it)
    busbw   algbw * 2(N-1)/N                 (nccl-tests' bus bandwidth: the bytes each
                                              device's link carries in a ring, per second;
                                              comparable across N)
    mem     5(N-1)S / time, as a fraction of the measured device-to-device copy rate.
            Counting: a reduce-scatter step reads two chunks and writes one (3 S/N
            bytes per device), an all-gather step reads one and writes one (2 S/N);
            N devices x (N-1) steps of each = 5(N-1)S bytes through the card's memory.
            Logical GPUs share one card's memory, so that is the ring's ceiling here.

Timing several streams with one pair of events: our devices' streams are Numba's
ordinary (blocking) streams, which synchronise with the legacy default stream, so an
event recorded on stream 0 waits for, and is waited on by, work on all of them.
``common.time_gpu(..., stream=0)`` therefore brackets the whole ring.

Logical devices are configured once per process (TensorFlow's rule): we configure
max(N) logical GPUs and run each N on the first N of them.

Without a real GPU the program says so and exits 0, writing nothing. ``--smoke``
runs tiny sizes on logical CPU devices with perf_counter timing, to check that the
program works (it writes JSON only to ``--out``).
"""
import argparse
import sys

from benchmarks import common

#: Default buffer sizes: 1 KB to 256 MB, x4 apart (a latency-bound end, a bandwidth-bound end).
SIZES = [1 << k for k in range(10, 29, 2)]
#: Smoke sizes: enough to exercise uneven chunks (1 KB / 4 bytes = 256 elements over N = 8...).
SMOKE_SIZES = [1 << 10, 1 << 12]
#: Ring sizes (logical GPUs on one card).
NS = (2, 4, 8)
#: Buffer for the device-to-device copy ceiling: large enough to be bandwidth-bound.
COPY_BYTES = 256 << 20
SMOKE_COPY_BYTES = 1 << 20
#: Everything is float32, as gradients are.
ITEMSIZE = 4
ALGORITHMS = ("ring", "reduce_to_one")


def _parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def _fmt_bytes(n):
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on logical CPU devices, perf_counter")
    p.add_argument("--out", help="JSON path (default benchmarks/results/allreduce-<gpu>-<date>.json; "
                                 "with --smoke, JSON is written only here)")
    p.add_argument("--ns", type=int, nargs="+", default=list(NS), help="ring sizes (default 2 4 8)")
    p.add_argument("--max-bytes", type=_parse_bytes, default=None, help="largest buffer, e.g. 64M")
    p.add_argument("--repeat", type=int, default=common.REPEAT, help="timed samples per point")
    args = p.parse_args(argv)
    if min(args.ns) < 2:
        p.error("--ns: a ring needs at least 2 devices")
    return args


def _configure(n, smoke):
    """n logical devices: CPUs for --smoke, else GPUs carved from GPU 0."""
    import mirrored as tf
    from mirrored import devices as registry
    if smoke:
        phys = tf.config.list_physical_devices("CPU")[0]
    else:
        phys = tf.config.list_physical_devices("GPU")[0]
    tf.config.set_logical_device_configuration(phys, [tf.config.LogicalDeviceConfiguration()] * n)
    return [d for d in registry.logical_devices() if d.device_type == phys.device_type]


def _buffers(devs, elements, value_of):
    """One flat float32 buffer per device, buffer i filled with value_of(i)."""
    bufs = []
    for i, dev in enumerate(devs):
        with dev.activate():
            buf = dev.empty((elements,), "float32")           # (elements,) float32
            dev.ops.fill(buf, value_of(i))
            bufs.append(buf)
    return bufs


def _check(algorithm, devs, elements):
    """Run once on buffers holding 1, 2, ..., N; every device must hold N(N+1)/2 exactly."""
    import numpy as np
    n = len(devs)
    bufs = _buffers(devs, elements, lambda i: i + 1)
    algorithm._sum_in_place(bufs, devs)
    want = n * (n + 1) / 2
    for dev, buf in zip(devs, bufs):
        host = dev.to_numpy(buf)
        if not np.all(host == want):
            bad = int(np.flatnonzero(host != want)[0])
            raise SystemExit(f"allreduce benchmark: {type(algorithm).__name__} gave {host[bad]} at "
                             f"element {bad} on {dev.name}, expected {want} (N={n}, {elements} "
                             f"elements): not timing a wrong result.")


def _fill(devs, bufs, value_of):
    for i, (dev, buf) in enumerate(zip(devs, bufs)):
        with dev.activate():
            dev.ops.fill(buf, value_of(i))


def _time_ring_graph(devs, elements, timer):
    """The ring captured once as a CUDA graph and replayed (what ``fit`` does by default,
    ``compile(run_eagerly=False)``): the same launches and events, without Python's cost
    per launch. Checked like the eager ring before it is timed. Returns (timing, None)
    or (None, why it was not timed)."""
    import numpy as np
    from mirrored.ring import RingAllReduce
    from mirrored.program.capture import StepGraphs
    ring = RingAllReduce()
    graphs = StepGraphs(devs, ring)
    if not graphs.enabled:
        return None, graphs.reason
    n = len(devs)
    bufs = _buffers(devs, elements, lambda i: i + 1)
    key = ("ring", elements)
    try:
        graphs.run(key, ring._sum_in_place, bufs, devs)       # eager: compiles, allocates
        _fill(devs, bufs, lambda i: i + 1)
        graphs.run(key, ring._sum_in_place, bufs, devs)       # captured, then replayed
        want = n * (n + 1) / 2
        for dev, buf in zip(devs, bufs):
            if not np.all(dev.to_numpy(buf) == want):
                return None, f"the replayed graph gave a wrong sum (want {want}): not timed"
        _fill(devs, bufs, lambda i: 0.0)
        return timer(lambda: graphs.run(key, ring._sum_in_place, bufs, devs)), None
    except Exception as exc:                                  # report it; time the rest
        return None, f"capture failed: {type(exc).__name__}: {exc}"
    finally:
        graphs.close()


def run(args):
    common.choose_cuda(smoke=args.smoke)        # before anything imports numba
    if not args.smoke:
        if common.no_gpu("benchmarks.allreduce", "Run it on a machine with a CUDA GPU, or "
                         "`python -m benchmarks.allreduce --smoke --out PATH` to check the program."):
            return 0
    import numpy as np
    from mirrored.cross_device_ops import ReductionToOneDevice
    from mirrored.ring import RingAllReduce

    sizes = SMOKE_SIZES if args.smoke else SIZES
    if args.max_bytes:
        sizes = [s for s in sizes if s <= args.max_bytes] or [args.max_bytes]
    all_devs = _configure(max(args.ns), args.smoke)
    info = common.device_info()

    if args.smoke:
        # CPU devices: host timer, and the "copy ceiling" is a host memcpy.
        def timer(fn):
            return common.time_host(fn, repeat=args.repeat)
        src = np.ones(SMOKE_COPY_BYTES // ITEMSIZE, np.float32)
        dst = np.empty_like(src)
        copy_t = timer(lambda: np.copyto(dst, src))
        copy = {"bytes": src.nbytes, "GBps": 2 * src.nbytes / copy_t["median_s"] / 1e9, **copy_t}
    else:
        def timer(fn):
            return common.time_gpu(fn, repeat=args.repeat, stream=0)   # stream 0: see docstring
        gbps, copy_t = common.copy_bandwidth(COPY_BYTES)
        copy = {"bytes": COPY_BYTES, "GBps": gbps, **copy_t}

    rows, skipped = [], []
    for n in args.ns:
        devs = all_devs[:n]
        for nbytes in sizes:
            elements = max(1, nbytes // ITEMSIZE)
            row = {"n": n, "bytes": elements * ITEMSIZE, "size": _fmt_bytes(elements * ITEMSIZE)}
            for name, algorithm in (("ring", RingAllReduce()), ("reduce_to_one", ReductionToOneDevice())):
                _check(algorithm, devs, elements)
                bufs = _buffers(devs, elements, lambda i: 0.0)
                t = timer(lambda: algorithm._sum_in_place(bufs, devs))
                s = t["median_s"]
                algbw = row["bytes"] / s / 1e9
                row[name] = t
                row[f"{name}_us"] = s * 1e6
                row[f"{name}_algbw"] = algbw
                row[f"{name}_busbw"] = algbw * 2 * (n - 1) / n
                del bufs
            mem = 5 * (n - 1) * row["bytes"] / row["ring"]["median_s"] / 1e9
            row["ring_mem_GBps"] = mem
            row["ring_mem_frac_of_copy"] = mem / copy["GBps"]
            row["ring_speedup"] = row["reduce_to_one"]["median_s"] / row["ring"]["median_s"]
            if not args.smoke:
                t, why = _time_ring_graph(devs, elements, timer)
                if t is None:
                    skipped.append({"name": f"ring graph N={n} {row['size']}", "reason": why})
                else:
                    row["ring_graph"] = t
                    row["ring_graph_us"] = t["median_s"] * 1e6
                    row["ring_graph_mem_frac_of_copy"] = (
                        5 * (n - 1) * row["bytes"] / t["median_s"] / 1e9 / copy["GBps"])
            rows.append(row)

    where = "logical CPU devices (smoke: perf_counter)" if args.smoke else f"logical GPUs on {info['device']}"
    print(f"all-reduce of float32 buffers over N {where}; medians of {args.repeat} samples")
    print(f"device-to-device copy: {copy['GBps']:.1f} GB/s of memory traffic (read + write)\n")
    common.print_table(rows, [
        ("n", "N", ""), ("size", "size", ""),
        ("ring_us", "ring µs", ".1f"), ("ring_algbw", "algbw GB/s", ".2f"),
        ("ring_busbw", "busbw GB/s", ".2f"), ("ring_mem_frac_of_copy", "mem/copy", ".2f"),
        ("reduce_to_one_us", "to-one µs", ".1f"), ("reduce_to_one_busbw", "to-one busbw", ".2f"),
        ("ring_speedup", "ring ×", ".2f"), ("ring_graph_us", "graph µs", ".1f"),
        ("ring_graph_mem_frac_of_copy", "graph mem/copy", ".2f")])
    for skip in skipped:
        print(f"skipped: {skip['name']}: {skip['reason']}")

    payload = {
        "mode": "smoke" if args.smoke else "cuda",
        "devices": "logical CPU" if args.smoke else "logical GPU (one card)",
        "timer": "perf_counter" if args.smoke else "cuda events (stream 0)",
        "dtype": "float32",
        "definitions": {
            "algbw_GBps": "bytes / median time / 1e9",
            "busbw_GBps": "algbw * 2(N-1)/N (nccl-tests)",
            "ring_mem_GBps": "5(N-1) * bytes / median ring time / 1e9",
            "copy_GBps": "2 * bytes / median device-to-device copy time / 1e9",
            "ring_graph": "the same ring captured once as a CUDA graph and replayed "
                          "(mirrored.program.capture.StepGraphs, as fit does by default)",
        },
        "copy": copy,
        "results": rows,
        "skipped": skipped,
    }
    return common.save_results("allreduce", payload, info, args.smoke, args.out)


def main(argv=None):
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
