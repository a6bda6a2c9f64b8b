"""The course lab "Mirrored Strategy: Basic" as written: 12 epochs of the full MNIST, timed.

``LAB_CELLS`` are the lab's code cells exactly as the course gives them (seed 002), with
only ``import tensorflow_datasets as tfds`` -> ``import mirrored.datasets as tfds`` and
``import tensorflow as tf`` -> ``import mirrored as tf``. ``tests/test_lab_convnet.py`` runs
them for one epoch and checks that the README shows them verbatim; this program runs them
as a student would, all 12 epochs, in a fresh Python process, and records:

    wall_s      the whole lab, from the first import to the end of fit (what a student waits)
    fit_s       model.fit(train_dataset, epochs=12) alone
    accuracy    model.evaluate(eval_dataset) after fit: a cell this program adds (the lab
                prints only the training accuracy); its time is not in wall_s
    cells_s     each cell's seconds, named by its first line (where the wall time goes:
                imports, loading the data, building the model, fit)
    epochs_s    each epoch's seconds within fit (a callback the program passes to fit; the
                cell's text is unchanged), so the first epoch's extra is epochs_s[0] minus
                the median of the others
    compile_s   seconds inside Numba's compilers during fit, CPU loops and CUDA kernels
                apart (Python to machine code or PTX; and how many kernels compiled), part
                of epochs_s[0]

    python -m benchmarks.course_lab --data-dir ~/tensorflow_datasets/mnist --out lab.json
    python -m benchmarks.course_lab --smoke              # a small, quick run: does it all work?

Cold and warm (issue 40): the lab runs twice in a row, each a fresh process, with one fresh
``NUMBA_CACHE_DIR`` (and ``CUDA_CACHE_PATH``, the driver's): "cold" finds the kernel cache
empty and compiles, "warm" loads what cold wrote, as a student's second run does. Both are
reported (``runs``). ``--serial-cold`` adds, first, "cold, compiled at launch": caches of its
own, empty, and ``MIRRORED_COMPILE_AHEAD=0``, so its kernels compile one after the other at
their first launch, as before ``kernels/compile_ahead.py``; each run's ``compile_ahead`` lists
what compiling ahead did (kernels missing, child processes, seconds).

PyTorch beside it (GPU only, where torch imports): the same ConvNet, initial weights, batch
and Adam as ``benchmarks.training``'s rows, trained for the same epochs on the same training
images in this process after the lab's runs: "eager" (``training.TorchRow``) and "cuda graph"
(``training.TorchGraphRow``: data on the device, Adam ``capturable=True``, the whole step
captured as one CUDA graph), each after one untimed warm-up epoch. ``--peer-epochs N``: N
timed epochs each instead (their ms/step is the median epoch's; ``total_s`` is then N epochs').

``--smoke``: one epoch of the first 512 training and 256 test images, the lab's dense model in
place of its ConvNet (no CPU loops to compile): for the test suite, well within a minute; it
writes only where ``--out`` points. A measured run writes only with ``--out``.

``--data-dir`` is a folder holding the four MNIST ``.gz`` files (the lab's own
``data_dir='./data'`` is kept: the program runs the lab in a scratch folder whose
``data/mnist`` points there). Without the full set the lab falls back to the bundled
8,000-image subset, and the JSON says so (``source``). ``--epochs`` changes the one
number, for a quick try. Target (issue 30, H100, x1 graph): wall <= 10 s, accuracy >= 98.5 %.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

LAB_CELLS = [
    '''\
# Import TensorFlow and TensorFlow Datasets

import mirrored.datasets as tfds
import mirrored as tf
tfds.disable_progress_bar()

import os
''',
    '''\
# Load the dataset we'll use for this lab
datasets, info = tfds.load(name='mnist', with_info=True, as_supervised=True, data_dir='./data')

mnist_train, mnist_test = datasets['train'], datasets['test']
''',
    '''\
# Define the strategy to use and print the number of devices found
strategy = tf.distribute.MirroredStrategy()
print('Number of devices: {}'.format(strategy.num_replicas_in_sync))
''',
    '''\
# Get the number of examples in the train and test sets
num_train_examples = info.splits['train'].num_examples
num_test_examples = info.splits['test'].num_examples

BUFFER_SIZE = 10000

BATCH_SIZE_PER_REPLICA = 64
# Use for Mirrored Strategy
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
# Use for No Strategy
# BATCH_SIZE = BATCH_SIZE_PER_REPLICA * 1
''',
    '''\
# Function for normalizing the image
def scale(image, label):
    image = tf.cast(image, tf.float32)
    image /= 255

    return image, label
''',
    '''\
# Set up the train and eval data set
train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)
''',
    '''\
# Use for Mirrored Strategy -- comment out `with strategy.scope():` and deindent for no strategy
with strategy.scope():
    model = tf.keras.Sequential([
      tf.keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),
      tf.keras.layers.MaxPooling2D(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(64, activation='relu'),
      tf.keras.layers.Dense(10)
    ])
''',
    '''\
model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=tf.keras.optimizers.Adam(),
                metrics=['accuracy'])
''',
    '''\
model.fit(train_dataset, epochs=12)
''',
]

#: What the program appends after the lab's cells (timing and the test accuracy); a line
#: starting with RESULT carries them back as JSON.
_MEASURE = """
import json as _json, sys, time as _time
_fit_s = _time.perf_counter() - _fit_start
_wall_s = _time.perf_counter() - _lab_start
_loss, _accuracy = model.evaluate(eval_dataset, verbose=0)
print("RESULT " + _json.dumps({"wall_s": _wall_s, "fit_s": _fit_s, "test_loss": float(_loss),
      "test_accuracy": float(_accuracy), "replicas": strategy.num_replicas_in_sync,
      "train_examples": num_train_examples, "source": info.source, "cells_s": _cells_s,
      "epochs_s": _epochs_s,
      "compile_s": {"cpu_loops": _cpu_compile.duration if _cpu_compile.done else 0.0,
                    "cuda_kernels": _cuda_compile["s"], "cuda_compiles": _cuda_compile["kernels"]},
      "compile_ahead": getattr(sys.modules.get("kernels.compile_ahead"), "log", [])}))
