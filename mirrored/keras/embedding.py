"""Keras's ``Embedding(input_dim, output_dim)``: integer token ids -> rows of a learned table,
written with ``call`` in ops (``call_layers.py`` runs it in a model).

    y[n, t, :] = embeddings[ids[n, t], :]        embeddings: (input_dim, output_dim)

How, and why so: the lookup is a one-hot product, ``one_hot(ids, input_dim) @ embeddings``.
It is the same rows (each one-hot row picks one row of the table, every other term an exact
0 * w), and its gradient comes from matmul's rule: d embeddings = one_hotᵀ @ dy, the
scatter-add of dy's rows onto the ids' rows, summed in a fixed order (bitwise-equal
replicas). It costs input_dim multiply-adds per output number instead of one: fine for the
course's vocabularies (a few thousand ids), not for a 50,000-word one (a gather op with a
scatter-add gradient is what is left).

Inputs. A model here takes float32 examples: ``fit`` converts integer arrays to float32, which
holds every integer up to 2**24 exactly, and the layer casts them back to int32. An id outside
[0, input_dim) gives a row of zeros (TensorFlow on a GPU does the same; on its CPU it raises).
``mask_zero`` is not implemented (no layer here consumes masks).

Neighbours: ``call_layers.py``, ``normalization.py`` (``initializer_arg``), ``mirrored/ops.py``.
"""
import numpy as np

from mirrored import ops
from mirrored.keras import initializers
from mirrored.keras.base_layer import Layer
from mirrored.keras.normalization import initializer_arg, refuse_extras


class Embedding(Layer):
    """Keras 3's ``Embedding(input_dim, output_dim, embeddings_initializer='uniform')``."""

    def __init__(self, input_dim, output_dim, embeddings_initializer="uniform", embeddings_regularizer=None,
                 embeddings_constraint=None, mask_zero=False, weights=None, lora_rank=None, **kwargs):
        kwargs.pop("input_length", None)                  # Keras 2's argument, ignored by Keras 3
        super().__init__(**kwargs)
        refuse_extras(self, embeddings_regularizer=embeddings_regularizer,
                      embeddings_constraint=embeddings_constraint, lora_rank=lora_rank, weights=weights)
        if mask_zero:
            raise NotImplementedError("Embedding(mask_zero=True) is not implemented (no layer here uses "
                                      "masks); leave it False.")
        if int(input_dim) < 1 or int(output_dim) < 1:
            raise ValueError(f"Embedding: input_dim and output_dim must be positive, got {input_dim}, {output_dim}.")
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        spec = "random_uniform" if embeddings_initializer == "uniform" else embeddings_initializer
        self.embeddings_initializer = initializer_arg(spec, f"Embedding {self.name!r} embeddings_initializer")

    def weight_specs(self, input_shape):
        return [("embeddings", (self.input_dim, self.output_dim))]

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(self.input_dim, self.output_dim),
                                          initializer=self.embeddings_initializer, name="embeddings")

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def call(self, inputs):
        ids = ops.as_tensor(inputs)
        if ids.dtype.kind not in "iu":
            ids = ops.cast(ids, np.int32)                # float32 token ids, exact below 2**24
        shape = tuple(ids.shape)
        flat = ops.reshape(ids, (int(np.prod(shape, dtype=np.int64)),))
        rows = ops.matmul(ops.one_hot(flat, self.input_dim), self.embeddings)   # (n, output_dim)
        return ops.reshape(rows, shape + (self.output_dim,))

    def get_config(self):
        return dict(self.base_config(), input_dim=self.input_dim, output_dim=self.output_dim,
                    embeddings_initializer=initializers.config(self.embeddings_initializer),
                    embeddings_regularizer=None, activity_regularizer=None, embeddings_constraint=None,
                    mask_zero=False)


__all__ = ["Embedding"]
