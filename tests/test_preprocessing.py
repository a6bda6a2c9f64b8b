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
    np.testing.assert_array_equal(inverse(np.array([[1, 3, 4], [4, 0, 2]])), [["a", "c", "d"], ["d", "[UNK]", "b"]])
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
    with pytest.raises(ValueError, match="reserved"):
        tf.keras.layers.StringLookup(vocabulary=["a", "[UNK]"])
    with pytest.raises(NotImplementedError, match="output_mode"):
        tf.keras.layers.StringLookup(vocabulary=VOCAB, output_mode="tf_idf")
    with pytest.raises(ValueError, match="invert"):
        tf.keras.layers.StringLookup(vocabulary=VOCAB, invert=True, output_mode="one_hot")


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
