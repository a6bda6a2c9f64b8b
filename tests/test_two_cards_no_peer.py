"""Two physical GPUs with no peer access (Kaggle's two T4s on PCIe may have none): the ring's
staged path carries fit, bitwise as the one-card path does.

The simulator has one GPU, so the second logical GPU pretends to be on card 1 (as
tests/test_gpu_hazards.py does for the peer copy), peer access is refused as
``can_access_peer`` would refuse it, and every cross-card copy is recorded.

    python -m pytest tests/test_two_cards_no_peer.py
"""
import numpy as np
import pytest

import mirrored as tf
from mirrored import devices as registry


def _fit(strategy, x, y, init):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu", input_shape=(7,)),
                                     tf.keras.layers.Dense(3)])
    model.set_weights(init)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(0.01))
    model.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)   # 9 over 2: 5 + 4
    return model


def test_fit_over_two_cards_without_peer_access_stages_every_hop_and_matches_one_card(devices, monkeypatch, rng):
    gpu0, gpu1 = [d for d in devices(cpus=1, gpus=2) if d.device_type == "GPU"]
    x = rng.standard_normal((27, 7)).astype(np.float32)
    y = rng.integers(0, 3, 27)
    init = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((7, 5), (5,), (5, 3), (3,))]
    one_card = _fit(tf.distribute.MirroredStrategy([gpu0.name, gpu1.name]), x, y, init)

    monkeypatch.setattr(gpu1, "gpu_id", 1)                    # now "card 1"
    monkeypatch.setattr(gpu1, "activate", gpu0.activate)      # the simulator's one card
    asked, copies = [], []
    monkeypatch.setattr(registry, "enable_peer_access",
                        lambda reader, owner: asked.append((reader, owner)) or False)

    def memcpy_peer(dst_dev, dst, src_dev, src, nbytes):
        copies.append((src_dev.gpu_id, dst_dev.gpu_id))
        dst.reshape(dst.size).copy_to_device(src.reshape(src.size))

    monkeypatch.setattr(registry, "_memcpy_peer", memcpy_peer)
    two_cards = _fit(tf.distribute.MirroredStrategy([gpu0.name, gpu1.name]), x, y, init)

    assert set(asked) == {(0, 1), (1, 0)}, f"the ring must ask for peer access both ways: {asked}"
    assert {(0, 1), (1, 0)} <= set(copies), f"every ring hop crosses the cards by a copy: {copies}"
    for w_one, w_two in zip(one_card.get_weights(), two_cards.get_weights()):
        np.testing.assert_array_equal(w_two, w_one)            # same sums, same order, same bits
    for v in two_cards.trainable_variables:
        a, b = (c.numpy() for c in v.values)
        np.testing.assert_array_equal(a, b)                    # the two cards' copies agree
