"""The cached launch (kernels/launch_cache.py), checked with no GPU.

Numba-cuda's real launch path cannot run in the simulator this suite uses, so each test runs a
child process with ``NUMBA_ENABLE_CUDASIM=0`` and the driver stubbed
(``benchmarks.launch.stub_driver``: kernels compile for real, arrays are numba device arrays over
addresses nothing reads, and the two driver calls record what they were given). What is checked:

* for every registered kernel signature, the parameter bytes the cache sends cuLaunchKernel
  equal the bytes numba's own launch hands cuda.core (converted by cuda.core's ``ParamHolder``,
  as numba's launch does), word for word, with the word sizes the kernel's ABI expects;
* scalars written into their slots in place give numba's bytes for the new values;
* a freed or replaced buffer is never launched with from a record;
* the numba-cuda names the cache reads exist; where one is missing, the cache says which
  numba-cuda version lacks it and every launch takes numba's path.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import run_smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Seconds a child may take (it compiles a few kernels with the real NVVM).
CHILD_TIMEOUT = 600

PRELUDE = """
import ctypes, gc, json, sys, warnings
import numpy as np
sys.path.insert(0, %r)
from benchmarks.launch import fake_array, fake_stream, stub_driver
stub = stub_driver()
from kernels import launch as kl, launch_cache
from cuda.core._kernel_arg_handler import ParamHolder

def numba_bytes(sizes):
    '''The bytes of numba's last launch, as cuda.core packs them, one entry per word.'''
    words = stub.numba[3]
    holder = ParamHolder(list(words))
    addresses = (ctypes.c_void_p * len(words)).from_address(holder.ptr)
    return len(words), [ctypes.string_at(a, n).hex() for a, n in zip(addresses, sizes)]

def cached_bytes(sizes):
    '''The bytes the cache's last cuLaunchKernel points at, one entry per word.'''
    params = stub.cached[9]
    addresses = (ctypes.c_void_p * len(sizes)).from_address(params)
    return [ctypes.string_at(a, n).hex() for a, n in zip(addresses, sizes)]
""" % ROOT


def run_child(code, **environ):
    """Run PRELUDE + ``code`` with real numba-cuda (and ``environ`` added to the environment);
    return the JSON it prints last."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **environ,
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT, cwd=ROOT)
    assert out.returncode == 0, f"child process failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_packed_bytes_equal_numbas_for_every_registered_signature():
    result = run_child("""
        from numba.cuda import types
        from numba.cuda.core import sigutils
        from numba.cuda.dispatcher import _Kernel
        from numba.cuda.np.numpy_support import as_dtype
        from kernels import registry
        rng = np.random.default_rng()

        class Library:                      # what numba's launch asks for the kernel's handle
            def get_cufunc(self):
                return stub_cufunc
        from benchmarks.launch import StubCufunc
        stub_cufunc = StubCufunc(0x4242)

        def abi_sizes(ty):
            '''Bytes of each parameter word the compiled kernel reads for one argument.'''
            if isinstance(ty, types.Array):
                return [8] * (5 + 2 * ty.ndim)     # meminfo, parent, size, itemsize, data, shape, strides
            return [1 if ty == types.boolean else ty.bitwidth // 8]

        def value_for(ty):
            if isinstance(ty, types.Array):
                shape = tuple(int(s) for s in rng.integers(1, 7, ty.ndim))
                return fake_array(shape, as_dtype(ty.dtype))
            dtype = as_dtype(ty)
            if dtype.kind == "f":
                return dtype.type(rng.standard_normal() * 1e3)
            info = np.iinfo(dtype)
            return dtype.type(rng.integers(info.min, info.max, endpoint=True, dtype=dtype))

        stream, checked, bad = fake_stream(), 0, []
        for spec in registry.registered():
            for signature in spec.signatures:
                argtypes, _ = sigutils.normalize_signature(signature)
                kernel = _Kernel.__new__(_Kernel)          # numba's class, not compiled
                kernel.signature = types.void(*argtypes)
                kernel.extensions, kernel.debug, kernel.cooperative = [], False, False
                kernel._codelibrary, kernel.py_func = Library(), spec.kernel.py_func
                args = [value_for(t) for t in argtypes]
                grid, block = (3, 2, 1), (32, 4, 1)
                kernel.launch(args, grid, block, stream)    # numba's real launch
                record = launch_cache.make_record(kernel, grid, block, stream, args)
                assert isinstance(record, launch_cache.Record), (spec.label, getattr(record, "why", ""))
                record.launch(args)                          # the cached launch
                sizes = [n for t in argtypes for n in abi_sizes(t)]
                words, theirs = numba_bytes(sizes)
                ours = cached_bytes(sizes)
                our_sizes = [ctypes.sizeof(w) for w in record.storage[0]]
                if (words, theirs, our_sizes) != (len(sizes), ours, sizes):
                    bad.append([spec.label, signature, words, len(sizes), our_sizes, sizes])
                if stub.cached[:7] != (record.func, *grid, *block) or stub.cached[8] is not record.stream:
                    bad.append([spec.label, "launch dims or stream", str(stub.cached[:9])])
                checked += 1
        print(json.dumps({"checked": checked, "bad": bad,
                          "registered": sum(len(s.signatures) for s in registry.registered())}))
    """)
    assert result["bad"] == [], result["bad"][:5]
    assert result["checked"] == result["registered"] > 100


