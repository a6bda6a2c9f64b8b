"""Agreement with Keras: the lab's ConvNet under MirroredStrategy reaches Keras's weights.

From the same initial weights and the same batches of real MNIST (the bundled subset),
the course lab's model — ``Conv2D(32, 3, relu) -> MaxPooling2D() -> Flatten() ->
Dense(64, relu) -> Dense(10)``, ``SparseCategoricalCrossentropy(from_logits=True)`` —
trained by ``fit`` under ``MirroredStrategy`` over 2 replicas (2 logical CPUs; a
miniature of it on 2 simulated logical GPUs) must end where Keras ends, with SGD, SGD with
momentum (and Nesterov) and Adam.

Keras is not a dependency, so Keras's math is written out here, in float64 NumPy, from
Keras 3's definitions, and shares no code with mirrored (no kernel, no CpuOps):

* ``Conv2D``: cross-correlation of NHWC images with an HWIO kernel, "valid", plus bias;
* ``MaxPooling2D()``: 2x2 windows, stride 2, "valid" (an odd last row/column is dropped);
  the gradient goes to the FIRST maximum of each window in row-major order (TensorFlow's
  MaxPoolGrad; ties are common on MNIST's blank background);
* ``Flatten``: NHWC rows flattened in (h, w, c) order;
* ReLU's gradient: 1 where the pre-activation is > 0, else 0 (TensorFlow's ReluGrad);
* the loss: softmax cross-entropy averaged over the GLOBAL batch (what Keras's fit
  computes under MirroredStrategy when the replicas get equal shares: each replica's mean
  scaled by 1/replicas);
* keras/src/optimizers/sgd.py ``update_step``: ``w -= lr*g``; with momentum ``m = momentum*m
  - lr*g; w += m``; Nesterov ``w += momentum*m - lr*g``;
* keras/src/optimizers/adam.py ``update_step`` (t = iterations + 1):
  ``alpha = lr*sqrt(1 - beta_2**t)/(1 - beta_1**t); m += (g - m)*(1 - beta_1);
  v += (g**2 - v)*(1 - beta_2); w -= alpha*m/(sqrt(v) + epsilon)`` — epsilon is added to
  sqrt(v) of the UNcorrected v ("epsilon hat" of Kingma & Ba, before their section 2.1),
  not inside the square root, not to the bias-corrected sqrt(v_hat) of their Algorithm 1.

The check (``assert_reaches``, bound ``RTOL``): every weight array ends within rtol 2e-3
of the oracle's, measured on what training changed (w - w0), element by element and in
norm. Measured on the change, not on the weights: a few steps move a weight by a small
fraction of its size, so an rtol on the weights would let a wrong step size pass.

ReLU and max-pool are discontinuous: where float64 puts a pre-activation, or a pool
window's top two values, within float32 rounding of each other, Keras's float32 step may
take the other branch (seed 1055: a window whose top two differ by 5.7e-9 at step 2, and
the conv kernel misses by 6e-3). Such a case is drawn again (``DRAWS``); a real mistake
misses on every draw.

That the check can fail: ``test_a_wrong_oracle_misses_the_bound`` runs the same training
against oracles with one deliberate mistake each (the loss averaged over each replica's
LOCAL batch; Adam's epsilon inside the square root; epsilon added to the bias-corrected
sqrt(v_hat), as in the paper's Algorithm 1; no bias correction) and requires the bound to
be missed.

    python -m pytest -q tests/test_keras_agreement.py
"""
import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import mirrored as tf
from mirrored import datasets
from tests.test_training import assert_replicas_bitwise_equal

#: Agreement bound, on what training changed (the issue's "float32 rounding (rtol 2e-3)"):
#: per weight array, |change - Keras's change| <= RTOL * (|Keras's change| + its largest
#: element) element by element, and <= RTOL * |Keras's change| in norm. The second term of
#: the first allows for gradients that cancel to nearly nothing: float32 sums keep them
#: only to ~1e-6 of their terms, and Adam moves such a weight by up to lr whatever their
#: size. Measured here: the norm-wise error is 1e-7 to 3e-5, the element-wise error at most
#: ~1e-4 of the largest change (seeds 0-2, every optimizer below).
RTOL = 2e-3
#: Fresh draws (data and initial weights) a case may take before a miss counts. ReLU and
#: max-pool are discontinuous: where a float64 pre-activation or a pool window's top two
#: values sit within float32 rounding of each other, Keras's float32 step may take the
#: other branch, and one filter's gradient differs by a whole term (seen: 2 cases in ~400
#: seeded draws, seeds 1000-1080 x the 5 optimizers, on the conv kernel or bias; every
#: other array within 7e-5 in norm). A
#: real mistake misses on every draw (the wrong oracles below by 100x the bound); a branch
#: flip misses twice running with a chance of ~(1/200)^2.
DRAWS = 2

