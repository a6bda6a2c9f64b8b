"""Distributed values and variables: ``PerReplica``, ``Mirrored``, ``Variable``, ``MirroredVariable``.

A *distributed value* holds one component per replica, in replica order:

* ``PerReplica`` — the components may differ (each replica's loss, its slice of
  the batch, its ``replica_id_in_sync_group``);
* ``Mirrored`` — the components are known to be equal (the result of an
  all-reduce, a broadcast).

A ``MirroredVariable`` is a ``Mirrored`` whose components are ``Variable``s, one
per replica device, created from one initial value and updated identically, so
they stay bitwise equal. Inside ``strategy.run`` a replica reads and writes its
own copy; in cross-replica context, reads see the first copy and writes go to
every copy. Updates from replica context need the variable's ``aggregation``
(SUM, MEAN, ONLY_FIRST_REPLICA) to say how the replicas' values combine, as in
TensorFlow.

Neighbours: ``strategy.py`` (creates them), ``cross_device_ops.py`` (reduces
them), ``context.py`` (which replica is running), ``tensor.py`` (components).
"""
import contextlib
import enum
import threading

from mirrored import context, nest
from mirrored.program import recording
from mirrored import devices as _dev
from mirrored.tensor import Operators, Tensor, infer_host_array, as_dtype, numpy_repr


_bound = threading.local()        # .replica: the copy every MirroredVariable reads in this thread


@contextlib.contextmanager
def replica_copies(replica_id):
    """Inside the block, this thread's reads of any MirroredVariable see replica
    ``replica_id``'s copy, whatever the context: a layer written with ops
    (``keras/call_layers.py``) runs on replica r's device inside fit's step, where no
    ``strategy.run`` says which replica is running."""
    was = getattr(_bound, "replica", None)
    _bound.replica = replica_id
    try:
        yield
    finally:
        _bound.replica = was


class VariableAggregation(enum.Enum):
    """How replica-context updates of a MirroredVariable combine (TensorFlow's enum)."""
    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


class VariableSynchronization(enum.Enum):
    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


def _components_repr(kind, components, show=repr):
    """``PerReplica:{\n  0: ...,\n  1: ...\n}``, each component shown by ``show`` (repr for
    repr, str for print, as TensorFlow's DistributedValues)."""
    body = ",\n".join(f"  {i}: {show(c)}" for i, c in enumerate(components))
    return f"{kind}:{{\n{body}\n}}"


class DistributedValues:
    """One value per replica. ``.values`` is the tuple of components, replica order."""

    def __init__(self, values):
        self._values = tuple(values)

    @property
    def values(self):
        return self._values

    def __repr__(self):
        return _components_repr(type(self).__name__, self._values)

    def __str__(self):
        return _components_repr(type(self).__name__, self._values, str)

    def _misuse(self, *_):
        raise TypeError(
            f"a {type(self).__name__} holds one value per replica and cannot be used as one "
            f"value here. Use it inside strategy.run (each replica gets its own component), "
            f"or combine the components with strategy.reduce / strategy.gather / "
            f"strategy.experimental_local_results.")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __float__ = __int__ = __array__ = _misuse


class PerReplica(DistributedValues):
    """Components that may differ between replicas."""


class Mirrored(DistributedValues):
    """Components that are equal on every replica.

    Each component remembers this Mirrored (``_mirrored_parent``). When every replica
    of ``strategy.run`` returns its own component — e.g. the result of ``all_reduce`` —
    ``run`` hands back a ``PerReplica`` of them, as TensorFlow does (its regroup keeps
    only variables whole; equal tensors on several devices are per-replica values).
    """

    def __init__(self, values):
        super().__init__(values)
        for v in self._values:
            if isinstance(v, Tensor):
                v._mirrored_parent = self


def select_replica(replica_id, structure):
    """The ``replica_id`` component of every distributed leaf of ``structure``."""
    return nest.map_structure(
        lambda v: v.values[replica_id] if isinstance(v, DistributedValues) else v, structure)


def regroup(per_replica_structures, wrap=PerReplica):
    """[structure of replica 0, structure of replica 1, ...] -> structure of PerReplica.

    A leaf that is the very same object on every replica stays itself (TF's
    rule); components of one MirroredVariable regroup to that variable; anything
    else (the tensors of an all-reduce included) becomes a PerReplica, as in TensorFlow.
    """
    def group(*leaves):
        first = leaves[0]
        if all(leaf is first for leaf in leaves):
            return first
        parent = getattr(first, "_mirrored_parent", None)
        if isinstance(parent, Variable) and len(parent.values) == len(leaves) and \
                all(leaf is comp for leaf, comp in zip(leaves, parent.values)):
            return parent
        return wrap(leaves)
    if len(per_replica_structures) == 1:
        return per_replica_structures[0]
    return nest.map_structure(group, *per_replica_structures)


