"""``@mirrored.function``: trace once per input signature, then replay (TensorFlow's ``tf.function``).

The API over the device program (``mirrored/program/``: record, replay, capture): the
signature key, the input slots, the outputs, TensorFlow's rules. What TensorFlow does,
and what this file does in its place:

1. **Key.** Each call is keyed by its *input signature*: the nesting of the arguments,
   each tensor's shape, dtype and device (a ``PerReplica`` batch: each replica's), and
   Python values by value (other objects by identity). A NumPy array (a data set's
   batch: ``for images, labels in train_ds: train_step(images, labels)``) is a tensor,
   as TensorFlow converts it: keyed by shape and dtype, uploaded into its input slot on
   the current device at each call (one copy). A new key (the short last batch of an
   epoch) traces again (``experimental_get_tracing_count``); when 5 of the last 10
   calls traced, each trace warns as TensorFlow does (``RetracingWarning``).
   ``input_signature`` is checked against every argument, whatever its kind (a
   mismatch: TensorFlow's ``TypeError``, and nothing runs).
2. **Trace.** The first call for a key runs the Python once, eagerly, inside a
   ``recording.Recording``: every device call the library makes on the way (each
   ``dev.ops.<op>`` launch, copy and upload: ``program/recording.py``) is written down, with
   the very buffers it used. The tensors of the arguments are first copied into
   *input slots*, buffers this trace owns, so the record reads those. Python side
   effects (``print``, appending to a list) happen here only, as in TensorFlow;
   ``print(tensor)`` shows a symbolic tensor, its value being a different one each call.
3. **Replay.** Later calls with the same key copy the new arguments' tensors into
   the input slots, then run the record: the launches in order, on the same buffers,
   with the host work recorded as callbacks run again (the optimizer's step count and
   Adam's alpha, the count of updates done, ``tf.print``, host metrics). No Python of the user's function, no
   ``strategy.run`` replica threads, no tape. On CPU devices this is the launch list;
   on one GPU card the launches between two host callbacks are captured once as a
   CUDA graph and replayed as one (a ``ConcreteFunction`` is a ``program/replay.py``
   ``Program``).
4. **Outputs.** What the function returns is copied out of the record's buffers (a
   replay rewrites those) into buffers of its device that the caller gets to keep:
   ``total_loss += step(batch)`` adds on the device, with no host read per step, and
   ``float(total_loss)`` reads it. Those buffers come from a small pool per returned
   tensor (``replay.OutputPool``): one is used again only once nothing holds it any more, so a
   kept result (``losses.append(step(x))``) keeps its own step's value, and a loop that
   keeps nothing allocates nothing per step.

   A returned variable is its value at that call (a copy: later assigns do not reach it).

What cannot be recorded is run eagerly, with one warning naming the user's line and
why (``EagerFallbackWarning``): a host read of a device value while tracing (``float``
of a loss, an ``if`` on a tensor: Python control flow would be frozen on one value),
``next()`` on a data set's iterator inside the function (the batch would be frozen).
The call that found out has already run eagerly, completely, so nothing runs twice.

**Threads.** A trace records its own thread's device calls and those of the replica
threads its ``strategy.run`` starts, never another thread's (``program/recording.py``): a data
loader's work, or another thread reading a tensor, is not part of the function. One call
of a function traces or replays at a time (``Function._lock``): two threads making the
first call at once trace it once and run it twice, and two threads replaying it each get
their own results (a replay writes into the trace's buffers). A Ctrl-C during a replay
is held back until the replay ends (``devices.every_device_or_none``): the step ran on
every replica or on none, as between two of TensorFlow's graph calls.

**Variables.** TensorFlow's rule: a function may make ``tf.Variable``s on its first call
only. A first call whose code makes some is traced twice (the first trace's effects
rolled back: TensorFlow's first trace has none), and making one in the second trace, or
in any later trace, raises TensorFlow's ``ValueError``. The library's own first-use
state (a model built inside the trace, an optimizer's slots: ``recording.initialization``)
is not counted.

``strategy.reduce`` inside a trace stays on the device (``reduce_in_trace``): the
replicas' values are copied to the first replica's device and added there in the order
the host adds them, so the sum is the same float32 sum.

Across workers (``MultiWorkerMirroredStrategy``) the exchanges are MPI calls made from
the host, not device calls: the all-reduce between workers (``collective_all_reduce.py``)
and ``strategy.reduce``'s are host work, recorded as host callbacks that every replay
runs again at the same point of the step (every worker replays the same calls in the
same order, as it traced them).

A trace that raises leaves nothing: no record is kept for its key, and every buffer and
host number it changed is put back (``Recording.roll_back``): weights, slots, the step
count, variables assigned before the error.

``reduce_retracing`` and ``jit_compile`` are accepted; a record has fixed shapes, so
every new shape traces (reduce_retracing cannot merge them), and every replay is
already a fixed launch list (or graph).

Neighbours: ``program/`` (``recording.py``: what is recorded, how; ``replay.py``: the
replay; ``capture.py``: CUDA graphs),
``strategy.py`` (``reduce`` calls ``reduce_in_trace``), ``keras/optimizers.py``
(``begin_step``, a host callback), ``tensor.py`` (``tf.print``, a host callback).
"""
import collections
import functools
import inspect
import threading
import warnings

