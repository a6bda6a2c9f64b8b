"""``apply_gradients`` for variables that are not a model's packed parameters: each
gradient summed across the replicas on its own, then one update launch per copy.

A model's trainable variables never come here. Their gradients
(``tape.gradient(loss, model.trainable_variables)``) are the model's packed gradient
buffers, and ``Optimizer.apply_gradients`` hands them to the training step that ``fit``
runs (``keras/step.py``). This is the path for everything else: variables a custom loop
makes itself (``tf.Variable`` in ``strategy.scope()``), a subset of a model's variables,
or gradients computed some other way. It gives the same update, one variable at a time.

Neighbours: ``optimizers.py`` (``apply_gradients``, the merge point, and the update
launch, ``update_buffer``), ``cross_device_ops.py`` (``all_reduce_components``: the sum).
"""
import numpy as np

from mirrored.strategy import to_tensor_on
from mirrored.tensor import Tensor
from mirrored.values import DistributedValues, Variable, components


def apply_to_variables(optimizer, strategy, pairs):
    """Sum each gradient across the replicas (``strategy``: the replicas' gradients are
    PerReplica values; None: one replica, nothing to sum), count the step, and update
    every copy of every variable with its summed gradient."""
    grads = [g for g, _ in pairs]
    variables = [v for _, v in pairs]
    for g, v in pairs:                  # every pair checked before anything is summed or counted
        check_shape(g, v)
    if strategy is not None:
        comps = [list(g.values) if isinstance(g, DistributedValues) else [g] * len(strategy.extended.devices)
                 for g in grads]
        reduced = strategy.extended.cross_device_ops.all_reduce_components("SUM", comps)
    else:
        reduced = [[g] * len(copies(v)) for g, v in pairs]
    launches = []                       # (device, weights, gradient there, slot key) per copy
    for k, v in enumerate(variables):
        for r, c in enumerate(copies(v)):
            dev = c.value().dev
            with dev.activate():
                optimizer.release_slots_with(c)
                launches.append((dev, c.value().buf, on_device(reduced[k][r], dev), ("var", id(c))))
    count, updates = optimizer.step_count, optimizer.updates_done
    try:
        optimizer.begin_step(list({dev.name: dev for dev, *_ in launches}.values()))   # each device once
        optimizer.update_buffers(launches)  # every copy's slots made before the first update
    except BaseException:
        if optimizer.updates_done == updates:   # (a Ctrl-C held back to the update's end: counted)
            optimizer.step_count = count        # a step that failed is not counted
        raise


def check_shape(gradient, variable):
    """Refuse a gradient (or a replica's part of one) whose shape is not its variable's, as
    TensorFlow's ``assign_sub`` does: the update kernels work on flat buffers, and NumPy
    would broadcast, so a (5,) gradient for a (2, 5) kernel would update it silently wrong."""
    want = tuple(copies(variable)[0].shape)
    for part in gradient.values if isinstance(gradient, DistributedValues) else (gradient,):
        got = tuple(part.shape) if hasattr(part, "shape") else np.shape(part)
        if got != want:
            raise ValueError(f"apply_gradients: the gradient for variable {variable.name!r} has shape "
                             f"{got}, the variable {want}. Pass each variable's gradient with the "
                             f"variable's own shape (as tape.gradient returns it).")


def copies(variable):
    """The per-device copies of ``variable`` (one, outside a strategy)."""
    try:
        return components(variable)
    except TypeError as err:
        raise TypeError(f"apply_gradients expects (gradient, variable) pairs: {err}") from None


def on_device(g, dev):
    """The raw float32 buffer of gradient ``g`` on ``dev`` (copied there if need be)."""
    if not isinstance(g, (Tensor, Variable)):
        g = np.asarray(g, np.float32)
    return to_tensor_on(g, dev).buf
