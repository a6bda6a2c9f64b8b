"""``mirrored.Tensor``: an array on one device, with TensorFlow's eager-tensor manners.

A Tensor is a thin handle: ``_buf`` (a NumPy array on a CPU device, a Numba
device array on a GPU) plus ``_device`` (the ``Device`` that owns it). Its
arithmetic runs where the data is: on a GPU in our elementwise and reduction
kernels (``kernels/``), never by copying to the host; on a CPU in their NumPy
references. Only ``.numpy()`` (and printing) brings data back to the host.

What TensorFlow users expect, and get here:
    x = mirrored.constant([1., 2.])      # float32 on the current device
    (x * 2 - 1).numpy()                  # array([1., 3.], dtype=float32)
    mirrored.reduce_sum(x), mirrored.cast(x, mirrored.int32)
    with mirrored.device("CPU:0"): ...   # place new tensors explicitly

``cast``, ``reduce_sum``, ``reduce_mean``, ``identity`` and ``reshape`` also accept NumPy
values and answer in NumPy, so ``Dataset.map(scale)`` from the course lab works
on the host pipeline unchanged.

Also here, for TensorFlow's distribute pages: ``add_n``, ``reshape``, ``range_``
(``mirrored.range``), ``print_`` (``mirrored.print``: to stderr), ``TensorShape`` and
``TensorSpec``; ``HostTensor`` (host results and dataset elements). Arithmetic on a loss
keeps the record ``GradientTape`` follows (``_scalar_node``/``_tensor_node``, keras/tape.py).

Neighbours: ``devices.py`` (where buffers live), ``backends.py`` (the ops).
"""
import numbers
import sys

import numpy as np

from mirrored import devices as _dev
from mirrored.program import recording
from mirrored.errors import InvalidArgumentError

# dtype names, as ``tf.float32`` etc. They are NumPy dtypes: anything that
# accepts a NumPy dtype accepts them.
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
uint8 = np.dtype(np.uint8)
bool_ = np.dtype(np.bool_)


def as_dtype(dtype):
    """Any dtype spelling (``mirrored.float32``, ``np.float32``, ``"float32"``) -> np.dtype."""
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{dtype!r} is not a dtype; use e.g. mirrored.float32 or 'int64'.") from None


#: What the operators call: ``mirrored/ops.py`` (the op table) fills it when imported
#: (``import mirrored`` imports it), so this file need not import the ops above it.
OPERATORS = {}


class Operators:
    """The arithmetic operators of a tensor and of a variable (``values.Variable`` reads its
    value through them, so a tape watches it): each calls its op in ``OPERATORS``. NumPy
    defers to them (``np_array - tensor`` is a tensor, as in TensorFlow)."""

    __slots__ = ()
    __array_priority__ = 100

    def __add__(self, other):
        return OPERATORS["add"](self, other)

    def __radd__(self, other):
        return OPERATORS["radd"](self, other)

    def __sub__(self, other):
        return OPERATORS["sub"](self, other)

    def __rsub__(self, other):
        return OPERATORS["rsub"](self, other)

    def __mul__(self, other):
        return OPERATORS["mul"](self, other)

    def __rmul__(self, other):
        return OPERATORS["rmul"](self, other)

    def __truediv__(self, other):
        return OPERATORS["truediv"](self, other)

    def __rtruediv__(self, other):
        return OPERATORS["rtruediv"](self, other)

    def __floordiv__(self, other):
        return OPERATORS["floordiv"](self, other)

    def __rfloordiv__(self, other):
        return OPERATORS["rfloordiv"](self, other)

    def __mod__(self, other):
        return OPERATORS["mod"](self, other)

    def __rmod__(self, other):
        return OPERATORS["rmod"](self, other)

    def __pow__(self, other):
        return OPERATORS["pow"](self, other)

    def __rpow__(self, other):
        return OPERATORS["rpow"](self, other)

    def __matmul__(self, other):
        return OPERATORS["matmul"](self, other)

    def __rmatmul__(self, other):
        return OPERATORS["rmatmul"](self, other)

    def __lt__(self, other):
        return OPERATORS["lt"](self, other)

    def __le__(self, other):
        return OPERATORS["le"](self, other)

    def __gt__(self, other):
        return OPERATORS["gt"](self, other)

    def __ge__(self, other):
        return OPERATORS["ge"](self, other)

    def __neg__(self):
        return OPERATORS["neg"](self)

    def __abs__(self):
        return OPERATORS["abs"](self)

    def __getitem__(self, key):
        return OPERATORS["getitem"](self, key)

    def ref(self):
        """A hashable reference to this tensor or variable (TensorFlow's ``ref()``: a dict or set
        key, ``.deref()`` gives the object back)."""
        return _Ref(self)


