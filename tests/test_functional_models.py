"""One engine for every model: Sequential, functional (``keras.Input`` -> layer calls ->
``keras.Model``) and subclassed (``class M(keras.Model)`` with ``call``) models run the same
program of layer nodes (``mirrored/keras/engine.py``, ``functional.py``).

What is claimed, and why each equality holds:

* The lab model written three ways gives BITWISE-equal weights after the same steps: the three
  build the same nodes in the same order, and our code fixes the order of every sum; checked
  on CPU devices and simulated GPUs, 1 and 2 replicas (replicas bitwise equal too).
* A DAG with fan-out (a residual Dense skip joined by an Add) and a shared layer (one Dense
  called twice) train to a float64 NumPy oracle of Keras's math within float32 tolerance. The
  oracle is written here from the definitions (a tensor feeding two nodes gets the sum of
  their gradients; a layer called twice gets the sum of its calls' gradients) and shares no
  code with the engine; an oracle that forgets either sum must miss the bound.
* Errors say what was wrong, where (the user's file and line while call() is traced), and
  what to do.

Besides the library's merge layers (``keras/merging.py``), a tiny test-only Add built on
``ops.binary("add")`` returns ``dy`` itself for BOTH inputs (the protocol allows it): exactly
the case where the engine must give each input its own buffer before a producer (a ReLU
Dense) modifies its gradient in place.

    python -m pytest -q tests/test_functional_models.py
"""
import numpy as np
import pytest

import mirrored as tf
from kernels.launch import view
from mirrored import keras
from mirrored.keras.base_layer import Layer
from tests.test_training import assert_replicas_bitwise_equal

L = keras.layers
F32 = np.float32
#: What training changed must agree with the float64 oracle's change within this, element by
#: element relative to (|change| + its largest element): float32 rounding of a few SGD steps
#: on tiny layers stays below 1e-4; a missing gradient sum is off by O(1).
RTOL = 2e-3


class TestAdd(Layer):
    """Add two tensors of one shape (test-only; the library's is keras/merging.py's)."""
    __test__ = False

    def output_shape_for(self, shapes):
        assert len(shapes) == 2 and tuple(shapes[0]) == tuple(shapes[1]), shapes
        return tuple(shapes[0])

    def build(self, shapes):
        self.input_shape = [tuple(s) for s in shapes]
        self.output_shape = tuple(shapes[0])
        self.built = True

    def make_buffers(self, state, b):
        return state.dev.empty((b,) + self.output_shape, F32)

    def forward(self, state, xs, training=False):
        y = state.buffers(xs[0].shape[0])
        state.ops.binary("add", view(xs[0], y.shape), view(xs[1], y.shape), y)
        return y

    def backward(self, state, dy):
        return [dy if need else None for need in state.need_dx]      # dy itself, for both inputs


def add_layer():
    return L.Add() if hasattr(L, "Add") else TestAdd()


# --- the lab model, three ways -----------------------------------------------------------------
def lab_sequential(shape, filters, hidden, classes):
    return keras.Sequential([L.Conv2D(filters, 3, activation="relu", input_shape=shape), L.MaxPooling2D(),
                             L.Flatten(), L.Dense(hidden, activation="relu"), L.Dense(classes)])


def lab_functional(shape, filters, hidden, classes):
    inputs = keras.Input(shape)
    x = L.Conv2D(filters, 3, activation="relu")(inputs)
    x = L.MaxPooling2D()(x)
    x = L.Flatten()(x)
    x = L.Dense(hidden, activation="relu")(x)
    return keras.Model(inputs, L.Dense(classes)(x), name="lab")


class LabModel(keras.Model):
    def __init__(self, filters, hidden, classes):
        super().__init__()
        self.conv = L.Conv2D(filters, 3, activation="relu")
        self.pool = L.MaxPooling2D()
        self.flatten = L.Flatten()
        self.hidden = L.Dense(hidden, activation="relu")
        self.out = L.Dense(classes)

    def call(self, inputs, training=None):
        return self.out(self.hidden(self.flatten(self.pool(self.conv(inputs)))))


def lab_subclassed(shape, filters, hidden, classes):
    model = LabModel(filters, hidden, classes)
    model.build((None,) + shape)
    return model


