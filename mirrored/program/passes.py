"""fit's, evaluate's and predict's passes, their device parts run through ``capture.py``'s graphs.

A pass is a *host part* (a batch split onto the replicas' input buffers, the optimizer's
scalars for this step: eager) and a *device part* (forward, loss, backward, all-reduce,
update: launches only, which a graph can hold). ``CapturedStep`` runs a model's passes
(``train``, ``evaluate``, ``predict``) as the step's own methods of those names do, but
each device part goes through ``capture.StepGraphs``, keyed by the pass, the loss mode and
the replicas' input buffers (so the batch size), as Keras keys the ``tf.function`` it
wraps ``train_step`` in: eager the first time a key is seen, captured the second time,
replayed after.

The step itself knows nothing of graphs: it fulfils ``StepPasses``, the contract written
here, and this file calls nothing else of it (``tests/test_layering.py``). The device
part's one host effect, the optimizer's count of updates done, is set by ``counted``
once for all, however often the device part's Python ran (once eager, once captured and
replayed, or not at all).

``compile(steps_per_execution=N)`` (Keras's knob for the launch overhead): ``train_steps``
and ``evaluate_steps`` put N steps in ONE graph, one replay per N batches. Each step's
host part writes the same input buffers, so what it wrote is copied on the device into a
staging slot of its own (``_stage``), and the graph copies slot i back before step i's
device part (``_restore``): N input slots, one program.

Planned ahead. Before a key's first (eager) run, ``StepGraphs.compile_first`` runs the
device part once as a dry recording, its launches written down and none made, its host
calls (the update count) not run (``recording.dry_run``; ``rolled_back_on_error`` drops
the buffers it made), and compiles the kernels it named in several processes at once
(``kernels/compile_ahead.py``): a first run on a machine compiles them at their launch
otherwise, one after the other.

When. ``compile(run_eagerly=False)``, Keras's default, runs fit, evaluate and predict
through ``CapturedStep`` on a GPU; ``run_eagerly=True`` launches every kernel from
Python (what labs 04 and 05 step through). The default stays silent where nothing can
be captured (it is the default); the old ``compile(cuda_graph=True)``, an explicit
request for graphs, warns there once. The weights come out bitwise the same either way.

Neighbours: ``capture.py`` (the graphs), ``keras/step.py`` and ``keras/inference.py``
(the step; ``StepPasses`` is its contract here), ``keras/trainer.py`` (``captured_step``),
``keras/model_api.py`` (``compile``); the package docstring tells the story.
"""
from mirrored import devices as _dev
from mirrored.program import capture


class StepPasses:
    """What ``CapturedStep`` asks of a model's step: the contract, written at this level.

    ``keras/step.py``'s ``Step`` fulfils it (its base class ``keras/inference.py``
    subclasses this one); this file calls nothing else of it, so it needs nothing from
    ``keras/`` (``tests/test_layering.py`` checks that it uses no name only code above it
    defines). Each pass is a *host part*, which puts a batch on the devices, and a
    *device part*, launches only, which a graph can hold.
    """

    #: the replicas' devices; the first one's stream is a capture's origin
    devices = ()

    def host_part(self, batch):
        """Training's host part: the batch split onto the replicas, the optimizer's scalars
        placed; ``(inputs, scale)`` (scale: 1/global batch)."""
        raise NotImplementedError

    def loss_mode(self):
        """Which loss kernel the device parts take (part of every key)."""
        raise NotImplementedError

    def device_part(self, inputs, mode, scale):
        """Training's device part: forward, backward, all-reduce, update."""
        raise NotImplementedError

    def inputs(self, batch):
        """evaluate's host part: the batch split onto the replicas' input buffers."""
        raise NotImplementedError

    def evaluate_part(self, inputs, mode):
        """evaluate's device part: forward and loss, added to the device metrics."""
        raise NotImplementedError

    def predict_inputs(self, xb):
        """predict's host part."""
        raise NotImplementedError

    def predict_part(self, inputs):
        """predict's device part; returns the replicas' output buffers."""
        raise NotImplementedError

    def read_outputs(self, outs):
        """The output buffers read to the host."""
        raise NotImplementedError

    def rows(self, batch):
        """A prepared batch's number of examples."""
        raise NotImplementedError

    def written(self, inputs, training):
        """``[(device, buffer)]``: what a host part wrote that its device part reads (what
        ``steps_per_execution`` stages per step)."""
        raise NotImplementedError

    def rolled_back_on_error(self):
        """Context manager: a step that raises inside it leaves nothing (the buffers it made
        dropped, the optimizer's step count put back)."""
        raise NotImplementedError

    def counted(self, steps):
        """Context manager around the device parts of ``steps`` training steps, whose Python
        ran once, twice (captured, then replayed) or not at all (replayed): when it ends,
        ``steps`` more updates are counted done, whatever ran."""
        raise NotImplementedError


