"""What writing TensorFlow yourself costs: a custom loss and a custom layer beside the built-ins.

    python -m benchmarks.composed                         # CPU (or the GPU if there is one)
    python -m benchmarks.composed --smoke --out /tmp/c.json   # tiny; the test suite runs this

Issue 48's speed rows, timed in one run, interleaved (every row's epoch 1, then every row's
epoch 2, ..., each round in a new random order, so a slow spell on a shared machine hits
all rows alike), each row the median of its epochs, from the same initial weights:

    convnet mse      the course lab's ConvNet, fit with the built-in "mse" (one-hot targets)
    convnet huber    the same model with the course's custom Huber loss written in ops
                     (``tf.where(tf.abs(err) <= 1, tf.square(err) / 2, tf.abs(err) - 0.5)``):
                     goal <= 1.3x the "mse" row
    dense builtin    Flatten -> Dense(64, relu) -> Dense(10), sparse cross-entropy
    dense custom     the same with keras.io's SimpleDense (add_weight + tf.matmul + relu)
                     in place of Dense(64): goal <= 1.5x the built-in row

The ratios are printed and written (JSON, ``--out``) with the machine and versions.
``benchmarks.training`` times the library against PyTorch and TensorFlow; this program
times the library against itself.
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from benchmarks.training import initial_weights, keras_layers, load_mnist

#: Goals from issue 48: (slower row, faster row, the most the ratio may be).
GOALS = (("convnet huber", "convnet mse", 1.3), ("dense custom", "dense builtin", 1.5))
CONVNET = {"convs": [[32, 3]], "units": [64, 10]}
DENSE = {"units": [64, 10]}


def huber(tf):
    def my_huber(y_true, y_pred):
        error = y_true - y_pred
        small = tf.abs(error) <= 1
        return tf.where(small, tf.square(error) / 2, tf.abs(error) - 0.5)
    return my_huber


def simple_dense(tf):
    class SimpleDense(tf.keras.layers.Layer):
        """keras.io's SimpleDense, with relu."""

        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units

        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal")
            self.b = self.add_weight(shape=(self.units,), initializer="zeros")

        def call(self, inputs):
            return tf.nn.relu(tf.matmul(inputs, self.w) + self.b)
    return SimpleDense


class Row:
    """One configuration: a compiled model and its data; ``epoch()`` times one epoch."""

    def __init__(self, tf, label, layers, loss, x, y, weights, batch):
        self.label, self.batch = label, batch
        self.model = tf.keras.Sequential(layers)
        self.model.compile(loss=loss, optimizer=tf.keras.optimizers.Adam(), run_eagerly=False)
        self.model.build((None,) + x.shape[1:])
        self.model.set_weights(weights)
        self.x, self.y = x, y
        self.times = []

    def epoch(self):
        start = time.perf_counter()
        history = self.model.fit(self.x, self.y, batch_size=self.batch, epochs=1, verbose=0, shuffle=False)
        self.times.append(time.perf_counter() - start)
        return history.history["loss"][-1]

    def ms_per_step(self):
        steps = -(-len(self.x) // self.batch)
        return 1000.0 * float(np.median(self.times)) / steps


def make_rows(tf, x, y, batch):
    onehot = np.eye(10, dtype=np.float32)[y]
    conv_w = initial_weights(CONVNET)
    dense_w = initial_weights(DENSE)
    sparse = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    custom = simple_dense(tf)
    dense_custom = [tf.keras.layers.Flatten(input_shape=x.shape[1:]), custom(64), tf.keras.layers.Dense(10)]
    return [
        Row(tf, "convnet mse", keras_layers(tf, CONVNET), "mse", x, onehot, conv_w, batch),
        Row(tf, "convnet huber", keras_layers(tf, CONVNET), huber(tf), x, onehot, conv_w, batch),
        Row(tf, "dense builtin", keras_layers(tf, DENSE), sparse, x, y, dense_w, batch),
        Row(tf, "dense custom", dense_custom, sparse, x, y, dense_w, batch),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny: 256 images, 2 rounds")
    parser.add_argument("--rounds", type=int, default=7, help="timed epochs per row (interleaved)")
    parser.add_argument("--limit", type=int, default=4096, help="training images used")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.limit, args.rounds = 256, 2
    import mirrored as tf
    x, y, source = load_mnist(args.limit)
    rows = make_rows(tf, x, y, args.batch)
    for row in rows:                                   # warm-up: compile, build buffers
        row.epoch()
        row.times.clear()
    order = np.random.default_rng(0)
    losses = {}
    for _ in range(args.rounds):
        for i in order.permutation(len(rows)):
            losses[rows[i].label] = rows[i].epoch()
    result = {
        "rows": {r.label: {"ms_per_step": r.ms_per_step(), "epochs_s": r.times, "final_loss": losses[r.label]}
                 for r in rows},
        "ratios": {}, "data": source, "images": len(x), "batch": args.batch, "rounds": args.rounds,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "device": tf.config.list_logical_devices()[-1].name, "numpy": np.__version__},
    }
    ms = {r.label: r.ms_per_step() for r in rows}
    for slow, fast, goal in GOALS:
        ratio = ms[slow] / ms[fast]
        result["ratios"][f"{slow} / {fast}"] = {"ratio": ratio, "goal": goal, "met": ratio <= goal}
    for r in rows:
        print(f"{r.label:15s} {ms[r.label]:8.2f} ms/step   final loss {losses[r.label]:.4f}")
    for name, info in result["ratios"].items():
        print(f"{name:32s} {info['ratio']:.2f}x (goal <= {info['goal']}x: {'met' if info['met'] else 'NOT met'})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