class Tensor(Operators):
    """An array on one device. Create with ``mirrored.constant`` or from ops."""

    __slots__ = ("_buf", "_device", "_node", "_mirrored_parent", "__weakref__")

    def __init__(self, buf, device, node=None):
        self._buf = buf          # np.ndarray (CPU) or Numba device array (GPU)
        self._device = device    # mirrored.devices.Device
        self._node = node        # how it was computed, for GradientTape (keras/tape.py)
        self._mirrored_parent = None   # the Mirrored it is a component of (values.py)

    # -- what it is
    @property
    def shape(self):
        return tuple(self._buf.shape)

    @property
    def dtype(self):
        return np.dtype(self._buf.dtype)

    @property
    def device(self):
        """The canonical device name, as TensorFlow's ``Tensor.device``."""
        return self._device.name

    @property
    def ndim(self):
        return len(self._buf.shape)

    # -- what the library's own code reads (not TensorFlow's API)
    @property
    def buf(self):
        """The raw array the kernels take: np.ndarray on a CPU device, a Numba device array
        on a GPU."""
        return self._buf

    @property
    def dev(self):
        """The ``mirrored.devices.Device`` holding it (``device`` is its name, as TensorFlow's)."""
        return self._device

    @property
    def node(self):
        """How it was computed, for ``GradientTape`` (``keras/tape.py``, ``autodiff.py``), or None."""
        return self._node

    @node.setter
    def node(self, node):
        self._node = node

    def numpy(self):
        """A NumPy copy on the host (a NumPy scalar for shape ``()``, as TF)."""
        host = self._device.to_numpy(self._buf)
        return host[()] if host.ndim == 0 else host

    def __array__(self, dtype=None, copy=None):
        host = np.asarray(self._device.to_numpy(self._buf))
        return host if dtype is None else host.astype(dtype)

    def __repr__(self):
        return tensor_repr(self)

    def __str__(self):
        return tensor_str(self)

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a scalar (shape ()) Tensor is undefined.")
        return self.shape[0]

    def __iter__(self):
        """Its rows along axis 0, each a Tensor on the same device (``for i in tf.range(5)``)."""
        if not self.shape:
            raise TypeError("iterating over a scalar (shape ()) Tensor is not allowed, as in TensorFlow.")
        host = self.numpy()
        return (constant(row, device=self._device) for row in host)

    def __float__(self):
        return float(self.numpy())

    def __format__(self, spec):
        return format(self.numpy(), spec) if spec else str(self)

    def __index__(self):
        if self.dtype.kind not in "iu" or self.shape != ():
            raise TypeError(f"only integer scalar tensors can be used as an index, not {self.dtype} {self.shape}.")
        return int(self.numpy())

    def __int__(self):
        return int(self.numpy())

    def __bool__(self):
        if self.shape not in ((), (1,)):
            raise ValueError(f"the truth value of a Tensor of shape {self.shape} is ambiguous; "
                             f"reduce it first (mirrored.reduce_sum, .numpy().any()).")
        return bool(self.numpy())

    # -- operators: TensorFlow's ops (``Operators`` below, and the ones only a tensor has)
    # ``==`` and ``!=`` compare elementwise, as TF 2's tensors do, so a Tensor is not hashable
    # (TF's rule too: key a dict by ``t.ref()`` or ``id(t)``).
    def __eq__(self, other):
        return OPERATORS["eq"](self, other)

    def __ne__(self, other):
        return OPERATORS["ne"](self, other)

    def __and__(self, other):
        return OPERATORS["and"](self, other)

    def __or__(self, other):
        return OPERATORS["or"](self, other)

    def __xor__(self, other):
        return OPERATORS["xor"](self, other)

    def __invert__(self):
        return OPERATORS["invert"](self)

    __hash__ = None

    def get_shape(self):
        """The shape as a ``TensorShape`` (TensorFlow's ``Tensor.get_shape``)."""
        return TensorShape(self.shape)