@pytest.mark.parametrize("kind,n", [("CPU", 1), ("CPU", 2), ("GPU", 1), ("GPU", 2)])
def test_the_lab_model_written_three_ways_trains_to_the_same_bits(devices, rng, kind, n):
    devices(cpus=n if kind == "CPU" else 1, gpus=n if kind == "GPU" else 0)
    # a miniature on simulated GPUs (a Python thread per CUDA thread)
    shape, filters, hidden, classes, batch = ((4, 4, 1), 2, 3, 3, 3) if kind == "GPU" else \
        ((10, 10, 1), 4, 8, 5, 9)
    steps = 1 if kind == "GPU" else 3
    x = rng.standard_normal((steps * batch,) + shape).astype(F32)
    y = rng.integers(0, classes, steps * batch)
    strategy = tf.distribute.MirroredStrategy([f"{kind}:{i}" for i in range(n)])
    models = []
    for make in (lab_sequential, lab_functional, lab_subclassed):
        with strategy.scope():
            models.append(make(shape, filters, hidden, classes))
    start = models[0].get_weights()
    assert [w.shape for w in models[1].get_weights()] == [w.shape for w in start]
    for model in models:
        model.set_weights(start)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        assert_replicas_bitwise_equal(model)
    want = models[0].get_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(want, start)), "training changed nothing"
    for model in models[1:]:
        for v, a, b in zip(model.trainable_variables, want, model.get_weights()):
            assert np.array_equal(a, b), f"{type(model).__name__}: {v.name} differs from the Sequential's"
    preds = [m.predict(x[:batch], verbose=0) for m in models]
    assert np.array_equal(preds[0], preds[1]) and np.array_equal(preds[0], preds[2])


# --- DAGs against a float64 oracle --------------------------------------------------------------
def cpus(n):
    """A MirroredStrategy over n logical CPUs (the default would take the simulated GPU)."""
    return tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def oracle_step(spec, weights, x, y, lr, sums=True):
    """One SGD step of Keras's math in float64 on the program ``spec``: a list of
    ("dense", input, kernel index, relu) / ("add", (a, b)) / ("concat", (a, b)); tensor 0 is x,
    tensor i + 1 op i's output; the loss is softmax cross-entropy averaged over the batch.
    ``sums=False``: the mistake the engine must not make, a tensor's (a weight's) gradient
    overwritten by its next consumer's (call's) instead of added to."""
    W = [np.asarray(w, np.float64) for w in weights]
    vals = [np.asarray(x, np.float64).reshape(len(x), -1)]
    for op in spec:
        if op[0] == "dense":
            z = vals[op[1]] @ W[op[2]] + W[op[2] + 1]
            vals.append(np.maximum(z, 0) if op[3] else z)
        elif op[0] == "add":
            vals.append(vals[op[1][0]] + vals[op[1][1]])
        else:
            vals.append(np.concatenate([vals[t] for t in op[1]], axis=1))
    logits = vals[-1]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    grads = [None] * len(vals)
    grads[-1] = p / len(y)
    gW = [np.zeros_like(w) for w in W]

    def arrive(t, g):
        grads[t] = g if grads[t] is None or not sums else grads[t] + g

    for i in reversed(range(len(spec))):
        op, dy = spec[i], grads[i + 1]
        if op[0] == "dense":
            dz = dy * (vals[i + 1] > 0) if op[3] else dy
            gW[op[2]] = gW[op[2]] * sums + vals[op[1]].T @ dz
            gW[op[2] + 1] = gW[op[2] + 1] * sums + dz.sum(0)
            arrive(op[1], dz @ W[op[2]].T)
        elif op[0] == "add":
            for t in op[1]:
                arrive(t, dy)
        else:
            cuts = np.cumsum([vals[t].shape[1] for t in op[1]])[:-1]
            for t, g in zip(op[1], np.split(dy, cuts, axis=1)):
                arrive(t, g)
    return [w - lr * g for w, g in zip(W, gW)]


def residual_model(din, hidden, classes):
    """x -> Dense(relu) = h; h -> Dense = r; Add([h, r]) -> Dense(classes): h feeds two nodes."""
    inputs = keras.Input((din,))
    h = L.Dense(hidden, activation="relu")(inputs)
    r = L.Dense(hidden)(h)
    s = add_layer()([h, r])
    model = keras.Model(inputs, L.Dense(classes)(s))
    return model, [("dense", 0, 0, True), ("dense", 1, 2, False), ("add", (1, 2)), ("dense", 3, 4, False)]


