"""StringLookup and IntegerLookup (keras/preprocessing.py) as Keras 3 documents them, and
TensorFlow's "Distributed input" preprocessing cell, which maps a data set of strings
through a StringLookup made under the strategy's scope.

The expected arrays are the examples of Keras 3's own docstrings for these layers (the
spec), plus fresh random tokens checked against a plain dictionary oracle.
"""
import numpy as np
import pytest

import mirrored as tf

VOCAB = ["a", "b", "c", "d"]


def test_string_lookup_index_layout_as_keras():
    layer = tf.keras.layers.StringLookup(vocabulary=VOCAB)
    np.testing.assert_array_equal(layer(np.array([["a", "c", "d"], ["d", "z", "b"]])), [[1, 3, 4], [4, 0, 2]])
    assert layer.get_vocabulary() == ["[UNK]", "a", "b", "c", "d"] and layer.vocabulary_size() == 5
    masked = tf.keras.layers.StringLookup(vocabulary=VOCAB, mask_token="")
    np.testing.assert_array_equal(masked(np.array([["a", "c", ""], ["", "z", "b"]])), [[2, 4, 0], [0, 1, 3]])
    assert masked.get_vocabulary() == ["", "[UNK]", "a", "b", "c", "d"]
    out = layer([b"a", b"q"])                         # TensorFlow's strings are bytes
    assert out.dtype == np.int64 and out.tolist() == [1, 0]


def test_random_tokens_against_a_dictionary_oracle(rng):
    vocab = [f"w{i}" for i in rng.permutation(50)[:20]]
    tokens = rng.choice(vocab + ["oov1", "oov2"], size=(7, 3))
    want = np.vectorize(lambda t: vocab.index(t) + 1 if t in vocab else 0)(tokens)
    np.testing.assert_array_equal(tf.keras.layers.StringLookup(vocabulary=vocab)(tokens), want)


def test_invert_and_one_hot():
    inverse = tf.keras.layers.StringLookup(vocabulary=VOCAB, invert=True)
    got = inverse(np.array([[1, 3, 4], [4, 0, 2]]))           # Keras's docstring: bytes, dtype=object
    assert got.dtype == object and got.tolist() == [[b"a", b"c", b"d"], [b"d", b"[UNK]", b"b"]]
    one_hot = tf.keras.layers.StringLookup(vocabulary=VOCAB, output_mode="one_hot")
    got = one_hot(np.array(["a", "b", "c", "d", "z"]))
    np.testing.assert_array_equal(got, np.eye(5, dtype=np.float32)[[1, 2, 3, 4, 0]])
    assert got.dtype == np.float32
    assert one_hot(np.array([["a"], ["z"]])).shape == (2, 5)              # a trailing 1 is encoded in place
    masked = tf.keras.layers.StringLookup(vocabulary=VOCAB, mask_token="", output_mode="one_hot")
    np.testing.assert_array_equal(masked(np.array(["", "b"])), [[0, 0, 0, 0, 0], [0, 0, 1, 0, 0]])


def test_integer_lookup_as_keras():
    vocab = [12, 36, 1138, 42]
    data = np.array([[12, 1138, 42], [42, 1000, 36]])
    np.testing.assert_array_equal(tf.keras.layers.IntegerLookup(vocabulary=vocab)(data), [[1, 3, 4], [4, 0, 2]])
    two_oov = tf.keras.layers.IntegerLookup(vocabulary=vocab, num_oov_indices=2)
    np.testing.assert_array_equal(two_oov(data), [[2, 4, 5], [5, 0, 3]])      # 1000 % 2 = 0
    np.testing.assert_array_equal(two_oov([1001]), [1])
    inverse = tf.keras.layers.IntegerLookup(vocabulary=vocab, invert=True)
    np.testing.assert_array_equal(inverse(np.array([[1, 3, 4], [4, 0, 2]])), [[12, 1138, 42], [42, -1, 36]])
    strict = tf.keras.layers.IntegerLookup(vocabulary=vocab, num_oov_indices=0)
    np.testing.assert_array_equal(strict([36, 12]), [1, 0])
    with pytest.raises(ValueError, match="num_oov_indices=0"):
        strict([7])


