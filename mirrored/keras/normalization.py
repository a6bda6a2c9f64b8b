"""Keras's normalization layers, written with ``call`` in ops (``call_layers.py`` runs them in a
model; their gradients, through the batch statistics too, come from the ops' rules):
``BatchNormalization`` and ``LayerNormalization``.

BatchNormalization (Keras 3's math, ``keras/src/layers/normalization/batch_normalization.py``)::

    training (fit, or training=True) and the layer trainable:
        mean = mean of x over every axis but ``axis``          (this replica's batch)
        var  = mean of (x - mean)**2 over the same axes        (biased, as Keras 3)
        moving_mean     <- moving_mean * momentum + mean * (1 - momentum)
        moving_variance <- moving_variance * momentum + var * (1 - momentum)
    otherwise (evaluate, predict, or a frozen layer, as Keras 3):
        mean, var = moving_mean, moving_variance
    y = (x - mean) / sqrt(var + epsilon) * gamma + beta

Under MirroredStrategy each replica normalizes with the statistics of ITS share of the batch,
and the moving statistics follow TensorFlow's: per-replica updates, read as their MEAN
(``non_trainable.py`` says how and why the replicas stay bitwise equal).
``synchronized=True`` (Keras's TensorFlow backend): in training inside ``strategy.run`` on
several replicas, the mean and variance are the GLOBAL batch's, from one all-reduce of every
replica's per-channel sum of x, sum of x**2 and count (``global_moments``); the all-reduce is
differentiable, so the backward all-reduces too. Every replica then holds the same statistics,
normalizes as one replica would on the whole batch, and updates its moving statistics to the same
bits. Such a layer says ``cross_replica = True``, and fit runs its model a replica thread per
device (``custom_step.py``), since only threads can wait for each other. On one replica it is
the unsynchronized math; in training outside ``strategy.run`` with several replicas, refused.

Neighbours: ``call_layers.py``, ``non_trainable.py`` (where the moving statistics live),
``mirrored/strategy.py`` (``ReplicaContext.all_reduce`` and its gradient), ``custom_step.py``,
``mirrored/ops.py`` (the ops), ``weight_shapes.py`` (``weight_specs``: what a file may hold).
"""
import numpy as np

from mirrored import ops
from mirrored.keras import initializers, non_trainable
from mirrored.keras.base_layer import Layer, snake_case
from mirrored.strategy import get_replica_context
from mirrored.values import components


def initializer_arg(spec, what):
    """An initializer as Keras's config gives it (a name, or ``{"class_name": "Ones", ...}``)."""
    if isinstance(spec, dict):
        spec = snake_case(spec.get("class_name", ""))
    return initializers.get(spec, what)


def refuse_extras(layer, **extras):
    """Regularizers and constraints are not implemented for these layers: refused by name."""
    given = sorted(k for k, v in extras.items() if v is not None)
    if given:
        raise NotImplementedError(f"{type(layer).__name__}: {', '.join(given)} not implemented here; leave "
                                  f"them None (or add the penalty to the loss).")


def channel_axis(layer, axis, input_shape):
    """``axis`` as a non-negative index into a batch of ``input_shape`` (batch axis 0)."""
    rank = len(input_shape)
    index = axis + rank if axis < 0 else axis
    if not 1 <= index < rank:
        raise ValueError(f"{type(layer).__name__} {layer.name!r}: axis={axis} is out of range for inputs "
                         f"of shape {tuple(input_shape)} (the batch axis 0 cannot be normalized over).")
    return index


