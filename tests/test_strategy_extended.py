"""``strategy.extended``'s public answers about replicas and workers (issue 29): what
``input_lib.py``, ``keras/step.py``, ``keras/data_adapters.py`` and the benchmarks read
instead of the extended object's private state. One machine here; across workers with a
stand-in for MPI (``tests/test_multi_worker.py`` runs the real thing under mpiexec)."""
import numpy as np
import pytest

import mirrored as tf
from mirrored.input_lib import local_bounds, rebatch_bounds
from mirrored.multi_worker import MultiWorkerExtended


@pytest.mark.parametrize("n", [1, 3])
def test_one_machine_every_replica_is_local(devices, rng, n):
    devices(cpus=n)
    ext = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)]).extended
    assert (ext.replica_offset, ext.num_workers, ext.num_replicas) == (0, 1, n)
    values = rng.standard_normal(5)
    summed = ext.sum_across_workers(list(values), "a test's sum")
    assert summed.dtype == np.float64 and np.array_equal(summed, values)
    token = object()
    assert ext.broadcast_from_chief(token, "a test's value") is token


class _FakeWorld:
    """What MultiWorkerExtended asks of ``workers.World``: rank, size, bcast, allgather."""

    def __init__(self, rank, size, others):
        self.rank, self.size, self.others, self.asked = rank, size, others, []

    def bcast(self, value, root, what):
        self.asked.append(what)
        return self.others[root] if root != self.rank else value

    def allgather(self, value, what):
        self.asked.append(what)
        return [value if r == self.rank else self.others[r] for r in range(self.size)]


class _Ops:
    def __init__(self, workers):
        self.workers = workers


@pytest.mark.parametrize("rank", [0, 2])
def test_across_workers_the_offset_counts_the_replicas_before_this_worker(devices, rng, rank):
    local = [d for d in devices(cpus=2) if d.device_type == "CPU"]   # (the simulator adds a GPU)
    parts = [rng.standard_normal(3) for _ in range(3)]
    world = _FakeWorld(rank, 3, dict(enumerate(parts)))
    ext = MultiWorkerExtended(None, local, _Ops(world))
    assert (ext.replica_offset, ext.num_workers, ext.num_replicas) == (2 * rank, 3, 6)
    assert ext.workers is world
    got = ext.sum_across_workers(parts[rank], "the epoch's metrics")
    want = (parts[0] + parts[1]) + parts[2]                 # rank order: the same bits on each
    assert np.array_equal(got, want)
    chiefs = ext.broadcast_from_chief("mine", "a shuffle")
    assert chiefs == "mine" if rank == 0 else chiefs is parts[0]
    assert world.asked == ["the epoch's metrics", "a shuffle"]
    # input_lib's share of a global batch of 13 (not divisible by 6) for this worker's two
    # replicas: TensorFlow's rebatching over all six, then replicas 2*rank and 2*rank + 1.
    assert local_bounds(13, ext) == rebatch_bounds(13, 6)[2 * rank:2 * rank + 2]