import numpy as np

from mirrored import backends, context, devices, nest
from mirrored.program import capture, recording, replay
from mirrored.tensor import Tensor, TensorSpec, as_function_output
from mirrored.values import DistributedValues, Variable


class EagerFallbackWarning(UserWarning):
    """A ``@function`` runs eagerly from now on: something in it cannot be replayed."""


class RetracingWarning(UserWarning):
    """A ``@function`` traced on most of its recent calls (TensorFlow logs the same warning)."""


#: TensorFlow's numbers for its retracing warning: when this many of the last
#: ``RETRACING_WINDOW`` calls of one function traced, each further trace warns.
RETRACING_THRESHOLD = 5
RETRACING_WINDOW = 10


def function(func=None, input_signature=None, autograph=True, jit_compile=None,
             reduce_retracing=False, experimental_implements=None, experimental_autograph_options=None,
             experimental_attributes=None, experimental_relax_shapes=None, experimental_compile=None,
             experimental_follow_type_hints=None):
    """``@mirrored.function`` (TensorFlow's ``@tf.function``): see the module docstring.
    ``input_signature`` (a list of ``TensorSpec``), when given, is checked against
    every call's tensors."""
    if func is None:
        return lambda f: Function(f, input_signature, reduce_retracing, jit_compile)
    return Function(func, input_signature, reduce_retracing, jit_compile)


