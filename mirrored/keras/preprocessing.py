"""``StringLookup`` and ``IntegerLookup``: Keras 3's vocabulary layers, as host-side preprocessing.

TensorFlow's "Distributed input" tutorial makes one under the strategy's scope and maps a
data set of strings through it, inside ``Dataset.map``, before the batches reach the
replicas::

    with strategy.scope():
        layer = tf.keras.layers.StringLookup(vocabulary=["a", "b", "c", "d", "f"])
    dataset = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat().batch(4)
    dataset.map(lambda x: layer(x))      # [1 3 0 1]: "e" is out of vocabulary (index 0)

Here the lookup is a dictionary on the host (NumPy in, NumPy out): it runs where the data
pipeline runs, before anything is copied to a device, so it has no kernel and no weights,
and a model cannot hold it (put it in the data set's ``map``, as the tutorial does).

Keras's index layout (``output_mode='int'``, ``get_vocabulary()`` lists it):

    [mask_token]           index 0, only when mask_token is set
    [oov_token] * num_oov  the out-of-vocabulary indices (1 by default: index 0 without a mask)
    vocabulary ...         the tokens, in the order given (or adapt()'s: most frequent first)

With ``num_oov_indices > 1`` an unknown token picks one of the OOV indices by a hash:
``floormod(value, num_oov_indices)`` for integers, as Keras; for strings Keras uses
TensorFlow's FarmHash, which is not reproduced here: a stable CRC-32 of the UTF-8 bytes
spreads them instead (the same token always gets the same index, but not TF's index).
``num_oov_indices=0``: an unknown token is an error. ``invert=True`` maps indices back to
tokens. ``output_mode='one_hot'``: one row of ``vocabulary_size()`` per value (float32); the
mask token has no column there and gives a row of zeros, as Keras drops it.

A vocabulary may be given as ``get_vocabulary()`` returns it, its special tokens leading it
(``[mask] + [oov] * num_oov_indices``, exactly so): they are recognised and skipped, so
``StringLookup(vocabulary=layer.get_vocabulary(), invert=True)`` is the inverse of
``layer`` (TF's text tutorials do this). Elsewhere in the vocabulary the mask token is an
error, and so is the OOV token when ``invert=True`` (it is the answer for unknown indices);
with ``invert=False`` the OOV token is a token like any other, as in Keras.

Strings are bytes, as in TensorFlow: a ``str`` is looked up as its UTF-8 bytes, and bytes
that are not UTF-8 (``b"\\xff"``) are tokens like any other, in the input and in the
vocabulary. ``invert=True`` returns Keras's ``array([b'a', b'[UNK]'], dtype=object)``;
``get_vocabulary()`` returns ``str``s, as Keras decodes them (``encoding``, UTF-8 by
default), and the bytes themselves for a token that does not decode (Keras raises there).

Neighbours: ``mirrored/data.py`` (``Dataset.map``, where these run), ``base_layer.py`` and
``layers.py`` (export them as ``keras.layers.StringLookup`` / ``IntegerLookup``), ``utils.py`` (``to_categorical``).
"""
import codecs
import collections
import zlib

import numpy as np

OUTPUT_MODES = ("int", "one_hot")


