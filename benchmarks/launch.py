"""Host time per kernel launch: numba-cuda's path beside the cached path (kernels/launch_cache.py).

    python -m benchmarks.launch                      # a table, every launcher
    python -m benchmarks.launch --json               # the same as JSON, on stdout
    python -m benchmarks.launch --launchers gemm,conv2d
    python -m benchmarks.launch --smoke --out /tmp/launch.json    # a few calls: does it run?

For each launcher, with the lab's shapes, the medians of ``REPEAT`` samples of ``NUMBER`` calls:

    numba_us               the launcher's launches through numba's path,
                           ``kernel[grid, block, stream](*args)``, checks excluded
    cached_us              the same launches through ``kernels.launch.launch`` once the cache
                           holds their records: one driver call each, checks excluded
    cached_with_checks_us  the launcher itself: its checks, its grid, its views and its launches

Without a GPU it stubs the driver, and says so: numba-cuda runs its real launch path, from
typing the arguments and packing them to building the launch configuration, up to the call into
the driver library; that call (cuda.core's ``launch`` for numba, ``cuLaunchKernel`` for the
cache) is a Python function that records its arguments and returns success. Kernels compile
for real (NVVM, no GPU needed) for a stand-in device of compute capability ``STUB_CC``; arrays
are numba ``DeviceNDArray`` objects over host memory that nothing reads (``fake_array``). So the
figures are the host's cost above the driver, on both paths alike. With a GPU the driver is real
and the kernels run (tiny shapes; the timer synchronises at the end of each sample).

Targets (issue 24), host time: cached launch <= 5 µs; launcher plus its checks <= 10 µs.

Neighbours: ``kernels/launch_cache.py`` (what is measured), ``tests/test_launch_cache.py`` (uses
``stub_driver`` and ``fake_array`` to check the packed bytes against numba's), lab 04 (the table).
"""
import argparse
import contextlib
import ctypes
import json
import os
import statistics
import sys
import time
import warnings

import numpy as np

from benchmarks import common

#: Compute capability of the stand-in device kernels are compiled for with a stubbed driver
#: (an H100's: the GPU the project's figures come from).
STUB_CC = (9, 0)
#: Calls per sample, and samples: a launch costs µs, so 2,000 calls make a ~10 ms sample.
NUMBER = 2000
REPEAT = 15
#: With a real GPU, at most this many calls per sample: CUDA queues about 1,024 launches before
#: a launch waits for the GPU, and conv2d_backward makes 3 per call.
GPU_NUMBER = 200
#: --smoke: enough calls to go through numba twice and the cache after, not to time.
SMOKE_NUMBER, SMOKE_REPEAT = 20, 2


# --- the stubbed driver ----------------------------------------------------------------------

class DriverStub:
    """What the stubbed driver was last asked to do: ``numba`` the (stream, config, kernel,
    *kernelargs) numba passed cuda.core's launch; ``cached`` the arguments of cuLaunchKernel."""

    def __init__(self):
        self.numba = None
        self.cached = None
        self.calls = 0

    def core_launch(self, stream, config, kernel, *kernelargs):
        self.numba = (stream, config, kernel, kernelargs)
        self.calls += 1

    def cu_launch_kernel(self, *args):
        self.cached = args
        self.calls += 1
        return (0,)                       # CUDA_SUCCESS


class _StubModule:
    initialized = True                    # numba's bind() sets a module up once


class StubCufunc:
    """What ``CUDACodeLibrary.get_cufunc`` returns: a loaded kernel's handle (one per code
    library, so two kernels never share one) and its module."""
    module = _StubModule

    def __init__(self, handle):
        from numba.cuda.cudadrv.driver import binding
        self.handle = binding.CUfunction(handle)
        self.kernel = None