# --- variables ---------------------------------------------------------------------

def _to_device_buffer(value, dtype, device):
    """A fresh buffer on ``device`` holding ``value`` (Tensor, NumPy or Python)."""
    if isinstance(value, Variable):
        value = value.value()
    if isinstance(value, Tensor):
        if dtype is not None and as_dtype(dtype) != value.dtype:
            raise ValueError(f"initial value has dtype {value.dtype}, the variable's is {as_dtype(dtype)}.")
        with device.activate():
            return device.copy_from(value.buf, value.dev)
    return device.from_numpy(infer_host_array(value, dtype))


class Variable(Operators):
    """A mutable tensor on one device (TensorFlow's ``tf.Variable``).

    Created inside a ``MirroredStrategy.scope()``, ``mirrored.Variable(...)``
    returns a ``MirroredVariable`` instead: one copy per replica device.
    """

    def __new__(cls, *args, **kwargs):
        if cls is Variable:
            strategy, replica_ctx = context.top()
            if strategy is not None:
                if replica_ctx is not None and strategy.num_replicas_in_sync > 1:
                    raise RuntimeError(
                        "create variables in strategy.scope(), outside strategy.run: inside "
                        "the replica function each replica would make its own, unsynchronised copy.")
                return strategy._create_variable(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, initial_value=None, trainable=True, name=None, dtype=None,
                 aggregation=VariableAggregation.NONE,
                 synchronization=VariableSynchronization.AUTO, device=None, **_ignored):
        if getattr(self, "_initialised", False):
            return                              # a MirroredVariable built by its strategy
        if initial_value is None:
            raise ValueError("a Variable needs an initial_value.")
        if callable(initial_value):
            initial_value = initial_value()
        dev = _dev.get_device(device) if device is not None else _dev.current_device()
        with recording.initialization(variable=True):   # made once: never replayed (TF's singleton rule)
            self._tensor = Tensor(_to_device_buffer(initial_value, dtype, dev), dev)
        self._name = name or "Variable"
        self._handle_name = f"{self._name}:0"
        self._trainable = trainable
        self._aggregation = VariableAggregation(aggregation) if aggregation is not None else VariableAggregation.NONE
        self._mirrored_parent = None
        self._initialised = True

    # -- what it is
    name = property(lambda self: self._handle_name)
    trainable = property(lambda self: self._trainable)
    aggregation = property(lambda self: self._aggregation)
    shape = property(lambda self: self._tensor.shape)
    dtype = property(lambda self: self._tensor.dtype)
    device = property(lambda self: self._tensor.device)

    def value(self):
        """The live Tensor (shares memory with the variable)."""
        return self._tensor

    def use_storage(self, tensor):
        """Hold the value in ``tensor`` from now on (same shape, dtype and device; its
        current contents become the value). ``keras/engine.py``'s ``ParameterPack`` puts
        every weight of a model into a view of one flat buffer per device this way."""
        t = self._tensor
        if tensor.shape != t.shape or tensor.dtype != t.dtype or tensor.dev is not t.dev:
            raise ValueError(f"variable {self.name} ({t.shape} {t.dtype} on {t.device}) cannot use "
                             f"a tensor of {tensor.shape} {tensor.dtype} on {tensor.device} as its storage.")
        self._tensor = tensor

    def read_value(self):
        """A copy of the current value, as a Tensor on the variable's device."""
        t = self._tensor
        with t.dev.activate():
            return Tensor(t.dev.copy_from(t.buf, t.dev), t.dev)

    def numpy(self):
        return self._tensor.numpy()

    def _as_tensor(self):
        return self._tensor

    def __repr__(self):
        return f"<tf.Variable '{self.name}' shape={self.shape} dtype={self.dtype}, numpy={numpy_repr(self.numpy())}>"

    def __array__(self, dtype=None, copy=None):
        return self._tensor.__array__(dtype)

    # -- updates, in place on the variable's own buffer
    def _new_buffer(self, value):
        t = self._tensor
        buf = _to_device_buffer(value, t.dtype, t.dev)
        if tuple(buf.shape) != t.shape:
            raise ValueError(f"cannot assign a value of shape {tuple(buf.shape)} to variable "
                             f"{self.name} of shape {t.shape}.")
        return buf

    def assign(self, value, use_locking=False, name=None, read_value=True):
        buf = self._new_buffer(value)
        t = self._tensor
        with t.dev.activate():
            t.dev.copy_into(t.buf, buf)
        return self

    def _update(self, op, delta):
        buf = self._new_buffer(delta)
        t = self._tensor
        with t.dev.activate():
            t.dev.ops.binary(op, t.buf, buf, t.buf)   # elementwise: in place is safe
        return self

    def assign_add(self, delta, use_locking=False, name=None, read_value=True):
        return self._update("add", delta)

    def assign_sub(self, delta, use_locking=False, name=None, read_value=True):
        return self._update("sub", delta)

    # -- operators: ``tensor.Operators`` (the value read through TensorFlow's ops: a tape watches it)
    def __float__(self): return float(self._tensor)
    def __int__(self): return int(self._tensor)


