"""GPU-only hazards, caught without a GPU (issue 19).

Numba's CUDA simulator is synchronous, single-device and forgiving: no stream ordering,
no grid limits, no real allocations, no graph capture. Each test here catches one thing
that only goes wrong on hardware, by one of three means:

* a child process with ``NUMBA_ENABLE_CUDASIM=0`` that builds *real* numba-cuda objects
  over a fake device pointer (no driver is ever called);
* a monkeypatched launcher or driver object that records what would be sent to the GPU;
* the simulator itself, with the GPU's launch constants on small grids.

Each section names the hazard, and each test fails on the code before its fix.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Seconds a child process may take to import numba-cuda and run a few lines.
CHILD_TIMEOUT = 120


def run_real_numba_cuda(code):
    """Run ``code`` in a child process with real (not simulated) numba-cuda and no GPU
    calls: ``ensure_context`` is replaced by a no-op, so array views can be made over a
    fake pointer. Returns stdout; fails the test with stderr if the child failed."""
    prelude = textwrap.dedent("""
        import contextlib, ctypes, gc, sys, weakref
        import numpy as np
        sys.path.insert(0, %r)
        from numba.cuda.cudadrv import devices as _devices
        from numba.cuda.cudadrv import driver as _driver
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        _devices._runtime.ensure_context = contextlib.nullcontext   # no driver, no context

        def fake_allocation(nbytes, freed, address=0x7f0000000000):
            '''What numba's memalloc returns (an OwnedPointer over an AutoFreePointer that
            the context's allocation table holds until the last view goes), over a fake
            address; ``freed`` records when cuMemFree would be queued.'''
            table = {}
            def free():
                table.pop(address, None)
                freed.append(nbytes)
            mem = _driver.AutoFreePointer(object(), ctypes.c_void_p(address), nbytes, finalizer=free)
            table[address] = mem
            return mem.own(), table
    """ % ROOT)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT, cwd=ROOT)
    assert out.returncode == 0, f"child process failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


# --- 1. memory accounting: refunded when the memory is freed, not before -----------------

def test_refund_waits_for_the_last_view_of_a_real_numba_cuda_allocation():
    # batch_reduce returns slices of a fused buffer and drops the buffer itself: with real
    # numba-cuda each slice holds its own OwnedPointer, so a refund hung on the base
    # array's pointer fired while the slices still held the memory.
    out = run_real_numba_cuda("""
        from mirrored.devices import Device, PhysicalDevice
        dev = Device(0, PhysicalDevice("/physical_device:GPU:0", "GPU"))
        freed = []
        pointer, table = fake_allocation(400, freed)
        base = DeviceNDArray((100,), (4,), np.dtype("float32"), gpu_data=pointer)
        del pointer
        dev._account(base, 400)
        view = base[10:20].reshape(2, 5)
        del base; gc.collect()
        print("with a view", dev.bytes_in_use, freed)
        del view; gc.collect()
        print("after it", dev.bytes_in_use, freed)
    """)
    assert "with a view 400 []" in out, f"refunded while a view still held the memory:\n{out}"
    assert "after it 0 [400]" in out, f"not refunded once the memory was freed:\n{out}"


def test_sum_all_scratch_is_charged_once_and_reused(devices, rng):
    gpu = devices(cpus=1, gpus=1)[1]
    from kernels import reduction
    x = rng.standard_normal(77).astype(np.float32)
    x_dev = gpu.from_numpy(x)
    out = gpu.empty((1,), np.float32)
    before = gpu.bytes_in_use
    for _ in range(3):
        gpu.ops.sum_all(x_dev, out)
    scratch = reduction.SUM_BLOCKS * 4
    assert gpu.bytes_in_use == before + scratch, (
        f"sum_all's partial buffer must be charged to the device once ({scratch} bytes) "
        f"and reused; bytes_in_use went from {before} to {gpu.bytes_in_use}")
    np.testing.assert_allclose(gpu.to_numpy(out)[0], x.astype(np.float64).sum(), rtol=1e-5)