def test_slots_and_records_through_the_launchers():
    # Real dispatch and compile: dropout's key and the ring step's chunk bounds change every
    # call (slots written in place); each cached launch sends numba's bytes for the same call.
    result = run_child("""
        from kernels import allreduce, dropout
        stream = fake_stream()
        x, out = fake_array((33,), np.float32), fake_array((33,), np.float32)
        own, peer = fake_array((65,), np.float32), fake_array((65,), np.float32)
        rng = np.random.default_rng()

        def cached_equals_numba(call, kernel, grid, block, args):
            # None if ``call`` took numba's path, else whether the cache sent numba's bytes.
            stub.cached = None
            call()
            if stub.cached is None:
                return None
            params = stub.cached[9]
            kernel[grid, block, stream](*args)             # numba's path, the same arguments
            words = stub.numba[3]
            sizes = [8 if isinstance(w, int) else ctypes.sizeof(w) for w in words]
            stub.cached = (None,) * 9 + (params,)
            return numba_bytes(sizes)[1] == cached_bytes(sizes)

        results = []
        threshold, scale = dropout.threshold_and_scale(0.25)
        for i in range(6):
            key = int(rng.integers(0, 2**64, dtype=np.uint64))
            results.append(["dropout", cached_equals_numba(
                lambda: dropout.dropout(x, out, 0.25, key, stream=stream),
                dropout.dropout_v1, *kl.grid_1d(33), (x, out, np.uint64(key), threshold, scale))])
        for i in range(6):
            lo = int(rng.integers(0, 34))
            hi = lo + 31                 # the grid follows the chunk's length: keep it fixed
            results.append(["ring", cached_equals_numba(
                lambda: allreduce.ring_reduce_step(own, peer, lo, hi, stream=stream),
                allreduce.ring_reduce_step_kernel, *kl.grid_1d(31),
                (own, peer, np.int64(lo), np.int64(hi)))])
        print(json.dumps(results))
    """)
    for name in ("dropout", "ring"):
        seen = [r[1] for r in result if r[0] == name]
        # The first two launches of a key take numba's path; from the third on the cache sends
        # them, with numba's bytes for the new scalars.
        assert seen == [None, None, True, True, True, True], (name, seen)


def test_a_freed_or_replaced_buffer_is_never_launched_from_a_record():
    result = run_child("""
        from kernels import elementwise
        stream = fake_stream()
        freed = []
        x, y = fake_array((31,), np.float32), fake_array((31,), np.float32)
        out = fake_array((31,), np.float32, freed=freed)
        address = out.device_ctypes_pointer.value
        for _ in range(3):
            elementwise.binary("add", x, y, out, stream=stream)
        key = launch_cache.key(elementwise.BINARY_KERNELS["add"], *kl.grid_1d(31), stream,
                               (x, y, out))
        cached_before = launch_cache.explain(key)
        del out; gc.collect()
        freed_now, after_free = list(freed), launch_cache.explain(key)

        # A new buffer at the very address the old one had, with another length: every launch
        # with it must carry its own length, never the record's.
        x2, y2 = fake_array((17,), np.float32), fake_array((17,), np.float32)
        new = fake_array((17,), np.float32, address=address)
        sent = []
        for _ in range(3):
            stub.numba = stub.cached = None
            elementwise.binary("add", x2, y2, new, stream=stream)
            if stub.cached is None:                     # numba's path: its words
                words = [int(w) for w in stub.numba[3]]
            else:                                       # the cache: the bytes it points at
                words = [int.from_bytes(bytes.fromhex(b), "little")
                         for b in cached_bytes([8] * 21)]
            sent.append([words[14 + 2], words[14 + 4]])   # third array: size, data pointer
        print(json.dumps({"cached_before": cached_before, "freed": freed_now == [address],
                          "after_free": after_free, "sent": sent, "address": address}))
    """)
    assert result["cached_before"] == "cached"
    assert result["freed"], "the cache must not keep a dropped buffer alive"
    assert result["after_free"] != "cached"
    assert result["sent"] == [[17, result["address"]]] * 3


