"""The device program: what a step does on the devices, run again without its Python.

A training step is Python (the model's layers, the tape, the ring, the optimizer) that ends
in device calls: kernel launches, copies, uploads. From the second step on, the Python
decides nothing new: the same launches on the same buffers, only the batch differs. So the
compiled mode runs the Python once and keeps what it did on the devices. One story, four
verbs::

    record    recording.py   the first run, with a recorder at the device boundary
                             (``backends.BOUNDARY``, per thread): every ``dev.ops.<op>``
                             launch, copy and upload is written down as an entry with the
                             very buffers it used; host work a step must redo each time
                             (the optimizer's step count and Adam's alpha, a metric,
                             ``tf.print``, the count of updates done) is an entry too, a
                             ``HostCall``. A host read of a device value cannot be
                             replayed: the recording is refused and the caller runs
                             eagerly. What the run changed can be rolled back.
    replay    replay.py      the entries (``Launch``, ``Upload``, ``PeerCopy``, ``HostCall``:
                             each knows how to run again) and a ``Program``: the entries
                             run again, in order, on the same buffers, after the new inputs
                             are copied into the input slots the recording read. On CPU
                             devices and in the simulator this is the list itself.
    capture   capture.py     on one GPU card a run of launches between two host calls is
                             captured once as a CUDA graph, at a program's first replay
                             (its recording was the first run), and replayed with one
                             driver call after (``StepGraphs``)
    plan      recording.py   a *dry* recording (``dry_run``): the step's device part run
                             once with every kernel launch written down and none made, its
                             host calls written down and not run; from it, before a key's
                             first run on a GPU, ``kernels/compile_ahead.py`` compiles the
                             kernels it names in several processes at once

The rules, the same for every user. A key says what the launches depend on (the input
signature of a ``@function`` call; for ``fit``/``evaluate``/``predict`` the pass, the loss
mode and the input buffers, i.e. the batch size, as Keras keys its ``tf.function``-wrapped
``train_step``). The first run of a key is eager and recorded (it compiles kernels and makes
every buffer); a key whose first run completed is replayed, its launches captured at the
first replay on a GPU (``passes.CapturedStep._run``; a ``@function``'s trace the same way). A
run that raises leaves nothing: a trace puts back what it changed (``Recording.roll_back``),
a step drops what it made (``Step.rolled_back_on_error``, which is also a dry run's undo), a
replay puts back the host numbers its host entries changed (``replay.Program.run``).

Who uses it:

* ``@mirrored.function`` (``mirrored/traced_function.py``): records a call per input
  signature, replays the ``Program`` (a ``ConcreteFunction`` is one, with input slots and
  outputs);
* ``fit``, ``evaluate``, ``predict`` with ``run_eagerly=False``, Keras's default, on every
  kind of device (``passes.py``'s ``CapturedStep``, over ``keras/step.py``'s ``Step`` through
  the ``StepPasses`` contract): each device part recorded once per key (``recording.record``),
  replayed after (a list on CPU devices and in the simulator, graphs on a GPU, planned and
  compiled ahead there before its first run: a dry recording), the update count one of its
  host entries; ``steps_per_execution=N`` on a GPU is one program over N input slots, put
  together from the N steps' recordings (on CPU devices the N steps replay one by one, each
  all or nothing). A layer whose ``call`` is made of ops and a loss written in ops
  (``keras/call_layers.py``, ``keras/custom_losses.py``) are part of the step: their Python
  runs when it is recorded, their launches are replayed with it. ``run_eagerly=True``
  runs the step's Python every step (what labs 04 and 05 step through).

Neighbours: ``mirrored/backends.py`` and ``mirrored/devices.py`` (the device boundary the
recorder sits at), ``mirrored/traced_function.py`` (``@function``), ``mirrored/keras/step.py``
(the step that ``passes.py`` runs), ``kernels/compile_ahead.py`` and ``kernels/launch.py``
(the plan: launches written down, not made).
"""
