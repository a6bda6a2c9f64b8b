"""The lab workflow behind ``python -m mirrored``: the course's MNIST lab, timed.

    python -m mirrored                          # the lab's ConvNet: no strategy vs MirroredStrategy
    python -m mirrored --model dense            # ... the fast dense stack instead
    python -m mirrored --logical-gpus 4         # ... on 1, 2, 4 logical devices
    python -m mirrored --devices GPU:0,GPU:1    # ... on these devices
    python -m mirrored --quick                  # a few steps on a little data: seconds

What it does, in the lab's order:

1. Devices: ``--logical-gpus N`` splits GPU:0 into N logical GPUs (or, with no
   real GPU, the CPU into N logical CPUs) — once, before anything else uses a
   device, as TensorFlow requires. With no GPU and no ``--logical-gpus``, the CPU
   is split in ``CPU_REPLICAS`` (2), so the comparison has a two-replica row: the
   split batch, the ring all-reduce, the samples/s. The comparison runs over
   ``--devices``, else every logical GPU, else those logical CPUs.
2. Data: MNIST from ``--data-dir`` (or ~/tensorflow_datasets), downloaded if it
   can be, else the bundled 8k/2k subset (said so, with the folder the full set
   would be kept in). The lab's pipeline:
   ``map(scale).cache().shuffle(10000).batch(GLOBAL_BATCH)``.
3. The lab's model — by default its ConvNet, ``Conv2D(32, 3, relu) → MaxPooling2D →
   Flatten → Dense(64, relu) → Dense(10)``; ``--model dense``: ``Flatten → Dense(64,
   relu) → Dense(10)`` — compiled as the lab does (Adam,
   ``SparseCategoricalCrossentropy(from_logits=True)``, ``['accuracy']``), trained
   with no strategy and with MirroredStrategy on 1, 2, 4, ... of the devices,
   every run from the same initial weights (``scaling.compare``), printing
   Keras's progress lines. The epochs are interleaved (every configuration's epoch
   1, then every one's epoch 2, ...: ``timing.interleaved_rounds``), so a slow spell
   of a shared machine lands on all rows alike.
4. A table (epoch time, ms/step, samples/s, scaling efficiency, test accuracy)
   with the data source, the model and the devices, and a PNG bar chart of it.
   Figures from too few timed steps are marked as too short to compare
   (``scaling.MIN_TIMED_STEPS``); ``--quick`` times two epochs after its warm-up.
   A row whose epoch times spread more than 2x, and every row when the no-strategy
   reference drifted more than 1.5x, is marked "!" with the reason under the table
   (``timing.timing_flags``): the machine was busy, run again.

The model is ``make_model`` (the one every notebook trains, as ``labs.make_model``); the notebooks use
this file's ``scale``, ``load_mnist``, ``make_data_fn`` and ``configure_devices`` too.

Neighbours: ``__main__.py`` (the command line), ``scaling.py`` (the measurements), ``viz.py``.
"""
import os
import warnings

import mirrored as tf
from mirrored import devices as _dev
from mirrored.lab import scaling, viz

BATCH_PER_REPLICA = 64           # the course lab's BATCH_SIZE_PER_REPLICA
BUFFER_SIZE = 10000              # the lab's shuffle buffer
#: 1 warm-up + 2 timed, interleaved across the rows (250 timed steps per row on the bundled
#: subset, enough to compare): 5 epochs made the default run 18 s on a quiet 2-core machine
#: (issue 25 asks for 10 s); --epochs for more.
DEFAULT_EPOCHS = 3
QUICK = {"train_examples": 1024, "test_examples": 512, "epochs": 3}   # --quick / MIRRORED_QUICK=1:
#                                  1 warm-up + 2 timed epochs (the median of one is one sample)
DEFAULT_PLOT = "mirrored-timing.png"
CPU_REPLICAS = 2                 # with no GPU, the CPU is split in two: the table gets a ×2 row
MODELS = {                       # --model: make_model's kinds, in words (the ConvNet by default)
    "conv": "the lab's ConvNet: Conv2D(32, 3, relu) → MaxPooling2D → Flatten → Dense(64, relu) → Dense(10)",
    "dense": "the dense stack: Flatten → Dense(64, relu) → Dense(10)",
}
DEFAULT_MODEL = "conv"
#: The lab's two models: the course's ConvNet (the default) and the fast dense stack.
MODEL_KINDS = ("conv", "dense")


class DeviceError(ValueError):
    """A device asked for on the command line is not there (the message lists those that are)."""