GLOBAL_BATCH, STEPS, REPLICAS = 16, 5, 2


# --- data ------------------------------------------------------------------------------------

def mnist_batches(rng, n, size=28):
    """``n`` random examples of the bundled real MNIST subset: images (n, size, size, 1)
    float32 in [0, 1] (the lab's ``scale``; ``size`` < 28 subsamples the image), labels."""
    images_file, labels_file = datasets.SPLIT_FILES["train"]
    images = datasets.read_idx(datasets.BUNDLED_DIR / images_file, datasets.IMAGES_MAGIC)
    labels = datasets.read_idx(datasets.BUNDLED_DIR / labels_file, datasets.LABELS_MAGIC)
    rows = rng.choice(len(images), n, replace=False)
    step = 28 // size
    x = images[rows][:, ::step, ::step][:, :size, :size, None].astype(np.float32) / np.float32(255)
    return x, labels[rows].astype(np.int64)


# --- Keras's math in float64 -----------------------------------------------------------------

def relu(z):
    return np.maximum(z, 0.0)


def forward(weights, x):
    """The lab model's forward pass; returns logits and what the backward pass needs."""
    kernel, conv_bias, w1, b1, w2, b2 = weights
    kh, kw = kernel.shape[:2]
    patches = sliding_window_view(x, (kh, kw), axis=(1, 2))          # (B, OH, OW, Cin, kh, kw)
    z0 = np.einsum("bhwcij,ijcf->bhwf", patches, kernel) + conv_bias   # cross-correlation
    a0 = relu(z0)
    b, oh, ow, c = a0.shape
    ph, pw = oh // 2, ow // 2                                         # 'valid': odd edge dropped
    windows = (a0[:, :2 * ph, :2 * pw].reshape(b, ph, 2, pw, 2, c)
               .transpose(0, 1, 3, 5, 2, 4).reshape(b, ph, pw, c, 4))  # (di, dj) row-major
    first_max = windows.argmax(axis=-1)                               # argmax = FIRST maximum
    pooled = windows.max(axis=-1)
    flat = pooled.reshape(b, -1)                                      # (h, w, c) order
    z1 = flat @ w1 + b1
    a1 = relu(z1)
    logits = a1 @ w2 + b2
    return logits, (patches, z0, first_max, pooled.shape, oh, ow, flat, z1, a1)