class CapturedStep:
    """A model's passes (a ``StepPasses``) with their device parts run through graphs.

    ``train(batch)``, ``evaluate(batch, mode)`` and ``predict(xb)`` do what ``Step``'s
    methods of those names do — the same host part, the same launches — but each
    device part is captured once per key (the pass, the replicas' input buffers, so
    the batch shape) and replayed after.
    """

    def __init__(self, step, graphs):
        if not isinstance(graphs, capture.StepGraphs):
            raise TypeError(f"CapturedStep runs device parts through a capture.StepGraphs, "
                            f"got {type(graphs).__name__}.")
        if not isinstance(step, StepPasses):
            raise TypeError(f"CapturedStep runs a StepPasses (program/passes.py's contract), "
                            f"got {type(step).__name__}.")
        self.step, self.graphs = step, graphs

    def train(self, batch):
        # The first device's context made current once for the whole step: the uploads,
        # buffers and launch inside find it current (devices.py, ``_Activation``).
        with self.step.devices[0].activate():
            inputs, scale = self.step.host_part(batch)
            mode = self.step.loss_mode()
            key = ("train", mode, scale) + _addresses(inputs)
            self.graphs.compile_first(key, self.step.device_part, (inputs, mode, scale),
                                      self.step.rolled_back_on_error)   # a dry run: a Ctrl-C need not wait
            # a replay updates every copy: a Ctrl-C comes after it; one update counted (rolled_back_on_error)
            with _dev.every_device_or_none(), self.step.counted(1):
                self.graphs.run(key, self.step.device_part, inputs, mode, scale)

    def evaluate(self, batch, mode):
        inputs = self.step.inputs(batch)
        self._run(("evaluate", mode) + _addresses(inputs), self.step.evaluate_part, inputs, mode)

    def predict(self, xb):
        inputs = self.step.predict_inputs(xb)
        outs = self._run(("predict",) + _addresses(inputs), self.step.predict_part, inputs)
        return self.step.read_outputs(outs)

    def _run(self, key, fn, *args):
        """``StepGraphs.run``, its kernels compiled ahead the first time ``key`` is seen."""
        self.graphs.compile_first(key, fn, args, self.step.rolled_back_on_error)
        return self.graphs.run(key, fn, *args)

    # -- compile(steps_per_execution=N): N steps, one graph ------------------------------------
    def train_steps(self, batches):
        """Keras's ``steps_per_execution``: the training steps of ``batches`` (two or more,
        from ``data_adapters.prepare``) replayed as ONE graph.

        A graph is bound to its buffers, and every step's host part writes the same ones:
        the replicas' input buffers of that batch size, and the optimizer's hyper-parameter
        vector on each device (``Optimizer.hyper``, Adam's alpha). So each host part i is
        followed by a copy, on the devices, of what it wrote into staging slot i
        (``_stage``), and the graph holds, for each step i, the copy back from slot i and
        then step i's device part (``_train_parts``). One replay runs the N steps in the
        order N single steps run them, each on its own batch and scalars: bitwise the
        same weights and slots. (The copies are device to device, queued on each device's
        stream: the next host part's upload waits for them.)

        The first execution of these batch sizes runs as N single eager steps (they compile
        the kernels and make every buffer a step uses; one that raised midway did not, and
        runs so again: ``StepGraphs.warm``); the next one is captured; later
        ones are replayed. A replayed execution is all or nothing: the N host parts run
        first, inside one ``Step.rolled_back_on_error``, so a failure there (out of memory) leaves the
        step count and the memory as before the execution, nothing having run on the
        devices; then one launch updates every copy N times.
        """
        step = self.step
        mode = step.loss_mode()
        execution = ("train", mode) + tuple(step.rows(b) for b in batches)
        if not self.graphs.warm(execution):
            for batch in batches:                            # N plain steps, each all or nothing
                with step.rolled_back_on_error():
                    inputs, scale = step.host_part(batch)    # step.train, its kernels compiled ahead
                    self.graphs.compile_first(("train", mode, scale) + _addresses(inputs),
                                              step.device_part, (inputs, mode, scale), step.rolled_back_on_error)
                    step.device_part(inputs, mode, scale)
                self.graphs.ran_eagerly()
            self.graphs.ran_once(execution)                  # all N done: the next is captured
            return
        with step.rolled_back_on_error():
            work = []
            for slot, batch in enumerate(batches):
                inputs, scale = step.host_part(batch)
                work.append((inputs, scale, _stage(slot, step.written(inputs, training=True))))
            key = ("train steps", mode) + tuple((scale,) + _addresses(inputs) + _staged_addresses(staged)
                                                for inputs, scale, staged in work)
            # a replay updates every copy N times; N updates counted (rolled_back_on_error)
            with _dev.every_device_or_none(), step.counted(len(batches)):
                self.graphs.run_captured(key, self._train_parts, work, mode)

    def _train_parts(self, work, mode):
        """What the graph of ``train_steps`` holds: per step, its staged inputs and scalars
        copied back, then its device part."""
        for inputs, scale, staged in work:
            _restore(staged)
            self.step.device_part(inputs, mode, scale)

    def evaluate_steps(self, batches, mode):
        """``evaluate``'s passes of ``batches`` as one graph, as ``train_steps`` does for
        training (the inputs are all a host part writes here; the metrics add up on the devices)."""
        step = self.step
        execution = ("evaluate", mode) + tuple(step.rows(b) for b in batches)
        if not self.graphs.warm(execution):
            for batch in batches:                            # step.evaluate, compiled ahead
                inputs = step.inputs(batch)
                self.graphs.compile_first(("evaluate", mode) + _addresses(inputs),
                                          step.evaluate_part, (inputs, mode), step.rolled_back_on_error)
                step.evaluate_part(inputs, mode)
                self.graphs.ran_eagerly()
            self.graphs.ran_once(execution)
            return
        work = []
        for slot, batch in enumerate(batches):
            inputs = step.inputs(batch)
            work.append((inputs, _stage(slot, step.written(inputs, training=False))))
        key = ("evaluate steps", mode) + tuple(_addresses(inputs) + _staged_addresses(staged)
                                               for inputs, staged in work)
        self.graphs.run_captured(key, self._evaluate_parts, work, mode)

    def _evaluate_parts(self, work, mode):
        for inputs, staged in work:
            _restore(staged)
            self.step.evaluate_part(inputs, mode)