def test_numba_names_exist_and_a_missing_one_falls_back_to_numbas_path():
    result = run_child("""
        missing = launch_cache.missing_numba_names()
        # A numba-cuda release that renamed a name the cache reads:
        launch_cache.NUMBA_NAMES += (("numba.cuda.dispatcher", "_Kernel._prepare_args_renamed"),)
        from kernels import elementwise
        stream = fake_stream()
        x, out = fake_array((5,), np.float32), fake_array((5,), np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                stub.numba = None
                elementwise.unary("neg", x, out, stream=stream)
                assert stub.numba is not None                   # numba's path ran, every time
        print(json.dumps({"missing_before": missing, "cached_calls": stub.cached is not None,
                          "warnings": [str(w.message) for w in caught]}))
    """)
    assert result["missing_before"] == []
    assert not result["cached_calls"]
    from importlib import metadata
    version = metadata.version("numba-cuda")
    assert any(f"numba-cuda {version}" in w and "_prepare_args_renamed" in w
               for w in result["warnings"]), \
        result["warnings"]


def test_the_environment_can_turn_the_cache_off():
    result = run_child("""
        from kernels import elementwise
        stream = fake_stream()
        x, out = fake_array((9,), np.float32), fake_array((9,), np.float32)
        numba_launches = 0
        for _ in range(4):
            stub.numba = None
            elementwise.unary("neg", x, out, stream=stream)
            numba_launches += stub.numba is not None
        print(json.dumps({"numba": numba_launches, "cached": stub.cached is not None,
                          "why": launch_cache.explain(None)}))
    """, MIRRORED_LAUNCH_CACHE="0")
    assert result == {"numba": 4, "cached": False, "why": "MIRRORED_LAUNCH_CACHE=0 is set"}


def test_a_failed_driver_call_raises():
    result = run_child("""
        from kernels import elementwise
        stream = fake_stream()
        x, out = fake_array((5,), np.float32), fake_array((5,), np.float32)
        for _ in range(2):
            elementwise.unary("neg", x, out, stream=stream)
        launch_cache.cuLaunchKernel = lambda *args: (700,)     # CUDA_ERROR_ILLEGAL_ADDRESS
        try:
            elementwise.unary("neg", x, out, stream=stream)
            message = None
        except RuntimeError as err:
            message = str(err)
        print(json.dumps({"message": message}))
    """)
    message = result["message"]
    assert message and "cuLaunchKernel returned 700 launching unary_kernel" in message
    assert "MIRRORED_LAUNCH_CACHE=0" in message


def test_requirements_pin_the_tested_numba_cuda_range():
    from importlib import metadata

    from packaging.specifiers import SpecifierSet
    line = next(l for l in open(os.path.join(ROOT, "requirements.txt"))
                if l.startswith("numba-cuda"))
    spec = SpecifierSet(line.split("]", 1)[1].split("#")[0].strip())
    assert any(s.operator in ("<", "<=") for s in spec), f"no upper bound in {line!r}"
    assert metadata.version("numba-cuda") in spec


def test_the_benchmark_runs_and_every_launch_it_times_is_cached(tmp_path):
    out = tmp_path / "launch.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = run_smoke("launch", "--json", "--out", str(out), env=env)   # every launcher, SMOKE_LIMIT_S
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["driver"].startswith(("stubbed", "real"))
    assert {"binary", "dropout", "sum_all", "conv2d_backward"} <= set(doc["launchers"])
    for name, row in doc["launchers"].items():
        assert row["note"] == "", (name, row["note"])          # every launch replayed
        assert all(row[k] > 0 for k in ("numba_us", "cached_us", "cached_with_checks_us"))
    assert doc["launchers"]["conv2d_backward"]["launches"] == 3
    assert json.loads(out.read_text())["launchers"] == doc["launchers"]
