"""fit's, evaluate's and predict's passes as recorded programs (``recording.record``).

A pass is a *host part* (a batch split onto the replicas' input buffers, the optimizer's
scalars for this step: eager) and a *device part* (forward, loss, backward, all-reduce,
update: launches, and one host entry, the update count). ``CapturedStep`` runs a model's
passes (``train``, ``evaluate``, ``predict``) as the step's own methods of those names do,
but each device part is a program keyed by the pass, the loss mode and the replicas' input
buffers (so the batch size), as Keras keys the ``tf.function`` it wraps ``train_step`` in,
and as ``@function`` keys its traces: the first run of a key is eager and recorded, later
runs replay the recording (on a GPU: captured as CUDA graphs at the first replay, replayed
as graphs after, ``capture.StepGraphs``). The update count is an entry of the program (a
``HostCall`` of ``Optimizer.count_update``): a replay counts, as the eager run did.

The step itself knows nothing of programs: it fulfils ``StepPasses``, the contract written
here, and this file calls nothing else of it (``tests/test_layering.py``).

``compile(steps_per_execution=N)`` (Keras's knob for the launch overhead): ``train_steps``
and ``evaluate_steps`` run N steps as ONE program over N input slots. Each step's host part
writes the same input buffers, so what it wrote is copied on the device into a staging slot
of its own (``_stage``); the program is, for each step i, the copies back from slot i and
then step i's own recorded program (``_run_steps``): put together from the recordings, no
Python run again.

Planned ahead. Before a key's first (eager) run on a GPU, ``_run`` runs the device part
once as a dry recording, its launches written down and none made, its host calls (the
update count) not run (``recording.dry_run``; ``rolled_back_on_error`` drops the buffers it
made), and compiles the kernels it named in several processes at once
(``kernels/compile_ahead.py``, ``_compile_ahead``): a first run on a machine compiles them
at their launch otherwise, one after the other.

When. ``compile(run_eagerly=False)``, Keras's default, runs fit, evaluate and predict
through ``CapturedStep`` on every kind of device (where nothing can be captured, CPU
devices and the simulator, its programs replay as lists); ``run_eagerly=True`` runs the
step's Python, launching every kernel from it (what labs 04 and 05 step through). The
default stays silent where nothing can be captured (it is the default); the old
``compile(cuda_graph=True)``, an explicit request for graphs, warns there once. The
weights come out bitwise the same either way.

Neighbours: ``recording.py`` (``record``: a key's first run, recorded),
``replay.py`` (a program's entries), ``capture.py`` (the graphs), ``keras/step.py`` and
``keras/inference.py`` (the step; ``StepPasses`` is its contract here), ``keras/trainer.py``
(``captured_step``), ``keras/model_api.py`` (``compile``); the package docstring tells the story.
"""
from mirrored import devices as _dev
from mirrored.program import capture, recording, replay


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


