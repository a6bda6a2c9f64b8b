"""Float64 oracles the tests share: central differences (what a gradient rule is checked against).

Neighbours: the tests that import it (``test_sync_batchnorm.py``, ``test_conv_transpose.py``,
``test_layers_next.py``); ``test_ops.py`` keeps its own of several arrays.
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
