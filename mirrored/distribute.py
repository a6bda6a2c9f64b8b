"""``mirrored.distribute``: TensorFlow's ``tf.distribute`` names.

Strategies (``MirroredStrategy``, ``OneDeviceStrategy``, ``MultiWorkerMirroredStrategy``
over MPI), contexts, reduce ops,
cross-device ops and distributed values, gathered in one namespace. Each name is
also available at the top level (``mirrored.MirroredStrategy``).
``HierarchicalCopyAllReduce`` is defined here: TensorFlow's name for our ring.
"""
import warnings

from mirrored.cross_device_ops import CrossDeviceOps, NcclAllReduce, ReduceOp, ReductionToOneDevice
from mirrored.ring import RingAllReduce
from mirrored.input_lib import InputOptions
from mirrored.strategy import (CentralStorageStrategy, InputContext, MirroredStrategy, OneDeviceStrategy,
                               ReplicaContext,
                               Strategy, StrategyExtended, ValueContext, get_replica_context,
                               get_strategy, has_strategy, in_cross_replica_context)
from mirrored.values import DistributedValues, Mirrored, MirroredVariable, PerReplica
from mirrored.collective_all_reduce import CollectiveAllReduce
from mirrored.multi_worker import (ClusterSpec, CommunicationImplementation, CommunicationOptions,
                                   MPIClusterResolver, MultiWorkerMirroredStrategy)


_HIERARCHICAL_NOTED = []


class HierarchicalCopyAllReduce(RingAllReduce):
    """Accepted, and runs as our ring (``RingAllReduce``), with a note once.

    TensorFlow's hierarchical copy is a reduction tree laid out for the NVLink topology
    of one 8-GPU machine (the DGX-1); the guide names it as the alternative to NCCL. Its
    result is the same sum; here the ring computes it. ``num_packs`` is accepted for
    compatibility (gradients are already one packed buffer)."""

    def __init__(self, num_packs=1):
        super().__init__()
        self.num_packs = num_packs
        if not _HIERARCHICAL_NOTED:
            _HIERARCHICAL_NOTED.append(True)
            warnings.warn("HierarchicalCopyAllReduce runs as mirrored's ring all-reduce "
                          "(RingAllReduce): the same sums; the hierarchical copy tree is "
                          "specific to the DGX-1's NVLink layout.", stacklevel=2)


class experimental:  # noqa: N801 (TensorFlow's namespace: tf.distribute.experimental)
    """``tf.distribute.experimental``: the multi-worker communication options."""

    CentralStorageStrategy = CentralStorageStrategy
    CommunicationImplementation = CommunicationImplementation
    CommunicationOptions = CommunicationOptions
    MultiWorkerMirroredStrategy = MultiWorkerMirroredStrategy