def test_adapt_orders_by_count_then_token_as_keras():
    layer = tf.keras.layers.StringLookup()
    layer.adapt(np.array([["a", "c", "d"], ["d", "z", "b"]]))
    assert layer.get_vocabulary() == ["[UNK]", "d", "z", "c", "b", "a"]
    ints = tf.keras.layers.IntegerLookup()
    ints.adapt(tf.data.Dataset.from_tensor_slices(np.array([[12, 1138, 42], [42, 1000, 36]])))
    assert ints.get_vocabulary() == [-1, 42, 1138, 1000, 36, 12]
    capped = tf.keras.layers.StringLookup(max_tokens=3)
    capped.adapt(["x", "y", "y", "z", "z", "z"])
    assert capped.get_vocabulary() == ["[UNK]", "z", "y"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="repeats"):
        tf.keras.layers.StringLookup(vocabulary=["a", "a"])
    with pytest.raises(ValueError, match=r"reserved token\(s\) \['\[UNK\]'\].* index\(es\) \[1\]"):
        tf.keras.layers.StringLookup(vocabulary=["a", "[UNK]"], invert=True)   # what would it return?
    with pytest.raises(ValueError, match=r"reserved token\(s\) \[''\].*starting with exactly \['', '\[UNK\]'\]"):
        tf.keras.layers.StringLookup(vocabulary=["a", ""], mask_token="")
    # Keras: the OOV token is only reserved when inverting; looking up, it is a token like any other
    assert tf.keras.layers.StringLookup(vocabulary=["a", "[UNK]"])(["[UNK]", "z"]).tolist() == [2, 0]
    with pytest.raises(NotImplementedError, match="output_mode"):
        tf.keras.layers.StringLookup(vocabulary=VOCAB, output_mode="tf_idf")
    with pytest.raises(ValueError, match="invert"):
        tf.keras.layers.StringLookup(vocabulary=VOCAB, invert=True, output_mode="one_hot")
    with pytest.raises(ValueError, match="encoding='no-such-codec'"):
        tf.keras.layers.StringLookup(vocabulary=VOCAB, encoding="no-such-codec")
    assert tf.keras.layers.StringLookup(vocabulary=[b"\xe9"], encoding="latin-1").get_vocabulary() == ["[UNK]", "\u00e9"]


def test_the_distributed_input_tutorials_preprocessing_cell(devices, monkeypatch):
    """The page's cell, as written (two logical CPUs, as the page's current version): the
    per-replica batches are the vocabulary indices of "a", "c", "e" repeated, replica by
    replica from one pipeline, "e" out of vocabulary (0)."""
    from mirrored import devices as registry
    monkeypatch.setattr(registry, "cuda_mode", lambda: "none")
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy()
    vocab = ["a", "b", "c", "d", "f"]
    with strategy.scope():
        layer = tf.keras.layers.StringLookup(vocabulary=vocab)

    def dataset_fn(input_context):
        dataset = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()
        global_batch_size = 4
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = dataset.batch(batch_size)
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

        def preprocess_with_kpl(input):
            return layer(input)
        return dataset.map(preprocess_with_kpl)

    distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    iterator = iter(distributed_dataset)
    stream = [1, 3, 0] * 8                                  # a, c, e -> 1, 3, 0
    for step in range(3):
        batch = iterator.get_next()
        parts = [t.numpy() for t in strategy.experimental_local_results(batch)]
        assert [p.dtype for p in parts] == [np.int64, np.int64]
        assert [p.tolist() for p in parts] == [stream[4 * step:4 * step + 2], stream[4 * step + 2:4 * step + 4]]
        assert "PerReplica:{" in str(batch)


def test_strings_flow_through_from_tensor_slices_batch_and_shard():
    words = np.array(["alpha", "b", "gamma", "d", "e"])
    got = [b.numpy().tolist() for b in tf.data.Dataset.from_tensor_slices(words).batch(2).shard(2, 1)]
    assert got == [["gamma", "d"]]
    pairs = tf.data.Dataset.from_tensor_slices((words, np.arange(5))).batch(3)
    first_words, first_ids = next(iter(pairs))
    assert first_words.numpy().tolist() == ["alpha", "b", "gamma"] and first_ids.numpy().tolist() == [0, 1, 2]


# --- get_vocabulary() given back (issue 51, item 4) --------------------------------------

def fresh_words(rng, n):
    """n distinct lower-case words, none of them a special token."""
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(list("abcdefghij"), size=int(rng.integers(1, 4)))))
    return [str(w) for w in rng.permutation(sorted(words))]


