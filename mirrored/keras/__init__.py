"""``mirrored.keras``: the Keras API the course lab uses, over layers that own their kernels.

    model = mirrored.keras.Sequential([
        mirrored.keras.layers.Flatten(input_shape=(28, 28, 1)),
        mirrored.keras.layers.Dense(64, activation="relu"),
        mirrored.keras.layers.Dense(10)])
    model.compile(loss=mirrored.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=mirrored.keras.optimizers.Adam(), metrics=["accuracy"])
    model.fit(train_dataset, epochs=12)

Three ways to write a model, one engine (a program of layer nodes): ``Sequential([...])``,
``keras.Model(inputs, outputs)`` from ``keras.Input`` and layer calls (functional), and
``class M(keras.Model)`` with ``call`` (subclassed, traced on first use).

Files: models.py (Model, Sequential, Functional: made and built), trainer.py (fit), functional.py (symbolic
tensors, layer calls recorded, the nodes' topological order, tracing), model_api.py (compile, evaluate,
predict, weights, saving, summary), step.py (one training step: split,
forward/backward, all-reduce, update; inference.py: evaluate's and predict's passes), engine.py (packed weights; a replica's
program of layers), layers.py (Flatten, Dense, Conv2D, MaxPooling2D: each with its
forward and backward; dropout.py: Dropout; merging.py: Add, Concatenate, ...; base_layer.py: Layer, Input;
initializers.py),
custom_step.py (fit, evaluate and predict running a model's own train_step, test_step,
predict_step; compute_loss, model.metrics), multi_io.py (a functional model of several inputs
or outputs as one program; compile_utils.py: its losses, loss_weights and metrics per output),
data_adapters.py (arrays, datasets, resident data), saving.py (Keras 3's
.weights.h5 and .keras files; ``models.load_model``),
losses.py, regularizers.py (L2), utils.py (to_categorical), datasets.py (keras.datasets:
mnist, fashion_mnist, cifar10), optimizers.py (SGD, Adam; optimizers_more.py: RMSprop, Adagrad, AdamW; schedules.py;
optimizer_state.py: clipping, weight decay, what Keras saves of them), metrics.py, callbacks.py, tape.py
(GradientTape), progbar.py, random.py (keras.random: normal, uniform, SeedGenerator), ops.py (keras.ops),
activations.py (keras.activations; a Dense's or Conv2D's activation its kernels do not apply: composed_layers.py).
"""
from mirrored.keras import (activations, callbacks, datasets, layers, losses, metrics, ops, optimizers,
                            random, regularizers, saving, utils)
from mirrored.keras.functional import KerasTensor
from mirrored.keras.layers import Input
from mirrored.keras.models import Functional, Model, Sequential

# Keras's merge layers (merging.py) as tf.keras.layers.Add, .Concatenate, .add, ...: set on the
# layers module here, so that layers.py, a file of the step's reading order, does not grow.
from mirrored.keras import composed_layers, conv_transpose, embedding, merging, normalization, pooling_layers
for _module in (merging, composed_layers,     # Activation, ReLU, Reshape, Lambda...: composed_layers.py
                normalization, pooling_layers, embedding,    # BatchNormalization, GlobalAveragePooling2D...
                conv_transpose):                             # Conv2DTranspose
    for _name in _module.__all__:
        setattr(layers, _name, getattr(_module, _name))
del _name, _module
# A Dense called on data inside another layer's call runs as its ops (composed_layers.dense_as_ops).
from mirrored.keras import call_layers  # noqa: E402
call_layers.inline_ops[layers.Dense] = composed_layers.dense_as_ops
# RMSprop, Adagrad, AdamW and keras.optimizers.schedules (optimizers_more.py) as tf.keras.optimizers.*:
# set on the optimizers module here, so that optimizers.py, a file of the reading order, does not grow.
from mirrored.keras import optimizers_more
for _name in optimizers_more.__all__:
    setattr(optimizers, _name, getattr(optimizers_more, _name))
del _name


class models:  # noqa: N801 (``keras.models``; ``from mirrored.keras.models import Model`` imports models.py)
    Model = Model
    Sequential = Sequential
    load_model = staticmethod(saving.load_model)


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True):
    """``tf.keras.models.load_model("m.keras")`` (also ``mirrored.keras.saving.load_model``)."""
    return saving.load_model(filepath, custom_objects, compile, safe_mode)
