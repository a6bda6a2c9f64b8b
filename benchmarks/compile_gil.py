"""Can kernels compile side by side in one process? Does NVVM release the GIL? (issue 40)

    python -m benchmarks.compile_gil            # medians of 5 tries; no GPU needed
    python -m benchmarks.compile_gil --smoke    # one try each: does it run?

Why it matters: a first ``fit`` compiles about 15 kernels, 0.3-0.5 s each on an H100's host.
If two could compile at once, compiling ahead of time in threads would shorten epoch 1.

What is measured, each with the real compiler (``cuda.compile_ptx``, NVVM, for sm_90):

    two kernels compiled one after the other, and in two threads      (wall seconds)
    libnvvm alone on one kernel's LLVM IR, the same two ways
    how fast a pure-Python loop in the main thread runs while another thread runs
    NVVM (or the whole compile), against while that thread only sleeps: near 0 would
    mean the GIL is held throughout; near 1, released (less where the cores are busy)

Found on the project's 2-core CI box, load average about 13 (2026-11-26), medians:
``compile_ptx`` 1.21 s sequential, 1.18 s in two threads; NVVM alone 0.33 s and 0.30 s;
the Python loop ran at 0.43 (0.31-0.87) of its speed during NVVM, 0.54 (0.30-0.55) during
a whole compile. So libnvvm releases the GIL (the loop keeps going), but two compiles do
not overlap: numba-cuda wraps ``compile_ptx`` and ``CUDADispatcher.compile`` (typing,
lowering, NVVM and the link) in its ``global_compiler_lock``, and its front end is Python.
Compiling ahead of time can overlap the compile with other host work (loading data,
building buffers) in a thread, not two compiles with each other; that would take
processes. On a GPU host with free cores the overlap with other work is what to measure.

Neighbours: ``kernels/disk_cache.py`` (a second process compiles nothing at all).
"""
import argparse
import json
import statistics
import sys
import threading
import time

SIGNATURE = "void(float32[::1], float32[::1], int64)"
CC = (9, 0)
#: Tries per figure (medians), and with --smoke.
TRIES, SMOKE_TRIES = 5, 1


def make_kernel(k):
    """A fresh Python function each call (numba compiles a new one every time)."""
    from numba import cuda

    def kern(x, y, n):
        i = cuda.grid(1)
        if i < n:
            acc = x[i]
            for j in range(32):
                acc = acc * 1.0001 + y[(i + j) % n] * (k + 1)
            y[i] = acc
    return kern


def compile_one(k):
    from numba import cuda
    cuda.compile_ptx(make_kernel(k), SIGNATURE, cc=CC)


def nvvm_of_one():
    """A call that runs libnvvm alone on one kernel's LLVM IR (caught from one compile)."""
    from numba import cuda
    from numba.cuda.cudadrv import nvvm
    caught, original = [], nvvm.compile_ir

    def catch(ir, **options):
        caught.append((ir, options))
        return original(ir, **options)
    nvvm.compile_ir = catch
    try:
        cuda.compile_ptx(make_kernel(99), SIGNATURE, cc=CC)
    finally:
        nvvm.compile_ir = original
    ir, options = caught[-1]
    return lambda _k: original(ir, **options)


def two(fn, threads):
    """Wall seconds for fn(0) and fn(1), one after the other or in two threads."""
    start = time.perf_counter()
    if threads:
        workers = [threading.Thread(target=fn, args=(k,)) for k in (0, 1)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        fn(0)
        fn(1)
    return time.perf_counter() - start


def loop_speed_during(fn):
    """Iterations per second of a Python loop here while another thread runs fn(0)."""
    done, count = threading.Event(), 0
    worker = threading.Thread(target=lambda: (fn(0), done.set()))
    start = time.perf_counter()
    worker.start()
    while not done.is_set():
        count += 1
    worker.join()
    return count / (time.perf_counter() - start)


def measure(tries):
    nvvm = nvvm_of_one()
    result = {}
    for name, fn in (("compile_ptx", compile_one), ("nvvm", nvvm)):
        seq = [two(fn, False) for _ in range(tries)]
        par = [two(fn, True) for _ in range(tries)]
        result[name] = {"sequential_s": statistics.median(seq), "two_threads_s": statistics.median(par)}
    for name, fn, nap in (("nvvm", nvvm, 0.3), ("compile_ptx", compile_one, 1.0)):
        ratios = sorted(loop_speed_during(fn) / loop_speed_during(lambda _k, s=nap: time.sleep(s))
                        for _ in range(tries))
        result[name]["python_loop_speed_ratio"] = {"median": statistics.median(ratios),
                                                   "min": ratios[0], "max": ratios[-1]}
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one try of each")
    args = parser.parse_args(argv)
    print(json.dumps(measure(SMOKE_TRIES if args.smoke else TRIES), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