class _Ref:
    """``Tensor.ref()``: hashable, equal for the same tensor; ``.deref()`` gives it back."""

    __slots__ = ("_t",)

    def __init__(self, t):
        self._t = t

    def deref(self):
        return self._t

    def __hash__(self):
        return id(self._t)

    def __eq__(self, other):
        return isinstance(other, _Ref) and other.deref() is self._t


def numpy_text(value, is_repr=False):
    """How TensorFlow shows a tensor's value inside its repr/str: ``1.0`` for scalars (NumPy's
    shortest float32 text, not Python's float64 one), ``array([0])`` (repr) or ``[0]`` (str)
    otherwise; text that spans several lines starts on a new line, as TensorFlow's
    ``numpy_text`` puts it."""
    text = str(value) if np.ndim(value) == 0 else (repr(value) if is_repr else str(value))
    return "\n" + text if "\n" in text else text


def numpy_repr(value):
    """A tensor's (or variable's) value as its repr shows it."""
    return numpy_text(value, is_repr=True)


def tensor_repr(t):
    """``<tf.Tensor: shape=(2,), dtype=float32, numpy=array([1., 2.], dtype=float32)>``;
    while a ``@function`` traces, the symbolic form (``symbolic_text``)."""
    if _tracing(t):
        return symbolic_text(t)
    return f"<tf.Tensor: shape={t.shape}, dtype={t.dtype}, numpy={numpy_repr(t.numpy())}>"


def tensor_str(t):
    """``tf.Tensor([1. 2.], shape=(2,), dtype=float32)``: what ``print(tensor)`` shows."""
    if _tracing(t):
        return symbolic_text(t)
    return f"tf.Tensor({numpy_text(t.numpy())}, shape={t.shape}, dtype={t.dtype})"


def _tracing(t):
    """A device tensor shown while a ``@function`` traces (not inside host work such as
    ``tf.print``): its value is a different one at every replay, so Python's ``print``
    shows what TensorFlow's shows there, the symbolic tensor."""
    return isinstance(t, Tensor) and recording.active() is not None and not recording.in_host_code()


def symbolic_text(t):
    """``Tensor("traced", shape=(32,), dtype=float32)``: a tensor inside a trace (as
    TensorFlow prints a graph tensor: no value)."""
    return f'Tensor("traced", shape={t.shape}, dtype={t.dtype})'


class StaticTensor(Tensor):
    """A tensor whose value is known on the host from the moment it is made, because shapes
    alone decide it: ``tf.shape(x)``, ``tf.size(x)``, ``tf.rank(x)``, and integer indexing and
    slicing of them (``tf.shape(x)[0]``). Reading it needs no device read, so a ``@function``
    may use it as a Python value (``keras.random.normal(shape=(tf.shape(x)[0], 8))``, keras.io's
    GAN) without refusing its trace: the shapes are part of the trace's input signature, as
    TensorFlow's static shapes are. On the device it is an ordinary int32 tensor."""

    __slots__ = ("_static",)

    @classmethod
    def of(cls, value, device):
        """``value`` (a host array of integers) as a tensor on ``device`` that knows it."""
        made = constant(value, device=device)
        static = cls(made._buf, made._device)
        static._static = np.array(value, made.dtype)
        return static

    def numpy(self):
        return self._static[()] if self._static.ndim == 0 else self._static.copy()

    def __array__(self, dtype=None, copy=None):
        return np.array(self._static, dtype=dtype)

    def __iter__(self):
        if not self.shape:
            raise TypeError("iterating over a scalar (shape ()) Tensor is not allowed, as in TensorFlow.")
        return (type(self).of(row, self._device) for row in self._static)

    def __getitem__(self, key):
        out = super().__getitem__(key)
        if isinstance(key, (int, np.integer, slice)) and isinstance(out, Tensor):
            static = type(self)(out._buf, out._device, out._node)
            static._static = np.array(self._static[key], self._static.dtype)
            return static
        return out


class HostTensor(np.ndarray):
    """A value on the host: a NumPy array that also answers ``.numpy()``.

    ``strategy.reduce``, ``strategy.gather`` and iterating a ``mirrored.data.Dataset``
    give these, so code written for TensorFlow (``strategy.reduce(...).numpy()``,
    ``for x in ds: x.numpy()``) and NumPy code both work. They print as TensorFlow's
    eager tensors (``<tf.Tensor: shape=(), dtype=float32, numpy=2.0>``); arithmetic on
    them is NumPy's.
    """

    def __repr__(self):
        return tensor_repr(self)

    def __str__(self):
        return tensor_str(self)

    @classmethod
    def wrap(cls, value):
        return np.asarray(value).view(cls)

    def numpy(self):
        plain = self.view(np.ndarray)
        return plain[()] if plain.ndim == 0 else plain

    @property
    def device(self):
        return f"{_dev.LONG_PREFIX}CPU:0"