class BatchNormalization(Layer):
    """Keras 3's ``BatchNormalization`` (the module docstring has its math)."""

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones", moving_mean_initializer="zeros",
                 moving_variance_initializer="ones", beta_regularizer=None, gamma_regularizer=None,
                 beta_constraint=None, gamma_constraint=None, synchronized=False, **kwargs):
        super().__init__(**kwargs)
        refuse_extras(self, beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
                      beta_constraint=beta_constraint, gamma_constraint=gamma_constraint)
        if isinstance(axis, (list, tuple)):
            if len(axis) != 1:
                raise NotImplementedError("BatchNormalization: one axis here (axis=-1, the channels).")
            axis = axis[0]
        self.axis, self.momentum, self.epsilon = int(axis), float(momentum), float(epsilon)
        self.center, self.scale, self.synchronized = bool(center), bool(scale), bool(synchronized)
        what = f"BatchNormalization {self.name!r}"
        self.initializers = {k: initializer_arg(v, f"{what} {k}_initializer") for k, v in (
            ("beta", beta_initializer), ("gamma", gamma_initializer),
            ("moving_mean", moving_mean_initializer), ("moving_variance", moving_variance_initializer))}

    def weight_specs(self, input_shape):
        """``[(name, shape)]`` of the weights made for examples of ``input_shape``, in
        ``weights``' order (Keras's: gamma, beta, moving_mean, moving_variance)."""
        c = (int(input_shape[channel_axis(self, self.axis, (None,) + tuple(input_shape)) - 1]),)
        return ([("gamma", c)] if self.scale else []) + ([("beta", c)] if self.center else []) + \
            [("moving_mean", c), ("moving_variance", c)]

    def build(self, input_shape):
        self.channel = channel_axis(self, self.axis, input_shape)
        for name, shape in self.weight_specs(input_shape[1:]):
            state = name.startswith("moving")
            setattr(self, name, self.add_weight(shape=shape, initializer=self.initializers[name], name=name,
                                                trainable=not state, aggregation="mean" if state else "none"))

    def compute_output_shape(self, input_shape):
        return input_shape

    @property
    def cross_replica(self):
        """True when ``synchronized``: the layer all-reduces inside its forward and backward,
        so fit runs its model a replica thread per device (``custom_step.runs_keras_step``)."""
        return self.synchronized

    def moments(self, inputs, axes):
        """The batch mean and (biased) variance over ``axes``, kept as axes of 1: this replica's
        batch, or with ``synchronized`` inside ``strategy.run`` on several replicas, the
        global batch's (``global_moments``)."""
        if self.synchronized:
            replica = get_replica_context()
            if replica is not None and replica.num_replicas_in_sync > 1:
                return self.global_moments(inputs, axes, replica)
            copies = len(components(self.moving_mean))
            if copies > 1:
                raise NotImplementedError(
                    f"BatchNormalization {self.name!r}(synchronized=True) was called in training "
                    f"outside strategy.run, with its weights on {copies} replicas: the global "
                    f"batch's statistics are all-reduced between replica threads, which only "
                    f"strategy.run starts. Call the model inside strategy.run (a custom loop's "
                    f"step), or use fit, which does so for a model with this layer.")
        mean = ops.reduce_mean(inputs, axis=axes, keepdims=True)
        var = ops.reduce_mean(ops.square(inputs - mean), axis=axes, keepdims=True)
        return mean, var

    def global_moments(self, inputs, axes, replica):
        """Keras 3's ``_compute_moments_sync`` (its TensorFlow backend): this replica's sum of x,
        sum of x**2 and count per channel, SUMmed over the replicas by one all-reduce (the ring;
        its backward all-reduces the gradients: ``ReplicaContext.all_reduce``), then

            mean = sum x / count,   var = max(sum x**2 / count - mean**2, 0)

        the global batch's, with the same bits on every replica (the ring hands every replica
        the same sums), so the moving statistics stay equal too."""
        c = inputs.shape[self.channel]
        shape = [1] * len(inputs.shape)
        shape[self.channel] = c
        count = float(np.prod([inputs.shape[i] for i in axes]))       # this replica's values per channel
        local = ops.stack([ops.reshape(ops.reduce_sum(inputs, axis=axes), (c,)),
                           ops.reshape(ops.reduce_sum(ops.square(inputs), axis=axes), (c,)),
                           ops.fill((c,), count, np.float32, device=inputs.dev)])       # (3, c)
        sums = replica.all_reduce("sum", local)                         # (3, c): the global batch's
        mean = sums[0] / sums[2]
        var = ops.maximum(sums[1] / sums[2] - ops.square(mean), 0.0)
        return ops.reshape(mean, shape), ops.reshape(var, shape)

    def call(self, inputs, training=False):
        ndim, c = len(inputs.shape), inputs.shape[self.channel]
        shape = [1] * ndim                                   # a channel vector, broadcast over the rest
        shape[self.channel] = c
        if training and self.trainable:
            mean, var = self.moments(inputs, [i for i in range(ndim) if i != self.channel])
            for moving, batch in ((self.moving_mean, mean), (self.moving_variance, var)):
                new = moving * self.momentum + ops.reshape(batch, (c,)) * (1.0 - self.momentum)
                non_trainable.assign_own_copy(moving, ops.stop_gradient(new))
        else:
            mean, var = ops.reshape(self.moving_mean, shape), ops.reshape(self.moving_variance, shape)
        inv = ops.rsqrt(var + self.epsilon)                  # (1, ..., c, ..., 1)
        if self.scale:
            inv = inv * ops.reshape(self.gamma, shape)
        shift = -mean * inv
        if self.center:
            shift = shift + ops.reshape(self.beta, shape)
        return inputs * inv + shift

    def get_config(self):
        return dict(self.base_config(), axis=self.axis, momentum=self.momentum, epsilon=self.epsilon,
                    center=self.center, scale=self.scale,
                    **{f"{k}_initializer": initializers.config(self.initializers[k])
                       for k in ("beta", "gamma", "moving_mean", "moving_variance")},
                    beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                    gamma_constraint=None, synchronized=self.synchronized)


