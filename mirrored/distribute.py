"""``mirrored.distribute``: TensorFlow's ``tf.distribute`` names.

Strategies (``MirroredStrategy``, ``OneDeviceStrategy``, ``MultiWorkerMirroredStrategy``
over MPI), contexts, reduce ops,
cross-device ops and distributed values, gathered in one namespace. Each name is
also available at the top level (``mirrored.MirroredStrategy``).
"""
from mirrored.cross_device_ops import CrossDeviceOps, NcclAllReduce, ReduceOp, ReductionToOneDevice
from mirrored.ring import HierarchicalCopyAllReduce, RingAllReduce
from mirrored.input_lib import InputOptions
from mirrored.strategy import (CentralStorageStrategy, InputContext, MirroredStrategy, OneDeviceStrategy,
                               ReplicaContext,
                               Strategy, StrategyExtended, ValueContext, get_replica_context,
                               get_strategy, has_strategy, in_cross_replica_context)
from mirrored.values import DistributedValues, Mirrored, MirroredVariable, PerReplica
from mirrored.collective_all_reduce import CollectiveAllReduce
from mirrored.multi_worker import (ClusterSpec, CommunicationImplementation, CommunicationOptions,
                                   MPIClusterResolver, MultiWorkerMirroredStrategy)


class experimental:  # noqa: N801 (TensorFlow's namespace: tf.distribute.experimental)
    """``tf.distribute.experimental``: the multi-worker communication options."""

    CentralStorageStrategy = CentralStorageStrategy
    CommunicationImplementation = CommunicationImplementation
    CommunicationOptions = CommunicationOptions
    MultiWorkerMirroredStrategy = MultiWorkerMirroredStrategy
