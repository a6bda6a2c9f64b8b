"""fit, evaluate, predict and compile take their arguments by Keras 3's rule: nothing a user
passes is silently ignored.

They used to swallow any keyword: ``fit(class_weight={0: 10})`` and ``fit(sample_weight=w)``
trained as if every example weighed the same, ``compile(loss_weights=[2.0])`` reported an
unscaled loss, and a misspelt argument vanished. Now an argument Keras does not have is
Keras 3's error (TypeError; ``evaluate``: ValueError "Arguments not recognized"), and
Keras's arguments that are not implemented here are accepted at their defaults (what a
saved Keras config or a careful caller passes) and refused by name otherwise, before the
model or its optimizer change. (``sample_weight`` and ``class_weight`` are implemented now:
tests/test_sample_weights.py.)

    python -m pytest -q tests/test_model_arguments.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.keras.model_api import NOT_IMPLEMENTED

#: A value for each argument that asks for something not implemented.
ASKING = {"validation_steps": 2, "validation_batch_size": 4, "validation_freq": 2, "steps": 1,
          "callbacks": [tf.keras.callbacks.History()]}


@pytest.fixture
def model_and_data(devices, rng):
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    x = rng.standard_normal((12, 4)).astype(np.float32)
    y = rng.standard_normal((12, 3)).astype(np.float32)
    return model, x, y


def call(model, method, x, y, **kwargs):
    if method == "predict":
        return model.predict(x, verbose=0, **kwargs)
    return getattr(model, method)(x, y, verbose=0, **kwargs)


def unchanged(model, before):
    return all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))


def test_every_argument_has_a_refusing_value():
    assert {k for table in NOT_IMPLEMENTED.values() for k in table} == set(ASKING)


@pytest.mark.parametrize("method,key", [(m, k) for m, table in NOT_IMPLEMENTED.items() for k in table])
def test_an_argument_asking_for_what_is_not_implemented_is_refused_by_name(model_and_data, method, key):
    model, x, y = model_and_data
    value = np.ones(len(x), np.float32) if ASKING[key] == "ones" else ASKING[key]
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match=rf"{method}\({key}=\.\.\.\) is not implemented here"):
        call(model, method, x, y, **{key: value})
    assert unchanged(model, before) and int(model.optimizer.iterations) == 0


@pytest.mark.parametrize("method", sorted(NOT_IMPLEMENTED))
def test_keras_defaults_are_accepted(model_and_data, method):
    model, x, y = model_and_data
    call(model, method, x, y, **NOT_IMPLEMENTED[method])
    if method == "fit":
        assert int(model.optimizer.iterations) == 1         # 12 examples, Keras's batch of 32


@pytest.mark.parametrize("method,error", [("fit", TypeError), ("predict", TypeError),
                                          ("evaluate", ValueError)])
def test_an_argument_keras_does_not_have_is_keras_s_error(model_and_data, method, error):
    model, x, y = model_and_data
    before = model.get_weights()
    with pytest.raises(error, match="unexpected keyword argument 'epoch'|Arguments not recognized"):
        call(model, method, x, y, epoch=3)                   # epochs, misspelt
    assert unchanged(model, before) and int(model.optimizer.iterations) == 0


@pytest.mark.parametrize("kwargs,error", [
    ({"loss_weights": [2.0]}, NotImplementedError), ({"weighted_metrics": ["accuracy"]}, NotImplementedError),
    ({"experimental_steps_per_execution": 4}, TypeError)])
def test_compile_refuses_what_it_would_ignore(model_and_data, kwargs, error):
    model, _, _ = model_and_data
    optimizer = model.optimizer
    with pytest.raises(error):
        model.compile(optimizer="adam", loss="mse", **kwargs)
    assert model.optimizer is optimizer, "a refused compile changed the model"


def test_compile_accepts_the_speed_options(model_and_data):
    model, x, y = model_and_data
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=4, jit_compile=True)
    model.fit(x, y, verbose=0)
    assert int(model.optimizer.iterations) == 1


@pytest.mark.parametrize("kwargs", [{"dtype": "float64"}, {"dtype": "mixed_float16"}])
@pytest.mark.parametrize("layer", ["Dense", "Conv2D"])
def test_a_layer_refuses_another_dtype(layer, kwargs):
    # dtype= was accepted and dropped: the float64 layer computed in float32.
    args = (3,) if layer == "Dense" else (4, 3)
    with pytest.raises(NotImplementedError, match="computes in float32"):
        getattr(tf.keras.layers, layer)(*args, **kwargs)


def test_freezing_a_built_layer_takes_it_out_of_the_trainable_weights(devices):
    devices(cpus=1)
    layer = tf.keras.layers.Dense(3, dtype=tf.float32, trainable=True)
    tf.keras.layers.Dense(3, dtype=np.float32)
    tf.keras.layers.Dense(3, dtype="float32")
    assert tf.keras.layers.Dense(3, trainable=False).trainable is False
    model = tf.keras.Sequential([layer])
    model.build((None, 4))
    layer.trainable = False
    assert len(model.trainable_variables) == 0 and len(model.non_trainable_variables) == 2
    layer.trainable = True
    assert layer.trainable is True and len(model.trainable_variables) == 2


def test_a_saved_keras_model_with_a_frozen_layer_loads_frozen(devices):
    from mirrored.keras import saving
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,)), tf.keras.layers.Dense(2)])
    config = saving.model_config(model)
    assert saving.model_from_config(config).layers[-1].trainable   # as saved: every layer trains
    config["config"]["layers"][-1]["config"]["trainable"] = False  # as Keras writes a frozen layer
    loaded = saving.model_from_config(config)
    assert loaded.layers[-1].trainable is False and len(loaded.trainable_variables) == 2


def test_save_takes_keras_3_s_arguments(model_and_data, tmp_path):
    model, _, _ = model_and_data
    path = str(tmp_path / "m.keras")
    model.save(path, include_optimizer=False)                 # not used by a .keras file, as Keras
    with pytest.warns(UserWarning, match="save_format"):
        model.save(path, save_format="keras")
    for kwargs, error in (({"zipped": False}, NotImplementedError), ({"signatures": {}}, ValueError)):
        with pytest.raises(error):
            model.save(str(tmp_path / "other.keras"), **kwargs)
        assert not (tmp_path / "other.keras").exists(), "a refused save wrote a file"


def test_input_takes_keras_3_s_arguments(devices, rng):
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.Input(batch_shape=(None, 4)), tf.keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = rng.standard_normal((5, 4)).astype(np.float32)
    assert model.predict(x, verbose=0).shape == (5, 2)      # batch_shape's example shape is (4,)
    tf.keras.Input(shape=(4,), batch_size=32, dtype="float64")
    for kwargs, error in (({"sparse": True}, NotImplementedError), ({"optional": True}, NotImplementedError),
                          ({"batch_shape": (None, 4)}, ValueError), ({"shpe": (4,)}, TypeError)):
        with pytest.raises(error):
            tf.keras.Input(shape=(4,), **kwargs)


def test_tensorboard_takes_keras_s_arguments_and_refuses_others(tmp_path):
    tf.keras.callbacks.TensorBoard(log_dir=str(tmp_path), histogram_freq=1, write_graph=True, write_images=False,
                                   write_steps_per_second=False, update_freq="epoch", profile_batch=0,
                                   embeddings_freq=0, embeddings_metadata=None)
    with pytest.raises(TypeError):
        tf.keras.callbacks.TensorBoard(log_dir=str(tmp_path), histogram_frequency=1)   # misspelt


def test_validation_data_may_be_keras_s_three_tuple(model_and_data):
    # Keras takes (x, y) or (x, y, sample_weight); (x, y, None) failed with "needs y".
    model, x, y = model_and_data
    history = model.fit(x, y, verbose=0, validation_data=(x, y, None))
    assert "val_loss" in history.history and int(model.optimizer.iterations) == 1
    # the weights weigh the validation loss as Keras's: sum(w l) / examples
    ones = model.fit(x, y, verbose=0, epochs=1, validation_data=(x, y, np.ones(len(x), np.float32)))
    half = np.full(len(x), 0.5, np.float32)
    again = model.evaluate(x, y, verbose=0, sample_weight=half)
    np.testing.assert_allclose(again, 0.5 * model.evaluate(x, y, verbose=0), rtol=1e-6)
    assert "val_loss" in ones.history and int(model.optimizer.iterations) == 2


def test_a_model_made_with_add_is_built_once_its_input_shape_is_known(devices, rng, capsys):
    # Keras 3 builds a Sequential as soon as its input shape is given; summary() after add()
    # raised "not yet built: give the first layer an input_shape", which it had.
    devices(cpus=1)
    model = tf.keras.Sequential()
    model.add(tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)))
    model.add(tf.keras.layers.Dense(3))
    model.summary()
    assert "Total params: 67" in capsys.readouterr().out            # 4*8+8 + 8*3+3
    assert model.built and len(model.get_weights()) == 4 and model.count_params() == 67
    with pytest.raises(RuntimeError, match="already built"):
        model.add(tf.keras.layers.Dense(2))                          # said plainly, not half-added
    unknown = tf.keras.Sequential()
    unknown.add(tf.keras.layers.Dense(3))
    assert unknown.trainable_variables == [] and not unknown.built   # no shape yet: nothing to build
    with pytest.raises(ValueError, match="not yet been built"):
        unknown.summary()
    unknown.compile(optimizer="sgd", loss="mse")
    unknown.fit(rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32),
                verbose=0)
    assert unknown.built and unknown.count_params() == 18


def test_freezing_a_whole_model_freezes_every_layer(model_and_data):
    model, _, _ = model_and_data
    model.trainable = False
    assert not model.trainable_variables and all(not layer.trainable for layer in model.layers)
    model.trainable = True
    assert model.trainable is True and len(model.trainable_variables) == len(model.weights)


def test_predict_steps_get_layer_and_predict_on_batch(model_and_data, rng):
    # predict(steps=) was accepted and ignored: a data set that repeats never ended.
    model, x, _ = model_and_data
    want = model.predict(x, verbose=0)
    close = dict(rtol=1e-5, atol=1e-6)                      # another batch size: maybe other BLAS blocks
    np.testing.assert_allclose(model.predict(x, batch_size=4, steps=2, verbose=0), want[:8], **close)
    forever = tf.data.Dataset.from_tensor_slices(x).batch(5).repeat()     # 12 rows: 5, 5, 2, 5, ...
    np.testing.assert_allclose(model.predict(forever, steps=4, verbose=0), np.concatenate([want, want[:5]]), **close)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="steps must be a positive whole number"):
            model.predict(x, steps=bad, verbose=0)
    np.testing.assert_allclose(model.predict_on_batch(x[:5]), want[:5], **close)
    layer = model.layers[0]
    assert model.get_layer(layer.name) is layer and model.get_layer(index=-1) is model.layers[-1]
    with pytest.raises(ValueError, match="No such layer: nope"):
        model.get_layer("nope")
    with pytest.raises(ValueError, match="out of range"):
        model.get_layer(index=len(model.layers))