def fresh_ints(rng, n):
    """n distinct integers, none of them 0 (a mask) or -1 (the OOV token)."""
    return [int(v) for v in rng.choice(np.arange(1, 1000), size=n, replace=False)]


LOOKUPS = {"string": (tf.keras.layers.StringLookup, fresh_words, "[UNK]", "", b"[UNK]", b""),
           "integer": (tf.keras.layers.IntegerLookup, fresh_ints, -1, 0, -1, 0)}


@pytest.mark.parametrize("kind", sorted(LOOKUPS))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("num_oov", [1, 2])
def test_get_vocabulary_round_trips_in_both_directions_as_keras(rng, kind, masked, num_oov):
    """Keras's set_vocabulary skips the special tokens when they lead the vocabulary exactly
    as get_vocabulary() lists them ([mask] + [oov] * num_oov_indices), so a layer built
    from another's get_vocabulary() is its inverse (invert=True: TF's text tutorials) or
    its twin (invert=False), with the same get_vocabulary(). The expected values follow
    from Keras's layout: the index of a vocabulary token is its position after the special
    tokens; an unknown index inverts to the OOV token, index 0 to the mask where there is
    one; an unknown token gets an OOV index (which one, for strings, is our hash's)."""
    Lookup, fresh, oov, mask, oov_out, mask_out = LOOKUPS[kind]
    words = fresh(rng, 7)
    known, unknown = words[:5], words[5:]
    kw = dict(num_oov_indices=num_oov, mask_token=mask if masked else None)
    forward = Lookup(vocabulary=known, **kw)
    special = [mask] * masked + [oov] * num_oov
    vocabulary = forward.get_vocabulary()
    assert vocabulary == special + known
    inverse = Lookup(vocabulary=vocabulary, invert=True, **kw)
    twin = Lookup(vocabulary=vocabulary, **kw)
    assert inverse.get_vocabulary() == twin.get_vocabulary() == vocabulary
    assert Lookup(vocabulary=inverse.get_vocabulary(), **kw).get_vocabulary() == vocabulary

    tokens = list(rng.choice(np.array(known + unknown + [mask] * masked, dtype=object), size=(4, 6)).reshape(-1))
    indices = forward(np.array(tokens).reshape(4, 6))           # (4, 6) int64
    np.testing.assert_array_equal(twin(np.array(tokens).reshape(4, 6)), indices)
    first = len(special)
    for token, index in zip(tokens, indices.reshape(-1).tolist()):
        if token in known:
            assert index == first + known.index(token), (token, index)
        elif masked and token == mask:
            assert index == 0
        else:
            assert int(masked) <= index < first, (token, index)   # one of the OOV indices
    back = inverse(indices)
    as_out = (lambda t: t.encode()) if kind == "string" else int
    want = [as_out(t) if t in known else mask_out if masked and t == mask else oov_out for t in tokens]
    assert back.shape == (4, 6) and back.reshape(-1).tolist() == want
    # indices past the vocabulary, and every special index, invert as Keras inverts them
    assert inverse([first + len(known), first + 50]).tolist() == [oov_out, oov_out]
    assert inverse(list(range(first))).tolist() == [mask_out] * masked + [oov_out] * num_oov


def test_a_vocabulary_from_another_layout_keeps_its_tokens_as_keras():
    """Only the exact leading special tokens are skipped (Keras's np.array_equal): a masked
    layer's vocabulary given to an unmasked one keeps "" as a token, and its "[UNK]" is
    refused when inverting (where would index 1 go?) but kept when looking up."""
    masked = tf.keras.layers.StringLookup(vocabulary=["a", "b"], mask_token="")
    vocabulary = masked.get_vocabulary()
    assert vocabulary == ["", "[UNK]", "a", "b"]
    plain = tf.keras.layers.StringLookup(vocabulary=vocabulary)
    assert plain.get_vocabulary() == ["[UNK]", "", "[UNK]", "a", "b"]
    assert plain(["", "a", "z"]).tolist() == [1, 3, 0]
    with pytest.raises(ValueError, match=r"index\(es\) \[1\].*starting with exactly \['\[UNK\]'\]"):
        tf.keras.layers.StringLookup(vocabulary=vocabulary, invert=True)
    two = tf.keras.layers.IntegerLookup(vocabulary=[5, 6], num_oov_indices=2).get_vocabulary()
    assert two == [-1, -1, 5, 6]
    one = tf.keras.layers.IntegerLookup(vocabulary=two)               # skips ONE -1, keeps the other
    assert one.get_vocabulary() == [-1, -1, 5, 6] and one([-1, 6, 7]).tolist() == [1, 3, 0]
    with pytest.raises(ValueError, match="reserved"):
        tf.keras.layers.IntegerLookup(vocabulary=two, invert=True)
    inverse = tf.keras.layers.StringLookup(vocabulary=["q"], invert=True)
    with pytest.raises(ValueError, match="reserved"):
        inverse.set_vocabulary(["x", "[UNK]"])
    assert inverse.get_vocabulary() == ["[UNK]", "q"] and inverse([1]).tolist() == [b"q"]   # unchanged


