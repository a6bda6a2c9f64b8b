"""A subclassed model whose ``call`` is made of ops and its own variables, as TF's guide
"Basic training loops" writes it:

    class MyModelKeras(tf.keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.w = tf.Variable(5.0)
            self.b = tf.Variable(0.0)
        def call(self, x):
            return self.w * x + self.b

Such a ``call`` cannot be traced into a program of layers (``functional.trace``): ``self.w *
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

Neighbours: ``models.py`` (``Model._program`` picks this path), ``call_layers.py`` (how a
layer's ``call`` runs in the engine), ``functional.py`` (the traced path).
"""
from mirrored import ops
from mirrored.keras import call_layers
from mirrored.keras.base_layer import Layer


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
        y = call(self.model, inputs, **kwargs)
        y = ops.as_tensor(y)
        return ops.expand_dims(y, -1) if self.scalars and y.ndim == 1 else y