def _stage(slot, written):
    """Copy each ``(dev, buffer)`` a host part wrote into staging ``slot``'s buffer of the
    same shape on that device (``dev.scratch``: made once, dropped by ``rolled_back_on_error`` with a
    failed step); ``[(dev, buffer, its staged copy)]``. Empty buffers are left out."""
    staged = []
    for n, (dev, buf) in enumerate(written):
        if buf.size:
            with dev.activate():
                copy = dev.scratch(("steps_per_execution", slot, n), buf.shape, buf.dtype)
                dev.copy_into(copy, buf)
            staged.append((dev, buf, copy))
    return staged


def _restore(staged):
    """Inside the graph: each staged copy back into the buffer the device part reads."""
    for dev, buf, copy in staged:
        with dev.activate():
            dev.copy_into(buf, copy)


def _staged_addresses(staged):
    return tuple((_address(buf), _address(copy)) for _, buf, copy in staged)


def _addresses(inputs):
    """The replicas' input buffers (x, y) as addresses: what a captured graph reads."""
    return tuple(tuple(_address(buf) for buf in _buffers(xy)) for xy in inputs)


def _buffers(xy):
    """A replica's input buffers: (x, y), or (x, (y, sample weights)) (``keras/sample_weights.py``)."""
    x, y = xy
    return (x,) + (y if isinstance(y, tuple) else (y,))


def _address(buf):
    """Where a device buffer's data starts (what a captured graph reads)."""
    cai = getattr(buf, "__cuda_array_interface__", None)
    return cai["data"][0] if cai is not None else id(buf)


