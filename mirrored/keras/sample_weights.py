"""Keras's ``sample_weight`` and ``class_weight``: each example's loss weighed, in ``fit`` and
``evaluate``, on every replica.

    model.fit(x, y, sample_weight=w)                 # w: (N,) one weight per example
    model.fit(x, y, class_weight={0: 1.0, 1: 5.0})   # each example weighs its class's weight
    model.fit(ds)                                    # ds yields (x, y, sample_weight) triples
    model.evaluate(x, y, sample_weight=w)

Keras 3's math (``keras/src/losses/loss.py``, ``reduce_weighted_values``): the per-example
losses are multiplied by their weights, then reduced by ``sum_over_batch_size``::

    loss = sum_i w_i * l_i / (number of examples)       (NOT / sum of the weights)

Under a strategy each replica's share is its sum of ``w_i * l_i`` divided by the GLOBAL
batch B (the engine's rule, ``engine.py``): the all-reduced SUM of the shares is exactly the
one-device loss on the whole batch, so N replicas train like one. (Keras 3 divides each
replica's mean by the replica count instead, ``scale_loss_for_distribution``: the same
number when the global batch splits evenly, not for an uneven last batch.)

``class_weight`` (Keras 3's ``class_weight_to_sample_weights``): each example weighs
``class_weight.get(its class, 1.0)``, its class the label (rounded), or the argmax of a one-hot
row; arrays are converted once, a data set's elements one by one (``ByClass``). Both
``sample_weight`` and ``class_weight`` at once is Keras's ValueError.

Where the weights go. They ride with each batch to the devices like the labels: cut by the
same rebatching rule (``step.split`` cuts every array of the batch alike), uploaded in the
same copy as x and y (``upload``: ``(x, (y, w), scalars)``; the program's loss reads
``(labels, weights)``). After the fused loss kernel (``engine.ReplicaProgram.loss``: the
per-example losses in ``buf.loss``, d loss/d logits (b, classes) already scaled by 1/B),
``apply`` multiplies, on the device:

    buf.loss[i]    *= w[i]         the loss metric: sum(w l) / examples, as Keras reports it
    buf.correct[i] *= w[i]         the accuracy: sum(w correct) / sum(w) (Keras's weighted mean)
    dlogits[i, :]  *= w[i]         the gradient of sum(w l) / B (a broadcast multiply)
    weight sum     += sum(w)       the accuracy's denominator (``ReplicaProgram.metric_sums[3]``)

The weights are device buffers like the labels, so a captured CUDA graph (``mirrored/program/capture.py``)
replays with each step's weights. The same for every loss (the fused ones and those written
in ops, ``custom_losses.Loss.run_in``: each fills the per-example losses and dlogits first).

Neighbours: ``data_adapters.py`` (the batches carry the weights), ``step.py`` (``_upload``
hands a weighted share here), ``engine.py`` (``loss`` calls ``apply``), ``models.py`` (fit's
arguments).
"""
import weakref

import numpy as np

from kernels.launch import view

FLOAT = np.dtype(np.float32)
BOTH = "You cannot `class_weight` and `sample_weight` at the same time."   # Keras 3's words
_WEIGHT_SUMS = weakref.WeakKeyDictionary()      # program -> view of its metric_sums[3:4]


# -- on the host: what the user gave, as one float32 weight per example ---------------------------
def check(sample_weight, examples, what="sample_weight"):
    """``sample_weight`` as (examples,) float32, C-contiguous: one number per example, (B,) or
    (B, 1), as Keras takes it for a model with one output."""
    w = sample_weight.numpy() if hasattr(sample_weight, "numpy") else np.asarray(sample_weight)
    if w.dtype.kind not in "biuf":
        raise TypeError(f"{what} of dtype {w.dtype}: sample weights must be numbers, one per example.")
    if w.shape not in ((examples,), (examples, 1)):
        raise ValueError(f"{what} of shape {w.shape} for {examples} examples: give one weight per "
                         f"example, shape ({examples},) (per-timestep or per-output weights are not "
                         f"implemented here).")
    return np.ascontiguousarray(w.reshape(examples), FLOAT)


