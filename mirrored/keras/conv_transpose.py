"""Keras 3's ``Conv2DTranspose`` (a "deconvolution"): NHWC images in and out, written with
``call`` in ops (``call_layers.py`` runs it in a model; its gradient comes from the ops' rules).

    y[n, i*sh + a - pt, j*sw + b - pl, f] += x[n, i, j, c] * kernel[a, b, f, c]    (+ bias[f])

kernel: (KH, KW, filters, in_channels), Keras's layout for the transpose (the kernel a Conv2D
from ``filters`` channels to ``in_channels`` would have: this layer's forward is that
Conv2D's gradient with respect to its input). Output size per axis, Keras 3's rule with
``output_padding=None`` (``deconv_output_length``)::

    'valid'  in * s + max(k - s, 0)     (= (in - 1) * s + k when k >= s)
    'same'   in * s

and ``pt`` (``pl``), TensorFlow's 'same' split of the forward Conv2D over the output:
``max(k - s, 0) // 2`` ('valid': 0). Only ``dilation_rate=1`` and ``output_padding=None``.

How, and why so (the simplest correct one): the transposed convolution is a plain
correlation of the input with zeros inserted between its pixels (``s - 1`` of them), padded,
with the kernel flipped in height and width::

    xd[n, i*s, j*s, c] = x[n, i, j, c]    (zeros elsewhere; concat with zeros + reshape)
    xp = xd padded with k - 1 - pt zeros before and the rest after
    y[n, o, p, f] = sum over a, b, c of xp[n, o + a, p + b, c] * kernel[KH-1-a, KW-1-b, f, c]

The sum is one matmul of the KH*KW shifted slices of xp, side by side (im2col by concat),
with the flipped kernel laid out as (filters, KH*KW*C). It does s*s times the multiplies of
a direct scatter (the inserted zeros) and copies KH*KW slices: fine for the course's sizes;
a fused kernel (the forward as ``conv2d_backward``'s dx path, the engine's) is what is left.

Neighbours: ``call_layers.py``, ``layers.py`` (Conv2D), ``pooling_layers.py`` (``pair``),
``composed_layers.py`` (``activation_fn``), ``base_layer.py`` (the shared argument checks).
"""
import numpy as np

from mirrored import ops
from mirrored.keras import initializers
from mirrored.keras.base_layer import Layer, channels_last, image_shape, padding_arg
from mirrored.keras.composed_layers import activation_fn
from mirrored.keras.normalization import initializer_arg, refuse_extras
from mirrored.keras.pooling_layers import pair


def transposed_size(size, kernel, stride, padding):
    """Output length and the 'same' padding before, of a transposed convolution along one axis."""
    if padding == "valid":
        return size * stride + max(kernel - stride, 0), 0
    return size * stride, max(kernel - stride, 0) // 2


def _zeros_between(x, axis, stride):
    """``x`` with ``stride - 1`` zeros after each pixel along ``axis`` (1 or 2), the trailing
    ones cut: length (n - 1) * stride + 1."""
    if stride == 1:
        return x
    shape = tuple(x.shape)
    n = shape[axis]
    split = shape[:axis + 1] + (1,) + shape[axis + 1:]           # a new axis after ``axis``
    zeros = ops.zeros(shape[:axis + 1] + (stride - 1,) + shape[axis + 1:], device=x.dev)
    x = ops.concat([ops.reshape(x, split), zeros], axis=axis + 1)
    x = ops.reshape(x, shape[:axis] + (n * stride,) + shape[axis + 1:])
    key = [slice(None)] * len(shape)
    key[axis] = slice(0, (n - 1) * stride + 1)
    return x[tuple(key)]


def _pad(x, axis, before, after):
    """``x`` with ``before`` and ``after`` zeros along ``axis``."""
    parts = []
    for count in (before, None, after):
        if count is None:
            parts.append(x)
        elif count > 0:
            shape = list(x.shape)
            shape[axis] = count
            parts.append(ops.zeros(tuple(shape), device=x.dev))
    return parts[0] if len(parts) == 1 else ops.concat(parts, axis=axis)


