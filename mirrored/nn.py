"""``mirrored.nn``: the ``tf.nn`` names the custom training loops use (they live in keras/tape.py,
beside the GradientTape that follows the losses they make)."""
from mirrored.keras.tape import compute_average_loss, scale_regularization_loss

__all__ = ["compute_average_loss", "scale_regularization_loss"]
