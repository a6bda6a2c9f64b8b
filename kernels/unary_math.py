"""Elementwise functions of one tensor: ``tf.abs``, ``tf.exp``, ``tf.nn.relu``, ...

One thread per element over the flattened array (grid-stride), like
``kernels/elementwise.py``: memory-bound, so all that matters is coalesced access.

Layout (as every file in ``kernels/``):
    table             ``UNARY_MATH``: op -> NumPy function (the definition)
    NumPy reference   ``unary_math_ref``
    (kernels, registration and the launcher follow; the CPU backend calls the reference)

TensorFlow's definitions kept here: ``round`` rounds half to even (``tf.round``, as
``np.round``); ``sign(0) = 0``; ``relu(NaN) = NaN``; ``leaky_relu(x) = x if x > 0 else
alpha * x``; ``softplus(x) = log(1 + exp(x))`` computed without overflow;
``sigmoid`` without overflow for large ``|x|``.
"""
import numpy as np


def _sigmoid(x):
    # exp of a negative number only: no overflow for any x
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def _softplus(x):
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype, copy=False)


def _relu(x):
    return np.where(x > 0, x, np.where(np.isnan(x), x, 0)).astype(x.dtype, copy=False)


#: op -> NumPy function of (x, alpha); ``alpha`` is used by leaky_relu and elu only.
UNARY_MATH = {
    "neg": lambda x, a: np.negative(x),
    "abs": lambda x, a: np.abs(x),
    "sign": lambda x, a: np.sign(x),
    "square": lambda x, a: np.square(x),
    "exp": lambda x, a: np.exp(x),
    "log": lambda x, a: np.log(x),
    "log1p": lambda x, a: np.log1p(x),
    "expm1": lambda x, a: np.expm1(x),
    "sqrt": lambda x, a: np.sqrt(x),
    "rsqrt": lambda x, a: 1 / np.sqrt(x),
    "reciprocal": lambda x, a: 1 / x,
    "sin": lambda x, a: np.sin(x),
    "cos": lambda x, a: np.cos(x),
    "tanh": lambda x, a: np.tanh(x),
    "sigmoid": lambda x, a: _sigmoid(x),
    "softplus": lambda x, a: _softplus(x),
    "relu": lambda x, a: _relu(x),
    "leaky_relu": lambda x, a: np.where(x > 0, x, x * x.dtype.type(a)),
    "elu": lambda x, a: np.where(x > 0, x, x.dtype.type(a) * np.expm1(np.minimum(x, 0))),
    "round": lambda x, a: np.round(x),
    "floor": lambda x, a: np.floor(x),
    "ceil": lambda x, a: np.ceil(x),
    "logical_not": lambda x, a: np.logical_not(x),
}
#: Ops defined for integer tensors too (the rest are float-only, as in TensorFlow).
INTEGER_OK = ("neg", "abs", "sign", "square", "relu")
#: Ops on bool tensors.
BOOL_OPS = ("logical_not",)


def unary_math_ref(op, x, alpha=0.0):
    """``op(x)`` elementwise, in x's dtype."""
    with np.errstate(all="ignore"):          # log(0) = -inf, sqrt(-1) = NaN: as TF, no warning
        return np.asarray(UNARY_MATH[op](x, alpha)).astype(x.dtype, copy=False)
