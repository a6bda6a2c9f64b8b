"""``mirrored.image``: ``tf.image.resize`` (the course's one-device lab feeds images to a
pretrained model with it). The op is in ``mirrored/ops.py``, its kernel ``kernels/resize.py``."""
from mirrored.ops import resize

__all__ = ["resize"]
