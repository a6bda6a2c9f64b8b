"""``compile``'s losses and metrics for a model of several outputs, as Keras 3 reads them
(keras/src/trainers/compile_utils.py: ``CompileLoss``, ``CompileMetrics``)::

    model = keras.Model([a, b], [o1, o2])           # outputs named by their layers: "o1", "o2"
    model.compile(optimizer="sgd",
                  loss={"o1": "mse", "o2": "mae"},   # or ["mse", "mae"], or "mse" for both
                  loss_weights=[1.0, 0.5],           # or {"o1": 1.0, "o2": 0.5}
                  metrics={"o1": ["mae"]})           # or [["mae"], ["mse"]]: a list per output

The loss a step differentiates is ``sum_i weight_i * loss_i(y_i, y_pred_i)`` (plus the layers'
penalties, ``custom_step.compute_loss``); each ``loss_i`` is this replica's share of the mean
over the GLOBAL batch (``share``), so the all-reduced SUM of the replicas' gradients is the
gradient of the whole batch's loss. The logs, as Keras 3 names them (sorted)::

    loss        the weighted total (the model's loss tracker, ``custom_step.LossTracker``)
    o1_loss     each output's loss, unweighted (a ``Mean`` per output, when there are several)
    o1_mae      each output's metrics, named ``<output>_<metric>``

The outputs are named by the layers that make them (``model.output_names``), or by their keys
when the model was made with a dict of outputs. A dict of losses, weights or metrics is keyed
by those names; a list has one entry per output, in order. What does not fit is refused at
``compile``, with the names there are.

Neighbours: ``custom_step.py`` (``compute_loss``, the logs), ``multi_io.py`` (the model),
``losses.py``, ``metrics.py``, ``model_api.py`` (``compile``).
"""
import copy

import numpy as np

from mirrored import context, nest, ops
from mirrored.program import recording
from mirrored.keras import losses as _losses
from mirrored.keras import metrics as _metrics
from mirrored.keras import sample_weights
from mirrored.keras.custom_losses import Loss
from mirrored.keras.tape import compute_average_loss
from mirrored.strategy import to_tensor_on
from mirrored.tensor import Tensor


def output_names(model):
    """The names compile's dicts are keyed by, in the order of the flat outputs."""
    structure = model.output_structure
    return sorted(structure) if isinstance(structure, dict) else list(model.output_names)


