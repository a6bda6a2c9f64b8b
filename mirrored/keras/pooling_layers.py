"""Keras's weightless image layers written with ``call`` in ops (``call_layers.py`` runs them in
a model; their gradients come from the ops' rules): ``GlobalAveragePooling2D``,
``GlobalMaxPooling2D``, ``AveragePooling2D``, ``UpSampling2D`` (NHWC, Keras's default layout).

    GlobalAveragePooling2D   y[n, c] = mean over h, w of x[n, h, w, c]        (reduce_mean)
    GlobalMaxPooling2D       y[n, c] = max over h, w of x[n, h, w, c]         (reduce_max)
    AveragePooling2D         y[n, i, j, c] = mean of the window at (i*sh, j*sw); 'same' pads
                             with zeros and, as TensorFlow, divides by the count of real cells
                             (the window's sum: ph*pw strided slices added)
    UpSampling2D('nearest')  y[n, i, j, c] = x[n, i // sh, j // sw, c]       (a broadcast)

Each is a few ops: their speed is that of the ops' kernels (an AveragePooling2D is ph*pw
strided copies and adds, not one fused kernel: fine for the sizes the course uses).

Neighbours: ``call_layers.py``, ``base_layer.py`` (``image_shape``, ``channels_last``,
``padding_arg``: the checks Conv2D and MaxPooling2D share), ``layers.py`` (MaxPooling2D).
"""
import numpy as np

from mirrored import ops
from mirrored.keras.base_layer import Layer, channels_last, image_shape, padding_arg


def pair(value, what):
    """Keras's int-or-pair arguments (pool_size, strides, size) as a pair of positive ints."""
    pair_ = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair_) != 2 or any(int(v) < 1 for v in pair_):
        raise ValueError(f"{what} must be a positive int or a pair of them, got {value!r}.")
    return tuple(int(v) for v in pair_)


class GlobalPooling2D(Layer):
    """The mean (or max) over the image's height and width, per channel."""

    reduce = None

    def __init__(self, data_format=None, keepdims=False, **kwargs):
        super().__init__(**kwargs)
        channels_last(self, data_format)
        self.keepdims = bool(keepdims)

    def compute_output_shape(self, input_shape):
        n, _, _, c = (input_shape[0],) + image_shape(self, input_shape[1:])
        return (n, 1, 1, c) if self.keepdims else (n, c)

    def call(self, inputs):
        return type(self).reduce(inputs, axis=[1, 2], keepdims=self.keepdims)

    def get_config(self):
        return dict(self.base_config(), data_format="channels_last", keepdims=self.keepdims)


class GlobalAveragePooling2D(GlobalPooling2D):
    reduce = staticmethod(ops.reduce_mean)


class GlobalMaxPooling2D(GlobalPooling2D):
    reduce = staticmethod(ops.reduce_max)