def gradients(weights, x, y, batch_for_mean):
    """Gradients of sum over the rows of softmax cross-entropy / ``batch_for_mean``."""
    kernel, conv_bias, w1, b1, w2, b2 = weights
    logits, (patches, z0, first_max, pshape, oh, ow, flat, z1, a1) = forward(weights, x)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    d = e / e.sum(axis=1, keepdims=True)
    d[np.arange(len(y)), y] -= 1.0
    d /= batch_for_mean
    g_w2, g_b2 = a1.T @ d, d.sum(0)
    dz1 = (d @ w2.T) * (z1 > 0)
    g_w1, g_b1 = flat.T @ dz1, dz1.sum(0)
    dpooled = (dz1 @ w1.T).reshape(pshape)
    b, ph, pw, c = pshape
    dwindows = dpooled[..., None] * (np.arange(4) == first_max[..., None])
    da0 = np.zeros((b, oh, ow, c))
    da0[:, :2 * ph, :2 * pw] = (dwindows.reshape(b, ph, pw, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
                                .reshape(b, 2 * ph, 2 * pw, c))
    dz0 = da0 * (z0 > 0)
    g_kernel = np.einsum("bhwcij,bhwf->ijcf", patches, dz0)
    return [g_kernel, dz0.sum((0, 1, 2)), g_w1, g_b1, g_w2, g_b2]


def global_batch_gradients(weights, x, y, replicas):
    """What fit computes: the mean over the whole global batch (the replicas' sum of
    their shares of it)."""
    return gradients(weights, x, y, batch_for_mean=len(x))


def local_mean_gradients(weights, x, y, replicas):
    """A deliberate mistake: each replica averages over its LOCAL batch, then the
    all-reduce sums (twice the gradient on 2 equal shares)."""
    share = -(-len(x) // replicas)                   # TensorFlow's split: rows [r*k, (r+1)*k)
    parts = [gradients(weights, x[r * share:(r + 1) * share], y[r * share:(r + 1) * share],
                       batch_for_mean=len(x[r * share:(r + 1) * share]))
             for r in range(replicas) if len(x[r * share:(r + 1) * share])]
    return [sum(p[k] for p in parts) for k in range(len(weights))]


class SGD:
    """keras/src/optimizers/sgd.py, float64."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False):
        self.lr, self.momentum, self.nesterov = learning_rate, momentum, nesterov
        self.m = None

    def apply(self, weights, grads):
        if not self.momentum:
            return [w - self.lr * g for w, g in zip(weights, grads)]
        if self.m is None:
            self.m = [np.zeros_like(w) for w in weights]
        out = []
        for k, (w, g) in enumerate(zip(weights, grads)):
            self.m[k] = self.momentum * self.m[k] - self.lr * g
            out.append(w + (self.momentum * self.m[k] - self.lr * g if self.nesterov else self.m[k]))
        return out


class Adam:
    """keras/src/optimizers/adam.py, float64. ``placement`` other than "keras" is a
    deliberate mistake (for the negative test)."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, placement="keras"):
        self.lr, self.b1, self.b2, self.eps = learning_rate, beta_1, beta_2, epsilon
        self.placement = placement
        self.t, self.m, self.v = 0, None, None

    def apply(self, weights, grads):
        if self.m is None:
            self.m = [np.zeros_like(w) for w in weights]
            self.v = [np.zeros_like(w) for w in weights]
        self.t += 1
        t, b1, b2, eps = self.t, self.b1, self.b2, self.eps
        alpha = self.lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        out = []
        for k, (w, g) in enumerate(zip(weights, grads)):
            self.m[k] += (g - self.m[k]) * (1 - b1)
            self.v[k] += (g * g - self.v[k]) * (1 - b2)
            m, v = self.m[k], self.v[k]
            if self.placement == "keras":
                step = alpha * m / (np.sqrt(v) + eps)
            elif self.placement == "inside_sqrt":
                step = alpha * m / np.sqrt(v + eps)
            elif self.placement == "algorithm_1":
                step = self.lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
            elif self.placement == "no_bias_correction":
                step = self.lr * m / (np.sqrt(v) + eps)
            else:
                raise ValueError(self.placement)
            out.append(w - step)
        return out


def oracle_weights(start, x, y, global_batch, optimizer, grads_fn=global_batch_gradients):
    """Keras's weights after training from ``start`` on ``x, y`` in batches of
    ``global_batch``, in order."""
    weights = [w.astype(np.float64) for w in start]
    batches = [(x[s:s + global_batch], y[s:s + global_batch]) for s in range(0, len(x), global_batch)]
    for x, y in batches:
        weights = optimizer.apply(weights, grads_fn(weights, x.astype(np.float64), y, REPLICAS))
    return weights


# --- ours --------------------------------------------------------------------------------------

def lab_convnet(input_shape=(28, 28, 1), filters=32, hidden=64):
    """The course lab's model (its sizes shrunk for the simulator when asked)."""
    return tf.keras.Sequential([
        tf.keras.layers.Conv2D(filters, 3, activation="relu", input_shape=input_shape),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(hidden, activation="relu"),
        tf.keras.layers.Dense(10)])


OPTIMIZERS = {   # name -> (ours, the oracle's): Keras's defaults unless a setting is the point
    "sgd": (lambda: tf.keras.optimizers.SGD(0.1), lambda: SGD(0.1)),
    "sgd-momentum": (lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9),
                     lambda: SGD(0.05, momentum=0.9)),
    "sgd-nesterov": (lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
                     lambda: SGD(0.05, momentum=0.9, nesterov=True)),
    "adam": (lambda: tf.keras.optimizers.Adam(), lambda: Adam()),
    # epsilon near sqrt(v): where it is added shows (1e-7 hides a wrong placement)
    "adam-eps": (lambda: tf.keras.optimizers.Adam(epsilon=1e-4), lambda: Adam(epsilon=1e-4)),
}


def train_ours(rng, kind, optimizer, x, y, global_batch=GLOBAL_BATCH, model_kwargs=None):
    """fit under MirroredStrategy over 2 replicas, on the lab's pipeline (batched, unshuffled
    so the oracle sees the same batches), from initial weights drawn under a seed taken
    from ``rng`` (a failure repeats with the test's printed seed); returns (start
    weights, end weights, model)."""
    tf.keras.utils.set_random_seed(int(rng.integers(2 ** 31)))
    strategy = tf.distribute.MirroredStrategy([f"{kind}:{r}" for r in range(REPLICAS)])
    with strategy.scope():
        model = lab_convnet(**(model_kwargs or {}))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=optimizer, metrics=["accuracy"])
    start = model.get_weights()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    model.fit(dataset, epochs=1, verbose=0)
    return start, model.get_weights(), model