class _IndexLookup:
    """What StringLookup and IntegerLookup share: the vocabulary, its index, the lookups."""

    def __init__(self, max_tokens, num_oov_indices, mask_token, oov_token, vocabulary, invert, output_mode,
                 name, kwargs):
        unknown = sorted(set(kwargs) - {"dtype", "vocabulary_dtype", "encoding", "idf_weights", "sparse",
                                        "pad_to_max_tokens", "trainable"})
        if unknown:
            raise TypeError(f"{type(self).__name__}: unexpected argument(s) {unknown}.")
        if kwargs.get("sparse") or kwargs.get("idf_weights") is not None:
            raise NotImplementedError(f"{type(self).__name__}: sparse outputs and idf_weights are not "
                                      f"implemented; use output_mode='int' or 'one_hot'.")
        if output_mode not in OUTPUT_MODES:
            raise NotImplementedError(f"{type(self).__name__}: output_mode={output_mode!r} is not implemented; "
                                      f"use one of {OUTPUT_MODES}.")
        if invert and output_mode != "int":
            raise ValueError(f"{type(self).__name__}: invert=True needs output_mode='int', got {output_mode!r}.")
        if not isinstance(num_oov_indices, int) or num_oov_indices < 0:
            raise ValueError(f"num_oov_indices must be an integer >= 0, got {num_oov_indices!r}.")
        self.max_tokens, self.num_oov_indices, self.invert = max_tokens, num_oov_indices, bool(invert)
        self.encoding = kwargs.get("encoding") or "utf-8"          # StringLookup's get_vocabulary
        try:
            codecs.lookup(self.encoding)
        except (LookupError, TypeError):
            raise ValueError(f"{type(self).__name__}: encoding={self.encoding!r} is not a text encoding "
                             f"Python knows; use e.g. 'utf-8' (Keras's default).") from None
        self.mask_token, self.oov_token = mask_token, oov_token    # as given (Keras's attributes)
        self._mask = None if mask_token is None else self._token(mask_token)   # as looked up
        self._oov = self._token(oov_token)
        self.output_mode, self.name = output_mode, name or self.NAME
        self._vocabulary = []
        self._index = {}
        if vocabulary is not None:
            self.set_vocabulary(vocabulary)

    # -- the vocabulary
    def set_vocabulary(self, vocabulary):
        """The tokens after the mask and OOV indices, in this order (a list, array or a text
        file of one token per line). Leading special tokens, as ``get_vocabulary()`` lists
        them, are skipped (Keras's rule: exactly ``[mask] + [oov] * num_oov_indices``)."""
        if isinstance(vocabulary, str):
            with open(vocabulary, encoding="utf-8") as f:
                vocabulary = [line.rstrip("\n") for line in f]
        if hasattr(vocabulary, "numpy"):
            vocabulary = vocabulary.numpy()
        listed = vocabulary.reshape(-1).tolist() if isinstance(vocabulary, np.ndarray) else list(vocabulary)
        given = [self._token(t) for t in listed]                # (not np.asarray: bytes beside str)
        special = [self._mask] * int(self._mask is not None and self.output_mode == "int") + \
            [self._oov] * self.num_oov_indices
        skip = len(special) if given[:len(special)] == special else 0   # get_vocabulary()'s own layout
        tokens = given[skip:]
        if len(set(tokens)) != len(tokens):
            repeated = sorted({t for t in tokens if tokens.count(t) > 1}, key=str)[:5]
            raise ValueError(f"{type(self).__name__}: the vocabulary repeats {self._shown(repeated)}; "
                             f"give each token once.")
        reserved = [t for t in (self._mask,) + (self._oov,) * self.invert if t is not None and t in tokens]
        if reserved:
            where = [i for i, t in enumerate(given) if i >= skip and t in reserved]
            raise ValueError(f"{type(self).__name__}: the vocabulary holds the reserved token(s) "
                             f"{self._shown(reserved)} (mask_token{' / oov_token' * self.invert}) at "
                             f"index(es) {where}, not only at its start. Leave them out (they have their "
                             f"own indices), or give the vocabulary as get_vocabulary() returns it, "
                             f"starting with exactly {self._shown(special)}.")
        if self.max_tokens is not None and len(tokens) + self._reserved() > self.max_tokens:
            raise ValueError(f"{type(self).__name__}: {len(tokens)} tokens + {self._reserved()} reserved "
                             f"indices exceed max_tokens={self.max_tokens}.")
        self._vocabulary = tokens
        first = self._reserved()
        self._index = {t: first + i for i, t in enumerate(tokens)}

    def adapt(self, data, batch_size=None, steps=None):
        """Learn the vocabulary from ``data`` (an array, a list, or a ``Dataset`` of them): the
        tokens by decreasing count, ties in decreasing token order (Keras's sort), at most
        ``max_tokens`` minus the reserved indices."""
        counts = collections.Counter()
        chunks = data if hasattr(data, "batch") and not isinstance(data, np.ndarray) else [data]
        for k, chunk in enumerate(chunks):
            if steps is not None and k >= steps:
                break
            counts.update(self._token(t) for t in self._values(chunk).reshape(-1).tolist())
        counts.pop(self._mask, None)
        counts.pop(self._oov, None)
        ordered = sorted(counts, key=lambda t: (counts[t], t), reverse=True)
        if self.max_tokens is not None:
            ordered = ordered[:max(self.max_tokens - self._reserved(), 0)]
        self.set_vocabulary(ordered)

    def get_vocabulary(self, include_special_tokens=True):
        """Every index's token: [mask], the OOV token once per OOV index, then the vocabulary
        (``str``s for StringLookup, as Keras returns them: see the module docstring)."""
        tokens = list(self._vocabulary)
        if include_special_tokens:
            mask = [self._mask] if self._mask is not None and self.output_mode == "int" else []
            tokens = mask + [self._oov] * self.num_oov_indices + tokens
        return self._shown(tokens)

    def _shown(self, tokens):
        """``tokens`` as a user sees them (StringLookup decodes its bytes)."""
        return list(tokens)

    def vocabulary_size(self):
        return len(self.get_vocabulary())

    def _reserved(self):
        """Indices before the first vocabulary token (mask in 'int' mode, then the OOV ones)."""
        return int(self._mask is not None and self.output_mode == "int") + self.num_oov_indices

    # -- the lookups
    def __call__(self, inputs):
        values = self._values(inputs)
        if not self._vocabulary and not self.invert and self.num_oov_indices == 0:
            raise RuntimeError(f"{type(self).__name__} has no vocabulary: pass vocabulary= or call adapt().")
        if self.invert:
            return self._tokens_of(values)
        indices = self._indices_of(values)                           # same shape, int64; -1: mask
        if self.output_mode == "int":
            return np.where(indices < 0, 0, indices)
        size = self.vocabulary_size()
        flat = indices.reshape(-1)
        out = np.zeros((flat.size, size), np.float32)                 # (n, V)
        keep = flat >= 0
        out[np.flatnonzero(keep), flat[keep]] = 1.0
        shape = indices.shape[:-1] if indices.ndim and indices.shape[-1] == 1 else indices.shape
        return out.reshape(shape + (size,))

    def _indices_of(self, values):
        mask_offset = int(self._mask is not None and self.output_mode == "int")
        flat = values.reshape(-1).tolist()
        out = np.empty(len(flat), np.int64)
        for i, value in enumerate(flat):
            token = self._token(value)
            index = self._index.get(token)
            if index is not None:
                out[i] = index
            elif self._mask is not None and token == self._mask:
                out[i] = 0 if self.output_mode == "int" else -1       # one_hot: no column (dropped)
            elif self.num_oov_indices == 0:
                raise ValueError(f"{type(self).__name__}: {token!r} is not in the vocabulary and "
                                 f"num_oov_indices=0; set num_oov_indices >= 1 to map unknown tokens.")
            else:
                out[i] = mask_offset + self._oov_bucket(token)
        return out.reshape(values.shape)

    def _tokens_of(self, values):
        mask = [self._mask] if self._mask is not None else []              # invert: 'int' mode
        vocabulary = mask + [self._oov] * self.num_oov_indices + self._vocabulary
        indices = np.asarray(values).astype(np.int64)
        flat = [vocabulary[i] if 0 <= i < len(vocabulary) else self._oov for i in indices.reshape(-1).tolist()]
        out = np.empty(len(flat), self.TOKEN_DTYPE)                        # (object: bytes as they are)
        out[:] = flat
        return out.reshape(indices.shape)

    @staticmethod
    def _values(inputs):
        if hasattr(inputs, "numpy"):
            inputs = inputs.numpy()
        if isinstance(inputs, (list, tuple)):           # (np.asarray fails on bytes beside str)
            values = np.array(inputs, dtype=object)
            if any(isinstance(v, (list, tuple, np.ndarray)) for v in values.reshape(-1).tolist()):
                raise ValueError(f"lookup layers take a rectangular array of tokens; got nested lists of "
                                 f"different lengths (shape {values.shape} of lists). Pad the rows to one "
                                 f"length (e.g. with the mask_token) or look each row up on its own.")
            return values
        return np.asarray(inputs)