class TraceTimeValue(HostTensor):
    """A host value read while a ``@function`` traced (``train_loss(loss)``: a metric called
    inside the function hands back its result, as TensorFlow's does). Right for the call that
    traced; a replay would not change it. So the function may use it, but if it RETURNS it
    (or a value computed from it: NumPy keeps the class) the trace is refused and the
    function runs eagerly, with a warning (``as_function_output``), rather than hand every
    later call the first call's number."""


def _empty(device, shape, dtype):
    return device.empty(shape, dtype)


def _is_scalar(value):
    return isinstance(value, numbers.Number) or (isinstance(value, np.ndarray) and value.ndim == 0)


def elementwise(op, x, other):
    """x <op> other for a Python/NumPy scalar or a same-shape Tensor ``other`` (``op``: add,
    sub, mul, div, rsub, rdiv): the same-shape kernels the engine uses, keeping the node of
    a loss (below). ``mirrored/ops.py`` calls this for the fused loss path and for numbers;
    every other case (broadcasting, the tape's graph) is there."""
    if x.dtype.kind in "iub" and op in ("div", "rdiv"):
        # TensorFlow's truediv on integers answers in floating point.
        x = cast(x, float64 if x.dtype.itemsize >= 4 else float32)
    dev = x._device
    if _is_scalar(other):
        other = np.asarray(other)[()]
        if x.dtype.kind in "iu" and isinstance(other, (float, np.floating)) and other != int(other):
            raise TypeError(f"cannot combine a {x.dtype} tensor with the non-integer scalar {other!r}; "
                            f"cast the tensor first: mirrored.cast(x, mirrored.float32).")
        out = _empty(dev, x.shape, x.dtype)
        with dev.activate():
            dev.ops.binary_scalar(op, x._buf, other, out)
        return Tensor(out, dev, _scalar_node(op, x._node, other))
    if hasattr(other, "_as_tensor"):          # a Variable: use its value
        other = other._as_tensor()
    if not isinstance(other, Tensor):
        other = constant(np.asarray(other), dtype=x.dtype, device=dev)
    if other._device is not dev:
        raise InvalidArgumentError(
            f"cannot {op} tensors on two devices: {x.device} and {other.device}. "
            f"Copy one across first, e.g. mirrored.identity(t, device='{x._device.short_name}').")
    if other.shape != x.shape:
        raise InvalidArgumentError(f"cannot {op} tensors of shapes {x.shape} and {other.shape}: "
                                   f"elementwise ops need equal shapes (or a scalar).")
    if other.dtype != x.dtype:
        raise InvalidArgumentError(f"cannot {op} a {x.dtype} tensor and a {other.dtype} tensor; "
                                   f"cast one first: mirrored.cast(t, mirrored.{x.dtype}).")
    out = _empty(dev, x.shape, x.dtype)
    with dev.activate():
        if op.startswith("r"):   # reflected forms never arise between two tensors
            raise AssertionError(op)
        dev.ops.binary(op, x._buf, other._buf, out)
    return Tensor(out, dev, _tensor_node(op, x, other))


# --- what GradientTape needs to know of arithmetic on losses ------------------------------
# A loss made from a model's output carries a node (keras/tape.py: ``_Loss`` for a
# per-example vector, ``_Scaled`` for a scalar). Arithmetic keeps it: + and - combine
# nodes (``plus``), * and / by a number scale it (``scaled``). A Tensor without a node
# is a constant to the tape (as a value TensorFlow's tape did not watch); an operation the
# tape cannot follow gives no node, and ``tape.gradient`` then says what it supports.

def _legacy(node):
    """A node of the fused loss path (``keras/tape.py``), which knows ``scaled`` and ``plus``."""
    return node if hasattr(node, "scaled") else None


def _scalar_node(op, node, s):
    node = _legacy(node)
    if node is None:
        return None
    s = float(s)
    if op == "mul":
        return node.scaled(s)
    if op == "div":
        return node.scaled(1.0 / s) if s else None
    if op in ("add", "sub"):
        return node                       # plus a constant: the same gradient
    if op == "rsub":
        return node.scaled(-1.0)
    return None


