"""What the lab notebooks (labs/*.ipynb) share: their first cell, and the lab's model.

Every notebook starts the same way: is this a quick run (``MIRRORED_QUICK=1``, set by
the test suite)? which devices do the replicas get? ``setup`` answers both, once, and
says what it chose::

    from mirrored.lab import labs
    lab = labs.setup(replicas=2)      # lab.quick, lab.devices, lab.description, lab.root

The device split follows ``workflow.configure_devices`` (the one ``python -m mirrored``
uses): two or more real GPUs are used as they are; one real GPU is split into
``replicas`` logical GPUs; with no GPU (or only Numba's CUDA simulator, far too slow to
train on) the CPU is split into ``replicas`` logical CPUs, so a laptop shows
``replicas`` replicas too. ``device_type="CPU"`` always splits the CPU (lab 03's ring,
whose pictures need exactly four devices). Logical devices are configured once per
process, before anything uses a device (TensorFlow's rule): run the setup cell first,
and restart the kernel to change it.

``make_model()`` is the course lab's model, the ConvNet ``Conv2D(32, 3, relu) ->
MaxPooling2D -> Flatten -> Dense(64, relu) -> Dense(10)`` (347,146 parameters),
compiled as the lab compiles it; ``make_model("dense")`` is the fast option,
``Flatten -> Dense(64, relu) -> Dense(10)`` (50,890 parameters). One model for every
lab: a notebook that uses the dense stack says why. (They live in ``workflow.py``, which
``python -m mirrored`` trains too; this module names them for the notebooks.)

Neighbours: ``workflow.py`` (the command-line lab: devices, data pipeline), ``scaling.py``,
``timing.py``, ``perf_model.py`` and ``viz.py`` (what the labs measure and draw).
"""
import dataclasses
import os

import mirrored as tf
from mirrored import devices as _dev
from mirrored.lab import workflow
from mirrored.lab.workflow import MODEL_KINDS, make_model, model_layers   # the lab's model: labs.make_model

#: Quick mode (``MIRRORED_QUICK=1``: the test suite runs every notebook so): the first
#: examples of each split only, and few timed steps. The ConvNet takes ~30 ms a step of 64
#: on an idle 2-core CPU (several times that on a busy one), so 256 examples are 4 steps:
#: an epoch per strategy in about a second. Enough to run every cell, not to measure.
QUICK = {"train_examples": 256, "test_examples": 128, "steps": 3, "warmup_steps": 1}

#: The parameter counts of the lab's two models (``MODEL_KINDS``) (``model.count_params()``), for the labs' arithmetic.
PARAMS = {"conv": (3 * 3 * 1 * 32 + 32) + (13 * 13 * 32 * 64 + 64) + (64 * 10 + 10),   # 347,146
          "dense": (28 * 28 * 64 + 64) + (64 * 10 + 10)}                                # 50,890


@dataclasses.dataclass
class Lab:
    """What ``setup`` found: ``quick`` (small settings), ``devices`` (names of the replica
    devices, in order), ``description`` (one line: which devices and why), ``root`` (the
    folder holding the packages ``mirrored``, ``kernels`` and ``benchmarks``: a checkout, or
    site-packages after ``pip install .``)."""
    quick: bool
    devices: list
    description: str
    root: str


def setup(replicas=2, device_type=None, out=print):
    """The notebooks' first cell: quick mode, the replica devices; returns a ``Lab``.

    ``replicas``: how many replica devices to prepare (None: leave the devices alone,
    e.g. lab 04, which runs kernels, not training). ``device_type``: None (GPUs where
    there are real ones, else logical CPUs) or "CPU" (always split the CPU). ``out``:
    where the one-line summary goes (None: nowhere).
    """
    if replicas is not None and (not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"labs.setup: replicas must be a positive integer (or None to leave "
                         f"the devices alone), got {replicas!r}.")
    if device_type not in (None, "CPU"):
        raise ValueError(f"labs.setup: device_type must be None (GPUs where there are real "
                         f"ones, else CPUs) or 'CPU', got {device_type!r}.")
    quick = workflow.quick_mode()
    root = os.path.dirname(os.path.dirname(os.path.abspath(tf.__file__)))
    names, description = [], "devices left as they are"
    if replicas is not None and device_type == "CPU":
        if not _dev.is_initialized():
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
        names = [d.name for d in tf.config.list_logical_devices("CPU")][:replicas]
        description = f"{len(names)} logical CPU device(s) split from the CPU"
        if len(names) < replicas:
            description += (f" (only {len(names)}: devices were configured earlier in this "
                            f"process; restart the kernel)")
    elif replicas is not None:
        names, description = workflow.configure_devices(replicas)
    lab = Lab(quick=quick, devices=names, description=description, root=root)
    if out is not None:
        out(f"quick mode (MIRRORED_QUICK): {quick}")
        if replicas is not None:
            out(f"replica devices: {description}")
            for name in names:
                out(f"   {name}")
    return lab


def same_weights_on_every_worker(folder, workers):
    """Lab 06's check: every worker wrote ``weights-<rank>.crc32`` (a CRC-32 of its weights'
    bytes) into ``folder``; return ``{rank: checksum}`` if all ``workers`` wrote the same one.

    Each worker writes its own file, so nothing depends on how the workers' printed lines
    interleave (they share one stdout and may run together on one line). A missing file or
    two different checksums raise a ``ValueError`` naming the workers: the check can fail.
    """
    folder = os.fspath(folder)
    sums, missing = {}, []
    for rank in range(int(workers)):
        path = os.path.join(folder, f"weights-{rank}.crc32")
        try:
            with open(path) as f:
                sums[rank] = f.read().strip()
        except FileNotFoundError:
            missing.append(rank)
    if missing:
        raise ValueError(f"worker(s) {missing} wrote no weights checksum in {folder} (expected "
                         f"weights-<rank>.crc32 from each of the {workers} workers): did they finish?")
    if len(set(sums.values())) != 1:
        raise ValueError(f"the workers' weights differ: checksums {sums}. Every replica of every "
                         f"worker should hold bitwise the same weights after the ring.")
    return sums
