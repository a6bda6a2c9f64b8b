"""Distributed datasets: how a global batch becomes one slice per replica.

``strategy.experimental_distribute_dataset(ds)`` expects ``ds`` to be batched by
the GLOBAL batch size. For every batch of size b it gives replica r the rows
``[r*k, min((r+1)*k, b))`` with ``k = ceil(b / N)``: TensorFlow's rebatching
rule. So 6 rows over 2 replicas -> 3 + 3; 6 over 4 -> 2 + 2 + 2 + 0; the last,
partial batch of an epoch may leave a replica an EMPTY slice, which every layer
above must handle (a replica with no rows contributes zero gradient).

Each slice is copied to its replica's device, as a ``PerReplica`` value of
``mirrored.Tensor``s that ``strategy.run`` unpacks.

``strategy.distribute_datasets_from_function(fn)`` is the other road: ``fn``
builds a dataset that is already batched per replica; replica r takes batch
``step * N + r``.

Neighbours: ``data.py`` (the Dataset), ``strategy.py``, ``values.py``.
"""
import numpy as np

from mirrored import nest
from mirrored.tensor import Tensor
from mirrored.values import PerReplica


def rebatch_bounds(batch_size, num_replicas):
    """[(start, stop)] per replica for one global batch (TensorFlow's rule)."""
    per = -(-batch_size // num_replicas)
    return [(min(r * per, batch_size), min((r + 1) * per, batch_size)) for r in range(num_replicas)]


def _to_device(leaf, dev):
    arr = np.asarray(leaf)
    with dev.activate():
        return Tensor(dev.from_numpy(arr), dev)


class DistributedDataset:
    """Iterating gives, per step, the global batch split into PerReplica slices."""

    def __init__(self, dataset, strategy, options=None):
        self._dataset = dataset
        self._strategy = strategy
        self._options = options

    def _split(self, batch):
        devices = self._strategy.extended._devices
        n = len(devices)
        leaves = nest.flatten(batch)
        sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
        if None in sizes or len(sizes) != 1:
            raise ValueError("experimental_distribute_dataset needs a batched dataset: every "
                             "component must have the same leading (batch) dimension; call "
                             ".batch(GLOBAL_BATCH_SIZE) first.")
        b = sizes.pop()
        bounds = rebatch_bounds(b, n)
        if n == 1:
            return nest.map_structure(lambda leaf: _to_device(leaf, devices[0]), batch)
        return nest.map_structure(
            lambda leaf: PerReplica([_to_device(np.asarray(leaf)[lo:hi], dev)
                                     for (lo, hi), dev in zip(bounds, devices)]), batch)

    def __iter__(self):
        for batch in self._dataset:
            yield self._split(batch)

    def __repr__(self):
        return f"<DistributedDataset over {self._strategy.num_replicas_in_sync} replicas>"


class DistributedDatasetsFromFunction:
    """Per step, replica r gets the next per-replica batch from one shared dataset."""

    def __init__(self, dataset, strategy, options=None):
        self._dataset = dataset
        self._strategy = strategy

    def __iter__(self):
        devices = self._strategy.extended._devices
        n = len(devices)
        it = iter(self._dataset)
        while True:
            batches = []
            for _ in range(n):
                try:
                    batches.append(next(it))
                except StopIteration:
                    return          # a step needs one batch per replica
            if n == 1:
                yield nest.map_structure(lambda leaf: _to_device(leaf, devices[0]), batches[0])
            else:
                per = [nest.map_structure(lambda leaf, d=dev: _to_device(leaf, d), bt)
                       for bt, dev in zip(batches, devices)]
                yield nest.map_structure(lambda *c: PerReplica(c), *per)
