"""How far one training step travels through the code: calls, files, functions, jumps.

    python -m benchmarks.step_path                      # lab ConvNet, 2 logical CPUs, batch 128
    python -m benchmarks.step_path --json /tmp/step_path.json
    python -m benchmarks.step_path --replicas 1 --batch 64
    python -m benchmarks.step_path --replayed           # the default fit: the step replayed

A student who follows one step of ``fit`` through the library opens every file the
step's calls land in. This program counts them. It builds the course lab's ConvNet
(``mirrored.lab.workflow.make_model``) under ``MirroredStrategy`` over ``--replicas``
logical CPUs, compiled with ``run_eagerly=True`` (the step's Python runs every step: what a
student follows, and what ``fit``'s default records once per batch size and then replays,
``mirrored/program/passes.py``), runs one warm-up ``fit`` (every buffer made, every loop compiled), then
``fit`` of ONE batch with ``sys.setprofile`` (and ``threading.setprofile``) on, and
records every call of a Python function in the project's own files (``mirrored/`` and
``kernels/``; NumPy, Numba and the tests are not counted). Each recorded call is one
"call"; a "jump" is a call landing in a different file from the call before it.

Three scopes, each counted over every project file and over ``mirrored/`` alone:

    fit    the whole ``model.fit`` of one batch (epoch set-up, callbacks, progress
           line, the step): what one fit step costs the reader end to end (issue 29's
           count: 1,238 calls in 26 files when it was filed; target <= 12 files)
    batch  fit's per-batch call, ``Trainer._train_on``: the batch prepared, then
           the step inside ``Step.rolled_back_on_error``
    step   from entering ``Step.train`` to the return of the optimizer's ``update``
           (the split, forward/backward, all-reduce, update: the issue's "from Step.train
           to the Adam update", 22 files when it was filed)

The table lists each file's calls in each scope. The counts are exact for this model,
batch and replica count: a call made once per layer or per replica is counted each
time. Compiled loops (Numba) and C functions are one call of the Python function
that calls them, or none.

``--replayed`` follows the default instead (``run_eagerly=False``): after the warm-up, the
step's device part is a recorded program replayed (``replay.Program.run``), so there is no
``step`` scope, only ``fit`` and ``batch``.

Neighbours: benchmarks/breakdown.py (where one step's TIME goes, part by part),
mirrored/__init__.py (the reading order this measures against).
"""
import argparse
import collections
import json
import os
import sys
import threading

import numpy as np

import mirrored as tf
from mirrored.lab import workflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tf.__file__)))
#: The project's library folders: calls in any other file are not recorded.
LIBRARY = ("mirrored/", "kernels/")
#: (file, qualified name) where each scope starts, and where it ends (None: where it started).
SCOPES = {
    "fit": (("mirrored/keras/trainer.py", "Trainer.fit"), None),
    "batch": (("mirrored/keras/trainer.py", "Trainer._train_on"), None),
    "step": (("mirrored/keras/step.py", "Step.train"), ("mirrored/keras/optimizers.py", "Optimizer.update")),
}


def library_file(filename):
    """``filename`` relative to the project root if it is a library file, else None."""
    if not filename.startswith(ROOT + os.sep):
        return None
    rel = os.path.relpath(filename, ROOT).replace(os.sep, "/")
    return rel if rel.startswith(LIBRARY) else None


def record(fn):
    """Run ``fn()`` with a profiler on; return its library events in order:
    ``("call" or "return", file, qualified name, thread id)``."""
    events = []
    relname = {}                                   # code object -> relative file (or None)

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        rel = relname.get(code, 0)
        if rel == 0:
            rel = relname[code] = library_file(code.co_filename)
        if rel is not None:
            events.append((event, rel, code.co_qualname, threading.get_ident()))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return events


