"""Compiled kernels kept on disk (kernels/registry.py, ``keep_on_disk``).

The course lab's first epoch spent 4.9-7.4 s of its 6-9 s compiling 15 kernels on an H100
(benchmarks/RESULTS.md); with numba-cuda's disk cache a second process loads them instead.
The cache is only safe where numba notices every edit that changes a kernel: its own file,
not the files of the device functions it calls. These tests check the rule on the real
kernel objects (a child process with the simulator off: decorating and registering needs
no GPU), on a made-up pair of files, and, on a real GPU, that a second process loads a
kernel the first one compiled.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Seconds a child may take to import numba-cuda and every kernel module.
CHILD_S = 240


def _child(code, cwd=ROOT, **env):
    """Run ``code`` in a fresh Python with the real numba-cuda (no simulator); its last
    stdout line, parsed as JSON."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **env,
               PYTHONPATH=os.pathsep.join(p for p in (str(cwd), str(ROOT),
                                                      os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=CHILD_S)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


_EVERY_KERNEL = """
    import json
    from kernels import registry
    print(json.dumps([[s.label, s.kernel.stats.cache_path is not None,
                       registry.device_functions_from_other_files(s.kernel)]
                      for s in registry.registered()]))
"""


def test_every_kernel_is_kept_on_disk_unless_it_calls_another_files_device_function():
    rows = _child(_EVERY_KERNEL)
    assert len(rows) > 50
    for label, cached, others in rows:
        assert cached == (not others), (label, cached, others)
    uncached = [label for label, cached, _ in rows if not cached]
    # the library's kernels are cached; only the "simple version first" v1/v2 convs and
    # pools reach kernels/launch.py's index helpers,
    assert len(uncached) < len(rows) // 4, uncached
    # and the random tensors' kernels (kernels/random_fill.py), which call dropout.py's mix64:
    # one definition of the generator for masks and random tensors, compiled per process
    assert all(any(v in label for v in ("_v1", "_v2", "random_")) for label in uncached), uncached


def test_the_environment_variable_keeps_nothing_on_disk():
    rows = _child(_EVERY_KERNEL, MIRRORED_KERNEL_CACHE="0")
    assert rows and not any(cached for _, cached, _ in rows)


def test_a_device_function_of_another_file_is_found_through_the_kernels_own_helpers(tmp_path):
    (tmp_path / "helpers_elsewhere.py").write_text(textwrap.dedent("""
        from numba import cuda

        @cuda.jit(device=True, inline="always")
        def twice(v):
            return 2 * v
    """))
    (tmp_path / "made_up_kernels.py").write_text(textwrap.dedent("""
        from numba import cuda
        from helpers_elsewhere import twice

        @cuda.jit(device=True, inline="always")
        def plus_one(v):
            return v + 1

        @cuda.jit(device=True, inline="always")
        def twice_plus_one(v):
            return twice(v) + 1           # the other file, one call down

        @cuda.jit
        def own_only(x):
            x[0] = plus_one(x[0])

        @cuda.jit
        def through_a_helper(x):
            x[0] = twice_plus_one(x[0])

        def make(fn):                     # a factory: the device function in a closure
            @cuda.jit
            def closed(x):
                x[0] = fn(x[0])
            return closed

        closed_other, closed_own = make(twice), make(plus_one)
    """))
    found = _child("""
        import json
        from kernels import registry
        import made_up_kernels as m
        names = ("own_only", "through_a_helper", "closed_other", "closed_own")
        print(json.dumps({n: [registry.device_functions_from_other_files(getattr(m, n)),
                              registry.keep_on_disk(getattr(m, n)),
                              getattr(m, n).stats.cache_path is not None] for n in names}))
    """, cwd=tmp_path)
    assert found["own_only"] == [[], True, True]
    assert found["closed_own"] == [[], True, True]
    assert found["through_a_helper"] == [["twice (helpers_elsewhere.py)"], False, False]
    assert found["closed_other"] == [["fn (helpers_elsewhere.py)"], False, False]


@pytest.mark.gpu
def test_a_second_process_loads_the_kernel_the_first_compiled(tmp_path):
    code = """
        import json
        import numpy as np
        from numba import cuda
        from kernels import elementwise
        x = cuda.to_device(np.arange(1000, dtype=np.float32))
        y = cuda.to_device(np.full(1000, np.nan, np.float32))
        elementwise.binary("mul", x, x, y)
        stats = elementwise.BINARY_KERNELS["mul"].stats
        print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values()),
                          bool(np.array_equal(y.copy_to_host(), np.arange(1000, dtype=np.float32) ** 2))]))
    """
    first = _child(code, NUMBA_CACHE_DIR=str(tmp_path))
    second = _child(code, NUMBA_CACHE_DIR=str(tmp_path))
    assert first == [0, 1, True]          # compiled, and written to the cache
    assert second == [1, 0, True]         # loaded, not compiled; the same result


@pytest.mark.gpu
def test_two_threads_launching_kernels_loaded_from_the_cache_at_once(tmp_path):
    """A kernel loaded from the disk cache loads its code into the context at its first
    launch; numba-cuda does that without a lock, and two replicas' threads once both did it
    ("key already in dictionary: <CUlibrary ...>", 2 logical GPUs on the H100). Launches on
    numba's path are serialised (kernels/launch_cache.py): every kernel here, in two threads
    that start together, on their own streams, from a warm cache. As in the library, the
    main thread starts CUDA and makes the streams and buffers; the threads only launch.
    Nothing waits without a limit: a stuck thread is reported, not waited on."""
    code = """
        import json, os, sys, threading
        import numpy as np
        from numba import cuda
        from kernels import elementwise
        ops = sorted(elementwise.BINARY_KERNELS)
        streams = [cuda.stream() for _ in range(2)]
        xs = [cuda.to_device(np.arange(1, 257, dtype=np.float32) * (r + 1)) for r in range(2)]
        outs = {(r, op): cuda.device_array(256, np.float32) for r in range(2) for op in ops}
        cuda.synchronize()
        barrier, errors, results = threading.Barrier(2, timeout=60), [], {}
        def replica(r):
            try:
                barrier.wait()
                for op in ops:
                    elementwise.binary(op, xs[r], xs[r], outs[(r, op)], streams[r])
                streams[r].synchronize()
            except Exception as err:
                errors.append(repr(err))
        threads = [threading.Thread(target=replica, args=(r,), daemon=True) for r in range(2)]
        [t.start() for t in threads]
        [t.join(timeout=120) for t in threads]
        errors += [f"replica {r} still running after 120 s" for r, t in enumerate(threads) if t.is_alive()]
        results = {key: out.copy_to_host() for key, out in outs.items()} if not errors else {}
        stats = [elementwise.BINARY_KERNELS[op].stats for op in ops]
        hits = sum(sum(s.cache_hits.values()) for s in stats)
        misses = sum(sum(s.cache_misses.values()) for s in stats)
        x = [np.arange(1, 257, dtype=np.float32) * (r + 1) for r in range(2)]
        want = {"add": lambda a: a + a, "sub": lambda a: a - a, "mul": lambda a: a * a,
                "div": lambda a: a / a, "rsub": lambda a: a - a, "rdiv": lambda a: a / a}
        wrong = [f"{op} on replica {r}" for r in range(2) for op in ops
                 if (r, op) in results and not np.array_equal(results[(r, op)], want[op](x[r]))]
        print(json.dumps([errors, hits, misses, len(ops), wrong]), flush=True)
        os._exit(0)      # a stuck thread (reported above) must not hold the exit
    """
    errors, _, _, _, wrong = _child(code, NUMBA_CACHE_DIR=str(tmp_path))   # fills the cache
    assert errors == [] and wrong == []
    errors, hits, misses, n_ops, wrong = _child(code, NUMBA_CACHE_DIR=str(tmp_path))
    assert errors == [] and wrong == []
    assert misses == 0 and hits >= n_ops    # every kernel loaded from the cache, none compiled


def test_info_says_whether_kernels_are_kept_and_where(tmp_path):
    """``python -m mirrored info``'s "kernel cache" line: on, for how many kernels and where
    (``NUMBA_CACHE_DIR`` here); off with the variable; nothing to keep in the simulator."""
    rows = _child(_EVERY_KERNEL)
    cached = sum(1 for _, on, _ in rows if on)
    line = _child("""
        import json
        from kernels import registry
        print(json.dumps(registry.disk_cache_note()))
    """, NUMBA_CACHE_DIR=str(tmp_path))
    assert line.startswith(f"on for {cached} of {len(rows)} kernels") and str(tmp_path) in line, line
    off = _child("""
        import json
        from kernels import registry
        print(json.dumps(registry.disk_cache_note()))
    """, MIRRORED_KERNEL_CACHE="0")
    assert off.startswith("off (MIRRORED_KERNEL_CACHE=0)"), off
    from mirrored import info          # this process: the simulator where there is no GPU
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        assert "kernel cache nothing to keep: the CUDA simulator compiles nothing" in info.report()