def quick_mode():
    """True when the environment asks for small settings (``MIRRORED_QUICK=1``; labs, tests)."""
    return os.environ.get("MIRRORED_QUICK", "").strip().lower() in ("1", "true", "yes")


# --- the lab's pieces ---------------------------------------------------------------------

def scale(image, label):
    """The lab's map function: uint8 pixels → float32 in [0, 1]."""
    image = tf.cast(image, tf.float32)
    image /= 255
    return image, label


def load_mnist(data_dir=None, quick=False):
    """``(train, test, source)``: MNIST datasets of (image, label) and where they came from.

    ``source`` is a short sentence for the report ("MNIST, full set: 60,000 train /
    10,000 test" or the bundled subset and why). ``quick``: the first
    ``QUICK['train_examples']`` / ``QUICK['test_examples']`` examples only.
    The loader's warning about the subset is turned into that sentence.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tf.datasets.BundledSubsetWarning)
        datasets, info = tf.datasets.load("mnist", with_info=True, as_supervised=True,
                                          data_dir=data_dir)
    train, test = datasets["train"], datasets["test"]
    n_train, n_test = info.splits["train"].num_examples, info.splits["test"].num_examples
    if info.source == "full":
        source = f"MNIST, full set: {n_train:,} train / {n_test:,} test"
    else:
        offline = os.environ.get("MIRRORED_OFFLINE", "").strip().lower() in ("1", "true", "yes")
        why = "MIRRORED_OFFLINE=1" if offline else "the full set is not cached and could not be downloaded"
        source = (f"MNIST, {info.source}: {n_train:,} train / {n_test:,} test ({why}; "
                  f"the full 60,000 / 10,000 is kept in {info.data_dir} once downloaded)")
    if quick:
        train, test = train.take(QUICK["train_examples"]), test.take(QUICK["test_examples"])
        source += f"; --quick: first {min(n_train, QUICK['train_examples']):,} / " \
                  f"{min(n_test, QUICK['test_examples']):,}"
    return train, test, source


def make_data_fn(train, test):
    """``data_fn(global_batch) -> (train_ds, test_ds)`` with the lab's pipeline.

    ``map(scale).cache()`` is built once and shared, so the scaled images are
    computed once for every strategy compared; each call adds the lab's
    ``shuffle(BUFFER_SIZE).batch(global_batch)``.
    """
    train_cached = train.map(scale).cache()
    test_cached = test.map(scale).cache()

    def data_fn(global_batch):
        return (train_cached.shuffle(BUFFER_SIZE).batch(global_batch),
                test_cached.batch(global_batch))
    return data_fn


# --- devices ------------------------------------------------------------------------------

def configure_devices(logical=None, use_physical_gpus=True):
    """Set up the devices for a comparison; returns ``(device names, description)``.

    * two or more real GPUs and ``use_physical_gpus``: the physical GPUs (the first
      ``logical`` of them if given), unsplit;
    * one real GPU: split into ``logical`` logical GPUs (each its own stream);
    * no real GPU (or only Numba's simulator, far too slow to train on): split the
      CPU into ``logical`` logical CPUs (``CPU_REPLICAS`` when not given, so that a
      laptop also shows two replicas).

    The split can happen once per process; if devices are already in use (a
    notebook cell run twice) the existing ones are used and the description says so.
    """
    mode = _dev.cuda_mode()
    real_gpus = tf.config.list_physical_devices("GPU") if mode == "real" else []
    kind = "GPU" if real_gpus else "CPU"
    note = ""
    if logical is not None and logical < 1:
        raise ValueError(f"the number of logical devices must be at least 1, got {logical}.")
    if _dev.is_initialized():
        note = " (devices were already configured in this process; restart to change them)"
    if not logical and kind == "CPU":
        logical = CPU_REPLICAS
    if not note and logical and not (use_physical_gpus and len(real_gpus) >= 2):
        target = real_gpus[0] if real_gpus else tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            target, [tf.config.LogicalDeviceConfiguration() for _ in range(logical)])
    names = [d.name for d in tf.config.list_logical_devices(kind)]
    if logical:
        names = names[:logical]
    short = [_dev.get_device(n).short_name for n in names]
    if kind == "GPU" and len(real_gpus) >= 2 and use_physical_gpus:
        what = f"{len(names)} physical GPU(s)"
    elif kind == "GPU":
        what = f"{len(names)} logical GPU(s) on one physical GPU"
    else:
        why = {"simulator": "the CUDA simulator is for testing kernels, far too slow to train on",
               "none": "no CUDA GPU found", "real": ""}[mode]
        what = (f"{len(names)} logical CPU devices split from the CPU ({why}); they share its "
                f"cores, so more replicas show the split batch and the ring and add no compute"
                if len(names) > 1 else f"the CPU ({why})")
    return names, f"{', '.join(short)}: {what}{note}"


def resolve_devices(spec):
    """``"GPU:0,GPU:1"`` → canonical device names; ``ValueError`` listing the devices there are."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--devices {spec!r} names no device; e.g. --devices GPU:0,GPU:1 or CPU:0. "
                         f"Devices here: {[d.name for d in _dev.logical_devices()]}.")
    devices = [_dev.get_device(n) for n in names]
    canonical = [d.name for d in devices]
    dup = [n for n in canonical if canonical.count(n) > 1]
    if dup:
        raise ValueError(f"--devices names {dup[0]} twice; each device may appear once.")
    return canonical