"""


#: Before fit: a clock for each epoch (a callback handed to the lab's own ``model.fit`` call)
#: and one for Numba's compilers, so the first epoch's extra time can be told apart: the CPU
#: loops' (the "numba:compile" event, outermost only) and the CUDA kernels' (numba-cuda 0.30
#: sends no event for a kernel's compile, so the program times ``CUDADispatcher.compile``,
#: outermost calls only: a kernel's device functions compile inside it).
_CLOCKS = """
import numba.core.event as _cpu_events
import numba.cuda.dispatcher as _cuda_dispatcher
from mirrored.keras.callbacks import LambdaCallback as _LambdaCallback
_cpu_compile = _cpu_events.TimingListener()
_cpu_events.register("numba:compile", _cpu_compile)
_cuda_compile = {"s": 0.0, "depth": 0, "kernels": 0}
def _timed_compile(compile):
    def timed(self, *args, **kwargs):
        _cuda_compile["depth"] += 1
        start = _time.perf_counter()
        try:
            return compile(self, *args, **kwargs)
        finally:
            _cuda_compile["depth"] -= 1
            if _cuda_compile["depth"] == 0:
                _cuda_compile["s"] += _time.perf_counter() - start
                _cuda_compile["kernels"] += 1
    return timed
_cuda_dispatcher.CUDADispatcher.compile = _timed_compile(_cuda_dispatcher.CUDADispatcher.compile)
_epochs_s = []
_epoch_clock = _LambdaCallback(
    on_epoch_begin=lambda epoch, logs=None: _epochs_s.append(-_time.perf_counter()),
    on_epoch_end=lambda epoch, logs=None: _epochs_s.__setitem__(-1, _epochs_s[-1] + _time.perf_counter()))
_lab_fit = model.fit
model.fit = lambda *args, **kwargs: _lab_fit(*args, callbacks=[_epoch_clock], **kwargs)
"""


def _cell_name(cell):
    """A cell's first line, for the cells_s table."""
    return cell.strip().splitlines()[0][:60]


#: --smoke: (the lab's text, what replaces it) — fewer images and the dense model.
SMOKE_EDITS = (
    ("mnist_train.map(scale)", "mnist_train.take(512).map(scale)"),
    ("mnist_test.map(scale)", "mnist_test.take(256).map(scale)"),
    ("tf.keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),\n"
     "      tf.keras.layers.MaxPooling2D(),\n      tf.keras.layers.Flatten(),",
     "tf.keras.layers.Flatten(input_shape=(28, 28, 1)),"),
)


