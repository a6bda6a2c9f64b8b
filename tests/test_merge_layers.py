"""Keras's merge layers (mirrored/keras/merging.py): Add, Subtract, Multiply, Average, Concatenate.

Each layer on its own, through the multi-input protocol the engine calls (build on a list
of per-example shapes; forward on a list of arrays; backward returning one gradient per
input), with a minimal state (``state``: dev, ops, need_dx, buffers) on a CPU device and
on a simulated GPU (a real one where there is one). Checked:

    forward     bitwise against NumPy float32 in the same order of operations (our code
                fixes it: ((x0 + x1) + x2) ..., one correctly rounded op per element and
                step), and within float32 rounding of a float64 oracle
    backward    against central finite differences in float64 of the oracle's
                L = sum(y * dy), within float32 rounding; None where need_dx says so;
                dy itself only where the layer says (Add, Subtract's input 0), own
                buffers elsewhere; inputs and dy never written
    CPU = GPU   bitwise, for the same reason as the first line
    shapes      Keras's checks, and errors that name the layer and the shapes

Buffers start NaN-poisoned, so an element a layer forgets to write fails.

    python -m pytest -q tests/test_merge_layers.py
"""
from types import SimpleNamespace

import numpy as np
import pytest

import mirrored as tf
from conftest import assert_close
from mirrored.keras import merging
from tests.test_conv_layers import central_differences

layers = tf.keras.layers

#: Central-difference step in float64: L is linear in each element of each input (a merge
#: is multilinear), so the difference is exact but for rounding (~1e-16 / EPS).
EPS = 1e-3
#: float32 results against the float64 oracle: a few roundings of the inputs' size.
F32_RTOL, F32_ATOL = 1e-5, 1e-6


# --- the float64 oracles (NumPy, written here, no code shared with the library) ---------------

def oracle(layer, xs):
    """y in float64 for the float64 inputs ``xs`` (each (b,) + shape_i)."""
    kind = type(layer).__name__
    if kind == "Add":
        return np.sum(xs, axis=0)
    if kind == "Subtract":
        return xs[0] - xs[1]
    if kind == "Multiply":
        return np.prod(xs, axis=0)
    if kind == "Average":
        return np.mean(xs, axis=0)
    return np.concatenate(xs, axis=layer.axis)          # Keras's axis counts the batch axis, as NumPy's here


def in_order_f32(layer, xs):
    """y as the layer must compute it in float32: left to right, one op at a time."""
    kind = type(layer).__name__
    if kind == "Concatenate":
        return np.concatenate(xs, axis=layer.axis)
    op = {"Add": np.add, "Subtract": np.subtract, "Multiply": np.multiply, "Average": np.add}[kind]
    y = xs[0].copy()
    for x in xs[1:]:
        y = op(y, x)
    return y / np.float32(len(xs)) if kind == "Average" else y


def fd_grads(layer, xs, dy):
    """d/dx_i of L = sum(oracle(xs) * dy), by central differences, every element."""
    return central_differences(lambda xs: np.sum(oracle(layer, xs) * dy), xs, EPS)


# --- a layer on one device, as the engine drives it -------------------------------------------

def make_state(layer, dev, need_dx):
    """The minimal state the protocol reads, its buffers NaN-poisoned when made."""
    made = {}
    state = SimpleNamespace(dev=dev, ops=dev.ops, need_dx=tuple(need_dx))

    def buffers(b):
        if b not in made:
            buf = made[b] = layer.make_buffers(state, b)
            for a in [buf.y] + [d for d in buf.dx if d is not None]:
                dev.ops.fill(a, np.nan)
        return made[b]
    state.buffers = buffers
    return state


def run(layer, dev, xs, dy, need_dx, flat_first=False):
    """Forward then backward on ``dev``; returns (y, [dx_i or None], state, device inputs,
    device dy) as host arrays where arrays. ``flat_first``: input 0 arrives as (b, features),
    as the model's input does."""
    with dev.activate():
        state = make_state(layer, dev, need_dx)
        xs_dev = [dev.from_numpy(x.reshape(len(x), -1) if flat_first and i == 0 else x)
                  for i, x in enumerate(xs)]
        dy_dev = dev.from_numpy(dy)
        y = dev.to_numpy(layer.forward(state, xs_dev, training=True))
        grads = layer.backward(state, dy_dev)
        host = [None if g is None else dev.to_numpy(g) for g in grads]
        return y, host, grads, state, xs_dev, dy_dev


