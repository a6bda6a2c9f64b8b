"""RMSprop, Adagrad, AdamW, SGD's momentum, clipping, weight decay and schedules in ``fit``,
against a float64 NumPy oracle of Keras 3's math (issue 49).

A tiny model whose gradient is known in closed form: one Dense layer (features -> units)
under mean squared error, so for a global batch of B rows the gradient of Keras's loss
(the mean over the outputs, then ``sum_over_batch_size``) is dP = 2 (XW + b - Y) / (B U),
dW = X^T dP, db = sum of dP's rows. The oracle then applies, in float64, what Keras 3's
``base_optimizer._backend_apply_gradients`` does: clip (one of clipnorm per variable,
global_clipnorm, clipvalue), decay the weights (``w -= w * wd * lr``), then the update
(``keras/src/optimizers/*.py``), with ``lr`` a schedule's value at ``iterations``.

The claims: fit's weights and Keras's optimizer variables (slots in Keras's order) equal
the oracle's within float32 tolerance after several steps (the float32 path rounds a few
times per step; a wrong formula errs by far more), on 1 and 2 logical CPU replicas, and the
replicas' copies are bitwise equal (the same launches on the same summed gradients).

    python -m pytest -n 0 -q tests/test_optimizers_more.py
"""
import math

import numpy as np
import pytest

import mirrored as tf
from mirrored.keras import schedules

#: fit (float32, a few roundings per step, STEPS steps) against the float64 oracle.
RTOL = 2e-4
ATOL = 2e-6
STEPS = 4
#: Adam's epsilon in these tests: with Keras's 1e-7, a gradient element near 0 makes m / sqrt(v)
#: jump between -1 and 1 on a float32 rounding (a difference of lr, not a wrong formula).
ADAM_EPSILON = 1e-3
FEATURES, UNITS, BATCH = 5, 3, 7          # a global batch of 7 over 2 replicas: shares of 4 and 3


# --- the float64 oracle: Keras 3's optimizers, one variable at a time -----------------------------

class Oracle:
    """Keras 3's apply_gradients in float64 for variables [W, b]: ``kind`` and its arguments,
    the base arguments (clipnorm, clipvalue, global_clipnorm, weight_decay), a schedule."""

    def __init__(self, kind, lr=0.01, schedule=None, clipnorm=None, clipvalue=None, global_clipnorm=None,
                 weight_decay=None, **hyper):
        self.kind, self.lr, self.schedule, self.hyper = kind, lr, schedule, hyper
        self.clipnorm, self.clipvalue, self.global_clipnorm = clipnorm, clipvalue, global_clipnorm
        self.weight_decay = 0.004 if kind == "adamw" and weight_decay is None else weight_decay
        self.iterations = 0
        self.slots = None

    def rate(self):
        return float(self.schedule(self.iterations)) if self.schedule is not None else self.lr

    def clip(self, grads):
        if self.clipnorm:
            return [g * self.clipnorm / max(np.sqrt(np.sum(g * g)), self.clipnorm) for g in grads]
        if self.global_clipnorm:
            n = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
            return [g * (self.global_clipnorm * min(1 / n, 1 / self.global_clipnorm)) for g in grads]
        if self.clipvalue:
            return [np.clip(g, -self.clipvalue, self.clipvalue) for g in grads]
        return grads

    def apply(self, grads, variables):
        lr = self.rate()
        grads = self.clip(grads)
        if self.weight_decay is not None:
            for v in variables:
                v -= v * self.weight_decay * lr
        if self.slots is None:
            init = self.hyper.get("initial_accumulator_value", 0.1) if self.kind == "adagrad" else 0.0
            self.slots = [{name: np.full_like(v, init) for name in ("m", "v", "avg", "mom")} for v in variables]
        t = self.iterations + 1
        for g, v, s in zip(grads, variables, self.slots):
            getattr(self, self.kind.replace("adamw", "adam"))(g, v, s, lr, t)
        self.iterations += 1

    def sgd(self, g, w, s, lr, t):
        mom, nesterov = self.hyper.get("momentum", 0.0), self.hyper.get("nesterov", False)
        if not mom:
            w -= lr * g
            return
        s["m"][...] = mom * s["m"] - lr * g
        w += mom * s["m"] - lr * g if nesterov else s["m"]

    def adam(self, g, w, s, lr, t, b1=0.9, b2=0.999):
        eps = self.hyper.get("epsilon", 1e-7)
        alpha = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        s["m"] += (g - s["m"]) * (1 - b1)
        s["v"] += (g * g - s["v"]) * (1 - b2)
        w -= alpha * s["m"] / (np.sqrt(s["v"]) + eps)

    def rmsprop(self, g, w, s, lr, t):
        rho, mom = self.hyper.get("rho", 0.9), self.hyper.get("momentum", 0.0)
        eps, centered = self.hyper.get("epsilon", 1e-7), self.hyper.get("centered", False)
        s["v"][...] = rho * s["v"] + (1 - rho) * g * g
        if centered:
            s["avg"][...] = rho * s["avg"] + (1 - rho) * g
            denominator = s["v"] - s["avg"] ** 2 + eps
        else:
            denominator = s["v"] + eps
        increment = lr * g / np.sqrt(denominator)
        if mom > 0:
            s["mom"][...] = mom * s["mom"] + increment
            w -= s["mom"]
        else:
            w -= increment

    def adagrad(self, g, w, s, lr, t):
        eps = self.hyper.get("epsilon", 1e-7)
        s["v"] += g * g
        w -= lr * g / np.sqrt(s["v"] + eps)

    def keras_slots(self):
        """The slots in Keras 3's order of optimizer.variables (after iteration, learning_rate)."""
        if self.kind in ("adam", "adamw"):
            return [a for s in self.slots for a in (s["m"], s["v"])]
        if self.kind == "sgd":
            return [s["m"] for s in self.slots] if self.hyper.get("momentum") else []
        if self.kind == "adagrad":
            return [s["v"] for s in self.slots]
        out = [s["v"] for s in self.slots]                              # RMSprop: grouped by slot
        if self.hyper.get("momentum", 0.0) > 0:
            out += [s["mom"] for s in self.slots]
        if self.hyper.get("centered"):
            out += [s["avg"] for s in self.slots]
        return out