def lab_script(epochs=12, smoke=False):
    """The lab's cells as one script, with clocks around them (each cell, each epoch, Numba's
    compiler) and the test accuracy after. The cells' text is unchanged but for the one
    number, ``epochs`` (and, ``smoke``, ``SMOKE_EDITS``); the clocks are lines between them."""
    cells = list(LAB_CELLS)
    assert cells[-1].strip() == "model.fit(train_dataset, epochs=12)"
    cells[-1] = cells[-1].replace("epochs=12", f"epochs={int(epochs)}")
    for old, new in SMOKE_EDITS if smoke else ():
        hits = [i for i, c in enumerate(cells) if old in c]
        assert len(hits) == 1, f"--smoke edit not found once in the lab's cells: {old!r}"
        cells[hits[0]] = cells[hits[0]].replace(old, new)
    parts = ["import time as _time\n_cells_s = {}\n_lab_start = _time.perf_counter()\n"]
    for i, cell in enumerate(cells):
        if i == len(cells) - 1:
            parts.append(_CLOCKS + "_fit_start = _time.perf_counter()\n")
        parts.append(f"_cell_start = _time.perf_counter()\n{cell}\n"
                     f"_cells_s[{_cell_name(cell)!r}] = _time.perf_counter() - _cell_start\n")
    return "\n".join(parts) + _MEASURE


