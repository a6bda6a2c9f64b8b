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

``cast``, ``reduce_sum``, ``reduce_mean`` and ``identity`` also accept NumPy
values and answer in NumPy, so ``Dataset.map(scale)`` from the course lab works
on the host pipeline unchanged.

Neighbours: ``devices.py`` (where buffers live), ``backends.py`` (the ops).
"""
import numbers

import numpy as np

from mirrored import devices as _dev
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


class Tensor:
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

    def numpy(self):
        """A NumPy copy on the host (a NumPy scalar for shape ``()``, as TF)."""
        host = self._device.to_numpy(self._buf)
        return host[()] if host.ndim == 0 else host

    def __array__(self, dtype=None, copy=None):
        host = np.asarray(self._device.to_numpy(self._buf))
        return host if dtype is None else host.astype(dtype)

    def __repr__(self):
        return f"<Tensor: shape={self.shape}, dtype={self.dtype}, numpy={numpy_repr(self.numpy())}>"

    def __str__(self):
        return f"Tensor({self.numpy()}, shape={self.shape}, dtype={self.dtype})"

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a scalar (shape ()) Tensor is undefined.")
        return self.shape[0]

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

    # -- arithmetic: + - * / with scalars and same-shape tensors, unary minus
    def __add__(self, other):
        return _binary("add", self, other)

    def __radd__(self, other):
        return _binary("add", self, other)

    def __sub__(self, other):
        return _binary("sub", self, other)

    def __rsub__(self, other):
        return _binary("rsub", self, other)

    def __mul__(self, other):
        return _binary("mul", self, other)

    def __rmul__(self, other):
        return _binary("mul", self, other)

    def __truediv__(self, other):
        return _binary("div", self, other)

    def __rtruediv__(self, other):
        return _binary("rdiv", self, other)

    def __neg__(self):
        out = _empty(self._device, self.shape, self.dtype)
        with self._device.activate():
            self._device.ops.unary("neg", self._buf, out)
        return Tensor(out, self._device)


def numpy_repr(value):
    """How TensorFlow shows a tensor's value: ``1.0`` for scalars, ``array([0])`` otherwise."""
    return str(value) if np.ndim(value) == 0 else repr(value)


class HostTensor(np.ndarray):
    """A result on the host: a NumPy array that also answers ``.numpy()``.

    ``strategy.reduce`` and ``strategy.gather`` return these, so code written
    for TensorFlow (``strategy.reduce(...).numpy()``) and NumPy code both work.
    """

    @classmethod
    def wrap(cls, value):
        return np.asarray(value).view(cls)

    def numpy(self):
        plain = self.view(np.ndarray)
        return plain[()] if plain.ndim == 0 else plain

    @property
    def device(self):
        return f"{_dev.LONG_PREFIX}CPU:0"


def _empty(device, shape, dtype):
    return device.empty(shape, dtype)


def _is_scalar(value):
    return isinstance(value, numbers.Number) or (isinstance(value, np.ndarray) and value.ndim == 0)


def _binary(op, x, other):
    """x <op> other, where other is a Python/NumPy scalar, a NumPy array or a Tensor."""
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
        return Tensor(out, dev)
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
    return Tensor(out, dev)


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
    return Tensor(out, total._device)