def stub_driver():
    """Let real (not simulated) numba-cuda compile and launch with no GPU and no driver.

    Call it in a process with ``NUMBA_ENABLE_CUDASIM=0``, before the first launch. It replaces:
    the current device and context (a stand-in of compute capability ``STUB_CC``), loading a
    compiled kernel (a stand-in handle), numba's conversion of a stream for cuda.core, and the
    two driver calls (``DriverStub``). Returns the ``DriverStub``.
    """
    from numba.cuda import codegen, dispatcher
    from numba.cuda.cudadrv import devices, driver

    from kernels import launch_cache

    class Device:
        compute_capability = STUB_CC
        id = 0
        MULTIPROCESSOR_COUNT = 132

    class Context:
        device = Device

    stub = DriverStub()
    handles = {}

    def get_cufunc(library):              # numba's: the current context, then a dict lookup
        Context.device
        cufunc = handles.get(id(library))
        if cufunc is None:
            cufunc = handles[id(library)] = StubCufunc(0x10000 + 0x100 * len(handles))
        return cufunc

    devices._runtime.ensure_context = contextlib.nullcontext
    devices.get_context = dispatcher.get_context = lambda devnum=None: Context
    dispatcher.get_current_device = lambda: Device
    codegen.CUDACodeLibrary.get_cufunc = get_cufunc
    driver._to_core_stream = lambda stream: stream
    dispatcher.launch = stub.core_launch
    launch_cache.cuLaunchKernel = stub.cu_launch_kernel
    from numba import cuda
    cuda.get_current_device = lambda: Device
    return stub


_FAKE_BASE = [0x7F0000000000]
_ALLOCATIONS = {}       # address -> the allocation, while an array uses it