class LayerNormalization(Layer):
    """Keras 3's ``LayerNormalization``: each example normalized over ``axis`` (the last by
    default): ``y = (x - mean) / sqrt(var + epsilon) * gamma + beta``, the statistics of that
    example alone (no moving statistics; training or not, the same)."""

    def __init__(self, axis=-1, epsilon=1e-3, center=True, scale=True, rms_scaling=False,
                 beta_initializer="zeros", gamma_initializer="ones", beta_regularizer=None,
                 gamma_regularizer=None, beta_constraint=None, gamma_constraint=None, **kwargs):
        super().__init__(**kwargs)
        refuse_extras(self, beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
                      beta_constraint=beta_constraint, gamma_constraint=gamma_constraint)
        if rms_scaling:
            raise NotImplementedError("LayerNormalization(rms_scaling=True) is not implemented; leave it False.")
        self.axis = list(axis) if isinstance(axis, (list, tuple)) else int(axis)
        self.epsilon, self.center, self.scale = float(epsilon), bool(center), bool(scale)
        what = f"LayerNormalization {self.name!r}"
        self.initializers = {"beta": initializer_arg(beta_initializer, f"{what} beta_initializer"),
                             "gamma": initializer_arg(gamma_initializer, f"{what} gamma_initializer")}

    def axes(self, rank):
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        return sorted(channel_axis(self, a, (None,) * rank) for a in axes)

    def weight_specs(self, input_shape):
        full = (None,) + tuple(input_shape)
        shape = tuple(int(full[a]) for a in self.axes(len(full)))
        return ([("gamma", shape)] if self.scale else []) + ([("beta", shape)] if self.center else [])

    def build(self, input_shape):
        for name, shape in self.weight_specs(input_shape[1:]):
            setattr(self, name, self.add_weight(shape=shape, initializer=self.initializers[name], name=name))

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, inputs):
        ndim = len(inputs.shape)
        axes = self.axes(ndim)
        shape = [inputs.shape[i] if i in axes else 1 for i in range(ndim)]
        mean = ops.reduce_mean(inputs, axis=axes, keepdims=True)
        var = ops.reduce_mean(ops.square(inputs - mean), axis=axes, keepdims=True)
        inv = ops.rsqrt(var + self.epsilon)
        if self.scale:
            inv = inv * ops.reshape(self.gamma, shape)
        y = (inputs - mean) * inv
        return y + ops.reshape(self.beta, shape) if self.center else y

    def get_config(self):
        return dict(self.base_config(), axis=self.axis, epsilon=self.epsilon, center=self.center,
                    scale=self.scale, rms_scaling=False,
                    beta_initializer=initializers.config(self.initializers["beta"]),
                    gamma_initializer=initializers.config(self.initializers["gamma"]),
                    beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                    gamma_constraint=None)


__all__ = ["BatchNormalization", "LayerNormalization"]