def _tensor_node(op, x, y):
    a, b = _legacy(x._node), _legacy(y._node)
    if a is None and b is None:
        return None
    if op in ("add", "sub"):
        if b is not None and op == "sub":
            b = b.scaled(-1.0)
        if a is None or b is None:
            return a if b is None else b  # plus a constant
        return a.plus(b)
    if op in ("mul", "div") and y.shape == () and b is None:
        return _scalar_node(op, a, y.numpy())
    if op == "mul" and x.shape == () and a is None:
        return _scalar_node(op, b, x.numpy())
    return None


# --- creating tensors ------------------------------------------------------------

def infer_host_array(value, dtype):
    """Python values -> NumPy with TensorFlow's default dtypes (float32, int32)."""
    if isinstance(value, Tensor):
        value = value.numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
    else:
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif arr.dtype == np.int64 and (arr.size == 0 or
                                        np.abs(arr).max(initial=0) < 2 ** 31):
            arr = arr.astype(np.int32)
    if dtype is not None:
        arr = arr.astype(as_dtype(dtype))
    return arr


def as_function_output(value):
    """What a ``tf.function`` hands back for ``value``: a Python number or NumPy scalar becomes
    a tensor on the current device (int -> int32, float -> float32, as ``tf.constant``);
    anything else (tensors, strategies' values, None, strings) stays as it is. A value read
    on the host during the trace (``TraceTimeValue``) refuses the trace."""
    if isinstance(value, TraceTimeValue):
        recording.unrecordable("it returns a value read on the host while tracing (a metric's "
                               "result): a replay would return the first call's value (return "
                               "nothing and read metric.result() outside the function)")
        return value
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return constant(value)
    return value


def constant(value, dtype=None, shape=None, name=None, device=None):
    """A Tensor holding ``value`` on the current device (TensorFlow's ``tf.constant``).

    ``device`` (ours): place it elsewhere without a ``with mirrored.device(...)``.
    """
    arr = infer_host_array(value, dtype)
    if shape is not None:
        shape = tuple(shape)
        if arr.size == 1 and int(np.prod(shape)) != 1:
            arr = np.full(shape, arr.reshape(()), arr.dtype)
        elif arr.size == int(np.prod(shape)):
            arr = arr.reshape(shape)
        else:
            raise ValueError(f"cannot make a constant of shape {shape} from {arr.size} values.")
    dev = _dev.get_device(device) if device is not None else _dev.current_device()
    return Tensor(dev.from_numpy(arr), dev)


def zeros(shape, dtype=float32, device=None):
    """A tensor of zeros (``tf.zeros``)."""
    return constant(np.zeros(shape, as_dtype(dtype)), device=device)


def ones(shape, dtype=float32, device=None):
    """A tensor of ones (``tf.ones``)."""
    return constant(np.ones(shape, as_dtype(dtype)), device=device)


def convert_to_tensor(value, dtype=None):
    """A Tensor unchanged (checked against ``dtype``), anything else via ``constant``."""
    if isinstance(value, Tensor):
        if dtype is not None and as_dtype(dtype) != value.dtype:
            raise ValueError(f"tensor has dtype {value.dtype}, requested {as_dtype(dtype)}; use mirrored.cast.")
        return value
    return constant(value, dtype=dtype)


def identity(x, device=None):
    """A copy of ``x``: on the current device (or ``device``) for a Tensor; NumPy stays NumPy."""
    if not isinstance(x, Tensor):
        return np.array(x, copy=True)
    dst = _dev.get_device(device) if device is not None else _dev.current_device()
    with dst.activate():
        return Tensor(dst.copy_from(x._buf, x._device), dst)


def cast(x, dtype):
    """``x`` converted to ``dtype`` (float -> int truncates toward zero, as TF)."""
    dtype = as_dtype(dtype)
    if not isinstance(x, Tensor):
        return np.asarray(x).astype(dtype)
    if x.dtype == dtype:
        return x
    dev = x._device
    out = _empty(dev, x.shape, dtype)
    with dev.activate():
        dev.ops.cast(x._buf, out)
    return Tensor(out, dev)


def _normalise_axis(axis, ndim):
    if axis is None:
        return None
    if not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be None or one integer here, got {axis!r}.")
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {ndim}.")
    return int(axis) % max(ndim, 1)


