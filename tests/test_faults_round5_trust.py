"""Bad input and faults, round five (issue 51), items 1, 2 and 3: what the library reads or
runs from places someone else may control. Each test of a refusal here failed on the code
before its fix (item 3's already passed: see its test).

1. **A kernel cache folder others can write.** numba's cache files (``*.nbi`` index,
   ``*.nbc`` data) are pickles: unpickling one runs whatever it was made to run. A folder
   others can write (mode 0777, say), or owned by another user, or an index file owned by
   another user, is now refused (``kernels/disk_cache.py``, ``distrust``): nothing there is
   unpickled, one ``KernelCacheWarning`` names the folder and the fix, and the kernels compile
   in memory. A child process (real numba-cuda, the driver stubbed as in
   ``tests/test_kernel_disk_cache.py``) plants an index whose unpickling creates a marker
   file, then takes each path that reads the cache: ``compile_ahead.missing`` (the check
   compiling ahead makes), ``disk_cache.load``, numba's own compile (what a kernel's first
   launch calls) and, for the CPU loops' ``@njit(cache=...)``, a loop's first call. The
   marker must never appear. (The CPU loops' files are checked when their module is imported,
   so the index file of another user is planted before that import.) (The simulator's kernels read no cache: nothing to check there.)
2. **The compile-ahead child imports from the working directory.** ``python -m`` puts the
   working directory first on ``sys.path``; a ``kernels/`` folder there was imported instead
   of ours. The child now starts with ``-P``; a planted ``kernels`` and ``mirrored`` that
   would create a marker are never imported, and the child still runs ours.
3. **A checkpoint's input shape.** ``Checkpoint.restore`` into a model not built yet builds
   it from the shape the file records; one declaring a 10**12-element example is refused
   before anything is built (round four's check, ``mirrored/checkpoint.py``).

Neighbours: kernels/disk_cache.py, kernels/compile_ahead.py, mirrored/checkpoint.py,
tests/test_kernel_disk_cache.py (the cache's other checks), tests/test_faults_round4_shapes.py.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mirrored as tf
from kernels import compile_ahead, disk_cache

ROOT = Path(__file__).resolve().parent.parent
#: Seconds the cache child may take: it imports numba-cuda and compiles one small CUDA kernel
#: and one CPU loop (a few seconds on a busy 2-core machine).
CHILD_S = 300
#: A user id no one here is: the owner of "another user's" folder (root may chown to it).
OTHER_UID = 12345

# The child: real numba-cuda, the driver stubbed; argv: the case, the marker's path.
PLANTED = r"""
import json, os, pickle, sys, types, warnings
case, marker = sys.argv[1], sys.argv[2]
from benchmarks.launch import stub_driver
stub_driver()
from numba.core.caching import FunctionCache

class Payload:                      # unpickling it creates the marker: code run from the file
    def __reduce__(self):
        return (open, (marker, "w"))

def plant(index_path):
    with open(index_path, "wb") as f:
        pickle.dump(Payload(), f)
    if case == "an index file of another user":
        os.chown(index_path, OTHER_UID, -1)

# the folder numba keeps kernels/optimizers.py's files in (made now), made untrusted first
source = os.path.join(ROOT, "kernels", "optimizers.py")
folder = FunctionCache(types.FunctionType(compile("", source, "exec"), {}, "f")).cache_path
if case == "a world-writable folder":
    os.chmod(folder, 0o777)
elif case == "a folder of another user":
    os.chown(folder, OTHER_UID, -1)
else:                               # the CPU loops' files are checked at import: one there now
    plant(os.path.join(folder, "optimizers.planted-1.py311.nbi"))

warnings.simplefilter("always")
ran = {}
with warnings.catch_warnings(record=True) as caught:
    import numpy as np
    from kernels import compile_ahead, disk_cache, optimizers
    kernel = optimizers.sgd_kernel
    assert disk_cache.kept(kernel) and kernel.stats.cache_path == folder, kernel.stats.cache_path
    plant(kernel._cache._cache_file._index_path)
    args = (np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(4, np.float32))
    types_ = tuple(kernel.typeof_pyval(a) for a in args)

    def took(path, action):
        action()
        ran[path] = os.path.exists(marker)
        if ran[path]:
            os.remove(marker)

    took("compile_ahead.missing", lambda: compile_ahead.missing([(kernel, args)]))
    took("disk_cache.load", lambda: disk_cache.load(kernel, types_))
    took("numba's compile (a first launch)", lambda: kernel.compile(types_))
    loop = optimizers._adam_loop
    plant(FunctionCache(loop.py_func)._cache_file._index_path)
    hyper = np.zeros(8, np.float32)
    took("a CPU loop's first call", lambda: loop(*[np.zeros(3, np.float32)] * 4, hyper))
print(json.dumps({"folder": folder, "ran": ran,
                  "warnings": [str(w.message) for w in caught
                               if issubclass(w.category, disk_cache.KernelCacheWarning)]}))
