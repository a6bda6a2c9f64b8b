"""Saving and loading a model's weights, atomically.

``model.save_weights(path)`` writes NumPy's ``.npz`` (one array per weight, Keras's
order: kernel (in, out), then bias, layer by layer) to a temporary file beside
``path`` and renames it into place, so a failed save (a full disk, an interrupt)
leaves any previous file intact and no temporary file behind. ``load_weights``
reads it back through ``model.set_weights``, which checks every shape before it
changes anything.

Neighbours: ``models.py`` (``Sequential.save_weights`` / ``load_weights`` call these).
"""
import contextlib
import os
import tempfile

import numpy as np


def save_weights(model, filepath, overwrite=True):
    """Write ``model``'s weights to exactly ``filepath``, atomically (see the module docstring)."""
    filepath = os.fspath(filepath)
    if not overwrite and os.path.exists(filepath):
        raise FileExistsError(f"{filepath} exists and overwrite=False.")
    folder = os.path.dirname(os.path.abspath(filepath))
    os.makedirs(folder, exist_ok=True)
    arrays = model.get_weights()
    names = np.array([v.name for v in model.trainable_variables])
    fd, tmp = tempfile.mkstemp(prefix=".weights-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, names=names, *arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, filepath)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_weights(model, filepath):
    """Read weights written by ``save_weights`` into ``model`` (checked against it first)."""
    filepath = os.fspath(filepath)
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"no weights file at {filepath}; save one with model.save_weights(path).")
    try:
        with np.load(filepath, allow_pickle=False) as data:
            n = len([k for k in data.files if k.startswith("arr_")])
            arrays = [data[f"arr_{i}"] for i in range(n)]
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{filepath} is not a weights file written by save_weights ({err}).") from err
    model.set_weights(arrays)