def reduce_sum(x, axis=None, keepdims=False):
    """Sum over every element (``axis=None``) or over one axis, in x's dtype."""
    if not isinstance(x, Tensor):
        return np.sum(np.asarray(x), axis=axis, keepdims=keepdims, dtype=np.asarray(x).dtype)
    axis = _normalise_axis(axis, x.ndim)
    dev = x._device
    with dev.activate():
        if axis is None:
            out = _empty(dev, (1,), x.dtype)
            dev.ops.sum_all(x._buf, out)
            shape = (1,) * x.ndim if keepdims else ()
            node = _legacy(x._node)
            return Tensor(out.reshape(shape), dev, node.summed() if node is not None else None)
        else:
            outer = int(np.prod(x.shape[:axis], dtype=np.int64))
            inner = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
            x3 = x._buf.reshape(outer, x.shape[axis], inner)      # free: contiguous
            out = _empty(dev, (outer, inner), x.dtype)
            dev.ops.sum_axis(x3, out)
            shape = x.shape[:axis] + ((1,) if keepdims else ()) + x.shape[axis + 1:]
        return Tensor(out.reshape(shape), dev)


def reduce_mean(x, axis=None, keepdims=False):
    """Mean over every element or over one axis (integer tensors: truncated, as TF)."""
    if not isinstance(x, Tensor):
        arr = np.asarray(x)
        return np.mean(arr, axis=axis, keepdims=keepdims).astype(arr.dtype)
    axis = _normalise_axis(axis, x.ndim)
    count = int(np.prod(x.shape)) if axis is None else x.shape[axis]
    total = reduce_sum(x, axis, keepdims)
    out = _empty(total._device, total.shape, total.dtype)
    with total._device.activate():
        total._device.ops.binary_scalar("div", total._buf, count, out)
    return Tensor(out, total._device, _scalar_node("div", total._node, count) if count else None)


# --- the handful of other tensor functions TensorFlow's distribute pages use ------------------

def add_n(inputs):
    """The elementwise sum of a non-empty list of same-shape tensors (``tf.add_n``).

    Losses keep their GradientTape record (``model.losses`` summed this way)."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("add_n needs at least one tensor (TensorFlow refuses an empty list too); "
                         "guard it with `if model.losses:`.")
    total = inputs[0] if isinstance(inputs[0], Tensor) else convert_to_tensor(inputs[0])
    for t in inputs[1:]:
        total = total + t
    return total


def reshape(tensor, shape):
    """``tensor`` with a new ``shape`` (one entry may be -1), the same values in row-major
    order (``tf.reshape``). A Tensor's result shares its buffer; NumPy stays NumPy."""
    if not isinstance(tensor, Tensor):
        return np.reshape(np.asarray(tensor), _shape_tuple(shape))
    size = int(np.prod(tensor.shape, dtype=np.int64))
    return Tensor(tensor._buf.reshape(_resolved_shape(size, _shape_tuple(shape))), tensor._device)


def _shape_tuple(shape):
    if isinstance(shape, Tensor):
        shape = shape.numpy()
    return tuple(int(d) for d in np.atleast_1d(np.asarray(shape))) if np.ndim(shape) else (int(shape),)