class Function:
    """A traced function: one ``ConcreteFunction`` per input signature (TensorFlow's names)."""

    def __init__(self, func, input_signature=None, reduce_retracing=False, jit_compile=None):
        if not callable(func):
            raise TypeError(f"mirrored.function wraps a Python function, got {func!r}.")
        functools.update_wrapper(self, func)
        self.python_function = func
        self.input_signature = input_signature
        self.reduce_retracing = reduce_retracing
        self.jit_compile = jit_compile
        self._traces = {}              # signature key -> ConcreteFunction
        self._tracing_count = 0
        self._eager = None             # why it runs eagerly from now on (after the one warning)
        # One call at a time traces or replays (a replay writes into the trace's buffers;
        # two threads' replays at once would mix their inputs and results): TensorFlow
        # gives each call its own outputs, and so do we, one call after the other.
        self._lock = threading.RLock()
        self._recent = collections.deque(maxlen=RETRACING_WINDOW)   # did each recent call trace?
        self._first_trace_done = False     # variables may be made on the first call only

    def __get__(self, instance, owner):
        """A method decorated with ``@function``: the instance is an argument (keyed by identity)."""
        return self if instance is None else functools.partial(self.__call__, instance)

    def experimental_get_tracing_count(self):
        """How many times the Python function has been traced (TensorFlow's name)."""
        return self._tracing_count

    def __call__(self, *args, **kwargs):
        # The BLAS at the thread count fit uses (backends.blas_policy: one thread, by
        # default): OpenBLAS's spinning threads made this step 10x slower on a busy machine.
        with backends.blas_threads():
            return self._call(args, kwargs)

    def _call(self, args, kwargs):
        if self._eager is not None or recording.active() is not None or context.top()[1] is not None:
            # eagerly: after a fallback; inside another function's trace (its launches
            # then belong to that trace, as TensorFlow inlines a nested call); or inside
            # strategy.run's replica function (a part of the caller's step, traced with it)
            return self._call_python(args, kwargs)
        self._check_signature(args, kwargs)
        key, why_not = signature(args, kwargs)
        if why_not is not None:
            self._fall_back(why_not, recording.user_line())
            return self._call_python(args, kwargs)
        with self._lock:                         # the first call traces once; replays take turns
            if self._eager is None:
                trace = self._traces.get(key)
                self._recent.append(trace is None)
                if trace is None:
                    return self._trace(key, args, kwargs)
                # A Ctrl-C lands between two replays, not inside one: every replica's
                # update done, or none (as between two of TensorFlow's graph calls).
                with devices.every_device_or_none():
                    return trace.replay(args, kwargs)
        return self._call_python(args, kwargs)   # another thread's trace fell back meanwhile

    def _call_python(self, args, kwargs):
        return nest.map_structure(_function_output, self.python_function(*args, **kwargs))

    def _trace(self, key, args, kwargs):
        """Trace the call (its effects happen now, once), keep the record for ``key``.

        TensorFlow's variable rule: a function may make ``tf.Variable``s on its first call
        only, and a first call that makes some is traced a second time, with making one
        an error (so a variable made on every call raises at once). Ours the same way: the
        first trace's effects are rolled back and the function traced again."""
        slots = InputSlots(args, kwargs)
        self._tracing_count += 1
        self._warn_if_retracing()
        first = not self._first_trace_done
        rec = self._record(slots, no_variables=not first)
        if first and rec.variables_made and rec.refused is None:
            rec.roll_back()                       # as if it had only been traced
            rec = self._record(slots, no_variables=True)
        rec.forget()                              # the copies kept for a roll-back
        self._first_trace_done = True
        result = rec.result
        if rec.refused is not None:
            self._fall_back(*rec.refused)
            return result                     # this call ran eagerly, completely
        trace = ConcreteFunction(slots, rec.entries, result)
        self._traces[key] = trace
        return trace.outputs()

    def _record(self, slots, no_variables):
        """The function's Python run once inside a ``Recording`` (``rec.result``: what it
        returned). If it raises, what it changed is put back and the error goes on."""
        rec = recording.Recording(no_variables=no_variables)
        rec.made([buf for _, buf in slots.slots])
        try:
            with rec:
                rec.result = self._call_python(slots.args, slots.kwargs)
        except BaseException:
            rec.roll_back()                   # no record kept for this key, no effect left
            raise
        return rec

    def _warn_if_retracing(self):
        traced = sum(self._recent)
        if traced >= RETRACING_THRESHOLD:
            name = getattr(self.python_function, "__qualname__", repr(self.python_function))
            warnings.warn(
                f"{traced} out of the last {len(self._recent)} calls to {name} triggered "
                f"tf.function retracing. Tracing is expensive and the excessive number of "
                f"tracings could be due to (1) creating @tf.function repeatedly in a loop, "
                f"(2) passing tensors with different shapes, (3) passing Python objects "
                f"instead of tensors. For (1), please define your @tf.function outside of the "
                f"loop. For (2), every new shape is a new trace here (a record has fixed "
                f"shapes): pad or batch to a few shapes. For (3), pass the values that change "
                f"as tensors (mirrored.constant(x)).", RetracingWarning, stacklevel=5)

    def _fall_back(self, reason, where):
        self._eager = reason
        self._traces.clear()
        name = getattr(self.python_function, "__qualname__", repr(self.python_function))
        filename, line, text = where if where is not None else ("<unknown>", 0, "")
        warnings.warn_explicit(
            f"@function {name} runs eagerly from now on, every call: {reason}"
            f"{f' (line: {text})' if text else ''}. A trace would freeze what that line "
            f"decided or read into every later call. To have it traced and replayed, keep "
            f"the values on the devices inside the function (return tensors, read them "
            f"outside; mirrored.print prints a value every call) and pass tensors as "
            f"arguments (a distributed data set's batches).",
            EagerFallbackWarning, filename, line)

    def _check_signature(self, args, kwargs):
        """Every argument (tensors, NumPy arrays, Python numbers, variables, nested
        structures) against ``input_signature``: a mismatch is TensorFlow's ``TypeError``."""
        if self.input_signature is None:
            return
        specs = list(self.input_signature)
        try:
            values = list(inspect.signature(self.python_function).bind(*args, **kwargs).arguments.values())
        except TypeError as err:
            raise TypeError(f"{self.__name__} was called with arguments that do not bind to its "
                            f"parameters ({err}); its input_signature is {specs}.") from None
        if len(values) == len(specs) + 1 and not _tensor_like(values[0]):
            values = values[1:]                    # a method's ``self``: not in the signature
        bad = _mismatch(specs, values)
        if bad is not None:
            raise TypeError(
                f"Binding inputs to {self.__name__} failed: {bad}. Its input_signature is "
                f"{specs}; the call gave {[_describe(v) for v in values]}. Pass arguments "
                f"of those shapes and dtypes (a dimension None takes any size), or drop "
                f"input_signature to trace each new signature.")

    def __repr__(self):
        return f"<mirrored.function {getattr(self, '__qualname__', '?')}: {len(self._traces)} trace(s)>"