def agreement(ours, ref, start):
    """Per weight array, measured on what training changed (w - w0): (norm of the error
    over the norm of the oracle's change, worst element-wise excess over the bound in units
    of the oracle's largest change; <= 0 is within it)."""
    out = []
    for a, r, w0 in zip(ours, ref, start):
        mine, theirs = a.astype(np.float64) - w0, r - w0
        err, scale = np.abs(mine - theirs), np.abs(theirs).max()
        if scale == 0:                   # Keras leaves the array as it was (a dead unit): so must we
            out.append((0.0, 0.0) if not err.any() else (np.inf, np.inf))
            continue
        excess = (err - RTOL * (np.abs(theirs) + scale)).max()
        out.append((np.linalg.norm(mine - theirs) / np.linalg.norm(theirs), excess / scale))
    return out


def reaches(ours, ref, start):
    return all(norm <= RTOL and excess <= 0 for norm, excess in agreement(ours, ref, start))


def assert_reaches(ours, ref, start, names):
    for name, (norm, excess) in zip(names, agreement(ours, ref, start)):
        assert norm <= RTOL, f"{name}: its change is {norm:.1e} (relative, in norm) from Keras's"
        assert excess <= 0, (f"{name}: an element's change is {excess:.1e} of the largest change "
                             f"past the bound (rtol {RTOL})")


# --- the tests ---------------------------------------------------------------------------------

def agreeing_draw(case, rng):
    """Run ``case(rng) -> (ours, oracle's, start, model)`` on fresh draws until one
    reaches the oracle's weights, at most ``DRAWS`` times; fails with the last miss."""
    for draw in range(DRAWS):
        ours, ref, start, model = case(rng)
        if reaches(ours, ref, start) or draw == DRAWS - 1:
            break
        print(f"draw {draw} missed (a branch flip?): {agreement(ours, ref, start)}")
    assert_reaches(ours, ref, start, [v.name for v in model.trainable_variables])
    return ours, ref, start, model


def lab_case(opt, kind="CPU", batch=GLOBAL_BATCH, steps=STEPS, size=28, model_kwargs=None):
    """One draw: real MNIST batches and initial weights from ``rng``, our fit, Keras's math."""
    ours_opt, oracle_opt = OPTIMIZERS[opt]

    def case(rng):
        x, y = mnist_batches(rng, batch * steps, size=size)
        start, end, model = train_ours(rng, kind, ours_opt(), x, y, batch, model_kwargs)
        return end, oracle_weights(start, x, y, batch, oracle_opt()), start, model
    return case


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_the_lab_convnet_on_2_cpu_replicas_reaches_kerass_weights(devices, rng, opt):
    devices(cpus=REPLICAS)
    end, _, start, model = agreeing_draw(lab_case(opt), rng)
    assert_replicas_bitwise_equal(model)
    assert all(not np.array_equal(a, w0) for a, w0 in zip(end, start)), "every array trained"


@pytest.mark.parametrize("opt,mistake", [
    ("sgd", "local_mean"), ("sgd-momentum", "local_mean"),
    ("adam", "inside_sqrt"), ("adam", "algorithm_1"), ("adam", "no_bias_correction")])
def test_a_wrong_oracle_misses_the_bound(devices, rng, opt, mistake):
    """The bound tells Keras's math from a near miss of it: the same training, checked
    against an oracle with one mistake, must fail the check the right oracle passes."""
    devices(cpus=REPLICAS)
    ours_opt, oracle_opt = OPTIMIZERS[opt]
    draws = []

    def case(rng):
        x, y = mnist_batches(rng, GLOBAL_BATCH * STEPS)
        start, end, model = train_ours(rng, "CPU", ours_opt(), x, y)
        draws.append((x, y))
        return end, oracle_weights(start, x, y, GLOBAL_BATCH, oracle_opt()), start, model
    end, _, start, _ = agreeing_draw(case, rng)
    x, y = draws[-1]
    if mistake == "local_mean":
        wrong = oracle_weights(start, x, y, GLOBAL_BATCH, oracle_opt(), grads_fn=local_mean_gradients)
    else:
        wrong = oracle_weights(start, x, y, GLOBAL_BATCH, Adam(placement=mistake))
    assert not reaches(end, wrong, start), f"an oracle with {mistake} passed the bound"


@pytest.mark.parametrize("opt", ["sgd-momentum", "adam"])
def test_a_tiny_lab_convnet_on_2_logical_gpus_reaches_kerass_weights(devices, rng, opt):
    """The lab's model in miniature (MNIST subsampled to 7x7, so the pool drops an odd
    last row and column; 2 filters, Dense(4)) on 2 logical GPUs, real or simulated."""
    devices(cpus=1, gpus=REPLICAS)
    _, _, _, model = agreeing_draw(lab_case(opt, "GPU", batch=4, steps=2, size=7,     # the simulator
                                            model_kwargs=dict(input_shape=(7, 7, 1), filters=2, hidden=4)),
                                   rng)
    assert_replicas_bitwise_equal(model)