#: (layer factory, per-example shapes): 1 to 3 inputs, shapes that fill no block evenly.
CASES = [
    (lambda: layers.Add(), [(2, 3), (2, 3), (2, 3)]),
    (lambda: layers.Add(), [(5,), (5,)]),
    (lambda: layers.Add(), [(4,)]),
    (lambda: layers.Subtract(), [(3, 2), (3, 2)]),
    (lambda: layers.Multiply(), [(2, 3), (2, 3), (2, 3)]),
    (lambda: layers.Multiply(), [(7,)]),
    (lambda: layers.Average(), [(2, 3), (2, 3), (2, 3)]),
    (lambda: layers.Concatenate(), [(3, 2), (3, 5), (3, 1)]),
    (lambda: layers.Concatenate(axis=1), [(1, 4), (3, 4)]),
    (lambda: layers.Concatenate(axis=2), [(2, 1, 3), (2, 4, 3)]),
    (lambda: layers.Concatenate(axis=-2), [(3, 2, 2), (3, 1, 2)]),
]
IDS = [f"{f().__class__.__name__}-{s}" for f, s in CASES]


def need_patterns(n):
    """Every input needs a gradient; the first does not (a model input); every other one."""
    patterns = [(True,) * n]
    if n > 1:
        patterns += [(False,) + (True,) * (n - 1), tuple(i % 2 == 1 for i in range(n))]
    return patterns


