"""One training step of ``fit``, in one place: split, forward/backward, all-reduce, update.

With N replicas and a global batch of B examples, ``Step.train`` reads as the
four steps of the README, each a visible call::

    1. split              replica r gets rows [r*k, (r+1)*k), k = ceil(B/N) (TensorFlow's
                          rule; a replica may get none), copied into its device's input
                          buffers (made once per batch size, reused every step)
    2. forward_backward   on every replica: its layers forward, the loss scaled by 1/B
                          (the GLOBAL batch), its layers backward into its packed
                          gradient buffer                              (engine.ReplicaProgram)
    3. all_reduce         SUM of the N packed gradient buffers: one ring over one buffer
                                                                       (engine.all_reduce)
    4. update             the same optimizer kernel on every copy of the weights, so the
                          copies stay bitwise equal                    (optimizers.update)

A step is a *host part* (1, every buffer the step needs, and the optimizer's per-step
scalars: one copy per device) and a *device part* (2-4: kernel launches; the update count).
A step that raises leaves no trace (``rolled_back_on_error``: the step count and the memory as before).
Nothing here times or captures: ``mirrored.lab.timing.TimedStep`` times each phase, and
``mirrored.program.passes.CapturedStep`` records the device part and replays it; both wrap
this step from outside and launch exactly the same kernels.

A custom training loop runs this same step: ``model(x, training=True)`` and ``tape.gradient``
run step 2 on the replica's ``ReplicaProgram`` (the methods ``forward_backward`` calls), and
``optimizer.apply_gradients`` calls ``Step.apply_gradients``: the optimizer's scalars, then
``reduce_and_update`` (steps 3-4), inside ``rolled_back_on_error``: fit's weights, bit for bit
(``tests/test_one_step.py``). Only who drives the replicas differs: one host thread here
(``copy_in``), a thread per replica under ``strategy.run``, meeting at ``apply_gradients``'s
merge point, where the last to arrive runs steps 3-4 once.

Neighbours: ``engine.py`` (what a replica runs), ``optimizers.py`` (the update),
``data_adapters.py`` (where batches come from), ``trainer.py`` (``fit`` calls ``train``).
"""
import contextlib

import numpy as np

from mirrored.input_lib import local_bounds, rebatch_bounds
from mirrored.keras.data_adapters import ResidentBatch
from mirrored.keras import custom_loop, sample_weights
from mirrored.keras.engine import ParameterPack, ReplicaProgram, all_reduce
from mirrored.keras.inference import InferencePasses
from mirrored.keras.losses import kernel_mode

#: The phases of one training step, in the order they happen (``mirrored.lab.timing``
#: records them, ``mirrored.lab.viz`` colours them).
INPUT_COPY = "input copy"              # host slice (or row numbers) -> the replica's device
FORWARD_BACKWARD = "forward+backward"  # the layers, the loss, the gradients
ALL_REDUCE = "all-reduce"              # SUM of the replicas' packed gradients (the ring)
OPTIMIZER = "optimizer"                # one update launch per device
STEP_PHASES = (INPUT_COPY, FORWARD_BACKWARD, ALL_REDUCE, OPTIMIZER)