class StringLookup(_IndexLookup):
    """``tf.keras.layers.StringLookup(max_tokens=None, num_oov_indices=1, mask_token=None,
    oov_token='[UNK]', vocabulary=None, invert=False, output_mode='int')``: strings to indices
    (int64), or back with ``invert=True`` (see the module docstring)."""

    def __init__(self, max_tokens=None, num_oov_indices=1, mask_token=None, oov_token="[UNK]", vocabulary=None,
                 invert=False, output_mode="int", name=None, **kwargs):
        super().__init__(max_tokens, num_oov_indices, mask_token, oov_token, vocabulary, invert, output_mode,
                         name, kwargs)

    @staticmethod
    def _token(value):
        """The bytes looked up for ``value``: bytes as they are, a str as its UTF-8 (TensorFlow's
        tf.string), anything else as its str's."""
        if isinstance(value, bytes):                     # (np.bytes_ too)
            return bytes(value)
        return str(value).encode("utf-8")

    def _shown(self, tokens):
        """Keras's get_vocabulary decodes each token (``encoding``); one that does not decode
        is returned as its bytes (Keras raises UnicodeDecodeError)."""
        shown = []
        for t in tokens:
            try:
                shown.append(t.decode(self.encoding))
            except UnicodeDecodeError:
                shown.append(t)
        return shown

    def _oov_bucket(self, token):
        # Keras: TensorFlow's FarmHash of the string (not reproduced: see the module docstring)
        return zlib.crc32(token) % self.num_oov_indices if self.num_oov_indices > 1 else 0

    TOKEN_DTYPE = object        # invert's output: bytes, as Keras's array([b'a', ...], dtype=object)
    NAME = "string_lookup"


class IntegerLookup(_IndexLookup):
    """``tf.keras.layers.IntegerLookup(max_tokens=None, num_oov_indices=1, mask_token=None,
    oov_token=-1, vocabulary=None, invert=False, output_mode='int')``: integer values to
    indices (int64), or back with ``invert=True`` (see the module docstring)."""

    def __init__(self, max_tokens=None, num_oov_indices=1, mask_token=None, oov_token=-1, vocabulary=None,
                 invert=False, output_mode="int", name=None, **kwargs):
        super().__init__(max_tokens, num_oov_indices, mask_token, oov_token, vocabulary, invert, output_mode,
                         name, kwargs)

    @staticmethod
    def _token(value):
        if isinstance(value, (float, np.floating)) and value != int(value):
            raise ValueError(f"IntegerLookup takes integers, got {value!r}.")
        return int(value)

    def _oov_bucket(self, token):
        return token % self.num_oov_indices if self.num_oov_indices > 1 else 0   # Keras's floormod

    TOKEN_DTYPE = np.int64
    NAME = "integer_lookup"

