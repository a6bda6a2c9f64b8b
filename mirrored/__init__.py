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
The kernels themselves live in the top-level ``kernels/`` package.
"""
from mirrored import config, errors
from mirrored.devices import device_scope as device
from mirrored.tensor import (Tensor, as_dtype, bool_, cast, constant, convert_to_tensor, float16,
                             float32, float64, identity, int8, int16, int32, int64, reduce_mean,
                             reduce_sum, uint8)

__version__ = "0.1.0"