def class_weights(y, class_weight):
    """Keras 3's ``class_weight_to_sample_weights``: (B,) float32, example i weighing
    ``class_weight.get(class of y[i], 1.0)``. ``y``: class indices (B,) or (B, 1) (rounded),
    or one-hot / probability rows (B, C) (their argmax)."""
    if not hasattr(class_weight, "items") or not hasattr(class_weight, "get"):
        raise ValueError(f"`class_weight` must be a dict-like mapping of class indices to weights. "
                         f"Received: class_weight={class_weight} of type {type(class_weight)}.")
    table = {}
    for key, value in class_weight.items():
        try:
            table[int(key)] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"`class_weight` must be a dictionary with integer keys representing class "
                             f"indices (and numbers as weights). Received: {key!r}: {value!r}.") from None
    y = y.numpy() if hasattr(y, "numpy") else np.asarray(y)
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else np.squeeze(y, axis=-1)
    classes = np.round(y.reshape(len(y))).astype(np.int64)                   # (B,) int64
    return np.array([table.get(int(c), 1.0) for c in classes], FLOAT)       # (B,) float32


def for_arrays(y, examples, sample_weight, class_weight):
    """fit/evaluate with arrays: the (examples,) float32 weights, or None (no weighting)."""
    if sample_weight is not None and class_weight is not None:
        raise ValueError(BOTH)
    if class_weight is not None:
        return class_weights(y, class_weight)
    return None if sample_weight is None else check(sample_weight, examples)


def refuse_for_dataset(sample_weight):
    """Keras 3's error: a data set carries its own weights, as the third item of each element."""
    if sample_weight is not None:
        raise ValueError("When providing `x` as a mirrored.data.Dataset, `sample_weight` should not be "
                         "passed. Instead, the sample weights should be included as part of the dataset: "
                         "each element an (x, y, sample_weight) triple.")


class ByClass:
    """A data set's batches with ``class_weight`` applied (Keras 3's ``make_class_weight_map_fn``):
    each (x, y) element becomes (x, y, the weights of y's classes)."""

    def __init__(self, batches, class_weight):
        class_weights(np.zeros(0), class_weight)          # the dict checked before the first batch
        self.batches, self.class_weight = batches, class_weight

    def __iter__(self):
        for element in self.batches:
            if isinstance(element, dict):
                element = (element.get("image"), element.get("label"))
            if not isinstance(element, (tuple, list)) or len(element) != 2:
                raise ValueError(BOTH if isinstance(element, (tuple, list)) and len(element) == 3 else
                                 "class_weight: each dataset element must be an (x, y) pair.")
            yield element[0], element[1], class_weights(element[1], self.class_weight)


# -- on the devices ------------------------------------------------------------------------------
def upload(program, part, scalars=None):
    """A weighted host share ``(x (b, in) float32, y (b,) + shape, w (b,) float32)`` into the
    program's input buffers (made once per batch size, with the optimizer's ``scalars``: one
    copy): ``(x_dev, (y_dev, w_dev), the scalars' buffer or None)``."""
    x, y, w = part
    b = len(x)
    k = len(scalars) if scalars is not None and b else 0
    key = ("sample weights", b, np.dtype(y.dtype), tuple(y.shape[1:]), k)
    bufs = program.input_cache.get(key)
    if bufs is None:
        specs = [((b, program.in_dim), FLOAT), ((b,) + tuple(y.shape[1:]), y.dtype), ((b,), FLOAT)]
        bufs = program.input_cache[key] = program.dev.empty_parts(specs + [((k,), FLOAT)] * bool(k))
        _WEIGHT_SUMS[program] = program.metric_sums[3:4]
    if b:
        program.dev.upload_parts(bufs, (x, y, w, scalars)[:len(bufs)])
    return bufs[0], (bufs[1], bufs[2]), (bufs[3] if k else None)


def apply(program, weights, buf, grad):
    """After the loss kernel: the per-example losses, correct counts and dlogits rows times
    ``weights`` (b,) on the device, and their sum into the program's weight sum."""
    ops, b = program.ops, program.last_b
    ops.binary("mul", buf.loss, weights, buf.loss)                        # (b,) w_i * l_i
    ops.binary("mul", buf.correct, weights, buf.correct)                  # (b,) w_i * correct_i
    if grad is not None:                                                  # (b, classes) rows * w_i
        ops.broadcast_binary("mul", grad, view(weights, (b, 1)), grad)
    total = program.dev.scratch("sample weight sum", (1,), FLOAT)
    ops.sum_all(weights, total)
    acc = _WEIGHT_SUMS.get(program)
    if acc is None:
        acc = _WEIGHT_SUMS[program] = program.metric_sums[3:4]
    ops.binary("add", acc, total, acc)