def mse_grads(x, y, w, b):
    """The gradient of Keras's MeanSquaredError (sum_over_batch_size) of x @ w + b, in float64."""
    d = 2 * (x @ w + b - y) / (x.shape[0] * y.shape[1])                # (B, U)
    return [x.T @ d, d.sum(axis=0)]


def make(kind, **kwargs):
    classes = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam,
               "adamw": tf.keras.optimizers.AdamW, "rmsprop": tf.keras.optimizers.RMSprop,
               "adagrad": tf.keras.optimizers.Adagrad}
    return classes[kind](**kwargs)


def fit_against_oracle(devices, rng, replicas, kind, opt_kwargs, oracle_kwargs, steps=STEPS, scale=1.0):
    devices(cpus=replicas)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    x = rng.standard_normal((steps * BATCH, FEATURES)).astype(np.float32)
    y = (scale * rng.standard_normal((steps * BATCH, UNITS))).astype(np.float32)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(UNITS, input_shape=(FEATURES,))])
        model.compile(loss="mse", optimizer=make(kind, **opt_kwargs))
    w, b = (a.astype(np.float64) for a in model.get_weights())
    oracle = Oracle(kind, **oracle_kwargs)
    for s in range(steps):
        xb, yb = x[s * BATCH:(s + 1) * BATCH].astype(np.float64), y[s * BATCH:(s + 1) * BATCH].astype(np.float64)
        oracle.apply(mse_grads(xb, yb, w, b), [w, b])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    got = model.get_weights()
    for name, g, want in zip(("kernel", "bias"), got, (w, b)):
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL, err_msg=f"{kind} {opt_kwargs}: {name}")
    opt = model.optimizer
    assert int(opt.iterations) == steps
    variables = opt.keras_variables(model.step.pack)
    head = 1 if opt.schedule is not None else 2
    assert len(variables) == head + len(oracle.keras_slots())
    for i, (g, want) in enumerate(zip(variables[head:], oracle.keras_slots())):
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL, err_msg=f"{kind}: optimizer variable {head + i}")
    for v in model.trainable_variables:                            # every replica's copy alike
        copies = strategy.experimental_local_results(v)
        for c in copies[1:]:
            np.testing.assert_array_equal(c.numpy(), copies[0].numpy())
    return model, oracle


