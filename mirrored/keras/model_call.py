"""A subclassed model whose ``call`` is made of ops and its own variables, as TF's guide
"Basic training loops" writes it:

    class MyModelKeras(tf.keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.w = tf.Variable(5.0)
            self.b = tf.Variable(0.0)
        def call(self, x):
            return self.w * x + self.b

Such a ``call`` cannot be turned into a program of layers (``functional.call_symbolically``): ``self.w *
x`` needs the value of x. So the model becomes ONE node whose layer, ``ModelCall``, is a
layer written with ``call`` (``call_layers.py``): the engine runs the model's ``call`` on the
replica's batch under a private tape, and its backward is that tape's gradient. The weights
of that node are the model's: the variables set as its attributes (in the order set, as
Keras tracks them), then its layers' weights. They are packed like any layer's (one buffer
per device, one ring a step), so fit, evaluate, predict, ``model(x)`` under a
GradientTape and ``strategy.run`` all run the user's ``call``.

Examples may be scalars (x of shape (N,)): Keras hands ``call`` the batch as it is, shape
(b,). The engine keeps a feature axis (its outputs are (b, units)), so such a model is
built for examples of shape (1,) and ``ModelCall`` squeezes that axis before ``call`` and adds
it back to a (b,) output; ``predict`` gives (N, 1) where Keras gives (N,).

The same path runs a model whose ``call`` mixes layers and ops on their outputs, as keras.io's
VAE (guide "Making new layers and models via subclassing") writes it:

    def call(self, inputs):
        z_mean, z_log_var, z = self.encoder(inputs)            # a layer returning a tuple
        reconstructed = self.decoder(z)
        kl_loss = -0.5 * ops.mean(z_log_var - ops.square(z_mean) - ops.exp(z_log_var) + 1)
        self.add_loss(kl_loss)
        return reconstructed

Tracing it into layer nodes fails (``functional.Untraceable``: ops on symbolic tensors, a layer
of several outputs), so ``untraceable`` says so and the model is this one node: its layers run
their ``call``s eagerly inside it, a Dense as its ops (``composed_layers.dense_as_ops``), and the
value given to ``self.add_loss`` joins fit's loss (``call_layers.add_loss``). Called on data
outside fit (``vae(x)`` under a custom loop's GradientTape), such a model runs its ``call`` op by
op (``call_eagerly``), so the tape sees every op and ``vae.losses`` holds the added terms as
tensors on the tape, which ``loss += sum(vae.losses)`` differentiates.

Neighbours: ``models.py`` (``Model._program`` picks this path), ``call_layers.py`` (how a
layer's ``call`` runs in the engine), ``functional.py`` (the traced path).
"""
import numpy as np

from mirrored import devices, ops, values
from mirrored.keras import call_layers, functional
from mirrored.keras.base_layer import Layer
from mirrored.tensor import Tensor


def untraceable(model, input_shape, input_layer):
    """True when ``model.call`` cannot be traced into layer nodes (``functional.Untraceable``);
    remembered, as ``call_eagerly`` asks it of every call. The failed trace may have built
    layers: their weights are the model's all the same."""
    if "_untraceable" not in model.__dict__:
        try:
            functional.call_symbolically(model, input_shape, True, input_layer(shape=input_shape))
            model.__dict__["_untraceable"] = False
        except functional.Untraceable:
            model.__dict__["_untraceable"] = True
    return model.__dict__["_untraceable"]


def built(model, input_shape, scalars):
    """The model's one layer, built (its output shape: call run once on zeros)."""
    layer = ModelCall(model, scalars)
    layer.build(input_shape)
    for owner in [model] + model.layers:         # the trial call's add_loss values are no call's
        call_layers.clear_added_losses(owner)
    return layer


def runs_eagerly(model):
    """A built model whose ``call`` could not be traced (``untraceable``): ``model(x)`` runs it op by op."""
    return bool(model.__dict__.get("_untraceable")) and model.nodes is not None


def call_eagerly(model, inputs, training, replica, dev):
    """``model(x)`` on data for such a model: its ``call`` on this replica's copies of the weights,
    on ``dev``, recorded by any open tape; the losses ``add_loss`` kept before are forgotten
    first (Keras: ``model.losses`` holds the last call's)."""
    call_layers.clear_added_losses(model)
    for layer in model.layers:
        call_layers.clear_added_losses(layer)
    with values.replica_copies(replica), devices.device_scope(dev):
        x = inputs if isinstance(inputs, Tensor) else ops.as_tensor(np.asarray(inputs, np.float32), device=dev)
        return call_layers.eager_call(model.nodes[0].layer, x, {"training": training})


class ModelCall(Layer):
    """The one layer of a model run as its ``call``: weights the model's, ``call`` the model's."""

    def __init__(self, model, scalars=False):
        super().__init__(name=f"{model.name}_call")
        self.__dict__["model"] = model           # not a sublayer: its weights are listed below
        self.scalars = scalars                   # x (N,): the engine's (b, 1), call's (b,)

    @property
    def weights(self):
        """The model's variables, then its layers' weights (Keras's order, ``model.weights``)."""
        return self.model.own_variables + [w for layer in self.model.layers for w in layer.weights]

    def call(self, inputs, training=False):
        call = type(self.model).call
        if self.scalars:                         # the engine keeps a feature axis; Keras's call has none
            inputs = ops.squeeze(inputs, -1)
        kwargs = {"training": training} if call_layers.takes_training(call) else {}
        with call_layers.model_owned():          # its layers' weights are the model's packed ones
            y = call(self.model, inputs, **kwargs)
        y = ops.as_tensor(y)
        return ops.expand_dims(y, -1) if self.scalars and y.ndim == 1 else y

