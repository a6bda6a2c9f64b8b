"""``keras.ops``: Keras 3's backend-agnostic op names, each mapped onto the op of TensorFlow's
name in ``mirrored/ops.py`` (one table; nothing is computed here).

keras.io's guides write layers with these (``ops.matmul(inputs, self.w) + self.b``,
``ops.mean(...)``, ``ops.exp(...)``), so ``from mirrored.keras import ops`` runs them as
written. The names differ from TensorFlow's where NumPy's do (``sum`` for ``reduce_sum``,
``concatenate`` for ``concat``, ``clip`` for ``clip_by_value``); the semantics are the same
rows of the op table, differentiated by the same tape. One difference kept from Keras:
``ops.shape(x)`` is a tuple of Python ints (``tf.shape`` gives a tensor).

Only the names listed here exist; others raise AttributeError (add a row when a guide needs it).

Neighbours: ``mirrored/ops.py`` (the op table), ``keras/random.py`` (``keras.random``),
``keras/activations.py`` (``keras.activations``).
"""
from mirrored import ops as _tf

# --- the NumPy API, element-wise ----------------------------------------------------------
add, subtract, multiply, divide = _tf.add, _tf.subtract, _tf.multiply, _tf.divide
power, maximum, minimum, where = _tf.pow, _tf.maximum, _tf.minimum, _tf.where
negative, absolute, abs, square, sqrt = _tf.negative, _tf.abs, _tf.abs, _tf.square, _tf.sqrt  # noqa: A001
exp, log, tanh, sign = _tf.exp, _tf.log, _tf.tanh, _tf.sign
floor, ceil, round = _tf.floor, _tf.ceil, _tf.round  # noqa: A001
matmul, transpose, expand_dims = _tf.matmul, _tf.transpose, _tf.expand_dims
stack, cast, stop_gradient = _tf.stack, _tf.cast, _tf.stop_gradient
zeros_like, ones_like, convert_to_tensor = _tf.zeros_like, _tf.ones_like, _tf.as_tensor

# --- neural-network ops (``keras.ops.relu``, ...) ----------------------------------------
relu, sigmoid, softplus, softmax, log_softmax = _tf.relu, _tf.sigmoid, _tf.softplus, _tf.softmax, _tf.log_softmax


def ones(shape, dtype="float32"):
    return _tf.ones(shape, dtype=dtype)


def zeros(shape, dtype="float32"):
    return _tf.zeros(shape, dtype=dtype)


def sum(x, axis=None, keepdims=False):  # noqa: A001 (keras.ops.sum)
    return _tf.reduce_sum(_tf.as_tensor(x), axis=axis, keepdims=keepdims)   # a tensor, for arrays too


def mean(x, axis=None, keepdims=False):
    return _tf.reduce_mean(_tf.as_tensor(x), axis=axis, keepdims=keepdims)


def max(x, axis=None, keepdims=False):  # noqa: A001
    return _tf.reduce_max(_tf.as_tensor(x), axis=axis, keepdims=keepdims)


def min(x, axis=None, keepdims=False):  # noqa: A001
    return _tf.reduce_min(_tf.as_tensor(x), axis=axis, keepdims=keepdims)


def reshape(x, new_shape):
    return _tf.reshape(_tf.as_tensor(x), new_shape)


def argmax(x, axis=None):
    """Keras's ``argmax``: over the flattened tensor when ``axis`` is None."""
    x = _tf.as_tensor(x)
    return _tf.argmax(_tf.reshape(x, (-1,)) if axis is None else x, axis=0 if axis is None else axis)


def concatenate(xs, axis=0):
    return _tf.concat(list(xs), axis=axis)


def squeeze(x, axis=None):
    return _tf.squeeze(_tf.as_tensor(x), axis=axis)


def clip(x, x_min, x_max):
    return _tf.clip_by_value(x, x_min, x_max)


def shape(x):
    """Keras's ``ops.shape``: the shape as a tuple of ints (``ops.shape(z)[0]`` is the batch)."""
    return tuple(_tf.as_tensor(x).shape)