class Conv2DTranspose(Layer):
    """Keras 3's ``Conv2DTranspose(filters, kernel_size, strides=(1, 1), padding='valid',
    activation=None, use_bias=True, kernel_initializer='glorot_uniform', bias_initializer='zeros')``."""

    def __init__(self, filters, kernel_size, strides=(1, 1), padding="valid", output_padding=None,
                 data_format=None, dilation_rate=(1, 1), activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, kernel_constraint=None,
                 bias_constraint=None, **kwargs):
        super().__init__(**kwargs)
        what = f"Conv2DTranspose {self.name!r}"
        refuse_extras(self, kernel_regularizer=kernel_regularizer, bias_regularizer=bias_regularizer,
                      activity_regularizer=activity_regularizer, kernel_constraint=kernel_constraint,
                      bias_constraint=bias_constraint)
        if not isinstance(filters, (int, np.integer)) or isinstance(filters, bool) or filters < 1:
            raise ValueError(f"{what}: filters must be a positive integer (the number of output "
                             f"channels), got {filters!r}.")
        self.filters = int(filters)
        self.kernel_size = pair(kernel_size, f"{what} kernel_size")
        self.strides = pair(strides, f"{what} strides")
        self.padding = padding_arg(self, padding)
        channels_last(self, data_format)
        if pair(dilation_rate, f"{what} dilation_rate") != (1, 1):
            raise NotImplementedError(f"{what}: dilation_rate={dilation_rate!r} is not supported; only "
                                      f"dilation_rate=1 is.")
        if output_padding is not None:
            raise NotImplementedError(f"{what}: output_padding={output_padding!r} is not supported; "
                                      f"leave it None (the output size is then inferred, Keras's default).")
        self.activation_name = activation if isinstance(activation, str) or activation is None else None
        self.activation = activation_fn(activation, what)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializer_arg(kernel_initializer, f"{what} kernel_initializer")
        self.bias_initializer = initializer_arg(bias_initializer, f"{what} bias_initializer")

    def kernel_shape(self, input_shape):
        return self.kernel_size + (self.filters, int(input_shape[-1]))      # (KH, KW, filters, C)

    def weight_specs(self, input_shape):
        return [("kernel", self.kernel_shape(input_shape))] + (
            [("bias", (self.filters,))] if self.use_bias else [])

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=self.kernel_shape(input_shape),
                                      initializer=self.kernel_initializer, name="kernel")
        self.bias = (self.add_weight(shape=(self.filters,), initializer=self.bias_initializer, name="bias")
                     if self.use_bias else None)

    def compute_output_shape(self, input_shape):
        h, w, _ = image_shape(self, input_shape[1:])
        (oh, _), (ow, _) = (transposed_size(n, k, s, self.padding)
                            for n, k, s in zip((h, w), self.kernel_size, self.strides))
        return (input_shape[0], oh, ow, self.filters)

    def call(self, inputs):
        x = ops.as_tensor(inputs)
        n, h, w, c = x.shape
        (kh, kw), (sh, sw) = self.kernel_size, self.strides
        (oh, top), (ow, left) = (transposed_size(size, k, s, self.padding)
                                 for size, k, s in zip((h, w), self.kernel_size, self.strides))
        x = _zeros_between(_zeros_between(x, 1, sh), 2, sw)             # (n, (h-1)*sh+1, (w-1)*sw+1, c)
        x = _pad(x, 1, kh - 1 - top, oh + kh - 1 - (kh - 1 - top) - x.shape[1])
        x = _pad(x, 2, kw - 1 - left, ow + kw - 1 - (kw - 1 - left) - x.shape[2])   # (n, oh+kh-1, ow+kw-1, c)
        taps = [(a, b) for a in range(kh) for b in range(kw)]
        cols = ops.concat([x[:, a:a + oh, b:b + ow, :] for a, b in taps], axis=3)   # (n, oh, ow, kh*kw*c)
        flipped = ops.concat([self.kernel[kh - 1 - a, kw - 1 - b] for a, b in taps], axis=1)  # (f, kh*kw*c)
        y = ops.matmul(ops.reshape(cols, (n * oh * ow, kh * kw * c)), flipped, transpose_b=True)
        if self.use_bias:
            y = y + self.bias
        return self.activation(ops.reshape(y, (n, oh, ow, self.filters)))

    def get_config(self):
        if self.activation_name is None and self.activation is not activation_fn(None, ""):
            raise NotImplementedError(f"Conv2DTranspose {self.name!r} holds a Python function as its "
                                      f"activation, which a file cannot hold here: use an activation's "
                                      f"name, or save_weights.")
        return dict(self.base_config(), filters=self.filters, kernel_size=list(self.kernel_size),
                    strides=list(self.strides), padding=self.padding, data_format="channels_last",
                    dilation_rate=[1, 1], activation=self.activation_name or "linear",
                    use_bias=self.use_bias,
                    kernel_initializer=initializers.config(self.kernel_initializer),
                    bias_initializer=initializers.config(self.bias_initializer),
                    kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                    kernel_constraint=None, bias_constraint=None)


__all__ = ["Conv2DTranspose"]