class Step(InferencePasses):
    """A built model's training step (evaluate's and predict's passes over the same programs
    are its base class's, ``inference.py``).

    Holds the packed parameters (``pack``), one ``ReplicaProgram`` per replica
    (``programs``) and the strategy's cross-device ops. Reads the model's
    ``optimizer`` and ``loss`` when it runs, so ``compile`` may change them.
    """

    def __init__(self, model, devices, cross_device_ops):
        self.model = model
        self.pack = ParameterPack(model.trainable_variables, devices, model.non_trainable_variables)
        custom_loop.register(self.pack, self)                          # for apply_gradients
        self.devices = self.pack.devices
        self.in_dim = int(np.prod(model.input_shape[1:], dtype=np.int64))   # inputs are (b, in_dim)
        offset = model.distribute_strategy.extended.replica_offset      # 0 on one machine
        replicas = model.distribute_strategy.num_replicas_in_sync
        self.programs = [ReplicaProgram(model.nodes, self.pack, r, self.in_dim, offset, replicas)
                         for r in range(len(self.devices))]
        self.cross_device_ops = cross_device_ops
        # (batch size, shard) -> this worker's replicas' [(start, stop)]: the rule's answer
        # depends on the batch size alone once the strategy is fixed, so it is asked once
        self.bounds = {}
        self.mode_of = None                # (loss object, its kernel mode): see loss_mode
        self.resident_loader = None        # data_adapters.ResidentLoader of the last resident data set

    # -- the training step -------------------------------------------------------------
    def train(self, batch):
        """One training step on one global batch: ``(x (B, in) float32, y (B,))`` host
        arrays (``data_adapters.host_batch``) or a ``ResidentBatch``."""
        inputs, scale = self.host_part(batch)
        self.device_part(inputs, self.loss_mode(), scale)

    def host_part(self, batch):
        """Step 1, and the optimizer's scalars for this step onto every device.

        Every buffer the step needs is made here, on every replica, before the optimizer
        counts the step and before any replica computes: a batch too large for a
        device's ``memory_limit`` fails here, with nothing changed (``rolled_back_on_error``)."""
        parts, load, scale = self.split(batch)                 # 1. N shares of the global batch,
        scalars = self.model.optimizer.step_scalars()          #    and the update's scalars (Adam's
        loaded = self.copy_in(parts, load, scalars)            #    alpha): ONE copy onto each device
        for program, (x, _, _) in zip(self.programs, loaded):
            with program.dev.activate():
                program.reserve(x.shape[0])                    #    its layers' and loss's buffers
        sent = {p.dev.name: h for p, (_, _, h) in zip(self.programs, loaded)}
        self.model.optimizer.begin_step(self.devices, sent)    #    the step counted, its scalars placed
        return [(x, y) for x, y, _ in loaded], scale

    def device_part(self, inputs, mode, scale):
        """Steps 2-4: kernel launches and the update count (a recorded program replays them: program/passes.py)."""
        for program, (x, y) in zip(self.programs, inputs):
            self.forward_backward(program, x, y, mode, scale)  # 2. forward, loss, backward per replica
        self.reduce_and_update(self.model.optimizer)           # 3-4. below

    def reduce_and_update(self, optimizer):
        """Steps 3 and 4, for ``fit`` and for a custom loop's ``apply_gradients`` alike."""
        self.all_reduce()                                      # 3. SUM of the packed gradients
        self.update(optimizer)                                 # 4. the same update on every copy

    def apply_gradients(self, optimizer):
        """A custom training loop's ``optimizer.apply_gradients``, once every replica's
        ``tape.gradient`` has written its packed gradient buffer (step 2): this step's scalars,
        then steps 3-4, exactly as ``fit`` makes them. A failure leaves no trace (``rolled_back_on_error``)."""
        with self.rolled_back_on_error(optimizer):
            optimizer.begin_step(self.devices)
            self.reduce_and_update(optimizer)

    @contextlib.contextmanager
    def rolled_back_on_error(self, optimizer=None):
        """A step that raises inside this block leaves no trace: the optimizer's step count goes
        back, and every buffer made during the block is dropped again (the replicas' input, layer
        and loss buffers, the optimizer's new slots, the devices' scratch, the ring's staging
        buffers among them): each device's memory accounting is as before.

        The weights and the optimizer's slots cannot have changed by then: every buffer
        is made before the first update launch (``host_part``, ``Optimizer.update``), and
        the update is the step's last phase, on every copy or none (a Ctrl-C raised once it
        is done undoes nothing: ``update_buffers``). Not undone: the epoch's running metrics.

        ``optimizer``: the one the step updates with (default: the model's). A model that
        was never compiled has no optimizer: ``predict`` and ``model(x)`` run on it (as in
        Keras), and only the buffers are put back.
        """
        opt = optimizer if optimizer is not None else self.model.optimizer
        step_count, updates = (opt.step_count, opt.updates_done) if opt is not None else (None, None)
        caches = self._caches(opt)
        sizes = [len(c) for c in caches]                       # caches only grow: new keys come last
        try:
            yield
        except BaseException:
            if opt is not None and opt.updates_done != updates:
                raise                                          # the update is done: so is the step
            if opt is not None:
                opt.step_count = step_count
            for cache, n in zip(caches, sizes):
                for key in list(cache)[n:]:
                    del cache[key]
            for program in self.programs:                      # they point at the dropped buffers
                program.x = program.logits = None
                program.last_b = 0
            raise

    def _caches(self, opt):
        """Every dict of buffers made on first use that a step can add to (each owner's
        ``caches()``: a device's is its scratch buffers, the ring's staging among them)."""
        caches = opt.caches() if opt is not None else []
        for program in self.programs:
            caches += program.caches()
        for dev in self.devices:
            caches += dev.caches()
        if self.resident_loader is not None:
            caches += self.resident_loader.caches()
        return caches

    # -- the four steps ------------------------------------------------------------------
    def split(self, batch, shard=True):
        """Each replica's share of a global batch by TensorFlow's rebatching rule, how to put a
        share on its device (``load(program, share, scalars=None) -> (x_dev, y_dev, the scalars'
        buffer or None)``), and the loss scale 1/B (B: the GLOBAL batch).

        Across workers (``shard``) the batch is cut for every worker's replicas and this worker
        keeps its own replicas' shares (``input_lib.local_bounds``); ``shard=False`` cuts it over
        this worker's replicas only (``predict``, where every worker computes every row)."""
        if isinstance(batch, ResidentBatch):
            idx = batch.idx                                            # (B,) row numbers
            bounds = self._bounds(len(idx), shard)
            return [idx[lo:hi] for lo, hi in bounds], batch.loader(self.model).load, 1.0 / max(len(idx), 1)
        bounds = self._bounds(len(batch[0]), shard)    # x (B, in) float32, y (B,) labels[, w (B,) weights]
        return [tuple(a[lo:hi] for a in batch) for lo, hi in bounds], _upload, 1.0 / max(len(batch[0]), 1)

    def _bounds(self, batch_size, shard):
        bounds = self.bounds.get((batch_size, shard))
        if bounds is None:
            bounds = (local_bounds(batch_size, self.model.distribute_strategy.extended) if shard
                      else rebatch_bounds(batch_size, len(self.programs)))
            self.bounds[(batch_size, shard)] = bounds
        return bounds

    def copy_in(self, parts, load, scalars=None):
        """Replica r puts ``parts[r]`` on its device: (b, in) float32 and (b,) labels in
        buffers made once per batch size and reused every step, ``scalars`` (the
        optimizer's) in the same copy: [(x, y, the scalars' buffer or None)].

        One thread drives every replica in turn, here and in every phase of a step: on a
        GPU each call only queues work on the device's stream, so the devices still work
        at once; logical CPU devices share the cores, and BLAS spreads each product over
        them. TensorFlow's traced ``fit`` step is the same: one graph, no replica threads.
        A thread per replica (``strategy.run``) would only add hand-offs to a step of a few
        hundred microseconds of Python holding the GIL (the README's benchmark notes)."""
        return [self.load_share(program, part, load, scalars) for program, part in zip(self.programs, parts)]

    def load_share(self, program, part, load, scalars=None):
        with program.dev.activate():
            return load(program, part, scalars)

    def forward_backward(self, program, x, y, mode, scale):
        with program.dev.activate():
            program.forward_backward(x, y, mode, scale)

    def all_reduce(self):
        all_reduce(self.pack, self.cross_device_ops)

    def update(self, optimizer):
        optimizer.update(self.pack)

    def loss_mode(self):
        """Which fused loss kernel the model's output takes (``losses.kernel_mode``), worked
        out once per loss object (``compile`` sets a new one, and asks at once)."""
        loss = self.model.loss
        if self.mode_of is None or self.mode_of[0] is not loss:
            self.mode_of = (loss, kernel_mode(loss, self.programs[0].softmax_output))
        return self.mode_of[1]

    # -- metrics, kept on the devices ------------------------------------------------------------
    def zero_metrics(self):
        for program in self.programs:
            with program.dev.activate():
                program.zero_metrics()

    def logs(self, metric_names, prefix="", across_workers=True):
        """Keras's logs from the devices' sums: the one host read of an epoch's metrics.
        ``across_workers``: summed over every worker (a collective: every worker must
        ask), else this worker's replicas only (a progress update mid-epoch)."""
        sums = np.sum([program.read_metrics() for program in self.programs], axis=0)
        ext = self.model.distribute_strategy.extended
        if across_workers and ext.num_workers > 1:
            sums = ext.sum_across_workers(list(sums), "the epoch's metrics")
        loss, correct, seen, weights = (float(v) for v in sums)       # weights: 0 unless sample-weighted
        logs = {prefix + "loss": loss / seen if seen else float("nan")}
        for name in metric_names:                                      # Keras's weighted mean if weighted
            logs[prefix + name] = correct / (weights or seen) if seen else float("nan")
        return logs

    def examples_seen(self):
        """Examples counted on the devices since the metrics were zeroed."""
        return sum(program.read_metrics()[2] for program in self.programs)


def check_compiled(model, what):
    """Refuse to run ``what`` on a model with no optimizer or loss yet, saying what to do."""
    if model.optimizer is None or model.loss is None:
        raise RuntimeError(f"You must compile your model before {what}: call "
                           f"model.compile(optimizer=..., loss=..., metrics=['accuracy']).")


def _upload(program, part, scalars=None):
    """A host share ``(x (b, in) float32, y (b,))`` into the program's (reused) input buffers,
    ``scalars`` with them (one copy on a GPU, ``devices.py``): (x_dev, y_dev, scalars' or None)."""
    if len(part) == 3:                                                 # (x, y, sample weights)
        return sample_weights.upload(program, part, scalars)
    x, y = part
    bufs = program.input_buffers(len(x), y.dtype, y.shape[1:], scalars)
    if len(x):
        program.dev.upload_parts(bufs, (x, y, scalars)[:len(bufs)])
    return (bufs + (None,))[:3]
