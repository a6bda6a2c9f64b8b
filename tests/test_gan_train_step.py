"""keras.io's GAN through ``fit``: a ``GAN(keras.Model)`` holding a discriminator and a
generator, its own ``compile(d_optimizer, g_optimizer, loss_fn)`` and a ``train_step`` that
trains both (issue 49; keras.io, "Customizing what happens in fit()", "Wrapping up: an
end-to-end GAN example"). Two models, two optimizers, gradients from one model into the
other, run by ``fit`` under MirroredStrategy (keras/custom_step.py: the step once per replica,
each ``apply_gradients`` a merge point).

The ``GAN`` class below is the guide's, word for word but for ``tf`` being ours. Its random
draws (``keras.random.normal`` latent vectors, ``keras.random.uniform`` label noise) are read
back as they are made: the test wraps ``keras.random.normal``/``uniform`` with functions that
keep a copy of each draw and which replica made it, so the step's code is untouched.

The oracle: the same two updates per step (the discriminator's Adam, as the guide's; the
generator's SGD, whose step shows the loss's scale where Adam's would hide it) in float64 NumPy, on the same batches, from
the same initial weights, with those draws, by Keras 3's rule for a loss object under N
replicas (``losses/loss.py``, ``scale_loss_for_distribution``: each replica's mean over its
rows times 1/N; the optimizer sums the replicas' gradients) — what TensorFlow's Keras 3
computes on the same data. float32 tolerance (BLAS products, three Adam steps); the
replicas' copies of every weight bitwise equal (one all-reduce, the same update everywhere).
The losses fit reports are the trackers' means of what the replicas gave them.

    python -m pytest -n 0 -q tests/test_gan_train_step.py
"""
import threading
import warnings

import numpy as np
import pytest

import mirrored as tf
from mirrored import keras
from mirrored.traced_function import EagerFallbackWarning
from mirrored.values import components
from oracles import bce_logits, leaky_mlp, leaky_mlp_backward

LATENT, DATA, HIDDEN, SLOPE = 3, 2, 4, 0.2
LR, BATCH, STEPS = 0.01, 6, 3          # 6 rows: 3 per replica on 2
SGD_LR = 0.5                           # the generator's: SGD, whose step shows the loss's scale (Adam's hides it)
TOL = dict(rtol=1e-4, atol=1e-5)       # float32 against float64 after three Adam steps


class GAN(keras.Model):
    """keras.io's, as the guide writes it."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        # Sample random points in the latent space
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )

        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)

        # Combine them with real images
        combined_images = tf.concat([generated_images, real_images], axis=0)

        # Assemble labels discriminating real from fake images
        labels = tf.concat(
            [tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0
        )
        # Add random noise to the labels - important trick!
        labels += 0.05 * keras.random.uniform(
            tf.shape(labels), seed=self.seed_generator
        )

        # Train the discriminator
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights)
        )

        # Sample random points in the latent space
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )

        # Assemble labels that say "all real images"
        misleading_labels = tf.zeros((batch_size, 1))

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        # Update metrics and return their value.
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }


# -- the draws, read back -----------------------------------------------------------------------
class Draws:
    """Every ``keras.random.normal``/``uniform`` result, by replica, in the order drawn."""

    def __init__(self, monkeypatch):
        self.by_replica, self.lock = {}, threading.Lock()
        for name in ("normal", "uniform"):
            monkeypatch.setattr(keras.random, name, self.recording(getattr(keras.random, name)))

    def recording(self, draw):
        def recorded(*args, **kwargs):
            out = draw(*args, **kwargs)
            context = tf.distribute.get_replica_context()
            replica = 0 if context is None else int(context.replica_id_in_sync_group.numpy())   # a tensor, as TF's
            with self.lock:
                self.by_replica.setdefault(replica, []).append(np.asarray(out.numpy(), np.float64))
            return out
        return recorded


# -- the float64 oracle ----------------------------------------------------------------------------
class SGD:
    """Plain SGD in float64."""

    def __init__(self, weights):
        pass

    def apply(self, weights, grads):
        return [w - SGD_LR * g for w, g in zip(weights, grads)]


class Adam:
    """Keras's Adam in float64 (epsilon 1e-7)."""

    def __init__(self, weights):
        self.m = [np.zeros_like(w) for w in weights]
        self.v = [np.zeros_like(w) for w in weights]
        self.t = 0

    def apply(self, weights, grads, b1=0.9, b2=0.999, eps=1e-7):
        self.t += 1
        alpha = LR * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
        out = []
        for i, (w, g) in enumerate(zip(weights, grads)):
            self.m[i] += (g - self.m[i]) * (1 - b1)
            self.v[i] += (g * g - self.v[i]) * (1 - b2)
            out.append(w - alpha * self.m[i] / (np.sqrt(self.v[i]) + eps))
        return out