"""


def _child(code, args, **env):
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    environ.update(env, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    prelude = f"ROOT = {str(ROOT)!r}\nOTHER_UID = {OTHER_UID}\n"
    run = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *map(str, args)],
                         cwd=ROOT, env=environ, capture_output=True, text=True, timeout=CHILD_S)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# --- 1. a kernel cache folder others can write ------------------------------------------------

@pytest.mark.parametrize("case", ["a world-writable folder", "a folder of another user",
                                  "an index file of another user"])
def test_a_planted_cache_index_never_runs_and_the_warning_names_the_folder(tmp_path, case):
    if case != "a world-writable folder" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (os.chown); this runs as "
                    f"user {os.geteuid()}")
    marker = tmp_path / "planted-code-ran"
    out = _child(PLANTED, [case, marker], NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    assert out["ran"] and not any(out["ran"].values()), \
        f"{case}: the planted index was unpickled (its code ran) by {out['ran']}"
    assert not marker.exists()
    assert len(out["warnings"]) == 1, out["warnings"]      # once, however many paths read
    words = out["warnings"][0]
    assert out["folder"] in words and "not trusted" in words and "chmod go-w" in words, words
    assert {"a world-writable folder": "writable by its group and everyone", "a folder of another user":
            f"owned by user id {OTHER_UID}", "an index file of another user":
            "its file optimizers.planted-1.py311.nbi is owned by user id"}[case] in words, words


def test_distrust_says_what_is_wrong_and_a_private_folder_is_trusted(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o755)
    (folder / "m.f-1.py311.nbi").write_bytes(b"")
    os.chmod(folder, 0o755)
    assert disk_cache.distrust(str(folder)) == ""
    assert disk_cache.distrust(str(tmp_path / "not made yet")) == ""      # nothing to read
    os.chmod(folder / "m.f-1.py311.nbi", 0o664)
    assert "its file m.f-1.py311.nbi is writable by its group (mode 664)" in disk_cache.distrust(
        str(folder))
    assert disk_cache.distrust(str(folder), "other.") == ""      # not that kernel's file
    os.chmod(folder, 0o1777)                                   # sticky or not: others may add files
    assert "the folder is writable by its group and everyone" in disk_cache.distrust(str(folder))


def test_info_says_the_cache_folder_is_not_trusted_and_why(tmp_path, monkeypatch):
    """``python -m mirrored info``'s cache line, from ``disk_cache.note`` (as info calls it)."""
    folder = tmp_path / "cache"
    folder.mkdir()
    os.chmod(folder, 0o777)

    class Kept:                      # a kernel kept on disk in that folder (what note reads)
        class stats:
            cache_path = str(folder)
        py_func = test_info_says_the_cache_folder_is_not_trusted_and_why

    monkeypatch.setenv(disk_cache.CACHE_VAR, "1")
    line = disk_cache.note([Kept], [Kept])
    assert line.startswith("off, folder not trusted") and str(folder) in line, line
    assert "writable by" in line and "chmod go-w" in line and "NUMBA_CACHE_DIR" in line, line
    os.chmod(folder, 0o755)
    assert disk_cache.note([Kept], [Kept]).startswith("on for 1 of 1 kernels")


# --- 2. the compile-ahead child imports only our packages ---------------------------------------

def test_the_compile_ahead_child_never_imports_the_working_directorys_kernels(tmp_path,
                                                                              monkeypatch):
    """A working directory holding ``kernels/`` and ``mirrored/`` that create a marker when
    imported: the child started by ``compile_all`` (its real command) runs our
    ``kernels.compile_ahead`` (it reports on its job) and imports neither."""
    marker = tmp_path / "planted-package-ran"
    for package in ("kernels", "mirrored"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write({package!r})\n")
    monkeypatch.chdir(tmp_path)

    class Kernel:                    # two index files: one job here, one for the child,
        class stats:                 # which cannot make its kernel (no such module)
            cache_path = str(tmp_path)

        def __init__(self, line):
            self.line = line

        def compile(self, types):
            pass

    monkeypatch.setattr(compile_ahead.disk_cache, "file_prefix", lambda k: f"f-{k.line}.")
    monkeypatch.setattr(compile_ahead, "job", lambda kernel, types: {
        "label": "planted_check", "module": "kernels.no_such_module", "made_by": [],
        "signature": "void()"})
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")      # the child selects a simulated device
    report = compile_ahead.compile_all([(Kernel(0), ()), (Kernel(1), ())], 0, 1)
    assert not marker.exists(), f"the child imported the working directory's {marker.read_text()}"
    assert report["children"] == 1 and len(report["errors"]) == 1, report
    assert report["errors"][0].startswith("planted_check void(): ModuleNotFoundError"), report


# --- 3. a checkpoint's input shape is checked before anything is built --------------------------

def test_a_checkpoint_declaring_a_10_to_the_12_element_input_is_refused_before_building(
        devices, tmp_path, rng):
    """Already true before issue 51 (round four's ``_check_planned``): kept as the issue's
    test. (10**6, 10**6) in front of Flatten + Dense(3) would be a (10**12, 3) kernel, 12 TB."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    L = tf.keras.layers

    def model(input_shape=None):
        with strategy.scope():
            return tf.keras.Sequential([L.Flatten(**({"input_shape": input_shape} if input_shape else {})),
                                        L.Dense(3)])
    saved = model((2, 2))
    saved.set_weights([rng.standard_normal(w.shape).astype(np.float32) for w in saved.get_weights()])
    path = tf.train.Checkpoint(model=saved).write(str(tmp_path / "ckpt")) + ".npz"
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["model:model/input_shape"] = np.array([10**6, 10**6], np.int64)
    with open(tmp_path / "huge.npz", "wb") as f:
        np.savez(f, **arrays)
    fresh = model()
    with pytest.raises(ValueError, match=r"\(1000000, 1000000\).*Nothing was built") as err:
        tf.train.Checkpoint(model=fresh).restore(str(tmp_path / "huge"))
    assert "(1000000000000, 3)" in str(err.value), err.value
    assert not fresh.built and not any(layer.built for layer in fresh.layers)