def fresh(rng, b, shapes):
    return [rng.uniform(-2, 2, (b,) + s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_backward_against_the_oracles(devices, rng, kind, case):
    factory, shapes = case
    cpu, gpu = devices(cpus=1, gpus=1)
    dev = cpu if kind == "CPU" else gpu
    for b, need in [(3, p) for p in need_patterns(len(shapes))] + [(1, (True,) * len(shapes))]:
        layer = factory()
        layer.build(shapes)
        assert layer.input_shape == shapes and layer.weights == [] and layer.trainable_weights == []
        xs = fresh(rng, b, shapes)
        y64 = oracle(layer, [x.astype(np.float64) for x in xs])
        assert layer.output_shape == y64.shape[1:]
        dy = rng.uniform(-1, 1, y64.shape).astype(np.float32)
        xs_before, dy_before = [x.copy() for x in xs], dy.copy()
        y, grads, raw, state, xs_dev, dy_dev = run(layer, dev, xs, dy, need, flat_first=True)
        what = f"{layer.name} on {kind}, b={b}, need_dx={need}"
        np.testing.assert_array_equal(y, in_order_f32(layer, xs), err_msg=what)      # bitwise
        assert_close(what, y, y64, F32_RTOL, F32_ATOL)
        want = fd_grads(layer, xs, dy.astype(np.float64))
        for i, (g, w, n) in enumerate(zip(grads, want, need)):
            if not n:
                assert g is None, f"{what}: input {i} needs no gradient, got one"
                continue
            assert g.shape == xs[i].shape, (what, i, g.shape)
            assert_close(f"{what}: d/dx{i}", g, w, F32_RTOL, F32_ATOL)
        for x_dev, x in zip(xs_dev, xs_before):                  # nothing wrote into the inputs
            np.testing.assert_array_equal(dev.to_numpy(x_dev).reshape(x.shape), x, err_msg=what)
        np.testing.assert_array_equal(dev.to_numpy(dy_dev), dy_before, err_msg=what)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_and_simulated_gpu_give_the_same_bits(devices, rng, case):
    """One correctly rounded float32 op per element and step, in the same order on both."""
    factory, shapes = case
    cpu, gpu = devices(cpus=1, gpus=1)
    layer = factory()
    layer.build(shapes)
    xs = fresh(rng, 5, shapes)
    dy = rng.uniform(-1, 1, (5,) + layer.output_shape).astype(np.float32)
    need = (True,) * len(shapes)
    y_cpu, g_cpu = run(layer, cpu, xs, dy, need)[:2]
    y_gpu, g_gpu = run(layer, gpu, xs, dy, need)[:2]
    np.testing.assert_array_equal(y_cpu, y_gpu)
    for a, b in zip(g_cpu, g_gpu):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_who_gets_dy_itself_and_why_the_others_get_copies(devices, rng, kind):
    """Add hands dy to the first input that needs a gradient and copies it for the others;
    Subtract hands it to input 0 only (dx1 = -dy in its own buffer, even when input 0 needs
    nothing). The others never hand dy on. A layer that gets dy may write into it (Dense's
    ReLU backward does): the other inputs' gradients must not change then."""
    cpu, gpu = devices(cpus=1, gpus=1)
    dev = cpu if kind == "CPU" else gpu
    dy = rng.uniform(-1, 1, (3, 4)).astype(np.float32)

    def grads(layer, n, need):
        layer.build([(4,)] * n)
        xs = fresh(rng, 3, [(4,)] * n)
        with dev.activate():
            state = make_state(layer, dev, need)
            dy_dev = dev.from_numpy(np.tile(dy, (1, n)) if isinstance(layer, layers.Concatenate) else dy)
            layer.forward(state, [dev.from_numpy(x) for x in xs])
            return layer.backward(state, dy_dev), dy_dev, state

    g, dy_dev, state = grads(layers.Add(), 3, (False, True, True))
    assert g[0] is None and g[1] is dy_dev and g[2] is not dy_dev
    assert state.buffers(3).dx[1] is None                        # no buffer made for input 1
    with dev.activate():
        dev.ops.fill(g[1], 0.0)                                  # what an in-place ReLU backward may do
        np.testing.assert_array_equal(dev.to_numpy(g[2]), dy)    # input 2's gradient is its own
    g, dy_dev, _ = grads(layers.Subtract(), 2, (True, True))
    assert g[0] is dy_dev and g[1] is not dy_dev
    g, dy_dev, _ = grads(layers.Subtract(), 2, (False, True))
    assert g[0] is None and g[1] is not dy_dev
    np.testing.assert_array_equal(dev.to_numpy(g[1]), -dy)
    for layer in (layers.Multiply(), layers.Average(), layers.Concatenate()):
        g, dy_dev, _ = grads(layer, 2, (True, True))
        assert all(x is not dy_dev for x in g), layer.name


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_a_replica_with_no_rows(devices, kind):
    """A replica may get none of a small global batch: b = 0 runs, launches nothing harmful,
    and returns empty arrays of the right shapes."""
    cpu, gpu = devices(cpus=1, gpus=1)
    dev = cpu if kind == "CPU" else gpu
    for layer, shapes in [(layers.Add(), [(3,), (3,)]), (layers.Multiply(), [(2, 2), (2, 2)]),
                          (layers.Average(), [(3,), (3,)]), (layers.Subtract(), [(3,), (3,)]),
                          (layers.Concatenate(axis=1), [(1, 2), (3, 2)])]:
        layer.build(shapes)
        xs = [np.zeros((0,) + s, np.float32) for s in shapes]
        y, grads = run(layer, dev, xs, np.zeros((0,) + layer.output_shape, np.float32),
                       (True,) * len(shapes))[:2]
        assert y.shape == (0,) + layer.output_shape
        assert [g.shape for g in grads] == [x.shape for x in xs]


def test_the_same_layer_runs_at_two_batch_sizes(devices, rng):
    """Buffers are per batch size (the last batch of an epoch is smaller)."""
    cpu, _ = devices(cpus=1, gpus=1)
    layer = layers.Concatenate()
    layer.build([(2,), (3,)])
    for b in (4, 1, 4):
        xs = fresh(rng, b, [(2,), (3,)])
        y = run(layer, cpu, xs, np.zeros((b, 5), np.float32), (False, False))[0]
        np.testing.assert_array_equal(y, np.concatenate(xs, axis=1))


# --- shapes and arguments, as Keras checks them ---------------------------------------------------

def test_shape_errors_name_the_layer_the_shapes_and_what_to_do():
    with pytest.raises(ValueError, match=r"Add 'a1' is a merge layer: call it on a LIST of tensors"):
        layers.Add(name="a1").build((28, 28))
    with pytest.raises(ValueError, match=r"at least 1 input\(s\), got 0"):
        layers.Add().build([])
    with pytest.raises(ValueError, match=r"Subtract 's' takes exactly 2 input\(s\), got 3"):
        layers.Subtract(name="s").build([(3,)] * 3)
    with pytest.raises(ValueError, match=r"Subtract .* got 1"):
        layers.Subtract().build([(3,)])
    with pytest.raises(ValueError, match=r"input 1 has examples of shape \(4,\), input 0 of shape "
                                         r"\(3,\).*incompatible. Give every input the same shape"):
        layers.Add().build([(3,), (4,)])
    with pytest.raises(NotImplementedError, match=r"Multiply 'm'.*\(1, 4\).*broadcast"):
        layers.Multiply(name="m").build([(3, 4), (1, 4)])
    with pytest.raises(NotImplementedError, match="broadcast"):
        layers.Average().build([(3, 4), (4,)])
    with pytest.raises(ValueError, match=r"Concatenate 'c' \(axis=-1\): input 1 has examples of shape "
                                         r"\(4, 2\).*all axes but the concatenation axis must match"):
        layers.Concatenate(name="c").build([(3, 2), (4, 2)])
    with pytest.raises(ValueError, match="different ranks"):
        layers.Concatenate().build([(3, 2), (3,)])
    with pytest.raises(NotImplementedError, match=r"axis=0 is the batch axis"):
        layers.Concatenate(axis=0).build([(3,), (3,)])
    with pytest.raises(NotImplementedError, match=r"axis=-3 is the batch axis"):
        layers.Concatenate(axis=-3).build([(3, 2), (3, 2)])
    with pytest.raises(ValueError, match=r"axis=3 is out of range .* use -1 \(the default\) or an axis "
                                         r"from 1 to 2"):
        layers.Concatenate(axis=3).build([(3, 2), (3, 2)])
    with pytest.raises(ValueError, match="axis must be an integer"):
        layers.Concatenate(axis="last")


def test_output_shapes():
    cat = layers.Concatenate(axis=1)
    cat.build([(2, 5), (3, 5), (1, 5)])
    assert cat.output_shape == (6, 5)
    last = layers.Concatenate()
    last.build([(2, 5), (2, 1)])
    assert last.output_shape == (2, 6)
    add = layers.Add()
    add.build([[4, 2], (4, 2)])                              # lists are shapes too, as Keras takes them
    assert add.output_shape == (4, 2) and add.input_shape == [(4, 2), (4, 2)]


def test_forward_refuses_a_wrong_number_of_inputs(devices):
    cpu, _ = devices(cpus=1, gpus=1)
    layer = layers.Add()
    layer.build([(2,), (2,)])
    state = make_state(layer, cpu, (True, True))
    with pytest.raises(ValueError, match="built for 2 inputs; forward got 3"):
        layer.forward(state, [np.zeros((1, 2), np.float32)] * 3)
    with pytest.raises(ValueError, match="need_dx must be a tuple of as many bools"):
        layer.make_buffers(SimpleNamespace(dev=cpu, ops=cpu.ops, need_dx=True), 2)


def test_configs_are_keras_3s_and_rebuild_the_layer():
    assert layers.Add(name="skip").get_config() == {"name": "skip", "trainable": True, "dtype": "float32"}
    config = layers.Concatenate(axis=2, name="join").get_config()
    assert config == {"name": "join", "trainable": True, "dtype": "float32", "axis": 2}
    again = layers.Concatenate(**config)
    assert again.axis == 2 and again.name == "join"
    for name in ("Add", "Subtract", "Multiply", "Average"):
        layer = getattr(layers, name)(**getattr(layers, name)(name=f"my_{name}").get_config())
        assert layer.name == f"my_{name}" and type(layer).__name__ == name


def test_keras_names_and_default_names():
    """tf.keras.layers.<Name> and the names saving.py looks up (base_layer.SUPPORTED) agree,
    and default layer names are Keras's (snake case, numbered after the first)."""
    from mirrored.keras.base_layer import SUPPORTED
    from mirrored.keras.layers import Add, Concatenate          # noqa: F401 (the import works)
    for name in ("Add", "Subtract", "Multiply", "Average", "Concatenate"):
        assert name in SUPPORTED and getattr(layers, name) is getattr(merging, name)
    first, second = layers.Average(), layers.Average()
    assert first.name.startswith("average") and second.name != first.name


def test_functional_forms_make_the_layer_and_call_it(monkeypatch):
    """``layers.add([a, b], name=...)`` is ``layers.Add(name=...)([a, b])``, and so on. Calling
    a layer on symbolic tensors is the engine's (the functional API, keras/engine.py): here a
    stand-in ``__call__`` records what it was called on."""
    monkeypatch.setattr(merging._Merge, "__call__", lambda self, inputs: (self, inputs), raising=False)
    inputs = [object(), object()]
    for fn, cls in ((layers.add, layers.Add), (layers.subtract, layers.Subtract),
                    (layers.multiply, layers.Multiply), (layers.average, layers.Average),
                    (layers.concatenate, layers.Concatenate)):
        layer, got = fn(inputs, name=f"f_{cls.__name__}")
        assert type(layer) is cls and layer.name == f"f_{cls.__name__}" and got is inputs
    layer, _ = layers.concatenate(inputs, axis=1)
    assert layer.axis == 1


def test_keras_3_configs_rebuild_through_saving():
    """What a Keras 3 .keras file holds for these layers (dtype as a DTypePolicy) becomes the
    constructor's arguments through saving.py's config reader, name and axis kept."""
    from mirrored.keras import saving
    policy = {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "float32"},
              "registered_name": None}
    for name, extra in (("Add", {}), ("Subtract", {}), ("Multiply", {}), ("Average", {}),
                        ("Concatenate", {"axis": 1})):
        config = dict({"name": f"k_{name.lower()}", "trainable": True, "dtype": policy}, **extra)
        cls = getattr(layers, name)
        layer = cls(**saving._kwargs_for(cls, config, name))
        assert layer.get_config() == dict({"name": f"k_{name.lower()}", "trainable": True,
                                           "dtype": "float32"}, **extra)


# --- in a model: every merge layer in one functional DAG, trained a step ----------------------

def all_five(keras):
    """x -> a = Dense(relu), b = Dense; s = Add(a, b, a) (a twice: fan-out into one node);
    d = Subtract(a, b); m = Multiply(s, d); v = Average(m, b); Concatenate(v, s) -> Dense."""
    inputs = keras.Input((5,))
    a = layers.Dense(4, activation="relu")(inputs)
    b = layers.Dense(4)(inputs)
    s = layers.Add()([a, b, a])
    d = layers.Subtract()([a, b])
    v = layers.Average()([layers.Multiply()([s, d]), b])
    return keras.Model(inputs, layers.Dense(3)(layers.Concatenate()([v, s])))


def all_five_loss_f64(weights, x, y):
    """The mean softmax cross-entropy of ``all_five`` in float64, written out."""
    w0, b0, w1, b1, w2, b2 = weights
    a = np.maximum(x @ w0 + b0, 0)
    b = x @ w1 + b1
    s, d = a + b + a, a - b
    logits = np.concatenate([(s * d + b) / 2, s], axis=1) @ w2 + b2
    z = logits - logits.max(axis=1, keepdims=True)
    return -(z - np.log(np.exp(z).sum(axis=1, keepdims=True)))[np.arange(len(y)), y].mean()


@pytest.mark.parametrize("kind", ["CPU", "GPU"])
def test_a_model_with_every_merge_layer_steps_to_the_float64_oracle(devices, rng, kind):
    """One SGD step over 2 replicas (5 rows: 3 + 2) equals w - lr * (central differences of the
    float64 loss), and the replicas stay bitwise equal. Needs the functional API
    (keras.Model, layers called on tensors: keras/engine.py, issue 38)."""
    from tests.test_conv_layers import STEP_ATOL, STEP_RTOL
    from tests.test_training import assert_replicas_bitwise_equal
    keras = tf.keras
    if not hasattr(keras, "Model"):
        pytest.skip("keras.Model (the functional API of issue 38) is not in this branch yet")
    devices(cpus=2, gpus=2 if kind == "GPU" else 0)
    lr = 0.25
    with tf.distribute.MirroredStrategy([f"{kind}:0", f"{kind}:1"]).scope():
        model = all_five(keras)
    before = [w + rng.uniform(0.05, 0.2, w.shape).astype(np.float32) for w in model.get_weights()]
    model.set_weights(before)                                     # nonzero biases: they count
    x = rng.uniform(-1, 1, (5, 5)).astype(np.float32)
    y = rng.integers(0, 3, 5)
    grads = central_differences(lambda ws: all_five_loss_f64(ws, x.astype(np.float64), y), before, 1e-6)
    model.compile(optimizer=keras.optimizers.SGD(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    for k, (w0, g, w1) in enumerate(zip(before, grads, model.get_weights())):
        np.testing.assert_allclose(w1, w0 - lr * g, rtol=STEP_RTOL, atol=STEP_ATOL, err_msg=f"weight {k}")
    assert_replicas_bitwise_equal(model)