class MirroredVariable(Variable, Mirrored):
    """One ``Variable`` per replica device, kept equal (TensorFlow's MirroredVariable)."""

    @classmethod
    def _build(cls, strategy, components, aggregation):
        """Made by ``MirroredStrategy._create_variable``, never directly."""
        self = object.__new__(cls)
        self._strategy = strategy
        self._values = tuple(components)
        for c in components:
            c._mirrored_parent = self
        self._aggregation = VariableAggregation(aggregation) if aggregation is not None else VariableAggregation.NONE
        self._initialised = True
        return self

    def __init__(self, *args, **kwargs):
        # Python calls __init__ again after Variable.__new__ returns us: already built.
        if not getattr(self, "_initialised", False):
            raise TypeError("MirroredVariables are created by mirrored.Variable(...) inside "
                            "strategy.scope(), not directly.")

    def replica_copy(self):
        """The copy of the replica this thread runs (inside ``strategy.run``, or a layer under
        ``replica_copies`` in fit's step), or None in cross-replica context."""
        bound = getattr(_bound, "replica", None)
        if bound is not None and bound < len(self._values):
            return self._values[bound]
        strategy, replica_ctx = context.top()
        if replica_ctx is not None and strategy is self._strategy:
            return self._values[replica_ctx.local_replica_id]
        return None

    def _local(self):
        """The copy this thread should see: its replica's inside run (or ``replica_copies``),
        else the first."""
        own = self.replica_copy()
        return self._values[0] if own is None else own

    name = property(lambda self: self._values[0].name)
    trainable = property(lambda self: self._values[0].trainable)
    shape = property(lambda self: self._values[0].shape)
    dtype = property(lambda self: self._values[0].dtype)
    device = property(lambda self: self._local().device)
    _tensor = property(lambda self: self._local()._tensor)

    def value(self):
        return self._local().value()

    def read_value(self):
        return self._local().read_value()

    def numpy(self):
        return self._local().numpy()

    def __repr__(self):
        return _components_repr("MirroredVariable", self._values)

    # -- updates
    def _apply(self, method, value):
        strategy, replica_ctx = context.top()
        if replica_ctx is None or strategy is not self._strategy:
            # cross-replica context: the same update on every copy
            for i, c in enumerate(self._values):
                getattr(c, method)(value.values[i] if isinstance(value, DistributedValues) else value)
            return self
        if self._aggregation == VariableAggregation.NONE:
            raise ValueError(
                "You must specify an aggregation method to update a MirroredVariable in replica "
                "context: pass aggregation=mirrored.VariableAggregation.SUM, MEAN or "
                "ONLY_FIRST_REPLICA to mirrored.Variable(...), or update it in cross-replica "
                "context (outside strategy.run, e.g. through a merge_call).")

        def merge(strategy, per_replica):
            if self._aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
                first = per_replica.values[0] if isinstance(per_replica, DistributedValues) else per_replica
                return self._apply(method, first)
            op = "SUM" if self._aggregation == VariableAggregation.SUM else "MEAN"
            reduced = strategy.extended.reduce_to(op, per_replica, destinations=self)
            return self._apply(method, reduced)

        replica_ctx.merge_call(merge, args=(value,))
        return self

    def assign(self, value, use_locking=False, name=None, read_value=True):
        return self._apply("assign", value)

    def assign_add(self, delta, use_locking=False, name=None, read_value=True):
        return self._apply("assign_add", delta)

    def assign_sub(self, delta, use_locking=False, name=None, read_value=True):
        return self._apply("assign_sub", delta)


def components(variable):
    """The per-device copies of a variable: a MirroredVariable's ``values``, or the
    Variable itself (one copy). Anything else is refused, with what was expected."""
    if isinstance(variable, MirroredVariable):
        return list(variable.values)
    if isinstance(variable, Variable):
        return [variable]
    raise TypeError(f"expected a mirrored.Variable or MirroredVariable (e.g. one of "
                    f"model.trainable_variables), got {type(variable).__name__}.")
