"""Float64 oracles the tests share: central differences (what a gradient rule is checked
against), and keras.io's GAN in NumPy (its networks Dense -> LeakyReLU -> Dense, its loss).

Neighbours: the tests that import it (``test_sync_batchnorm.py``, ``test_conv_transpose.py``,
``test_layers_next.py``, ``test_gan_train_step.py``, ``test_nested_models.py``); ``test_ops.py``
keeps its own of several arrays.
"""
import numpy as np


def numeric_grad(f, x, eps=1e-6):
    """d f(x) / d x by central differences: ``f`` a float64 function of the array ``x`` to a number."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


def leaky_mlp(w, x, slope):
    """Dense -> LeakyReLU(``slope``) -> Dense with weights ``w`` = [W1, b1, W2, b2]: (its output,
    what its backward needs)."""
    h = x @ w[0] + w[1]
    a = np.where(h > 0, h, slope * h)
    return a @ w[2] + w[3], (x, h, a)


def leaky_mlp_backward(w, saved, dout, slope):
    """(weight gradients, d input) of ``leaky_mlp`` for d output ``dout``."""
    x, h, a = saved
    dh = (dout @ w[2].T) * np.where(h > 0, 1.0, slope)
    return [x.T @ dh, dh.sum(0), a.T @ dout, dout.sum(0)], dh @ w[0].T


def bce_logits(logits, y, scale=1.0):
    """``scale`` x the mean binary cross-entropy on logits, and its gradient."""
    loss = np.mean(np.maximum(logits, 0) - logits * y + np.log1p(np.exp(-np.abs(logits))))
    return scale * loss, scale * (1 / (1 + np.exp(-logits)) - y) / logits.size