# --- signatures and input slots --------------------------------------------------------------

def signature(args, kwargs):
    """``(key, None)``: the hashable input signature of a call; or ``(None, why)`` where
    an argument cannot be traced. A NumPy array (a data set's batch) is a tensor, as
    TensorFlow converts it: keyed by shape, dtype and the device it goes to."""
    leaves = nest.flatten((list(args), kwargs))
    return (nest.structure_of((list(args), kwargs)), tuple(_leaf_key(leaf) for leaf in leaves)), None


def _leaf_key(leaf):
    if isinstance(leaf, Tensor):
        return "tensor", leaf.shape, leaf.dtype.str, leaf.device
    if _is_host_tensor(leaf):
        return "tensor", leaf.shape, leaf.dtype.str, devices.current_device().name
    if isinstance(leaf, Variable):
        return "object", id(leaf)
    if isinstance(leaf, DistributedValues):
        return type(leaf).__name__, tuple(_leaf_key(c) for c in leaf.values)
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes, np.generic)):
        return "value", type(leaf).__name__, leaf
    if isinstance(leaf, np.ndarray):                   # a 0-d array (a host scalar): its value
        return "value", leaf.dtype.str, leaf.item()
    return "object", id(leaf)


def _is_host_tensor(leaf):
    """A NumPy array of one or more dimensions (``HostTensor``s too): a tensor to a trace."""
    return isinstance(leaf, np.ndarray) and leaf.ndim > 0


def _function_output(value):
    """What a call returns for ``value``: a variable as its value at this call (a copy:
    later assigns do not reach it, as TensorFlow returns a read), numbers as tensors."""
    if isinstance(value, Variable):
        return value.read_value()
    return as_function_output(value)


def _tensor_like(value):
    return isinstance(value, (Tensor, Variable, np.ndarray, np.generic, bool, int, float)) or (
        isinstance(value, (list, tuple)) and all(_tensor_like(v) for v in nest.flatten(value)))


def _mismatch(specs, values):
    """Why ``values`` do not fit ``specs`` (structures of ``TensorSpec``), or None."""
    if len(specs) != len(values):
        return f"{len(values)} argument(s) for {len(specs)} spec(s)"
    for spec, value in zip(specs, values):
        if isinstance(spec, TensorSpec):
            why = _leaf_mismatch(spec, value)
        else:
            flat_specs, flat_values = nest.flatten(spec), nest.flatten(value)
            if len(flat_specs) != len(flat_values):
                why = f"{_describe(value)} does not have the structure of {spec}"
            else:
                why = next((w for w in (_leaf_mismatch(s, v) for s, v in zip(flat_specs, flat_values))
                            if w is not None), None)
        if why is not None:
            return why
    return None