def oracle_step(gw, dw, d_adam, g_sgd, shares, n):
    """One GAN step over the replicas' ``shares`` [(real rows, z1, label noise, z2)]: the
    discriminator's Adam step on the summed replica gradients, then the generator's SGD step.
    Returns the new weights and each replica's (d_loss, g_loss)."""
    dgrads, losses = None, []
    for real, z1, noise, _ in shares:
        b = len(real)
        combined = np.concatenate([leaky_mlp(gw, z1, SLOPE)[0], real])
        labels = np.concatenate([np.ones((b, 1)), np.zeros((b, 1))]) + 0.05 * noise
        logits, saved = leaky_mlp(dw, combined, SLOPE)
        d_loss, dlogits = bce_logits(logits, labels, 1.0 / n)     # Keras 3: the mean times 1/N
        grads, _ = leaky_mlp_backward(dw, saved, dlogits, SLOPE)
        dgrads = grads if dgrads is None else [a + g for a, g in zip(dgrads, grads)]
        losses.append([d_loss])
    dw = d_adam.apply(dw, dgrads)
    ggrads = None
    for (real, _, _, z2), replica_losses in zip(shares, losses):
        fake, gsaved = leaky_mlp(gw, z2, SLOPE)
        logits, dsaved = leaky_mlp(dw, fake, SLOPE)
        g_loss, dlogits = bce_logits(logits, np.zeros((len(real), 1)), 1.0 / n)
        _, dfake = leaky_mlp_backward(dw, dsaved, dlogits, SLOPE)
        grads, _ = leaky_mlp_backward(gw, gsaved, dfake, SLOPE)
        ggrads = grads if ggrads is None else [a + g for a, g in zip(ggrads, grads)]
        replica_losses.append(g_loss)
    return g_sgd.apply(gw, ggrads), dw, losses


def models(strategy):
    L = keras.layers
    with strategy.scope():
        discriminator = keras.Sequential([keras.Input((DATA,)), L.Dense(HIDDEN), L.LeakyReLU(negative_slope=SLOPE),
                                          L.Dense(1)], name="discriminator")
        generator = keras.Sequential([keras.Input((LATENT,)), L.Dense(HIDDEN), L.LeakyReLU(negative_slope=SLOPE),
                                      L.Dense(DATA)], name="generator")
        gan = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT)
        gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=LR),
                    g_optimizer=keras.optimizers.SGD(learning_rate=SGD_LR),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return gan, discriminator, generator


@pytest.mark.parametrize("n", [1, 2])
def test_keras_io_gan_trains_by_fit_to_a_float64_oracle(devices, rng, monkeypatch, n):
    devices(cpus=n)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    gan, discriminator, generator = models(strategy)
    draws = Draws(monkeypatch)
    real = rng.normal(size=(STEPS * BATCH, DATA)).astype(np.float32)
    dw = [w.astype(np.float64) for w in discriminator.get_weights()]
    gw = [w.astype(np.float64) for w in generator.get_weights()]
    history = gan.fit(tf.data.Dataset.from_tensor_slices(real).batch(BATCH), epochs=1, verbose=0)

    per = -(-BATCH // n)                                         # TF's rebatching: ceil(B / N) rows each
    assert sorted(draws.by_replica) == list(range(n))
    for replica, made in draws.by_replica.items():
        assert len(made) == 3 * STEPS, f"replica {replica} drew {len(made)} times in {STEPS} steps"
    d_adam, g_sgd, given = Adam(dw), SGD(gw), []
    for s in range(STEPS):
        shares = []
        for r in range(n):
            z1, noise, z2 = draws.by_replica[r][3 * s:3 * s + 3]
            rows = real[s * BATCH + r * per:s * BATCH + (r + 1) * per].astype(np.float64)
            assert z1.shape == (len(rows), LATENT) and noise.shape == (2 * len(rows), 1)
            shares.append((rows, z1, noise, z2))
        gw, dw, losses = oracle_step(gw, dw, d_adam, g_sgd, shares, n)
        given += losses

    for model, oracle in ((discriminator, dw), (generator, gw)):
        for v, want in zip(model.trainable_weights, oracle):
            copies = [c.numpy() for c in components(v)]
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0])       # replicas: bitwise equal
            np.testing.assert_allclose(copies[0], want, **TOL, err_msg=f"{model.name} {v.name} after {STEPS} steps")
    d_losses, g_losses = zip(*given)                             # every replica's value, every step
    np.testing.assert_allclose(history.history["d_loss"][-1], np.mean(d_losses), **TOL)
    np.testing.assert_allclose(history.history["g_loss"][-1], np.mean(g_losses), **TOL)


def test_the_gan_traced_by_fit_replays_the_eager_run_bit_for_bit(devices, rng):
    """The same GAN, its draws left on the devices: fit traces its train_step once (Keras's
    tf.function) and replays it, with fresh draws each replay, to the weights and logs of
    running its Python every batch (run_eagerly=True), bit for bit, on 2 replicas."""
    devices(cpus=2)
    real = rng.normal(size=(STEPS * BATCH, DATA)).astype(np.float32)
    results = []
    for eagerly in (False, True):
        keras.utils.set_random_seed(5)
        gan, discriminator, generator = models(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]))
        gan.run_eagerly = eagerly
        with warnings.catch_warnings():
            warnings.simplefilter("error", EagerFallbackWarning)         # traced, not fallen back
            history = gan.fit(tf.data.Dataset.from_tensor_slices(real).batch(BATCH), epochs=2, verbose=0).history
        results.append((discriminator.get_weights() + generator.get_weights(), history))
    (traced, h_traced), (eager, h_eager) = results
    for a, b in zip(traced, eager):
        np.testing.assert_array_equal(a, b)
    assert h_traced == h_eager