def test_the_tutorials_inverse_layer_by_hand():
    """Worked by hand from Keras's layout: mask "" at 0, two OOV indices, then the words."""
    ids = tf.keras.layers.StringLookup(vocabulary=["b", "a"], mask_token="", num_oov_indices=2)
    assert ids.get_vocabulary() == ["", "[UNK]", "[UNK]", "b", "a"]
    chars = tf.keras.layers.StringLookup(vocabulary=ids.get_vocabulary(), mask_token="", num_oov_indices=2,
                                         invert=True)
    assert chars([[0, 1, 2], [3, 4, 9]]).tolist() == [[b"", b"[UNK]", b"[UNK]"], [b"b", b"a", b"[UNK]"]]
    assert ids(["a", "", "b"]).tolist() == [4, 0, 3]


# --- bytes that are not UTF-8 (issue 51, item 5) -----------------------------------------

def fresh_bytes(rng, n):
    """n distinct byte strings, most of them not UTF-8 (bytes 0x80-0xff alone)."""
    out = set()
    while len(out) < n:
        out.add(bytes(rng.integers(0x61, 0x100, size=int(rng.integers(1, 4))).astype(np.uint8).tolist()))
    return list(out)


def test_bytes_that_are_not_utf8_are_tokens_like_any_other(rng):
    """TensorFlow's strings are bytes: Keras looks b"\\xff" up as it is, in the input and in
    the vocabulary (OOV where unknown), and a str as its UTF-8 bytes. Checked against a
    dictionary of bytes."""
    words = fresh_bytes(rng, 9)
    assert any(not _is_utf8(w) for w in words)
    known, unknown = words[:6], words[6:]
    layer = tf.keras.layers.StringLookup(vocabulary=known)
    tokens = [words[i] for i in rng.integers(0, len(words), size=15)]
    want = [known.index(t) + 1 if t in known else 0 for t in tokens]
    assert layer(tokens).tolist() == want
    assert layer(np.array(tokens, dtype=object).reshape(3, 5)).tolist() == np.reshape(want, (3, 5)).tolist()
    # a str is its UTF-8 bytes: "café" is b"caf\xc3\xa9", whichever way either side was written
    cafe = tf.keras.layers.StringLookup(vocabulary=[b"\xff", "caf\u00e9", b"\xc3\xa9t\xc3\xa9"])
    assert cafe([b"caf\xc3\xa9", "\u00e9t\u00e9", b"\xff", "\u00ff", b"\xfe"]).tolist() == [2, 3, 1, 0, 0]
    # get_vocabulary decodes as Keras does; a token that does not decode comes back as its bytes,
    # and the vocabulary round-trips, inverted too (invert gives bytes, as Keras)
    shown = layer.get_vocabulary()
    assert shown == ["[UNK]"] + [w.decode() if _is_utf8(w) else w for w in known]
    inverse = tf.keras.layers.StringLookup(vocabulary=shown, invert=True)
    assert inverse(layer(tokens)).tolist() == [t if t in known else b"[UNK]" for t in tokens]
    assert tf.keras.layers.StringLookup(vocabulary=shown)(tokens).tolist() == want
    with pytest.raises(ValueError, match="different lengths"):      # ragged: refused, as before
        layer([[b"\xff", "a"], ["a"]])
    adapted = tf.keras.layers.StringLookup()
    adapted.adapt(np.array([b"\xff", b"\xff", b"a"], dtype=object))
    assert adapted.get_vocabulary() == ["[UNK]", b"\xff", "a"]


def _is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