def pooled_size(size, pool, stride, padding):
    """Output length and padding before of TensorFlow's pooling along one axis."""
    if padding == "valid":
        return (size - pool) // stride + 1, 0
    out = -(-size // stride)
    return out, max((out - 1) * stride + pool - size, 0) // 2


class AveragePooling2D(Layer):
    """Keras's ``AveragePooling2D(pool_size=(2, 2), strides=None, padding='valid')``:
    the mean of each window (strides default to pool_size)."""

    def __init__(self, pool_size=(2, 2), strides=None, padding="valid", data_format=None, **kwargs):
        super().__init__(**kwargs)
        channels_last(self, data_format)
        self.pool_size = pair(pool_size, "AveragePooling2D pool_size")
        self.strides = pair(strides, "AveragePooling2D strides") if strides is not None else self.pool_size
        self.padding = padding_arg(self, padding)

    def compute_output_shape(self, input_shape):
        h, w, c = image_shape(self, input_shape[1:])
        (oh, _), (ow, _) = (pooled_size(n, p, s, self.padding)
                            for n, p, s in zip((h, w), self.pool_size, self.strides))
        if oh < 1 or ow < 1:
            raise ValueError(f"AveragePooling2D {self.name!r}: a {self.pool_size} window does not fit "
                             f"images of {h}x{w} with padding='valid'.")
        return (input_shape[0], oh, ow, c)

    def window_sum(self, x, oh, ow):
        """sum over (i, j) of the window of x[:, i + sh*a, j + sw*b, :]: ph*pw strided slices."""
        (ph, pw), (sh, sw) = self.pool_size, self.strides
        total = None
        for i in range(ph):
            for j in range(pw):
                part = x[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw, :]
                total = part if total is None else total + part
        return total

    def call(self, inputs):
        n, h, w, c = inputs.shape
        (oh, top), (ow, left) = (pooled_size(size, p, s, self.padding)
                                 for size, p, s in zip((h, w), self.pool_size, self.strides))
        if self.padding == "valid":
            return self.window_sum(inputs, oh, ow) * (1.0 / (self.pool_size[0] * self.pool_size[1]))
        # 'same': zeros around, and each window divided by how many real cells it covers
        hp = max((oh - 1) * self.strides[0] + self.pool_size[0], h)
        wp = max((ow - 1) * self.strides[1] + self.pool_size[1], w)
        real = np.zeros((1, hp, wp, 1), np.float32)
        real[:, top:top + h, left:left + w] = 1.0
        counts = np.zeros((1, oh, ow, 1), np.float32)
        for i in range(self.pool_size[0]):
            for j in range(self.pool_size[1]):
                counts += real[:, i:i + self.strides[0] * (oh - 1) + 1:self.strides[0],
                               j:j + self.strides[1] * (ow - 1) + 1:self.strides[1]]
        x = inputs
        if hp > h:
            x = ops.concat([ops.zeros((n, top, w, c), device=inputs.dev), x,
                           ops.zeros((n, hp - h - top, w, c), device=inputs.dev)], axis=1)
        if wp > w:
            x = ops.concat([ops.zeros((n, hp, left, c), device=inputs.dev), x,
                           ops.zeros((n, hp, wp - w - left, c), device=inputs.dev)], axis=2)
        return self.window_sum(x, oh, ow) * ops.as_tensor(1.0 / counts, device=inputs.dev)

    def get_config(self):
        return dict(self.base_config(), pool_size=list(self.pool_size), padding=self.padding,
                    strides=list(self.strides), data_format="channels_last")


class UpSampling2D(Layer):
    """Keras's ``UpSampling2D(size=(2, 2), interpolation='nearest')``: each pixel repeated
    ``size`` times along height and width (a reshape and a broadcast: its gradient sums the
    repeats back)."""

    def __init__(self, size=(2, 2), data_format=None, interpolation="nearest", **kwargs):
        super().__init__(**kwargs)
        channels_last(self, data_format)
        if interpolation != "nearest":
            raise NotImplementedError(f"UpSampling2D(interpolation={interpolation!r}) is not implemented; "
                                      f"'nearest' is.")
        self.size = pair(size, "UpSampling2D size")

    def compute_output_shape(self, input_shape):
        h, w, c = image_shape(self, input_shape[1:])
        return (input_shape[0], h * self.size[0], w * self.size[1], c)

    def call(self, inputs):
        n, h, w, c = inputs.shape
        sh, sw = self.size
        x = ops.reshape(inputs, (n, h, 1, w, 1, c))
        x = ops.broadcast_to(x, (n, h, sh, w, sw, c))
        return ops.reshape(x, (n, h * sh, w * sw, c))

    def get_config(self):
        return dict(self.base_config(), size=list(self.size), data_format="channels_last",
                    interpolation="nearest")


__all__ = ["GlobalAveragePooling2D", "GlobalMaxPooling2D", "AveragePooling2D", "UpSampling2D"]
