"""``mirrored.nn``: the ``tf.nn`` names the custom training loop uses."""
from mirrored.keras.tape import compute_average_loss

__all__ = ["compute_average_loss"]