class CapturedStep:
    """A model's passes (a ``StepPasses``) with their device parts run as recorded programs.

    ``train(batch)``, ``evaluate(batch, mode)`` and ``predict(xb)`` do what ``Step``'s
    methods of those names do (the same host part, the same launches), but each device
    part is recorded once per key (the pass, the replicas' input buffers, so the batch
    shape) and replayed after (``_run``: the first-run rule).
    """

    def __init__(self, step, graphs):
        if not isinstance(graphs, capture.StepGraphs):
            raise TypeError(f"CapturedStep runs device parts through a capture.StepGraphs, "
                            f"got {type(graphs).__name__}.")
        if not isinstance(step, StepPasses):
            raise TypeError(f"CapturedStep runs a StepPasses (program/passes.py's contract), "
                            f"got {type(step).__name__}.")
        self.step, self.graphs = step, graphs
        self.known = {}            # key -> (its Program, or None: eager every time; its first result)
        self.compile_ahead = _compile_ahead(step.devices)      # None: kernels are not compiled ahead here
        self.executions = {}       # an execution's shape -> its N-step programs by key (first run done)

    def forget(self):
        """Drop every program (and its graphs): a buffer they read is going (a data set kept
        on the devices leaves them, with the buffer its row numbers and scalars went up in)."""
        self.known.clear()
        self.executions.clear()
        self.graphs.close()

    def train(self, batch):
        # The first device's context made current once for the whole step: the uploads,
        # buffers and launch inside find it current (devices.py, ``_Activation``).
        with self.step.devices[0].activate():
            inputs, scale = self.step.host_part(batch)
            mode = self.step.loss_mode()
            self._run(self._key(("train", mode, scale), inputs, True), self.step.device_part, inputs, mode, scale)

    def evaluate(self, batch, mode):
        inputs = self.step.inputs(batch)
        self._run(self._key(("evaluate", mode), inputs, False), self.step.evaluate_part, inputs, mode)

    def predict(self, xb):
        inputs = self.step.predict_inputs(xb)
        outs = self._run(self._key(("predict",), inputs, False), self.step.predict_part, inputs)
        return self.step.read_outputs(outs)

    def _key(self, kind, inputs, training):
        """A device part's key: ``kind`` (the pass, the loss mode) and the addresses of every
        buffer its host part wrote for it (``StepPasses.written``: the replicas' inputs, so
        the batch size, and a training step's optimizer scalars, which go up with a copied
        batch and with a resident batch's row numbers into different buffers)."""
        return kind + tuple(_address(buf) for _, buf in self.step.written(inputs, training))

    def _run(self, key, fn, *args):
        """The device part ``fn(*args)`` under ``key``: the one first-run rule, as a
        ``@function``'s. The first time, it runs eagerly and is recorded (it compiles the
        kernels, planned and compiled ahead before, and makes every buffer); after, its
        recording is replayed (``replay.Program``: on a GPU captured as CUDA graphs at its
        first replay) and the first run's result returned (the same buffers, rewritten). A
        first run that raised keeps nothing: the next is a first run again. One that could
        not be recorded (a host read) runs eagerly every time. A run updates every copy or
        none (a Ctrl-C comes after it)."""
        known = self.known.get(key)
        if known is None and recording.active() is not None:
            return fn(*args)                   # inside a @function's trace: its launches are the trace's
        if known is None and self.compile_ahead is not None:        # planned: a dry run, then
            self.compile_ahead.before_first_run(                       # the kernels it names compiled
                lambda: recording.dry_run(fn, args, self.step.rolled_back_on_error), self.step.devices[0].gpu_id)
        with _dev.every_device_or_none():
            if known is None:
                result, program = recording.record(lambda: fn(*args), self.graphs if self.graphs.enabled else None, key)
                self.known[key] = (program, result)
                self.graphs.ran_eagerly()
                return result
            program, result = known
            if program is None:
                return fn(*args)
            with self.step.devices[0].activate():      # the card's context, for the launches
                program.run()
            return result

    # -- compile(steps_per_execution=N): N steps, one program ------------------------------------
    def train_steps(self, batches):
        """Keras's ``steps_per_execution``: the training steps of ``batches`` (two or more,
        from ``data_adapters.prepare``) run as ONE program.

        A program is bound to its buffers, and every step's host part writes the same ones:
        the replicas' input buffers of that batch size, and the optimizer's hyper-parameter
        vector on each device (``Optimizer.hyper``, Adam's alpha). So each host part i is
        followed by a copy, on the devices, of what it wrote into staging slot i
        (``_stage``), and the program holds, for each step i, the copy back from slot i and
        then step i's recorded device part (``_run_steps``). One replay runs the N steps in
        the order N single steps run them, each on its own batch and scalars: bitwise the
        same weights and slots. (The copies are device to device, queued on each device's
        stream: the next host part's upload waits for them.)

        The first execution of these batch sizes runs as N single steps, each all or nothing
        (they record each step's program, compile the kernels and make every buffer; one
        that raised midway did not, and runs so again); later ones run the N-step program
        (on a GPU: captured at its first run, replayed after). Such an execution is all or
        nothing: the N host parts run first, inside one ``Step.rolled_back_on_error``, so a
        failure there (out of memory) leaves the step count and the memory as before the
        execution, nothing having run on the devices; then one program updates every copy
        N times.
        """
        step = self.step
        mode = step.loss_mode()
        execution = ("train", mode) + tuple(step.rows(b) for b in batches)
        if execution not in self.executions:
            for batch in batches:                            # N plain steps, each all or nothing
                with step.rolled_back_on_error():
                    self.train(batch)
            self.executions[execution] = {}                  # all N done: one program from now on
            return
        with step.rolled_back_on_error():
            work = []
            for slot, batch in enumerate(batches):
                inputs, scale = step.host_part(batch)
                work.append((self._key(("train", mode, scale), inputs, True), (inputs, mode, scale),
                             _stage(slot, step.written(inputs, training=True))))
            with _dev.every_device_or_none():                # N updates of every copy, or none
                self._run_steps(self.executions[execution], "train steps", mode, step.device_part, work)

    def evaluate_steps(self, batches, mode):
        """``evaluate``'s passes of ``batches`` as one program, as ``train_steps`` does for
        training (the inputs are all a host part writes here; the metrics add up on the devices)."""
        step = self.step
        execution = ("evaluate", mode) + tuple(step.rows(b) for b in batches)
        if execution not in self.executions:
            for batch in batches:
                self.evaluate(batch, mode)
            self.executions[execution] = {}
            return
        work = []
        for slot, batch in enumerate(batches):
            inputs = step.inputs(batch)
            work.append((self._key(("evaluate", mode), inputs, False), (inputs, mode),
                         _stage(slot, step.written(inputs, training=False))))
        self._run_steps(self.executions[execution], "evaluate steps", mode, step.evaluate_part, work)

    def _run_steps(self, made, kind, mode, fn, work):
        """``work``'s N steps (``(a step's key, its device part's arguments, its staged
        inputs)``) as one program, kept in ``made`` by the staged buffers' addresses: for each
        step, the copies back from its staging slot (``Launch``es of ``copy_into``), then
        the entries of its own recorded program. A step with no recorded program (its run
        could not be recorded) makes the N steps run one by one: restore, then its device part."""
        key = (kind, mode) + tuple(single[2:] + _staged_addresses(staged) for single, _, staged in work)
        program = made.get(key)
        if program is None:
            singles = [self.known.get(single, (None,))[0] for single, _, _ in work]
            if any(p is None for p in singles):
                for (single, args, staged) in work:
                    _restore(staged)
                    self._run(single, fn, *args)
                return
            entries = [entry for (_, _, staged), single in zip(work, singles)
                       for entry in [replay.Launch(dev, "copy_into", (buf, copy), {})
                                     for dev, buf, copy in staged] + single.entries]
            program = made[key] = replay.Program(entries, self.graphs, key)
        with self.step.devices[0].activate():
            program.run()


def _compile_ahead(devices):
    """``kernels.compile_ahead`` where a step's first run compiles kernels (real GPUs: that
    module's docstring; ``CapturedStep`` runs where graphs can be captured, so one worker),
    else None."""
    if any(d.device_type != "GPU" for d in devices) or _dev.cuda_mode() != "real":
        return None
    from kernels import compile_ahead
    return compile_ahead if compile_ahead.wanted() else None


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
    """Each staged copy back into the buffer the device part reads (``_run_steps``, step by step)."""
    for dev, buf, copy in staged:
        with dev.activate():
            dev.copy_into(buf, copy)


def _staged_addresses(staged):
    return tuple((_address(buf), _address(copy)) for _, buf, copy in staged)


def _address(buf):
    """Where a device buffer's data starts (what a captured graph reads)."""
    cai = getattr(buf, "__cuda_array_interface__", None)
    return cai["data"][0] if cai is not None else id(buf)