def _leaf_mismatch(spec, value):
    if isinstance(value, DistributedValues) and not isinstance(value, Variable):
        return next((w for w in (_leaf_mismatch(spec, c) for c in value.values) if w is not None), None)
    if isinstance(value, (Tensor, Variable)):
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
    elif isinstance(value, (np.ndarray, np.generic)):
        shape, dtype = value.shape, value.dtype
    elif isinstance(value, (bool, int, float)) or (isinstance(value, (list, tuple)) and _tensor_like(value)):
        shape, dtype = np.asarray(value).shape, None     # a Python value: converted to the spec's dtype
    else:
        return f"{_describe(value)} is not a tensor, a NumPy array or a number, for {spec}"
    if not spec.shape.is_compatible_with(shape) or (dtype is not None and dtype != spec.dtype):
        return f"{_describe(value)} does not fit {spec}"
    return None


def _describe(value):
    if isinstance(value, (Tensor, Variable)):
        return f"Tensor{list(value.shape)} {np.dtype(value.dtype)}"
    if isinstance(value, np.ndarray):
        return f"NumPy {value.dtype}{list(value.shape)}"
    return type(value).__name__


class InputSlots:
    """The trace's own copies of a call's tensors (``args``, ``kwargs``: the call's
    structure with each tensor, replica component or NumPy array replaced by its copy on
    a device), and ``refill``: a later call's values copied into them (a NumPy array:
    one upload, as TensorFlow converts it at each call)."""

    def __init__(self, args, kwargs):
        self.slots = []                        # (device, buffer) per tensor, flattening order
        self.pins = nest.flatten((list(args), kwargs))   # objects keyed by identity stay alive
        slotted = nest.map_structure(self._slot, (list(args), kwargs))
        self.args, self.kwargs = tuple(slotted[0]), slotted[1]

    def _slot(self, leaf):
        if isinstance(leaf, Tensor):
            buf = _copy(leaf)
            self.slots.append((leaf.dev, buf))
            return Tensor(buf, leaf.dev)
        if _is_host_tensor(leaf):
            dev = devices.current_device()
            with dev.activate():
                buf = dev.from_numpy(np.ascontiguousarray(leaf))
            self.slots.append((dev, buf))
            return Tensor(buf, dev)
        if isinstance(leaf, DistributedValues) and not isinstance(leaf, Variable):
            return type(leaf)([self._slot(c) for c in leaf.values])
        return leaf

    def refill(self, args, kwargs):
        values = [t for leaf in nest.flatten((list(args), kwargs)) for t in _tensors(leaf)]
        for (dev, buf), t in zip(self.slots, values):
            if not buf.size:
                continue
            if isinstance(t, np.ndarray):
                with dev.activate():
                    dev.upload_into(buf, np.ascontiguousarray(t).view(np.ndarray))
            elif t.buf is not buf:
                dev.copy_into(buf, t.buf)


def _tensors(leaf):
    """The values of ``leaf`` that have input slots: tensors, replica components, NumPy arrays."""
    if isinstance(leaf, Tensor) or _is_host_tensor(leaf):
        return [leaf]
    if isinstance(leaf, DistributedValues) and not isinstance(leaf, Variable):
        return [t for c in leaf.values for t in _tensors(c)]
    return []


def _device_tensors(leaf):
    """The tensors of ``leaf`` (a replica value's components): what a result holds on devices."""
    if isinstance(leaf, Tensor):
        return [leaf]
    if isinstance(leaf, DistributedValues) and not isinstance(leaf, Variable):
        return [t for c in leaf.values for t in _device_tensors(c)]
    return []


def _copy(tensor):
    """A new buffer on the tensor's device holding a copy of its values."""
    dev = tensor.dev
    with dev.activate():
        out = dev.empty(tensor.shape, tensor.dtype)
        if tensor.buf.size:
            dev.copy_into(out, tensor.buf)
    return out


