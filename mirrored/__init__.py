"""mirrored: TensorFlow's MirroredStrategy, re-implemented to be read.

``import mirrored as tf`` and the course's MNIST lab runs: devices
(``mirrored.config``), tensors on a device (``mirrored.constant`` ...), and, as
the project grows, strategies, data pipelines and Keras-style models. Each name
behaves as TensorFlow documents it; see the README and shared/API.md.

Map of the package:
    devices.py    devices: physical, logical, CPU and CUDA backends
    config.py     mirrored.config (TF's device functions)
    backends.py   the NumPy and CUDA implementations of every op
    tensor.py     mirrored.Tensor and tensor functions
    errors.py     TF-named errors
    strategy.py   MirroredStrategy, OneDeviceStrategy, replica contexts (mirrored.distribute)
    values.py     PerReplica, Mirrored, Variable, MirroredVariable
    cross_device_ops.py   how replicas' values are summed (ring all-reduce, reduce-to-one)
    input_lib.py  distributed datasets (global batch -> per-replica slices)
    data.py       mirrored.data.Dataset (tf.data semantics over NumPy)
    datasets.py   mirrored.datasets.load("mnist") (tfds.load), bundled offline subset in _data/
    keras/        Sequential, Dense, losses, optimizers, GradientTape (mirrored.keras)
    graphs.py     a training step captured once as a CUDA graph, replayed every step
    nn.py         compute_average_loss
    random.py     set_seed
The kernels themselves live in the top-level ``kernels/`` package.
"""
from mirrored import config, data, datasets, distribute, errors, graphs, keras, nn, random
from mirrored.devices import device_scope as device
from mirrored.distribute import (InputContext, MirroredStrategy, OneDeviceStrategy, ReduceOp,
                                 ReplicaContext, ValueContext, get_replica_context, get_strategy,
                                 in_cross_replica_context)
from mirrored.keras.tape import GradientTape
from mirrored.values import Variable, VariableAggregation, VariableSynchronization
from mirrored.tensor import (Tensor, as_dtype, bool_, cast, constant, convert_to_tensor, float16,
                             float32, float64, identity, int8, int16, int32, int64, ones, reduce_mean,
                             reduce_sum, uint8, zeros)



def function(fn=None, **_options):
    """``@mirrored.function`` is accepted for compatibility with ``@tf.function``.

    There is no graph compilation here: the decorated function runs eagerly,
    exactly as written, every time it is called (TensorFlow would trace it into
    a graph on the first call). Options such as ``jit_compile`` are ignored.
    """
    if fn is None:
        return lambda f: f
    return fn


__version__ = "0.1.0"
