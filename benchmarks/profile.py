"""Where a kernel's GPU time goes: the lab-shape kernels launched a few times each, for
Nsight Compute (``ncu``) to profile.

    python -m benchmarks.profile                          # on a GPU: CUDA-event times only
    python -m benchmarks.profile --only 'conv2d|max_pool' --launches 5
    python -m benchmarks.profile --list                   # the case names (for --only)
    python -m benchmarks.profile --smoke                  # tiny shapes, CUDA simulator
    bash benchmarks/gpu_session.sh profile                # under ncu (the command below)

``benchmarks/kernels.py`` says how fast each kernel is (median of many timed calls, and
the fraction of copy bandwidth); this program is for asking *why*: it builds the same
inputs (its ``conv_pool_cases``: conv 3x3 1->32 on 28x28 images and 2x2 max-pool
on its 26x26x32 output, batch 512 by default; ``memory_cases``: an elementwise
add, softmax cross-entropy over 10 classes and the SGD-momentum and Adam updates on
64 MB arrays), then for each case

    1. warms up: the first call compiles the kernel and is checked against the float64
       NumPy reference (a wrong kernel is reported and never profiled); one more call;
    2. opens a profiler range (``cuProfilerStart``), launches the case ``--launches``
       times, closes it (``cuProfilerStop``).

Under ``ncu --profile-from-start off`` only the launches inside those ranges are
profiled: no warm-up, no compile, no check, no kernel of the program's own set-up.
One "launch" of a case may be several kernels (conv2d's backward launches dx, then the
dW partial sums and their finish); the report lists them by kernel name, in launch
order, case after case in the order this program prints. The stage in
benchmarks/gpu_session.sh runs::

    ncu --target-processes all --profile-from-start off --clock-control none \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis ... \\
        --export $OUT/profile --force-overwrite python -m benchmarks.profile --no-times

and exports the report as CSV. Without ncu (or without permission to read the GPU's
counters) the program alone still says something: each launch is bracketed by CUDA
events on the legacy default stream, and the table gives the median, min and max
microseconds per launch and GB/s over the case's floor of bytes moved. (The first
interval also holds the first launch's host overhead, since the stream starts idle;
later ones are the kernels alone, unless a kernel is shorter than its launch: hence the
median.) Under ncu those times would include its replays, so ``--no-times`` leaves them out.

``--smoke`` runs tiny shapes in Numba's CUDA simulator (no profiler, host-clock times
that mean nothing): it proves the program works, and the test suite runs it
(tests/test_benchmarks_profile.py). JSON only with ``--out``.

Neighbours: benchmarks/kernels.py (the cases, and their timing as benchmarks),
benchmarks/breakdown.py (a training step's time per layer), benchmarks/gpu_session.sh.
"""
import argparse
import contextlib
import itertools
import re
import statistics
import sys
import time

from benchmarks import common
from benchmarks import kernels as kbench

#: Profiled launches per case: ncu replays each one for every pass its sections need,
#: so a few are plenty (the counters of one launch vary little), and each adds a result
#: to the report.
LAUNCHES = 3
#: --smoke: one launch per case (it checks the program; well under a minute in the simulator)
SMOKE_LAUNCHES = 1
#: Untimed, unprofiled calls first: the checked call (which compiles) and one more.
WARMUP = 2
#: --smoke: batch 2 of 6x6 images and 2 KB arrays (kernels.py's smoke sizes).
SMOKE_BATCH = kbench.SMOKE_CONV_BATCH


def cases(batch, hw, nbytes, second=None):
    """Every case in the order it is profiled: the lab's conv and pooling layers (and the
    tutorials' second conv, of size ``second``: kernels.py's default, or its smoke size),
    then the memory-bound kernels (a generator: each case's arrays are made when reached)."""
    return itertools.chain(kbench.conv_pool_cases(batch, hw, second), kbench.memory_cases(nbytes))


@contextlib.contextmanager
def profiler_range(simulated):
    """``cuProfilerStart`` ... ``cuProfilerStop`` around the block: what
    ``ncu --profile-from-start off`` profiles (with no profiler attached, they do
    nothing). The simulator has no profiler API: there the block just runs."""
    if simulated:
        yield
        return
    from numba import cuda
    try:
        cuda.profile_start()
    except Exception as exc:           # a driver without the profiler API: launch anyway, say so
        print(f"note: cuProfilerStart failed ({type(exc).__name__}: {exc}); launching without "
              f"a profiler range (ncu --profile-from-start off would see nothing)")
        yield
        return
    try:
        yield
    finally:
        cuda.profile_stop()