def residual_model_dy_twice(din, hidden, classes):
    """The residual model joined by TestAdd, whose backward hands dy itself to BOTH inputs."""
    inputs = keras.Input((din,))
    h = L.Dense(hidden, activation="relu")(inputs)
    r = L.Dense(hidden, activation="relu")(h)
    model = keras.Model(inputs, L.Dense(classes)(TestAdd()([r, h])))
    return model, [("dense", 0, 0, True), ("dense", 1, 2, True), ("add", (2, 1)), ("dense", 3, 4, False)]


def shared_model(din, hidden, classes):
    """x -> Dense(relu) -> shared Dense(relu) -> the same shared Dense again -> Dense(classes)."""
    inputs = keras.Input((din,))
    shared = L.Dense(hidden, activation="relu")
    h = L.Dense(hidden, activation="relu")(inputs)
    model = keras.Model(inputs, L.Dense(classes)(shared(shared(h))))
    return model, [("dense", 0, 0, True), ("dense", 1, 2, True), ("dense", 2, 2, True), ("dense", 3, 4, False)]


def concat_model(din, hidden, classes):
    """Two branches of the input, Concatenate, Dense(classes)."""
    inputs = keras.Input((din,))
    a = L.Dense(hidden, activation="relu")(inputs)
    b = L.Dense(hidden + 1, activation="relu")(inputs)
    model = keras.Model(inputs, L.Dense(classes)(L.Concatenate()([a, b])))
    return model, [("dense", 0, 0, True), ("dense", 0, 2, True), ("concat", (1, 2)), ("dense", 3, 4, False)]


def train_against_oracle(devices, rng, make, n, sums=True):
    devices(cpus=n)
    din, hidden, classes, batch, steps, lr = 7, 6, 4, 9, 3, 0.5
    with cpus(n).scope():
        model, spec = make(din, hidden, classes)
    start = model.get_weights()
    x = rng.standard_normal((steps * batch, din)).astype(F32)
    y = rng.integers(0, classes, steps * batch)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert_replicas_bitwise_equal(model)
    want = start
    for s in range(steps):
        want = oracle_step(spec, want, x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch], lr, sums)
    return model.get_weights(), want, start


def misses(got, want, start):
    """[(index, worst ratio)] of the weight arrays whose change is off by more than RTOL."""
    bad = []
    for k, (g, w, s) in enumerate(zip(got, want, start)):
        dg, dw = g - s, w - s
        err = np.abs(dg - dw) / (np.abs(dw) + np.abs(dw).max() + 1e-12)
        if err.max() > RTOL:
            bad.append((k, float(err.max())))
    return bad


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("make", [residual_model, residual_model_dy_twice, shared_model],
                         ids=["residual", "residual-dy-twice", "shared"])
def test_a_dag_trains_to_the_float64_oracle(devices, rng, make, n):
    got, want, start = train_against_oracle(devices, rng, make, n)
    assert not misses(got, want, start)


@pytest.mark.parametrize("make", [residual_model, shared_model], ids=["residual", "shared"])
def test_an_oracle_without_the_gradient_sums_misses(devices, rng, make):
    got, want, start = train_against_oracle(devices, rng, make, 1, sums=False)
    assert misses(got, want, start), "the check cannot tell a missing fan-out sum"


@pytest.mark.skipif(not hasattr(L, "Concatenate"), reason="keras.layers.Concatenate (keras/merging.py) "
                    "is not in this branch yet")
@pytest.mark.parametrize("n", [1, 2])
def test_a_two_branch_concatenate_model_trains_to_the_float64_oracle(devices, rng, n):
    got, want, start = train_against_oracle(devices, rng, concat_model, n)
    assert not misses(got, want, start)