def span(events, start, end=None):
    """The calls ``[(file, name)]`` from the first call of ``start`` (file, name) to the
    return of ``end`` (default: of that same call of ``start``), on the thread of start."""
    for i, (event, rel, name, thread) in enumerate(events):
        if event == "call" and (rel, name) == start:
            break
    else:
        raise ValueError(f"{start[1]} ({start[0]}) was never called in the traced run.")
    end = end or start
    depth, calls = 0, []
    for event, rel, name, t in events[i:]:
        if event == "call":
            calls.append((rel, name))
        if t != thread or (rel, name) != end:
            continue
        depth += 1 if event == "call" else -1
        if event == "return" and depth <= 0:
            return calls
    raise ValueError(f"{end[1]} ({end[0]}) never returned after {start[1]} was called.")


def summarise(calls, prefix=""):
    """Counts over calls ``[(file, name)]`` whose file starts with ``prefix``: calls, files
    (calls per file), functions, jumps (a call in a different file from the call before)."""
    calls = [c for c in calls if c[0].startswith(prefix)]
    per_file = collections.Counter(rel for rel, _ in calls)
    jumps = sum(1 for a, b in zip(calls, calls[1:]) if a[0] != b[0])
    return {"calls": len(calls), "files": len(per_file), "functions": len(set(calls)),
            "jumps": jumps, "per_file": dict(per_file.most_common())}


def lab_convnet(replicas=2, batch=128, seed=0, run_eagerly=True):
    """The lab ConvNet under MirroredStrategy over ``replicas`` logical CPUs (made here if
    there are not yet that many), compiled with ``run_eagerly``, and a one-batch data set of
    ``batch`` random examples."""
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
    except RuntimeError:                       # already set up (a test's process): use what is there
        if len(tf.config.list_logical_devices("CPU")) < replicas:
            raise
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        model = workflow.make_model("conv")
    model.run_eagerly = run_eagerly
    rng = np.random.default_rng(seed)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def follow(model, dataset, scopes=tuple(SCOPES)):
    """Trace ``model.fit(dataset, epochs=1)`` (after one warm-up fit): each of ``scopes``'
    counts, over the library (``all``) and over ``mirrored/`` alone (``mirrored``)."""
    model.fit(dataset, epochs=1, verbose=0)                       # warm-up: buffers, compiled loops
    events = record(lambda: model.fit(dataset, epochs=1, verbose=0))
    result = {}
    for scope in scopes:
        start, end = SCOPES[scope]
        calls = span(events, start, end)
        result[scope] = {"all": summarise(calls), "mirrored": summarise(calls, "mirrored/")}
    return result


def table(result):
    """The result as text: totals per scope, then each file's calls per scope."""
    lines = [f"{'':14} {'calls':>7} {'files':>6} {'functions':>10} {'jumps':>6}"]
    for scope, counts in result.items():
        for which in ("all", "mirrored"):
            c = counts[which]
            lines.append(f"{scope + ' ' + which:<14} {c['calls']:>7} {c['files']:>6} "
                         f"{c['functions']:>10} {c['jumps']:>6}")
    scopes = list(result)
    lines += ["", "calls per file: " + " ".join(f"{s:>6}" for s in scopes)]
    for rel in result[scopes[0]]["all"]["per_file"]:
        lines.append(f"  {rel:<30} " + " ".join(f"{result[s]['all']['per_file'].get(rel, 0):>6}"
                                                  for s in scopes))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="logical CPUs (default 2)")
    parser.add_argument("--batch", type=int, default=128, help="global batch (default 128)")
    parser.add_argument("--json", metavar="OUT", help="also write the counts as JSON to OUT")
    parser.add_argument("--replayed", action="store_true",
                        help="follow the default fit (run_eagerly=False): the step replayed")
    args = parser.parse_args(argv)
    model, dataset = lab_convnet(args.replicas, args.batch, run_eagerly=not args.replayed)
    result = follow(model, dataset, ("fit", "batch") if args.replayed else tuple(SCOPES))
    how = "replayed (the default)" if args.replayed else "its Python (run_eagerly=True)"
    print(f"One fit step of the lab ConvNet, {how}, {args.replicas} logical CPU(s), batch {args.batch}:")
    print(table(result))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"replicas": args.replicas, "batch": args.batch, "replayed": args.replayed,
                       "scopes": result}, f, indent=1)
        os.replace(tmp, args.json)
    return result


if __name__ == "__main__":
    main()
