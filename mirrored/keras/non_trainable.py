"""Weights the optimizer does not update: a frozen layer's (``layer.trainable = False``) and a
layer's state (``add_weight(trainable=False)``: BatchNormalization's moving mean and variance).

Where they live. ``engine.ParameterPack`` packs what the ring sums and the optimizer updates:
the TRAINABLE weights. A non-trainable weight stays outside it, as its own copy per device
(a ``MirroredVariable``): no gradient is summed for it, no optimizer slot is made for it. Its
layer still reads it (``layer_views`` hands a layer every weight's copy on its device, in
``layer.weights``'s order, the frozen ones with a scratch gradient buffer that nothing reads).

State that training changes per replica. TensorFlow's BatchNormalization (tf.keras 2) makes
its moving statistics ``synchronization=ON_READ, aggregation=MEAN``: inside the step every
replica updates ITS copy from ITS batch's statistics, and reading the variable outside the
replicas (saving, ``get_weights``) gives the MEAN of the copies. Here a non-trainable weight
made with ``aggregation="mean"`` is updated the same way (``assign_own_copy``) and, in the
step's all-reduce, the copies are replaced by their mean (``AveragedState.average``: one
ring over one flat buffer per device). The update ``m * moving + (1 - m) * batch_stat`` is
linear, so the mean of the updated copies is TensorFlow's read value, and every replica
then holds those same bits (the replicas stay bitwise equal). What differs: inside TF's
step a replica reads its own, not yet averaged copy; here every replica reads the mean
of the last step's copies.

Neighbours: ``engine.py`` (``ParameterPack``, ``ReplicaProgram``: who calls this),
``base_layer.py`` (``Layer.trainable``, ``weights`` / ``trainable_weights`` /
``non_trainable_weights`` in Keras's order), ``normalization.py`` (BatchNormalization).
"""
import numpy as np

from mirrored.tensor import Tensor
from mirrored.values import MirroredVariable, VariableAggregation, components

FLOAT = np.dtype(np.float32)


class AveragedState:
    """The non-trainable variables with ``aggregation=MEAN`` (per-replica state), packed into
    one flat float32 buffer per device, so the step's MEAN over the replicas is one ring."""

    def __init__(self, variables, devices):
        self.variables = [v for v in variables if v.aggregation == VariableAggregation.MEAN]
        self.devices = list(devices)
        total = int(sum(int(np.prod(v.shape, dtype=np.int64)) for v in self.variables))
        self.flat = []                                  # (total,) float32 per device
        for r, dev in enumerate(self.devices):
            with dev.activate():
                flat = dev.empty((total,), FLOAT)
                offset = 0
                for var in self.variables:
                    comp = components(var)[r]
                    size = int(np.prod(var.shape, dtype=np.int64))
                    view = flat[offset:offset + size]
                    dev.copy_into(view, comp.value().buf)
                    comp.use_storage(Tensor(view.reshape(var.shape), dev))
                    offset += size
            self.flat.append(flat)

    def __bool__(self):
        return bool(self.variables)

    def average(self, cross_device_ops):
        """Every replica's copy becomes the mean of all replicas' copies (one replica: as is)."""
        cross_device_ops.all_reduce_flat("MEAN", self.flat, self.devices)


def layer_views(layer, pack, r, own):
    """Replica ``r``'s views of ``layer``'s weights for the engine (``LayerState``), in
    ``layer.weights``'s order: ``(weights, grads, packed)``. A trainable weight's are views
    into the pack (its gradient: the packed gradient, or, when ``own`` is False, a shared
    layer's earlier node, a scratch buffer the engine adds into ``packed``); a non-trainable
    weight's value is its own copy on the device and its gradient a scratch buffer."""
    dev = pack.devices[r]
    where = {id(v): k for k, v in enumerate(pack.variables)}
    trainable = {id(v) for v in layer.trainable_weights}
    weights, grads, packed = [], [], []
    with dev.activate():
        for w in layer.weights:
            k = where.get(id(w)) if id(w) in trainable else None
            if k is None:                                # frozen, or state: not in the pack
                weights.append(components(w)[r].value().buf)
                scratch = dev.empty(tuple(w.shape), FLOAT)
                grads.append(scratch)
                packed.append(scratch)
                continue
            weights.append(pack.param_views[r][k])
            packed.append(pack.grad_views[r][k])
            grads.append(pack.grad_views[r][k] if own else dev.empty(tuple(w.shape), FLOAT))
    return weights, grads, packed


def assign_own_copy(variable, value):
    """``variable.assign(value)`` for per-replica state: inside a replica (fit's step, or
    ``strategy.run``) only that replica's copy changes (the step's all-reduce then averages
    the copies); outside every replica, every copy."""
    copy = variable.replica_copy() if isinstance(variable, MirroredVariable) else variable
    (variable if copy is None else copy).assign(value)


def aggregation(name, what):
    """Keras's ``add_weight(aggregation=...)`` name ("none", "mean", "sum",
    "only_first_replica") as TensorFlow's ``VariableAggregation``."""
    if isinstance(name, VariableAggregation):
        return name
    key = str(name).upper()
    if key not in VariableAggregation.__members__:
        raise ValueError(f"{what}: aggregation={name!r} is not one of 'none', 'mean', 'sum', "
                         f"'only_first_replica'.")
    return VariableAggregation[key]