def launch(run, n, with_times, simulated):
    """Call ``run()`` ``n`` times; per launch seconds (CUDA events on the legacy default
    stream between launches; the host clock in the simulator, which runs synchronously),
    or None when ``with_times`` is False."""
    from numba import cuda
    if not with_times:
        for _ in range(n):
            run()
        cuda.synchronize()
        return None
    if simulated:                      # simulator events do not time (elapsed_time is -1)
        marks = [time.perf_counter()]
        for _ in range(n):
            run()
            cuda.synchronize()
            marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])]
    events = [cuda.event(timing=True) for _ in range(n + 1)]
    events[0].record(0)
    for e in events[1:]:
        run()
        e.record(0)
    events[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]   # ms -> s


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=None,
                        help=f"images for the conv and pooling cases (default {kbench.CONV_BATCH}; "
                             f"--smoke: {SMOKE_BATCH})")
    parser.add_argument("--launches", type=int, default=None,
                        help=f"profiled launches per case, after {WARMUP} warm-up calls "
                             f"(default {LAUNCHES}; --smoke: {SMOKE_LAUNCHES})")
    parser.add_argument("--only", metavar="REGEX",
                        help="only the cases whose name matches (re.search, case-insensitive), "
                             "e.g. 'conv2d v1|max_pool'")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--no-times", action="store_true",
                        help="launch only, no CUDA events (under ncu, whose replays would be timed)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in the CUDA simulator (checks the program runs)")
    parser.add_argument("--out", help="write the JSON here (nothing is written without it)")
    args = parser.parse_args(argv)
    if args.launches is None:
        args.launches = SMOKE_LAUNCHES if args.smoke else LAUNCHES
    if args.launches < 1:
        parser.error(f"--launches must be at least 1, got {args.launches}")
    batch = args.batch if args.batch is not None else (SMOKE_BATCH if args.smoke else kbench.CONV_BATCH)
    if batch < 1:
        parser.error(f"--batch must be at least 1, got {batch}")
    try:
        only = re.compile(args.only, re.IGNORECASE) if args.only else None
    except re.error as exc:
        parser.error(f"--only {args.only!r} is not a regular expression: {exc}")

    common.choose_cuda(smoke=args.smoke or args.list)    # before anything imports numba.cuda
    simulated = args.smoke
    hw = kbench.SMOKE_CONV_HW if args.smoke else kbench.CONV_HW
    nbytes = kbench.SMOKE_MEM_BYTES if args.smoke else kbench.MEM_BYTES
    if not args.smoke and not args.list:
        if common.no_gpu("benchmarks.profile", "On a machine with a CUDA GPU run "
                         "`bash benchmarks/gpu_session.sh profile` (under ncu) or "
                         "`python -m benchmarks.profile`; to check this program, "
                         "`python -m benchmarks.profile --smoke`."):
            return 0
    if args.list:                      # names only: built at smoke sizes, in the simulator
        for case in cases(SMOKE_BATCH, kbench.SMOKE_CONV_HW, kbench.SMOKE_MEM_BYTES, kbench.SMOKE_SECOND_CONV):
            print(case.name)
        print("(names at --smoke sizes; at full size the sizes in brackets differ)")
        return 0

    from numba import cuda
    info = common.device_info()
    with_times = not args.no_times
    print(f"device: {info['device']}" + ("  (simulator: times mean nothing)" if simulated else ""))
    print(f"each case: {WARMUP} warm-up calls (the first checked), then {args.launches} launches "
          f"inside cuProfilerStart/Stop" + ("" if with_times else "; no CUDA events (--no-times)"))
    rows, skipped, order = [], [], 0
    for case in cases(batch, hw, nbytes, kbench.SMOKE_SECOND_CONV if args.smoke else None):
        if only is not None and not only.search(case.name):
            continue
        case.run()                                     # compiles; the check holds for this call
        cuda.synchronize()
        bad = case.check()
        if bad:
            skipped.append(dict(name=case.name, reason=f"wrong result, not profiled: {bad}"))
            print(f"skipped: {case.name}: wrong result, not profiled: {bad}")
            continue
        for _ in range(WARMUP - 1):
            case.run()
        cuda.synchronize()
        order += 1
        print(f"case {order}: {case.name} [{case.impl}]: {args.launches} launches", flush=True)
        with profiler_range(simulated):
            per_launch = launch(case.run, args.launches, with_times, simulated)
        row = dict(case=order, name=case.name, impl=case.impl, bytes=case.moved,
                   launches=args.launches)
        if per_launch is not None:
            med = statistics.median(per_launch)
            row.update(median_us=med * 1e6, min_us=min(per_launch) * 1e6,
                       max_us=max(per_launch) * 1e6,
                       gbps=case.moved / med / 1e9 if med > 0 else None)
        rows.append(row)
    if only is not None and not rows and not skipped:
        print(f"benchmarks.profile: no case matches --only {args.only!r}; "
              f"`python -m benchmarks.profile --list` lists them.")
        return 2

    print()
    columns = [("name", "case (in launch order)", ""), ("bytes", "bytes moved", ","),
               ("launches", "launches", "")]
    if with_times:
        columns += [("median_us", "median µs", ".1f"), ("min_us", "min", ".1f"),
                    ("max_us", "max", ".1f"), ("gbps", "GB/s", ".1f")]
    common.print_table(rows, columns)
    for s in skipped:
        print(f"skipped: {s['name']}: {s['reason']}")
    payload = {"method": {"timer": None if not with_times else
                          ("perf_counter (simulator)" if simulated else "CUDA events, one per launch"),
                          "warmup": WARMUP, "launches": args.launches, "smoke": args.smoke,
                          "batch": batch, "only": args.only, "memory_bytes_per_array": nbytes},
               "rows": rows, "skipped": skipped}
    if args.out:
        common.save_results("profile", payload, info, args.smoke, args.out)
    return 1 if skipped else 0                         # a wrong kernel fails the stage


if __name__ == "__main__":
    sys.exit(main())
