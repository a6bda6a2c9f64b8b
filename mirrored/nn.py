"""``mirrored.nn``: TensorFlow's ``tf.nn`` names.

The custom training loops' ``compute_average_loss`` and ``scale_regularization_loss`` live in
keras/tape.py, beside the GradientTape that follows the losses they make; the activations
and cross entropies are ops (``mirrored/ops.py``: each with its gradient rule, or a
composition of ops that have one).
"""
from mirrored.keras.tape import compute_average_loss, scale_regularization_loss
from mirrored.ops import (elu, leaky_relu, log_softmax, relu, sigmoid, sigmoid_cross_entropy_with_logits,
                          softmax, softmax_cross_entropy_with_logits, softplus,
                          sparse_softmax_cross_entropy_with_logits, tanh)

__all__ = ["compute_average_loss", "scale_regularization_loss", "elu", "leaky_relu", "log_softmax",
           "relu", "sigmoid", "sigmoid_cross_entropy_with_logits", "softmax",
           "softmax_cross_entropy_with_logits", "softplus", "sparse_softmax_cross_entropy_with_logits", "tanh"]