def run_lab(data_dir=None, epochs=12, timeout_s=900, env=None, smoke=False):
    """Run the lab in a fresh process (``env``: variables to set for it); return (the
    RESULT dict, the lab's stdout then stderr)."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if data_dir:
            (scratch / "data").mkdir()
            os.symlink(Path(data_dir).expanduser().resolve(), scratch / "data" / "mnist")
        (scratch / "lab.py").write_text(lab_script(epochs, smoke))
        env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        run = subprocess.run([sys.executable, "lab.py"], cwd=scratch, env=env,
                             capture_output=True, text=True, timeout=timeout_s)
    if run.returncode == 0 and "RESULT " not in run.stdout:
        raise RuntimeError(f"the lab ran but printed no RESULT line:\n{run.stdout[-3000:]}")
    if run.returncode != 0:
        raise RuntimeError(f"the lab failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]), run.stdout + run.stderr


def cold_and_warm(data_dir=None, epochs=12, smoke=False, run=run_lab, serial_cold=False):
    """The lab twice, with one fresh ``NUMBA_CACHE_DIR`` and one fresh ``CUDA_CACHE_PATH``
    (the driver's own cache of code it compiled, which a machine that ran the lab before
    keeps in ~/.nv): {"cold": RESULT, "warm": RESULT}, and the two logs. Each log is printed
    as its run ends, so a run stopped later (a time limit) still shows the lab's figures.
    ``serial_cold``: first a "cold, compiled at launch" run, with empty caches of its own and
    ``MIRRORED_COMPILE_AHEAD=0`` (kernels/compile_ahead.py off): what compiling ahead saves."""
    runs, logs = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        env = {"NUMBA_CACHE_DIR": os.path.join(scratch, "numba"),
               "CUDA_CACHE_PATH": os.path.join(scratch, "cuda-driver")}
        serial = {"NUMBA_CACHE_DIR": os.path.join(scratch, "numba-serial"),
                  "CUDA_CACHE_PATH": os.path.join(scratch, "cuda-driver-serial")}
        for folder in list(env.values()) + list(serial.values()):
            os.mkdir(folder)
        plan = [("cold, compiled at launch", dict(serial, MIRRORED_COMPILE_AHEAD="0"))] if serial_cold else []
        for name, run_env in plan + [("cold", env), ("warm", env)]:
            result, log = run(data_dir, epochs, env=run_env, smoke=smoke)
            runs[name] = result
            logs.append(f"--- {name} run ---\n{log}")
            print(logs[-1], flush=True)
    return runs, "\n".join(logs)


def lab_training_images(data_dir=None, smoke=False):
    """The lab's training images as it scales them, and their labels: (N, 28, 28, 1) float32
    in [0, 1], (N,) int64; the full set from ``data_dir`` as the lab reads it, else (offline)
    the bundled subset; ``smoke``: the first 512."""
    from mirrored import datasets
    datasets.disable_progress_bar()
    with tempfile.TemporaryDirectory() as scratch:              # <data_dir>/mnist, as the lab's
        kwargs = {}
        if data_dir:
            os.symlink(Path(data_dir).expanduser().resolve(), Path(scratch) / "mnist")
            kwargs = {"data_dir": scratch}
        train = datasets.load("mnist", split="train", as_supervised=True, **kwargs)
        x, y = (np.stack(a) for a in zip(*train))               # (N, 28, 28, 1) uint8, (N,)
    if smoke:
        x, y = x[:512], y[:512]
    return x.astype(np.float32) / 255, y.astype(np.int64)      # the lab's scale()


def torch_rows(data_dir, epochs, smoke=False):
    """PyTorch eager and CUDA-graph rows on the lab's training images (see the module
    docstring): ([{row, epochs_s, ms_per_step, ...}], None) or ([], why they were skipped)."""
    from benchmarks import training
    torch, why = training.torch_status()
    if torch is None:
        return [], why
    if not torch.cuda.is_available():
        return [], "PyTorch has no CUDA here: the PyTorch rows are GPU rows"
    import mirrored as tf
    x, y = lab_training_images(data_dir, smoke)
    spec = training.MODELS["convnet"]
    weights = training.initial_weights(spec)
    rows = []
    for make in (training.TorchRow, training.TorchGraphRow):
        row = make(torch, tf, True, spec, x, y, weights)
        timer = training.epoch_timer(True)
        timer(row.epoch)                                       # warm-up, untimed
        seconds = [timer(row.epoch) for _ in range(epochs)]
        steps = -(-len(x) // row.global_batch)
        rows.append({"row": row.name, "strategy": row.strategy_label, "epochs_s": seconds,
                     "total_s": sum(seconds), "steps_per_epoch": steps,
                     "ms_per_step": statistics.median(seconds) / steps * 1e3,
                     "final_loss": row.final_loss()})
    return rows, None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="folder with the four MNIST .gz files")
    parser.add_argument("--epochs", type=int, default=None, help="default 12 (1 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="small and quick (see the docstring)")
    parser.add_argument("--no-peers", action="store_true", help="no PyTorch rows")
    parser.add_argument("--peer-epochs", type=int, default=None,
                        help="timed epochs of each PyTorch row (default: the lab's); their "
                             "ms/step is a median, so 3 give it in a quarter of the time")
    parser.add_argument("--serial-cold", action="store_true",
                        help="first a cold run with MIRRORED_COMPILE_AHEAD=0 (its own empty "
                             "caches): what compiling the kernels ahead saves")
    parser.add_argument("--out", help="JSON file to write (default: nothing written)")
    args = parser.parse_args(argv)
    from benchmarks import common
    for name in ("epochs", "peer_epochs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    epochs = args.epochs or (1 if args.smoke else 12)
    peer_epochs = args.peer_epochs or epochs
    runs, _ = cold_and_warm(args.data_dir, epochs, args.smoke,        # prints each run's log
                            serial_cold=args.serial_cold)
    print(json.dumps(runs, indent=1))
    peers, skipped = [], []
    if args.no_peers:
        skipped.append({"name": "PyTorch rows", "reason": "--no-peers"})
    else:
        peers, why = torch_rows(args.data_dir, peer_epochs, args.smoke)
        if why:
            skipped.append({"name": "PyTorch rows", "reason": why})
    for row in peers:
        print(f"{row['row']}: {row['ms_per_step']:.3f} ms/step, {row['total_s']:.2f} s "
              f"for {peer_epochs} epoch(s)")
    for s in skipped:
        print(f"skipped: {s['name']}: {s['reason']}")
    payload = {"epochs": epochs, "peer_epochs": peer_epochs, "mode": "smoke" if args.smoke else "full",
               "result": runs["warm"], "runs": runs, "peers": peers, "skipped": skipped,
               "target": {"wall_s_warm": 4.0, "wall_s_cold": 7.0, "test_accuracy": 0.985}}
    return common.save_results("course_lab", payload, common.device_info(), args.smoke, args.out)


if __name__ == "__main__":
    sys.exit(main())