def per_output(value, names, what, default=None):
    """``value`` as one entry per output: a dict keyed by output names (missing: ``default``), a
    list or tuple of one per output, or one value for every output; a clear error otherwise."""
    if isinstance(value, dict):
        unknown = sorted(k for k in value if k not in names)
        if unknown:
            raise ValueError(f"compile({what}=...): the dict has the key(s) {unknown}, which name no output "
                             f"of the model; its outputs are {names} (the names of the layers that make "
                             f"them, or the keys of a dict of outputs).")
        return [value.get(n, default) for n in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(f"compile({what}=...): a list of {len(value)} for a model of {len(names)} outputs "
                             f"{names}; give one entry per output (None for none), or a dict keyed by "
                             f"output names.")
        return list(value)
    return [value] * len(names)


def of_one_output(value, model, what):
    """compile's ``loss`` (``metrics``) for a model of one output given as a list of one entry
    or a dict keyed by its name, as Keras 3 takes them: that entry (a loss; metrics as a list)."""
    if not isinstance(value, dict) and not (what == "loss" and isinstance(value, (list, tuple))):
        return value
    entry = per_output(value, output_names(model), what)[0]
    return entry if what == "loss" or entry is None or isinstance(entry, (list, tuple)) else [entry]


class CompileLoss:
    """Keras 3's ``CompileLoss``: one loss (or None) and one weight per output, and the
    per-output loss trackers (``metrics``: a ``Mean`` named ``<output>_loss`` each, when
    several outputs have a loss)."""

    def __init__(self, loss, loss_weights, model):
        names = output_names(model)
        user = per_output(loss, names, "loss")
        self.losses = [None if l is None else _losses.get(copy.copy(l) if isinstance(l, str) else l) for l in user]
        if all(l is None for l in self.losses):
            raise ValueError(f"compile(loss=...): no output of {names} has a loss; give at least one.")
        if loss_weights is not None and not isinstance(loss_weights, (list, tuple, dict)):
            raise ValueError(f"compile(loss_weights=...): for a model of several outputs, a list of one "
                             f"weight per output or a dict keyed by output names {names}; got {loss_weights!r}.")
        weights = per_output(loss_weights, names, "loss_weights", 1.0) if loss_weights is not None \
            else [1.0] * len(names)
        if any(not isinstance(w, (int, float, np.number)) or isinstance(w, bool) for w in weights):
            raise ValueError(f"compile(loss_weights=...): each weight must be a number, got {weights}.")
        self.names, self.weights, self.user_loss, self.user_weights = names, [float(w) for w in weights], loss, \
            loss_weights
        with_loss = [n for n, l in zip(names, self.losses) if l is not None]
        self.metrics = [_metrics.Mean(name=f"{n}_loss") for n in with_loss] if len(with_loss) > 1 else []

    def __call__(self, y, y_pred, global_batch):
        """This replica's share of ``sum_i weight_i loss_i``; each unweighted ``loss_i`` into its
        tracker as the mean over this replica's rows, weighed by them (so the tracker's mean
        over the replicas and the batches is the loss of every example seen)."""
        ys, preds = targets(y, self.names, self.losses), nest.flatten(y_pred)
        total, trackers = None, iter(self.metrics)
        for loss, weight, y_i, p in zip(self.losses, self.weights, ys, preds):
            if loss is None:
                continue
            value = share(loss, y_i, p, global_batch)
            tracker = next(trackers, None)
            b = int(p.shape[0])
            if tracker is not None and b:
                track(tracker, value, (global_batch or b) / b, b)
            term = value * weight if weight != 1.0 else value
            total = term if total is None else total + term
        return total


def targets(y, names, used):
    """``y`` (a list in the outputs' order, or a dict keyed by their names) as one target per
    output (None where the output has no loss or metric: ``used``)."""
    if isinstance(y, dict):
        missing = [n for n, u in zip(names, used) if u and n not in y]
        if missing:
            raise ValueError(f"the targets (y) are a dict with the keys {sorted(y)}, with none for the "
                             f"output(s) {missing}; the model's outputs are {names}: key y by them.")
        return [y.get(n) for n in names]
    if isinstance(y, (list, tuple)) and len(y) == len(names):
        return list(y)
    got = f"a {type(y).__name__} of {len(y)}" if isinstance(y, (list, tuple)) else f"one {type(y).__name__}"
    raise ValueError(f"the model has {len(names)} outputs {names}, so y is a list of as many targets, in "
                     f"that order, or a dict keyed by those names; got {got}.")


def share(loss, y, y_pred, global_batch, sample_weight=None):
    """This replica's share of ``loss(y, y_pred)``: its summed per-example losses (each times its
    weight, when ``sample_weight`` is given: Keras 3 divides by the examples, not by the weights)
    over the global batch (Keras's ``sum_over_batch_size``), or its sum (``"sum"``), or the
    per-example losses (``"none"``)."""
    if not isinstance(y_pred, Tensor):
        raise TypeError("compute_loss: y_pred must be the model's output, self(x, training=True).")
    b = int(y_pred.shape[0])
    weights = None if sample_weight is None else weights_on(sample_weight, y_pred, b)   # (b,) float32
    if _losses.takes_targets(loss):                    # float targets in the output's dtype, as Keras
        y = to_tensor_on(y, y_pred.dev)
        if y.dtype != y_pred.dtype:
            y = ops.cast(y, y_pred.dtype)
    if isinstance(loss, Loss):                         # written in ops
        if loss.reduction == "none":
            values = loss(y, y_pred)
            return values if weights is None else values * as_rank(weights, values.ndim)
        scale = 1.0 / (global_batch or b * replicas())
        per_example, total = loss.shares(to_tensor_on(y, y_pred.dev), y_pred, b, scale)
        if weights is None:
            return total
        weighted = ops.reduce_sum(per_example * weights)
        return weighted if loss.reduction == "sum" else weighted * float(scale)
    if loss.reduction != "sum_over_batch_size" and weights is None:
        return loss(y, y_pred)
    per_example = copy.copy(loss)
    per_example.reduction = "none"
    values = per_example(y, y_pred)                    # (b,) float32
    if weights is not None:
        values = values * weights
    if loss.reduction == "none":
        return values
    if loss.reduction == "sum":
        return ops.reduce_sum(values)
    return compute_average_loss(values, global_batch_size=global_batch)


def weights_on(sample_weight, like, b):
    """``sample_weight`` as a (b,) float32 tensor on ``like``'s device: one weight per example,
    as Keras takes them for a model with one output (``sample_weights.check``)."""
    if isinstance(sample_weight, Tensor):
        if tuple(sample_weight.shape) not in ((b,), (b, 1)):
            raise ValueError(f"sample_weight of shape {tuple(sample_weight.shape)} for {b} examples: give one "
                             f"weight per example, shape ({b},).")
        weights = ops.reshape(ops.cast(sample_weight, "float32"), (b,))
        return weights if weights.dev is like.dev else to_tensor_on(weights.numpy(), like.dev)
    return to_tensor_on(sample_weights.check(sample_weight, b), like.dev)


def as_rank(weights, ndim):
    """(b,) weights as (b, 1, ...) to multiply per-element loss values of rank ``ndim``."""
    return weights if ndim <= 1 else ops.reshape(weights, (-1,) + (1,) * (ndim - 1))


@recording.host_work
def track(tracker, share, scale, rows):
    """``tracker`` given this replica's mean loss (its ``share`` of the global batch's, times
    ``scale``), weighed by its ``rows``: host work, which a traced step's replay does again
    with that replay's value (``keras/traced_step.py``)."""
    mean = float(_metrics.host_array(share)) * scale
    tracker.update_state(np.float64(mean), sample_weight=rows)


def replicas():
    """The replicas in sync inside ``strategy.run`` (1 outside it)."""
    strategy, replica_ctx = context.top()
    return strategy.num_replicas_in_sync if replica_ctx is not None and strategy is not None else 1


class OutputMetrics(_metrics.Metric):
    """Keras 3's ``CompileMetrics`` for several outputs (one entry of ``model.metrics``, named
    "compile_metrics"): each output's metrics, updated with that output and its target; the
    result's keys ``<output>_<metric name>`` (Keras's, a repeated name numbered ``_1``...)."""

    def __init__(self, metrics, model):
        super().__init__("compile_metrics")
        self.names, self.user_metrics = output_names(model), metrics        # (compile's argument: saving)
        if metrics is not None and not isinstance(metrics, (list, tuple, dict)):
            raise ValueError(f"compile(metrics=...): for a model of several outputs {self.names}, a list with "
                             f"one entry per output or a dict keyed by their names (Keras 3's rule); got "
                             f"{metrics!r}.")
        entries = per_output(metrics, self.names, "metrics") if metrics is not None else [None] * len(self.names)
        self.per_output = [[_metrics.get(m) for m in (e if isinstance(e, (list, tuple)) else [e])]
                           if e is not None else [] for e in entries]
        self.metrics = [m for ms in self.per_output for m in ms]

    def update_state(self, y_true, y_pred, sample_weight=None):
        ys = targets(y_true, self.names, [bool(ms) for ms in self.per_output])
        for ms, y, p in zip(self.per_output, ys, nest.flatten(y_pred)):
            for m in ms:
                m.update_state(y, p, sample_weight=sample_weight)

    def result(self):
        out, seen = {}, {}
        for name, ms in zip(self.names, self.per_output):
            for m in ms:
                key = f"{name}_{m.name}"
                if key in seen:
                    seen[key] += 1
                    key = f"{key}_{seen[key] - 1}"
                else:
                    seen[key] = 1
                out[key] = m.result()
        return out

    def reset_state(self):
        super().reset_state()
        for m in getattr(self, "metrics", ()):
            m.reset_state()

    @property
    def variables(self):
        return [v for m in self.metrics for v in m.variables]
