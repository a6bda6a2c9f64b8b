"""An optimizer's arguments by Keras's rule: nothing a user passes is silently ignored.

Keras 3 refuses an argument it does not know (``ValueError: Argument(s) not recognized``)
and ignores ``decay`` with a warning. Keras's clipping and weight decay are implemented
(tests/test_optimizers_more.py); its other arguments (``use_ema``, ``loss_scale_factor``...)
are not: their defaults are accepted (a Keras config carries them all), anything else is
refused, naming the argument, where it used to be dropped without a word. A Keras
``compile_config`` goes through the same rule when a saved model is loaded.

    python -m pytest -q tests/test_optimizer_arguments.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored.keras import saving
from mirrored.keras.optimizer_state import BASE_ARGUMENTS, NOT_IMPLEMENTED

#: What Keras 3 writes for each optimizer (TensorFlow 2.21's get_config, defaults).
KERAS_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
                  "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
                  "loss_scale_factor": None, "gradient_accumulation_steps": None}
OPTIMIZERS = {"Adam": tf.keras.optimizers.Adam, "SGD": tf.keras.optimizers.SGD}
#: A value that turns each not-implemented argument on.
TURNED_ON = {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 10,
             "loss_scale_factor": 128.0, "gradient_accumulation_steps": 4}


def test_the_list_is_keras_s():
    assert BASE_ARGUMENTS == KERAS_DEFAULTS and set(TURNED_ON) == set(NOT_IMPLEMENTED)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras_defaults_are_accepted(name):
    opt = OPTIMIZERS[name](learning_rate=0.01, **KERAS_DEFAULTS)
    assert float(opt.learning_rate) == pytest.approx(0.01)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("key", sorted(TURNED_ON))
def test_an_argument_turned_on_is_refused_by_name(name, key):
    with pytest.raises(NotImplementedError, match=rf"{name}\({key}=.*leave {key} at its default"):
        OPTIMIZERS[name](**{key: TURNED_ON[key]})


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("key", ["lr", "foo", "momentum_typo"])
def test_an_unknown_argument_is_a_value_error_as_in_keras(name, key):
    with pytest.raises(ValueError, match=rf"Argument\(s\) not recognized: \{{'{key}'"):
        OPTIMIZERS[name](**{key: 0.1})


def test_decay_is_ignored_with_keras_s_warning():
    with pytest.warns(UserWarning, match="`decay` is no longer supported") as record:
        opt = tf.keras.optimizers.Adam(0.01, decay=0.1)
    assert record[0].filename == __file__, "the warning should point at the caller's line"
    assert float(opt.learning_rate) == pytest.approx(0.01)


@pytest.mark.parametrize("use_ema,ok", [(False, True), (True, False)])
def test_a_saved_keras_compile_config_goes_through_the_same_rule(devices, use_ema, ok):
    devices(cpus=1)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
    config = {"optimizer": {"module": "keras.optimizers", "class_name": "Adam",
                            "config": dict(KERAS_DEFAULTS, name="adam", learning_rate=0.002, beta_1=0.9,
                                           beta_2=0.999, epsilon=1e-7, amsgrad=False, use_ema=use_ema,
                                           clipnorm=0.5)},
              "loss": "mse", "metrics": None, "run_eagerly": False}
    if ok:
        saving.compile_from_config(model, config)
        assert float(model.optimizer.learning_rate) == pytest.approx(0.002)
        assert np.isfinite(float(model.optimizer.learning_rate))
        assert model.optimizer.clipnorm == 0.5                          # implemented: kept
    else:
        with pytest.raises(NotImplementedError, match=r"Adam\(use_ema=True\)"):
            saving.compile_from_config(model, config)