def test_a_layer_called_twice_shares_its_weights_and_keras_orders_the_layers(devices):
    devices(cpus=1)
    model, _ = shared_model(5, 4, 3)
    dense, shared, head = model.layers
    assert [len(l.inbound_nodes) for l in model.layers] == [1, 2, 1]
    assert len(model.trainable_variables) == 6 and model.count_params() == 5 * 4 + 4 + 4 * 4 + 4 + 4 * 3 + 3
    model2, _ = residual_model(5, 4, 3)
    assert [type(l).__name__ for l in model2.layers][:2] == ["Dense", "Dense"]
    assert len(model2.layers) == 4


class Residual(keras.Model):
    """residual_model, subclassed (built on first use: inside strategy.run for the loop)."""

    def __init__(self, hidden, classes):
        super().__init__()
        self.h, self.r = L.Dense(hidden, activation="relu"), L.Dense(hidden)
        self.add, self.out = L.Add(), L.Dense(classes)

    def call(self, x, training=None):
        h = self.h(x)
        return self.out(self.add([h, self.r(h)]))


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_a_gradient_tape_loop_on_a_dag_equals_fit(devices, rng, kind):
    devices(cpus=2)
    din, hidden, classes, batch = 6, 5, 3, 8
    strategy = cpus(2)
    with strategy.scope():
        fitted, _ = residual_model(din, hidden, classes)
        looped = residual_model(din, hidden, classes)[0] if kind == "functional" else Residual(hidden, classes)
        if kind == "subclassed":
            looped.build((None, din))
        opt = keras.optimizers.SGD(0.3)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    looped.set_weights(fitted.get_weights())
    x = rng.standard_normal((batch, din)).astype(F32)
    y = rng.integers(0, classes, batch)
    fitted.compile(optimizer=keras.optimizers.SGD(0.3),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fitted.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    def step(inputs):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(yb, looped(xb, training=True)), global_batch_size=batch)
        grads = tape.gradient(loss, looped.trainable_variables)
        opt.apply_gradients(zip(grads, looped.trainable_variables))

    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))
    for inputs in dist:
        strategy.run(step, args=(inputs,))
    for a, b in zip(fitted.get_weights(), looped.get_weights()):
        assert np.array_equal(a, b)


# --- subclassed models ----------------------------------------------------------------------------
class WithDropout(keras.Model):
    def __init__(self, branch):
        super().__init__(name="with_dropout")
        self.branch = branch
        self.blocks = [L.Dense(6, activation="relu"), L.Dense(6, activation="relu")]
        self.dropout = L.Dropout(0.5, seed=3)
        self.head = L.Dense(3)

    def call(self, x, training=None):
        for block in self.blocks:
            x = block(x)
        if self.branch == "dropout" and training:
            x = self.dropout(x, training=training)      # TF's tutorials branch so
        elif self.branch == "structure" and training:
            x = self.blocks[1](x)                         # a different model in training: refused
        elif self.branch is None:
            x = self.dropout(x, training=training)
        return self.head(x)


@pytest.mark.parametrize("branch", [None, "dropout"])
def test_training_reaches_dropout_in_a_subclassed_model(devices, rng, branch):
    devices(cpus=1)
    model = WithDropout(branch)
    x = rng.standard_normal((4, 5)).astype(F32)
    out = model(x, training=False).numpy()
    assert [type(l).__name__ for l in model.layers] == ["Dense", "Dense", "Dropout", "Dense"]
    assert np.array_equal(out, model(x, training=False).numpy())       # no dropout outside training
    assert not np.array_equal(out, model(x, training=True).numpy())    # dropout in training
    assert np.allclose(model.predict(x, verbose=0), out)


def test_a_subclassed_model_that_branches_into_other_layers_in_training_is_refused(devices):
    devices(cpus=1)
    with pytest.raises(NotImplementedError, match="different model when training is True"):
        WithDropout("structure")(np.zeros((2, 5), F32))


class PeeksAtValues(keras.Model):
    def __init__(self, how):
        super().__init__()
        self.how, self.dense = how, L.Dense(3)

    def call(self, x):
        y = self.dense(x)
        if self.how == "if":
            if y:                                  # the line the error must name
                return y
        elif self.how == "numpy":
            np.asarray(y)
        elif self.how == "float":
            float(y)
        return y


