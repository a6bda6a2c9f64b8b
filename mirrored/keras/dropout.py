"""Keras's ``Dropout`` layer: inverted dropout with a counter-based mask, reproducible and
the same bits on every device.

Neighbours: ``layers.py`` (the layer protocol and the course lab's layers),
``kernels/dropout.py`` (the mask's generator and kernels, with their NumPy references),
``base_layer.py`` (``Layer``), ``saving.py`` (``training_state``: the counters a .keras
archive keeps).
"""
import numpy as np

from kernels import dropout as dropout_kernels           # the mask's key and the rate's check
from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored import random as _random
from mirrored.program import recording
from mirrored.keras.base_layer import Layer

FLOAT = np.dtype(np.float32)


class Dropout(Layer):
    """Keras's inverted dropout: in training each unit is kept with probability 1 - rate and
    scaled by 1 / (1 - rate); in evaluate and predict the layer is the identity (no launch).

    The mask comes from kernels/dropout.py's counter-based generator: unit i of a replica's
    (b, ...) batch is kept or not by a hash of (key, i), with

        key = dropout_key(seed, step, replica)

    so the mask is reproducible (the seed is ``seed``, or drawn from ``mirrored.random``
    when the layer is built, so ``mirrored.random.set_seed`` repeats a run), different on
    every replica and step (each replica drops different units of its own slice, as in
    TensorFlow), and the same bits on the CPU (``dropout_ref``) and the GPU. ``step``
    counts this replica's training forwards.

    The counter lives on the replica's device (a (3,) uint64 array: seed, step, key; made
    on first use), not in Python: a training forward launches ``dropout_next_key`` (one
    thread writes this step's key and counts the step) and then the mask kernel, which
    reads the key there. Neither launch takes anything from the host that changes from
    step to step, so a CUDA graph of the step (``compile(run_eagerly=False)``,
    ``mirrored/program/capture.py``) draws a new mask at every replay, the eager masks bit for bit.
    Backward applies the same mask to dy (the key is still there), in place:
    dx = dy * scale where kept.

    Because N replicas drop different units, a model with dropout does NOT train like one
    replica on the global batch (the other layers still do, given the same masks).

    ``model.save("m.keras")`` keeps the seed in use and every replica's step count
    (``training_state``, read from the devices) and ``load_model`` restores them, so
    training resumes with the masks an uninterrupted run would draw. Keras 3 keeps its
    Dropout's SeedGenerator state in neither file (a loaded model restarts its counter at
    0); ``save_weights`` / ``load_weights`` leave this state alone, as Keras's do.
    """

    def __init__(self, rate, noise_shape=None, seed=None, input_shape=None, name=None, **kwargs):
        super().__init__(input_shape=input_shape, name=name, **kwargs)
        self.rate = dropout_kernels.check_rate(rate, f"Dropout {self.name!r}")
        if noise_shape is not None:
            raise NotImplementedError(f"Dropout {self.name!r}: noise_shape is not supported; every "
                                      f"unit gets its own draw (noise_shape=None).")
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
                                 or seed < 0):
            raise ValueError(f"Dropout {self.name!r}: seed must be a non-negative integer or None, "
                             f"got {seed!r}.")
        self.seed = seed
        self._seed = None            # the seed in use, fixed when the layer is built
        self._counters = {}          # replica id -> (device, its (3,) uint64 counter there)
        self._start = {}             # replica id -> the step its counter starts at (a restore)

    def get_config(self):
        return dict(self.base_config(), rate=self.rate, seed=self.seed, noise_shape=None)

    def build(self, input_shape):
        super().build(input_shape)
        self._seed = int(self.seed) if self.seed is not None else int(_random.generator().integers(2**63))

    @property
    def _steps(self):
        """{replica id: training forwards so far}, read from the devices."""
        steps = dict(self._start)
        for r, (dev, counter) in self._counters.items():
            steps[r] = int(dev.to_numpy(counter)[dropout_kernels.STEP])
        return steps

    def training_state(self):
        counts = self._steps
        steps = np.zeros(max(counts, default=0) + 1, np.int64)    # (replicas,): forwards so far
        for r, n in counts.items():
            steps[r] = n
        return {"seed": np.uint64(self._seed % 2**64), "steps": steps}    # dropout_key takes mod 2^64

    def set_training_state(self, state, what):
        seed, steps = state.get("seed"), state.get("steps")
        if (set(state) != {"seed", "steps"} or np.ndim(seed) != 0 or np.ndim(steps) != 1
                or not np.issubdtype(np.asarray(seed).dtype, np.integer)
                or not np.issubdtype(np.asarray(steps).dtype, np.integer) or np.any(np.asarray(steps) < 0)):
            raise ValueError(f"{what}: the state of Dropout {self.name!r} is damaged: expected an "
                             f"integer seed and a vector of step counts >= 0, got {state!r}. Read the "
                             f"weights alone with model.load_weights (the masks then start afresh).")
        self._seed = int(seed)
        self._start = {r: int(n) for r, n in enumerate(steps)}
        for r, (dev, counter) in self._counters.items():          # in place: a graph reads them
            dev.upload_into(counter, dropout_kernels.counter_init(self._seed, self._start.pop(r, 0)))

    def _counter(self, state):
        """This replica's counter on its device, made on first use."""
        r = state.replica_id
        if r not in self._counters:
            host = dropout_kernels.counter_init(self._seed, self._start.pop(r, 0))   # (3,) uint64
            with recording.initialization():            # a @function's replay never resets it
                self._counters[r] = (state.dev, state.dev.from_numpy(host))
        return self._counters[r][1]

    def make_buffers(self, state, b):
        self._counter(state)                                          # before any step computes
        return state.dev.empty((b,) + self.input_shape, FLOAT)       # y: (b,) + input shape

    def forward(self, state, x, training=False):
        if not training or self.rate == 0.0:
            return x                                                  # identity: nothing launched
        b = x.shape[0]
        counter = self._counter(state)
        # the key names the replica among ALL replicas (every worker's), so no two draw one mask
        state.ops.dropout_next_key(counter, state.global_replica_id)  # this step's key, step += 1
        y = state.buffers(b)
        x = view(x, (b,) + self.input_shape)
        state.ops.dropout_keyed(x, y, self.rate, counter)             # y: (b,) + input shape
        return y

    def backward(self, state, dy):
        if not state.need_dx:
            return None
        if self.rate != 0.0:
            state.ops.dropout_keyed(dy, dy, self.rate, self._counter(state))  # dx = dy * mask * scale
        return dy