def replica_counts(n):
    """1, 2, 4, ... up to ``n``, and ``n`` itself: the rows of a scaling table."""
    counts = {n}
    k = 1
    while k < n:
        counts.add(k)
        k *= 2
    return sorted(counts)


# --- the whole job ---------------------------------------------------------------------------

def model_layers(kind="conv"):
    """A fresh list of the lab model's layers (``kind``: "conv" or "dense")."""
    layers = tf.keras.layers
    if kind == "conv":
        return [layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
                layers.MaxPooling2D(),
                layers.Flatten(),
                layers.Dense(64, activation="relu"),
                layers.Dense(10)]
    if kind == "dense":
        return [layers.Flatten(input_shape=(28, 28, 1)),
                layers.Dense(64, activation="relu"),
                layers.Dense(10)]
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS} "
                     f"('conv': the course lab's ConvNet, 'dense': the fast dense stack).")


def make_model(kind="conv"):
    """The lab's model, compiled as the lab compiles it (call inside ``strategy.scope()``):
    Adam, ``SparseCategoricalCrossentropy(from_logits=True)``, ``metrics=['accuracy']``."""
    model = tf.keras.Sequential(model_layers(kind))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def run(epochs=None, devices=None, logical_gpus=None, batch_per_replica=BATCH_PER_REPLICA,
        data_dir=None, plot=DEFAULT_PLOT, quick=False, model=DEFAULT_MODEL, out=print):
    """Run the lab workflow; returns ``(rows, report_text)``.

    ``devices``: a comma-separated device string (``--devices``), or None.
    ``model``: "conv" (the lab's ConvNet) or "dense" (``MODELS``).
    Raises ``DeviceError`` (a ``ValueError``) for a device that does not exist; its
    message lists the devices there are.
    """
    quick = quick or quick_mode()
    if epochs is None:
        epochs = QUICK["epochs"] if quick else DEFAULT_EPOCHS
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}.")
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}.")
    try:
        names, device_text = configure_devices(logical_gpus)
        if devices is not None:
            names = resolve_devices(devices)
            device_text = ", ".join(_dev.get_device(n).short_name for n in names) + ": chosen with --devices"
    except ValueError as err:
        raise DeviceError(str(err)) from err
    train, test, source = load_mnist(data_dir, quick=quick)
    out(f"data:    {source}")
    out(f"model:   {MODELS[model]}")
    out(f"devices: {device_text}")
    strategies = scaling.lab_strategies(names, replica_counts(len(names)))
    data_fn = make_data_fn(train, test)
    with tf.device(names[0]):             # "no strategy" runs on the first device compared
        rows = scaling.compare(lambda: make_model(model), data_fn, strategies, epochs=epochs,
                               batch_per_replica=batch_per_replica, verbose=1, log=out)
    warm = "first epoch is warm-up, not timed" if epochs > 1 else "one epoch: warm-up included"
    report = "\n".join([
        "",
        "MNIST lab: no strategy vs MirroredStrategy",
        f"data:    {source}",
        f"model:   {MODELS[model]}",
        f"devices: {device_text}",
        f"epochs:  {epochs} ({warm}); batch {batch_per_replica} per replica, global batch = "
        f"{batch_per_replica} × replicas",
        "",
        scaling.format_table(rows),
    ])
    out(report)
    if plot:
        path = os.path.abspath(plot)
        short = " — too short to compare" if any(r.get("too_short") for r in rows) else ""
        what = {"conv": "the lab's ConvNet", "dense": "dense stack"}[model]
        viz.plot_comparison(rows, path, title=f"MNIST lab, {what} ({'quick, ' if quick else ''}"
                                                 f"{device_text.split(':')[0]}){short}")
        out(f"plot:    {path}")
    return rows, report
