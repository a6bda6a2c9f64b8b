"""``mirrored.distribute``: TensorFlow's ``tf.distribute`` names.

Strategies (``MirroredStrategy``, ``OneDeviceStrategy``), contexts, reduce ops,
cross-device ops and distributed values, gathered in one namespace. Each name is
also available at the top level (``mirrored.MirroredStrategy``).
"""
from mirrored.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce,
                                       ReduceOp, ReductionToOneDevice, RingAllReduce)
from mirrored.input_lib import InputOptions
from mirrored.strategy import (InputContext, MirroredStrategy, OneDeviceStrategy, ReplicaContext,
                               Strategy, StrategyExtended, ValueContext, get_replica_context,
                               get_strategy, has_strategy, in_cross_replica_context)
from mirrored.values import DistributedValues, Mirrored, MirroredVariable, PerReplica