def _resolved_shape(size, shape):
    """``shape`` with its one -1 worked out for ``size`` elements; ValueError if they differ."""
    unknown = [i for i, d in enumerate(shape) if d == -1]
    known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
    if len(unknown) > 1 or any(d < -1 for d in shape) or \
            (unknown and (known == 0 or size % known)) or (not unknown and known != size):
        raise ValueError(f"cannot reshape a tensor of {size} elements to shape {shape} "
                         f"(at most one -1, and the sizes must match).")
    if unknown:
        return shape[:unknown[0]] + (size // known,) + shape[unknown[0] + 1:]
    return shape


def range_(start, limit=None, delta=1, dtype=None, name=None):
    """``tf.range``: ``[start, limit)`` by ``delta`` as a 1-D tensor on the current device;
    int32 for integers and float32 for floats, as TensorFlow infers them."""
    if limit is None:
        start, limit = 0, start
    values = np.arange(start, limit, delta)
    if dtype is None:
        dtype = float32 if values.dtype.kind == "f" else int32
    return constant(values, dtype=dtype)


@recording.host_work
def print_(*inputs, output_stream=None, summarize=3, sep=" ", end="\n", name=None):
    """``tf.print``: tensors shown by value (``[0 1 2 ... 7 8 9]``: ``summarize`` items from
    each end of each axis), tuples, lists and dicts of them element by element, per-replica
    values replica by replica, anything else as ``str``; to standard error by default, as
    TensorFlow's. As in TensorFlow it prints at every call of a ``@function``, replays
    included (a host callback of the trace, reading the value that call computed;
    ``traced_function.py``), where Python's ``print`` runs while tracing only."""
    stream = sys.stderr if output_stream is None else output_stream
    print(*(_print_form(v, summarize) for v in inputs), sep=sep, end=end, file=stream)


def _print_form(value, summarize):
    """How ``tf.print`` shows ``value`` (see ``print_``)."""
    if isinstance(value, (Tensor, np.ndarray, np.generic)) or hasattr(value, "_as_tensor"):
        arr = np.asarray(value)
        if arr.ndim == 0:
            return str(arr[()])
        return np.array2string(arr, threshold=2 * summarize if summarize >= 0 else sys.maxsize,
                               edgeitems=max(summarize, 1), separator=" ")
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        parts = [_print_form(v, summarize) for v in value]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_print_form(v, summarize) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_print_form(v, summarize)}" for k, v in value.items()) + "}"
    components = getattr(value, "values", None)
    if isinstance(components, tuple) and type(value).__name__ in ("PerReplica", "Mirrored"):
        shown = ",\n".join(f"  {i}: {_print_form(v, summarize)}" for i, v in enumerate(components))
        return f"{type(value).__name__}:{{\n{shown}\n}}"
    return str(value)


class TensorShape:
    """A shape whose dimensions may be unknown (``None``): ``tf.TensorShape``.

    Compares equal to a tuple or list with the same dimensions; ``as_list()``, ``rank``,
    ``is_compatible_with``, indexing and iteration as TensorFlow's."""

    def __init__(self, dims):
        if isinstance(dims, TensorShape):
            dims = dims._dims
        self._dims = None if dims is None else tuple(None if d is None else int(d) for d in dims)

    @property
    def rank(self):
        return None if self._dims is None else len(self._dims)

    def as_list(self):
        if self._dims is None:
            raise ValueError("as_list() is not defined on an unknown TensorShape.")
        return list(self._dims)

    def is_compatible_with(self, other):
        other = TensorShape(other)
        if self._dims is None or other._dims is None:
            return True
        return len(self._dims) == len(other._dims) and all(
            a is None or b is None or a == b for a, b in zip(self._dims, other._dims))

    def __iter__(self):
        return iter(self._dims or ())

    def __len__(self):
        return len(self._dims)

    def __getitem__(self, i):
        return TensorShape(self._dims[i]) if isinstance(i, slice) else self._dims[i]

    def __eq__(self, other):
        try:
            return self._dims == TensorShape(other)._dims
        except TypeError:
            return NotImplemented

    def __hash__(self):
        return hash(self._dims)

    def __repr__(self):
        return "TensorShape(None)" if self._dims is None else f"TensorShape({list(self._dims)})"

    def __str__(self):
        if self._dims is None:
            return "<unknown>"
        return "(" + ", ".join("None" if d is None else str(d) for d in self._dims) + \
            ("," if len(self._dims) == 1 else "") + ")"


class TensorSpec:
    """What a tensor will look like: shape (dimensions may be ``None``) and dtype
    (``tf.TensorSpec``). ``Dataset.element_spec`` and ``from_generator``'s
    ``output_signature`` are structures of these."""

    def __init__(self, shape, dtype=float32, name=None):
        self.shape = TensorShape(shape)
        self.dtype = as_dtype(dtype)
        self.name = name

    @classmethod
    def from_value(cls, value):
        arr = np.asarray(value)
        return cls(arr.shape, arr.dtype)

    def is_compatible_with(self, value):
        """``value`` (a spec or an array) has this dtype and a compatible shape."""
        if isinstance(value, TensorSpec):
            return value.dtype == self.dtype and self.shape.is_compatible_with(value.shape)
        arr = np.asarray(value)
        return arr.dtype == self.dtype and self.shape.is_compatible_with(arr.shape)

    def __eq__(self, other):
        return (isinstance(other, TensorSpec) and self.shape == other.shape
                and self.dtype == other.dtype and self.name == other.name)

    def __hash__(self):
        return hash((self.shape, self.dtype, self.name))

    def __repr__(self):
        return f"TensorSpec(shape={self.shape}, dtype=tf.{self.dtype.name}, name={self.name!r})"
