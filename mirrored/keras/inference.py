"""evaluate's and predict's passes: forward (and the loss) on the training step's programs.

Each pass is a host part (the inputs onto the devices, split as the training step splits
a batch) and a device part (launches only), as the training step is, so that
``mirrored.program.passes.CapturedStep`` can record and replay the latter. ``InferencePasses`` is the base
class of ``step.Step``, whose ``programs``, ``split`` and ``copy_in`` it uses.

``InferencePasses`` subclasses ``passes.StepPasses``, the contract ``CapturedStep`` runs a
step through (``mirrored/program/passes.py`` sits below keras/ and names what it needs there); the last two
methods here fill in what the step itself does not say: the batch's rows and what a host part
wrote.

Neighbours: ``step.py`` (the training step), ``engine.py`` (``ReplicaProgram.forward``
and ``loss``), ``model_api.py`` (``evaluate`` and ``predict`` call these), ``program/passes.py``
(``StepPasses``, the contract).
"""

import numpy as np

from mirrored.program.passes import StepPasses
from mirrored.keras.data_adapters import ResidentBatch


class InferencePasses(StepPasses):
    """Forward-only passes over ``self.programs`` (one per replica): evaluate, predict; and
    the rest of ``passes.StepPasses`` (the module docstring)."""

    def evaluate(self, batch, mode):
        """Loss and accuracy of one global batch, added to the metrics on the devices."""
        self.evaluate_part(self.inputs(batch), mode)

    def inputs(self, batch, shard=True):
        """Each replica's share of ``batch`` in its device's input buffers: [(x, y)]."""
        parts, load, _ = self.split(batch, shard)
        return [(x, y) for x, y, _ in self.copy_in(parts, load)]

    def evaluate_part(self, inputs, mode):
        """Forward and the loss (no gradient) on every replica: launches only."""
        for program, (x, y) in zip(self.programs, inputs):
            with program.dev.activate():
                program.forward(x)
                program.loss(y, mode, 1.0, with_grad=False)

    def predict(self, xb):
        """xb: (B, in) float32 -> each replica's outputs on the host, in replica order."""
        return self.read_outputs(self.predict_part(self.predict_inputs(xb)))

    def predict_inputs(self, xb):
        labels = np.zeros(xb.shape[0], np.int32)                       # unused: predict has no loss
        return self.inputs((xb, labels), shard=False)

    def predict_part(self, inputs):
        """Forward on every replica: launches only; returns each replica's output buffer."""
        outs = []
        for program, (x, _) in zip(self.programs, inputs):
            with program.dev.activate():
                outs.append(program.forward(x, probabilities=True))
        return outs

    def read_outputs(self, outs):
        """Each replica's output buffer, read to the host (waits for its device)."""
        return [program.dev.to_numpy(out) for program, out in zip(self.programs, outs)]

    # -- the rest of passes.StepPasses ------------------------------------------------------------
    def rows(self, batch):
        """A prepared batch's number of examples (host arrays, or a ``ResidentBatch``'s row numbers)."""
        return len(batch.idx) if isinstance(batch, ResidentBatch) else len(batch[0])

    def written(self, inputs, training):
        """What a host part wrote that its device part reads: the replicas' input buffers and,
        for training, the optimizer's scalars on each device (``Optimizer.hyper``)."""
        written = [(p.dev, buf) for p, (x, y) in zip(self.programs, inputs)     # y: labels, or
                   for buf in (x,) + (y if isinstance(y, tuple) else (y,))]     # (labels, sample weights)
        if training:
            written += [(dev, self.model.optimizer.hyper[dev.name]) for dev in self.devices]
        return written