def fake_array(shape, dtype, freed=None, address=None):
    """A numba ``DeviceNDArray`` of ``shape`` and ``dtype`` over a made-up device address that
    nothing reads: a fresh one, or ``address`` (as an allocator may hand out a freed block
    again). ``freed``: a list that gets the address when numba would queue its cuMemFree."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.cudadrv.driver import AutoFreePointer
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    nbytes = max(int(np.prod(shape)) * dtype.itemsize, 1)
    if address is None:
        address = _FAKE_BASE[0]
        _FAKE_BASE[0] += (nbytes + 255) // 256 * 256 + 256

    def free():                          # numba calls it when the last view has gone
        _ALLOCATIONS.pop(address, None)
        if freed is not None:
            freed.append(address)
    # As numba's context does, a table holds the allocation until the last view goes.
    memory = _ALLOCATIONS[address] = AutoFreePointer(object(), ctypes.c_void_p(address), nbytes,
                                                     finalizer=free)
    strides, step = [], dtype.itemsize               # C order
    for extent in reversed(shape):
        strides.insert(0, step)
        step *= max(extent, 1)
    return DeviceNDArray(shape, tuple(strides), dtype, gpu_data=memory.own())


def fake_stream(handle=0x5000):
    """A numba ``Stream`` over a made-up handle (not the default stream)."""
    from numba.cuda.cudadrv.driver import Stream, binding
    return Stream(binding.CUstream(handle))


# --- the launchers, with the lab's shapes ----------------------------------------------------

def launcher_calls(make, stream):
    """{launcher name: a zero-argument call of it}, arrays made by ``make(shape, dtype)``.
    Shapes: the lab's dense MLP (784-64-10, batch 64) and ConvNet layer (3x3, 1->32 channels,
    28x28, batch 64)."""
    from kernels import (activations, allreduce, conv2d, dropout, elementwise, gather, gemm,
                         optimizers, pooling, reduction, softmax_xent)
    f32 = np.float32
    b, d, h, c = 64, 784, 64, 10
    x, w, y = make((b, d), f32), make((d, h), f32), make((b, h), f32)
    y2, bias = make((b, h), f32), make((h,), f32)
    logits, labels = make((b, c), f32), make((b,), np.int32)
    loss, grad, correct = make((b,), f32), make((b, c), f32), make((b,), f32)
    g, v, m = make((d, h), f32), make((d, h), f32), make((d, h), f32)
    sgd_hyper, adam_hyper = make((optimizers.SGD_HYPER_SIZE,), f32), make((optimizers.ADAM_HYPER_SIZE,), f32)
    part, total = make((reduction.SUM_BLOCKS,), f32), make((1,), f32)
    rows, idx = make((1000, d), f32), make((b,), np.int64)
    img, kern, kbias = make((b, 28, 28, 1), f32), make((3, 3, 1, 32), f32), make((32,), f32)
    conv_out = make((b, 26, 26, 32), f32)
    dimg, dkern = make((b, 28, 28, 1), f32), make((3, 3, 1, 32), f32)
    dconv, partial = make((b, 26, 26, 32), f32), make(conv2d.dw_partial_shape(
        (b, 28, 28, 1), (3, 3, 1, 32)), f32)
    pooled, arg = make((b, 13, 13, 32), f32), make((b, 13, 13, 32), pooling.ARG_DTYPE)
    own, peer = make((d * h,), f32), make((d * h,), f32)
    counter = iter(range(1, 1 << 62))
    return {
        "gemm": lambda: gemm.gemm(x, w, y, stream=stream),
        "binary": lambda: elementwise.binary("add", y, y2, y, stream=stream),
        "binary_scalar": lambda: elementwise.binary_scalar("mul", y, 0.5, y2, stream=stream),
        "fill": lambda: elementwise.fill(y, 0.0, stream=stream),
        "bias_relu": lambda: activations.bias_relu(y, bias, y2, stream=stream),
        "relu_backward": lambda: activations.relu_backward(y, y2, y, stream=stream),
        "softmax_xent": lambda: softmax_xent.softmax_xent(logits, labels, loss, grad, correct,
                                                          stream=stream),
        "sum_all": lambda: reduction.sum_all(loss, total, part, stream=stream),
        "sgd_momentum": lambda: optimizers.sgd(w, g, v, sgd_hyper, stream=stream),
        "adam": lambda: optimizers.adam(w, g, m, v, adam_hyper, stream=stream),
        "dropout": lambda: dropout.dropout(y, y2, 0.5, next(counter), stream=stream),
        "gather_rows": lambda: gather.gather_rows(rows, idx, x, stream=stream),
        "ring_reduce_step": lambda: allreduce.ring_reduce_step(own, peer, 0, d * h // 2,
                                                               stream=stream),
        "conv2d": lambda: conv2d.conv2d(img, kern, kbias, conv_out, relu=True, stream=stream),
        "conv2d_backward": lambda: conv2d.conv2d_backward(img, kern, dconv, dimg, dkern, kbias,
                                                          partial=partial, stream=stream),
        "max_pool": lambda: pooling.max_pool(conv_out, pooled, arg, stream=stream),
        "max_pool_backward": lambda: pooling.max_pool_backward(pooled, arg, dconv,
                                                               stream=stream),
    }


@contextlib.contextmanager
def recorded_launches():
    """Inside, every ``kernels.launch.launch`` a launcher makes also appends (kernel, grid, block,
    stream, args) to the list this yields (the launchers import ``launch`` by name)."""
    from kernels import launch as kl
    real, seen, patched = kl.launch, [], []

    def recording(kernel, grid, block, stream, *args):
        seen.append((kernel, grid, block, stream, args))
        real(kernel, grid, block, stream, *args)
    for name, module in list(sys.modules.items()):
        if name.startswith("kernels.") and getattr(module, "launch", None) is real:
            module.launch = recording
            patched.append(module)
    try:
        yield seen
    finally:
        for module in patched:
            module.launch = real


def measure(call, stream, number=NUMBER, repeat=REPEAT, sync=None, clock=time.perf_counter):
    """The three figures for one launcher ``call`` (µs per call of the launcher), and notes."""
    from kernels import launch as kl
    from kernels import launch_cache
    for _ in range(3):                   # compile, then the record (see launch_cache)
        call()
    with recorded_launches() as launches:
        call()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=kl.LOW_OCCUPANCY_MESSAGE)
        configured = [(k[g, b, s], a) for k, g, b, s, a in launches]

    def numba_path():
        for c, a in configured:
            c(*a)

    def cached_path():
        for k, g, b, s, a in launches:
            kl.launch(k, g, b, s, *a)

    def us(fn):
        """Median µs per call: ``number`` calls between two clock reads, the GPU's queue
        emptied before each sample (outside the timing), so no call waits for the GPU."""
        for _ in range(10):
            fn()
        samples = []
        for _ in range(repeat):
            if sync:
                sync()
            t0 = clock()
            for _ in range(number):
                fn()
            samples.append((clock() - t0) / number)
        return statistics.median(samples) * 1e6
    why = {launch_cache.explain(launch_cache.key(k, g, b, s, a)) for k, g, b, s, a in launches}
    row = {"launches": len(launches), "numba_us": us(numba_path), "cached_us": us(cached_path),
           "cached_with_checks_us": us(call)}
    row["note"] = "" if why == {"cached"} else "; ".join(sorted(why - {"cached"}))
    return row


def run(names=None, number=NUMBER, repeat=REPEAT):
    """Measure ``names`` (default: every launcher); returns the JSON document."""
    common.choose_cuda(smoke=False)
    if common.simulator():
        raise SystemExit("benchmarks.launch times numba-cuda's real launch path: run it without "
                         "NUMBA_ENABLE_CUDASIM=1 (with no GPU it stubs the driver).")
    ok, why = common.gpu_status()
    if ok:
        from numba import cuda
        # zeros: valid row numbers, labels and arg-max offsets for the kernels that index
        stream, make = cuda.stream(), (lambda shape, dtype: cuda.to_device(np.zeros(shape, dtype)))
        sync, clock = stream.synchronize, time.perf_counter
        number = min(number, GPU_NUMBER)
        driver = f"real: {why}; clock: wall time, {number} calls per sample"
    else:
        stub_driver()
        stream, make, sync, clock = fake_stream(), fake_array, None, time.thread_time
        driver = (f"stubbed ({why}): numba-cuda's real path up to the driver call, which is a "
                  f"Python stand-in on both paths; clock: this thread's CPU time (pure host "
                  f"work: time spent waiting for a core on a shared machine is not counted)")
    calls = launcher_calls(make, stream)
    unknown = sorted(set(names or ()) - set(calls))
    if unknown:
        raise SystemExit(f"benchmarks.launch: unknown launcher(s) {unknown}; choose from "
                         f"{sorted(calls)}.")
    rows = {name: measure(calls[name], stream, number, repeat, sync, clock)
            for name in (names or calls)}
    from kernels import launch_cache
    return {"driver": driver, "numba_cuda": launch_cache.numba_cuda_version(),
            "machine": f"{os.cpu_count()} CPU cores", "number": number, "repeat": repeat,
            "launchers": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--launchers", help="comma-separated names (default: all)")
    parser.add_argument("--number", type=int, default=NUMBER, help="calls per sample")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="samples (median quoted)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_NUMBER} calls x {SMOKE_REPEAT} samples: checks the program "
                             f"runs (its times mean little)")
    parser.add_argument("--out", help="also write the JSON here (atomically)")
    args = parser.parse_args(argv)
    names = [n for n in (args.launchers or "").split(",") if n]
    number, repeat = (SMOKE_NUMBER, SMOKE_REPEAT) if args.smoke else (args.number, args.repeat)
    doc = run(names, number, repeat)
    if args.out:
        common.write_json("launch", doc, common.device_info(), out=args.out)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"host µs per launcher call, median of {doc['repeat']} samples of {doc['number']} "
          f"calls; numba-cuda {doc['numba_cuda']}; {doc['machine']}\ndriver: {doc['driver']}\n")
    rows = [dict(name=name, **row) for name, row in doc["launchers"].items()]
    common.print_table(rows, [("name", "launcher", ""), ("launches", "launches", "d"),
                              ("numba_us", "numba µs", ".1f"), ("cached_us", "cached µs", ".1f"),
                              ("cached_with_checks_us", "+ checks µs", ".1f"),
                              ("note", "not cached because", "")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
