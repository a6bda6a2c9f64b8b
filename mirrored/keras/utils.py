"""``keras.utils``: ``to_categorical`` (one-hot labels) and ``set_random_seed``.

    y_train = keras.utils.to_categorical(y_train, num_classes=10)   # (n,) -> (n, 10) float
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])

``to_categorical`` is Keras 3's, array for array: float64 rows of zeros with a 1.0 at each
label, the trailing axis of size 1 dropped first ((n, 1) labels, as cifar10 has them, give
(n, C)). Keras indexes with the labels as they are, so a negative label silently picks a
class from the end; here a label outside [0, num_classes) is an error that names it.

Neighbours: ``losses.py`` (``CategoricalCrossentropy``, the loss for these labels),
``metrics.py`` (``CategoricalAccuracy``), ``mirrored/random.py`` (the seeds).
"""
import numbers

import numpy as np


def to_categorical(x, num_classes=None):
    """Class indices ``x`` (any shape, integers) as one-hot rows: shape ``x.shape + (C,)``
    (a trailing axis of size 1 dropped), float64, as Keras 3. ``num_classes`` None: one more
    than the largest label."""
    if hasattr(x, "numpy"):
        x = x.numpy()
    raw = np.asarray(x)
    if raw.dtype.kind not in "iub" and raw.size:
        if raw.dtype.kind != "f" or not np.all(np.isfinite(raw) & (raw == np.floor(raw))):
            raise ValueError(f"to_categorical: labels must be whole numbers (class indices), got "
                             f"dtype {raw.dtype}{' with fractional or non-finite values' if raw.dtype.kind == 'f' else ''}.")
    labels = raw.astype(np.int64)
    shape = labels.shape
    if shape and shape[-1] == 1 and len(shape) > 1:      # (n, 1) -> (n,), as Keras
        shape = shape[:-1]
    flat = labels.reshape(-1)                              # (n,)
    if num_classes is None:
        if not flat.size:
            raise ValueError("to_categorical: no labels to count the classes from; pass num_classes.")
        num_classes = int(flat.max()) + 1
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        raise ValueError(f"to_categorical: num_classes must be a positive integer, got {num_classes!r}.")
    num_classes = int(num_classes)
    bad = (flat < 0) | (flat >= num_classes)
    if bad.any():
        raise ValueError(f"to_categorical: labels must lie in [0, {num_classes}); got "
                         f"{flat[bad][:5].tolist()}{' ...' if bad.sum() > 5 else ''}. Check num_classes "
                         f"and the labels' encoding.")
    categorical = np.zeros((flat.size, num_classes))       # (n, C) float64
    categorical[np.arange(flat.size), flat] = 1.0
    return categorical.reshape(shape + (num_classes,))


def set_random_seed(seed):
    """Seed the initialisers and shuffles (``tf.keras.utils.set_random_seed``)."""
    from mirrored import random
    random.set_seed(seed)