@pytest.mark.parametrize("how", ["if", "numpy", "float"])
def test_python_control_flow_on_a_tensor_value_names_the_users_line(devices, how):
    devices(cpus=1)
    with pytest.raises(TypeError) as err:
        PeeksAtValues(how).build((None, 4))
    assert __file__ in str(err.value) and "symbolic tensor" in str(err.value)
    assert "supported" in str(err.value)


def test_save_of_a_subclassed_model_needs_get_config_and_its_weights_round_trip(devices, rng, tmp_path):
    devices(cpus=1)
    model = WithDropout(None)
    x = rng.standard_normal((3, 5)).astype(F32)
    model.build((None, 5))
    with pytest.raises(NotImplementedError, match="WithDropout: it has no get_config"):
        model.save(str(tmp_path / "m.keras"))
    assert not (tmp_path / "m.keras").exists()
    model.save_weights(str(tmp_path / "w.weights.h5"))
    other = WithDropout(None)
    other.build((None, 5))
    assert not np.array_equal(other.predict(x, verbose=0), model.predict(x, verbose=0))
    other.load_weights(str(tmp_path / "w.weights.h5"))
    assert np.array_equal(other.predict(x, verbose=0), model.predict(x, verbose=0))


class Configured(keras.Model):
    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = L.Dense(units, activation="relu")
        self.head = L.Dense(2)

    def call(self, x):
        return self.head(self.dense(x))

    def get_config(self):
        return {"units": self.units, "name": self.name}


def test_a_subclassed_model_with_get_config_saves_whole(devices, rng, tmp_path):
    devices(cpus=1)
    model = Configured(units=5, name="conf")
    x = rng.standard_normal((3, 4)).astype(F32)
    want = model.predict(x, verbose=0)
    model.save(str(tmp_path / "m.keras"))
    back = keras.models.load_model(str(tmp_path / "m.keras"), custom_objects={"Configured": Configured})
    assert isinstance(back, Configured) and back.units == 5 and back.name == "conf"
    assert np.array_equal(back.predict(x, verbose=0), want)


# --- the functional API's errors -------------------------------------------------------------------
def test_the_functional_apis_errors_say_what_to_do(devices):
    devices(cpus=1)
    layer = L.Dense(3)                         # on data, a layer runs as Keras runs it (eagerly)
    out = layer(np.ones((2, 4), F32))
    kernel, bias = layer.get_weights()
    layer.set_weights([kernel * 2, bias])
    np.testing.assert_allclose(layer(np.ones((2, 4), F32)).numpy(), np.ones((2, 4)) @ (kernel * 2) + bias,
                               rtol=1e-5)
    np.testing.assert_allclose(out.numpy(), np.ones((2, 4)) @ kernel + bias, rtol=1e-5)
    a, b = keras.Input((4,)), keras.Input((4,))
    unused = keras.Model([a, b], L.Dense(2)(a))        # an input no layer reads: accepted, as Keras 3
    assert unused.predict([np.ones((2, 4), F32), np.ones((2, 4), F32)], verbose=0).shape == (2, 2)
    with pytest.raises(ValueError, match="takes 2 inputs"):
        unused.predict(np.ones((2, 4), F32), verbose=0)
    with pytest.raises(ValueError, match="Graph disconnected"):
        keras.Model(a, add_layer()([L.Dense(4)(a), L.Dense(4)(b)]))
    dense = L.Dense(3)
    dense(a)
    with pytest.raises(ValueError, match="shares its weights"):
        dense(keras.Input((5,)))
    with pytest.raises(NotImplementedError, match="keras.layers.Add"):
        a + b
    drop = L.Dropout(0.5)
    with pytest.raises(NotImplementedError, match="called 2 times"):
        keras.Model(a, L.Dense(2)(drop(drop(a))))


def test_keras_model_is_reached_the_ways_tensorflow_users_write_it():
    from mirrored.keras.models import Model
    assert Model is keras.Model is keras.models.Model is tf.keras.Model
    inputs = keras.Input((3,), name="features")
    model = keras.models.Model(inputs=inputs, outputs=L.Dense(2)(inputs), name="m")
    assert type(model).__name__ == "Functional" and isinstance(model, keras.Model)
    assert model.input_shape == (None, 3) and model.output_shape == (None, 2) and model.name == "m"
    assert isinstance(keras.Sequential([keras.Input((3,)), L.Dense(2)]), keras.Model)