CASES = {
    "rmsprop": ("rmsprop", dict(learning_rate=0.01), dict(lr=0.01)),
    "rmsprop-momentum-centered": ("rmsprop", dict(learning_rate=0.01, rho=0.8, momentum=0.5, centered=True),
                                  dict(lr=0.01, rho=0.8, momentum=0.5, centered=True)),
    "rmsprop-momentum": ("rmsprop", dict(learning_rate=0.01, momentum=0.9), dict(lr=0.01, momentum=0.9)),
    "adagrad": ("adagrad", dict(learning_rate=0.05, initial_accumulator_value=0.2),
                dict(lr=0.05, initial_accumulator_value=0.2)),
    "adamw": ("adamw", dict(learning_rate=0.01, weight_decay=0.1, epsilon=ADAM_EPSILON),
              dict(lr=0.01, weight_decay=0.1, epsilon=ADAM_EPSILON)),
    "sgd-nesterov": ("sgd", dict(learning_rate=0.05, momentum=0.9, nesterov=True),
                     dict(lr=0.05, momentum=0.9, nesterov=True)),
    "sgd-weight-decay": ("sgd", dict(learning_rate=0.05, weight_decay=0.5), dict(lr=0.05, weight_decay=0.5)),
    "adam-clipnorm": ("adam", dict(learning_rate=0.01, clipnorm=0.3, epsilon=ADAM_EPSILON),
                      dict(lr=0.01, clipnorm=0.3, epsilon=ADAM_EPSILON)),
    "sgd-global-clipnorm": ("sgd", dict(learning_rate=0.1, global_clipnorm=0.4),
                            dict(lr=0.1, global_clipnorm=0.4)),
    "rmsprop-clipvalue": ("rmsprop", dict(learning_rate=0.01, clipvalue=0.05), dict(lr=0.01, clipvalue=0.05)),
}


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_in_fit_against_keras_math(devices, rng, case, replicas):
    kind, opt_kwargs, oracle_kwargs = CASES[case]
    fit_against_oracle(devices, rng, replicas, kind, opt_kwargs, oracle_kwargs, scale=3.0)


def test_clipping_acts(devices, rng):
    """The clip cases above are not no-ops: the clipped oracle differs from the unclipped one."""
    model, clipped = fit_against_oracle(devices, rng, 1, "sgd", dict(learning_rate=0.1, global_clipnorm=0.4),
                                        dict(lr=0.1, global_clipnorm=0.4), scale=3.0)
    plain = Oracle("sgd", lr=0.1)
    w, b = (rng.standard_normal(s) for s in ((FEATURES, UNITS), (UNITS,)))
    g = [3 * rng.standard_normal(w.shape), 3 * rng.standard_normal(b.shape)]
    assert not np.allclose(clipped.clip(g)[0], plain.clip(g)[0])


SCHEDULES = {
    "exponential": lambda: schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5),
    "exponential-staircase": lambda: schedules.ExponentialDecay(0.05, 2, 0.5, staircase=True),
    "piecewise": lambda: schedules.PiecewiseConstantDecay([0, 2], [0.05, 0.01, 0.002]),
    "cosine": lambda: schedules.CosineDecay(0.05, decay_steps=3, alpha=0.1),
    "cosine-warmup": lambda: schedules.CosineDecay(0.0, decay_steps=3, warmup_target=0.05, warmup_steps=2),
}


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_in_fit_against_keras_math(devices, rng, name, replicas):
    model, oracle = fit_against_oracle(devices, rng, replicas, "adamw",
                                       dict(learning_rate=SCHEDULES[name](), weight_decay=0.2, epsilon=ADAM_EPSILON),
                                       dict(lr=None, schedule=SCHEDULES[name](), weight_decay=0.2,
                                            epsilon=ADAM_EPSILON), steps=5)
    opt = model.optimizer
    assert float(opt.learning_rate) == pytest.approx(SCHEDULES[name]()(5), rel=1e-6)   # at iterations
    with pytest.raises(TypeError, match="not settable"):
        opt.learning_rate = 0.1


def test_schedule_values_are_keras_s():
    """Keras 3's formulas at chosen steps (hand-computed)."""
    e = schedules.ExponentialDecay(0.1, 10, 0.5)
    assert e(0) == pytest.approx(0.1) and e(10) == pytest.approx(0.05) and e(5) == pytest.approx(0.1 * 0.5 ** 0.5)
    assert schedules.ExponentialDecay(0.1, 10, 0.5, staircase=True)(19) == pytest.approx(0.05)
    p = schedules.PiecewiseConstantDecay([3, 6], [1.0, 0.5, 0.1])
    assert [p(s) for s in (0, 3, 4, 6, 7)] == [1.0, 1.0, 0.5, 0.5, 0.1]
    c = schedules.CosineDecay(1.0, 4, alpha=0.2)
    assert c(2) == pytest.approx(0.8 * 0.5 + 0.2) and c(100) == pytest.approx(0.2)
    w = schedules.CosineDecay(0.0, 4, warmup_target=1.0, warmup_steps=2)
    assert w(1) == pytest.approx(0.5) and w(2) == pytest.approx(1.0) and w(4) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="1 less"):
        schedules.PiecewiseConstantDecay([1, 2], [1.0])