# --- one trace: its record and how it is replayed ------------------------------------------

class ConcreteFunction(replay.Program):
    """One input signature's record: a ``replay.Program`` (the entries, run again) with the
    call's input slots and what it returns (TensorFlow's ``ConcreteFunction``: what
    ``get_concrete_function`` returns, one traced graph)."""

    def __init__(self, slots, entries, result):
        super().__init__(entries, capture.StepGraphs.for_program(replay.devices_of(entries)))
        if self.graphs is not None:
            self.graphs.ran_eagerly()              # the trace was the first run: the next is captured
        self.slots = slots
        self.result = result
        self.pools = None                          # id(returned tensor) -> OutputPool (outputs)

    def outputs(self):
        """What this call returns: the record's result, each tensor the record writes
        copied into a buffer of its ``OutputPool``; a tensor it never touches (one the
        function captured and returns as it is) comes back as itself."""
        if self.pools is None:
            buffers = self.buffers() + [buf for _, buf in self.slots.slots]
            self.pools = {id(t): replay.OutputPool(t)
                          for t in (t for leaf in nest.flatten(self.result) for t in _device_tensors(leaf))
                          if replay.touches(t.buf, buffers)}
        return nest.map_structure(self._copied, self.result)

    def _copied(self, leaf):
        if isinstance(leaf, Tensor):
            pool = self.pools.get(id(leaf))
            return leaf if pool is None else Tensor(pool.copy_of(leaf), pool.dev)
        if isinstance(leaf, DistributedValues) and not isinstance(leaf, Variable):
            if any(id(t) in self.pools for t in _device_tensors(leaf)):
                return type(leaf)([self._copied(c) for c in leaf.values])
        return leaf

    def replay(self, args, kwargs):
        """Run the record on a new call's tensors; returns this call's outputs."""
        self.slots.refill(args, kwargs)
        self.run()
        return self.outputs()


# --- strategy.reduce inside a trace ----------------------------------------------------------

def reduce_in_trace(dev, reduce_op, value, axis, on_host, local=True):
    """``strategy.reduce`` while a trace records: the result stays on ``dev``, the first
    replica's device (the strategy passes it). Float values across replicas (``axis=None``): copied there and added in
    replica order, as ``strategy.reduce_on_host`` adds them (the same float32 sums),
    MEAN then divided by the count. Anything else, and every value where other workers
    hold replicas too (``local=False``: ``MultiWorkerMirroredStrategy``): ``on_host()``
    (the host's reduction) run as a host callback at every replay, its result uploaded
    into one buffer."""
    comps = list(value.values) if isinstance(value, DistributedValues) else [value]
    if local and axis is None and all(isinstance(c, Tensor) and c.dtype.kind == "f" and c.shape == comps[0].shape
                            and c.dtype == comps[0].dtype for c in comps):
        with dev.activate():
            total = dev.empty(comps[0].shape, comps[0].dtype)
            first = comps[0].buf if comps[0].dev is dev else dev.copy_from(comps[0].buf, comps[0].dev)
            dev.copy_into(total, first)
            for c in comps[1:]:
                other = c.buf if c.dev is dev else dev.copy_from(c.buf, c.dev)
                dev.ops.binary("add", total, other, total)
            if reduce_op == "MEAN":
                dev.ops.binary_scalar("div", total, len(comps), total)
        return Tensor(total, dev)
    made = {}
    recording.host_work(_reduce_into)(dev, made, on_host)
    return Tensor(made["buf"], dev)


def _reduce_into(dev, made, on_host):
    """``on_host()``'s array uploaded into one buffer of ``dev`` (made the first time)."""
    host = np.asarray(on_host(), order="C")          # (ascontiguousarray would make a scalar 1-d)
    if "buf" not in made:
        with dev.activate():
            made["buf"] = dev.empty(host.shape, host.dtype)
    dev.upload_into(made["buf"], host.astype(made["buf"].dtype, copy=False))