def test_base_arguments_are_checked_as_keras_does():
    with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"):
        tf.keras.optimizers.Adam(clipnorm=1.0, clipvalue=0.5)
    with pytest.raises(ValueError, match="weight_decay must be a finite number"):
        tf.keras.optimizers.SGD(weight_decay="a lot")
    with pytest.raises(ValueError, match="`weight_decay` must be a float"):
        tf.keras.optimizers.AdamW(weight_decay=None)
    for name in ("rmsprop", "adagrad", "adamw"):
        assert type(tf.keras.optimizers.get(name)).__name__.lower() == name
    opt = tf.keras.optimizers.AdamW(learning_rate=schedules.ExponentialDecay(0.1, 2, 0.5), clipnorm=2.0)
    config = opt.get_config()
    assert config["learning_rate"]["class_name"] == "ExponentialDecay" and config["clipnorm"] == 2.0
    assert config["weight_decay"] == 0.004


# --- saved and loaded: Keras 3's .keras archive, resume == uninterrupted ------------------------

SAVED = {
    "rmsprop-momentum-centered": lambda: tf.keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True,
                                                                     clipvalue=0.2),
    "adagrad-global-clipnorm": lambda: tf.keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.3,
                                                                   global_clipnorm=0.5),
    "adamw-schedule-clipnorm": lambda: tf.keras.optimizers.AdamW(
        schedules.CosineDecay(0.0, 4, warmup_target=0.02, warmup_steps=2), weight_decay=0.1, clipnorm=0.4),
    "sgd-piecewise": lambda: tf.keras.optimizers.SGD(schedules.PiecewiseConstantDecay([1, 3], [0.1, 0.05, 0.01]),
                                                     momentum=0.9, nesterov=True, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(SAVED))
def test_keras_file_round_trip_resumes_bitwise(devices, rng, tmp_path, name):
    """Train 3 steps, save a .keras file, load it, train 3 more == 6 steps uninterrupted, bit for
    bit (weights and every optimizer variable), on 2 replicas: the config (the optimizer's class,
    arguments, schedule) and the state (iteration, learning rate, slots in Keras's order) came back."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    x = rng.standard_normal((6 * BATCH, FEATURES)).astype(np.float32)
    y = (3 * rng.standard_normal((6 * BATCH, UNITS))).astype(np.float32)
    models = []
    for _ in range(2):
        with strategy.scope():
            m = tf.keras.Sequential([tf.keras.layers.Dense(UNITS, input_shape=(FEATURES,))])
            m.compile(loss="mse", optimizer=SAVED[name]())
        models.append(m)
    straight, interrupted = models
    interrupted.set_weights(straight.get_weights())
    straight.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    interrupted.fit(x[:3 * BATCH], y[:3 * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "m.keras"
    interrupted.save(path)
    with strategy.scope():
        loaded = tf.keras.models.load_model(path)
    opt = loaded.optimizer
    assert type(opt) is type(straight.optimizer) and int(opt.iterations) == 3
    assert opt.get_config() == interrupted.optimizer.get_config()
    loaded.fit(x[3 * BATCH:], y[3 * BATCH:], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(straight.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    want, got = (m.optimizer.keras_variables(m.step.pack) for m in (straight, loaded))
    assert len(want) == len(got) == opt.keras_head + len(opt.slot_names) * 2
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_a_schedule_advances_in_a_custom_loop_and_a_replayed_function(devices, rng):
    """``apply_gradients`` in a ``@tf.function`` replays its recorded launches; the per-step
    vector is a host call made again each replay, so the schedule's rate still moves: the
    weights equal fit's, bitwise, step after step."""
    devices(cpus=2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    make_opt = lambda: tf.keras.optimizers.SGD(schedules.ExponentialDecay(0.1, 1, 0.5), global_clipnorm=1.0,
                                               weight_decay=0.3)
    x = rng.standard_normal((4 * BATCH, FEATURES)).astype(np.float32)
    y = (3 * rng.standard_normal((4 * BATCH, UNITS))).astype(np.float32)
    with strategy.scope():
        by_fit = tf.keras.Sequential([tf.keras.layers.Dense(UNITS, input_shape=(FEATURES,))])
        by_fit.compile(loss="mse", optimizer=make_opt())
        by_loop = tf.keras.Sequential([tf.keras.layers.Dense(UNITS, input_shape=(FEATURES,))])
        by_loop.compile(loss="mse", optimizer=make_opt())
    by_loop.set_weights(by_fit.get_weights())
    loss_fn = tf.keras.losses.MeanSquaredError(reduction="sum")
    opt = by_loop.optimizer

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, by_loop(xb, training=True)) / (BATCH * UNITS) * UNITS
        grads = tape.gradient(loss, by_loop.trainable_variables)
        opt.apply_gradients(zip(grads, by_loop.trainable_variables))

    @tf.function
    def step(batch):
        strategy.run(replica_step, args=batch)

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    for batch in data:
        step(batch)
    by_fit.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 4
    assert float(opt.learning_rate) == pytest.approx(0.1 * 0.5 ** 4)
    for a, b in zip(by_fit.get_weights(), by_loop.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
