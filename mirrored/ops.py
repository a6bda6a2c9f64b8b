"""TensorFlow's ops, as one table: what each computes, and its gradient.

Each op is a lesson in three lines: it checks its inputs, launches its kernel through
``dev.ops`` on the device its inputs live on (the CPU backend runs the kernel's NumPy
reference, a GPU the Numba kernel: ``kernels/``), and tells the tape its gradient rule
(``autodiff.record``). The rules are written in these same ops, so a tape recording the
backward pass of another gives second derivatives.

======================  ======================================  ==================================
op (TensorFlow's name)  forward (kernel)                        gradient rule (g = d target / d out)
======================  ======================================  ==================================
add  x + y              broadcast_binary("add")                 g, g           (each summed back to
sub  x - y              broadcast_binary("sub")                 g, -g           its input's shape:
multiply  x * y         broadcast_binary("mul")                 g*y, g*x        ``unbroadcast``)
divide  x / y           broadcast_binary("div")                 g/y, -g*x/y**2
pow  x ** y             broadcast_binary("pow")                 g*y*x**(y-1), g*z*log(x) where x>0
maximum, minimum        broadcast_binary                        g to x where x>=y (x<=y), else to y
squared_difference      broadcast_binary                        2(x-y)g, -2(x-y)g
floordiv, floormod      broadcast_binary                        None; (g, -g*floordiv(x, y))
less, equal, ...        broadcast_binary -> bool                none (bool)
where(c, x, y)          where                                   where(c, g, 0), where(c, 0, g)
neg abs exp log ...     unary_math(op)                          UNARY_GRAD below (e.g. exp: g*y)
sigmoid tanh relu ...   unary_math(op)                          g*y*(1-y), g*(1-y**2), g where x>0
cast                    cast                                    g cast back (float -> float only)
reduce_sum/mean         reduce_axis("sum") per axis             g broadcast back to x's shape
reduce_max/min          reduce_axis("max"/"min")                g shared among the ties
reduce_prod             reduce_axis("prod")                     g*prod/x
argmax/argmin           arg_reduce_axis                         none (int64)
matmul                  gemm                                    g@b^T, a^T@g
reshape, expand_dims,   none (a view of the same buffer)        g reshaped back
squeeze
transpose               strided_copy (strides permuted)         transpose(g, inverse perm)
x[...] (slicing)        strided_copy (offset, strides)          g copied into zeros at the slice
concat, stack           strided_copy into slabs                 g sliced per input
broadcast_to            strided_copy (stride 0)                 g summed back
one_hot, gather,        compositions of the ops above           (follows from theirs)
softmax,
log_softmax, the
cross entropies
random.normal/uniform   random_fill, random_advance (random.py)  none (no input)
image.resize            resize                                  none here
======================  ======================================  ==================================

TensorFlow's rules kept: NumPy broadcasting; a Python number takes the tensor's dtype,
a float that is not whole with an integer tensor is a TypeError; two tensors of different
dtypes are an ``InvalidArgumentError`` (cast one first), never a silent cast; ``/`` on
integers answers in floating point (int8/16 -> float32, int32/64 -> float64); ``//`` and
``%`` floor; comparisons give bool; integer outputs carry no gradient.

The model call and our losses are not in this table: a model's output is ONE node whose
backward is the engine's fused backward (``keras/tape.py``).

Neighbours: ``autodiff.py`` (the tape's graph and walk), ``tensor.py`` (the Tensor; its
operators call the functions here through ``tensor.OPERATORS``), ``kernels/broadcast.py``,
``kernels/unary_math.py``, ``kernels/reduce_axis.py``, ``kernels/strided_copy.py``,
``kernels/random_fill.py``, ``kernels/resize.py``.
"""
import numbers

import numpy as np

from kernels import broadcast, unary_math
from mirrored import autodiff, devices
from mirrored.program import recording
from mirrored import tensor
from mirrored.errors import InvalidArgumentError
from mirrored.tensor import Tensor, as_dtype, cast as _cast_no_grad
from mirrored.values import Variable

newaxis = None


# --- inputs ---------------------------------------------------------------------------------

def _is_legacy(t):
    """A loss made by our loss objects from a model's output (``keras/tape.py``'s ``_Loss`` and
    ``_Scaled``, which know ``scaled`` and ``plus``): arithmetic keeps the fused loss path.
    A model's output itself is not: ops on it are recorded, it is a leaf of the graph."""
    return isinstance(t, Tensor) and t.node is not None and hasattr(t.node, "scaled")


def as_tensor(value, dtype=None, device=None):
    """A Tensor for ``value``: tensors as they are; a variable's value (watched by a
    recording tape); anything else a constant on ``device`` (default: the current one)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, Variable):
        return autodiff.read_variable(value, value.value())
    if hasattr(value, "values") and not isinstance(value, (np.ndarray, list, tuple, dict)):
        raise TypeError(f"{type(value).__name__} holds one value per replica: use it inside "
                        f"strategy.run (each replica gets its own), or strategy.reduce it first.")
    return tensor.constant(value, dtype=dtype, device=device)


def _number(value):
    if type(value) in (float, int):                  # the common case, checked first
        return True
    return isinstance(value, (numbers.Number, np.number, np.bool_)) and not isinstance(value, Tensor)


_constants = {}                    # (id(device), dtype, bytes) -> (device, Tensor): numbers met in ops
_CONSTANTS_KEPT = 256


def _constant(arr, dev):
    """``arr`` (a NumPy value, usually a 0-d number such as the 0 of ``x > 0``) as a tensor on
    ``dev``, uploaded once and kept: ops never write their inputs, so one copy serves every
    step (a training step would otherwise upload its numbers every time)."""
    if arr.size > 16:
        return tensor.constant(arr, device=dev)
    key = (id(dev), arr.dtype.str, arr.shape, arr.tobytes())
    entry = _constants.get(key)
    if entry is None or entry[0] is not dev:
        if len(_constants) >= _CONSTANTS_KEPT:
            _constants.clear()
        with recording.initialization():           # made once: a replay never redoes it
            entry = _constants[key] = (dev, tensor.constant(arr, device=dev))
    return entry[1]


def _pair(op, x, y):
    """Both operands as Tensors of one dtype on one device (TensorFlow's conversion rules)."""
    first = x if isinstance(x, (Tensor, Variable)) else y
    if not isinstance(first, (Tensor, Variable)):
        x = as_tensor(x)
        first = x
    anchor = as_tensor(first)
    dtype, dev = anchor.dtype, anchor.dev
    out = []
    for v in (x, y):
        if v is first:
            out.append(anchor)
        elif isinstance(v, (Tensor, Variable)):
            out.append(as_tensor(v))
        else:
            arr = np.asarray(v)
            if arr.dtype == object:
                raise TypeError(f"{op}: cannot convert {v!r} to a tensor.")
            if dtype.kind in "iu" and arr.dtype.kind == "f" and np.any(arr != np.floor(arr)):
                raise TypeError(f"{op}: cannot combine a {dtype} tensor with the non-integer value "
                                f"{v!r}; cast the tensor first: mirrored.cast(x, mirrored.float32).")
            out.append(_constant(arr.astype(dtype), dev))
    a, b = out
    if a.dev is not b.dev:
        raise InvalidArgumentError(
            f"{op}: the tensors are on two devices, {a.device} and {b.device}. Copy one across "
            f"first, e.g. mirrored.identity(t, device='{a.dev.short_name}').")
    if a.dtype != b.dtype:
        raise InvalidArgumentError(
            f"cannot compute {op} of a {a.dtype} tensor and a {b.dtype} tensor: TensorFlow "
            f"never casts silently; cast one first, e.g. mirrored.cast(t, mirrored.{a.dtype}).")
    return a, b


def empty(dev, shape, dtype):
    """A new tensor of ``shape`` on ``dev``, not yet written (every op's output)."""
    return Tensor(dev.empty(tuple(shape), as_dtype(dtype)), dev)


def flat(t):
    """``t``'s buffer as 1-D (free: buffers are C-contiguous)."""
    return t.buf.reshape(int(np.prod(t.shape, dtype=np.int64)))


# --- elementwise between two tensors (broadcasting) -----------------------------------------

def _shape_of(op, *shapes):
    """The broadcast shape, or TensorFlow's InvalidArgumentError naming the shapes."""
    try:
        return broadcast.broadcast_shape(*shapes)
    except ValueError as e:
        raise InvalidArgumentError(f"{op}: {e}") from None


def _broadcast_op(op, x, y, name=None):
    out_shape = _shape_of(op, x.shape, y.shape)
    dev = x.dev
    out = empty(dev, out_shape, broadcast.result_dtype(op, x.dtype))
    if out.buf.size:
        with dev.activate():
            dev.ops.broadcast_binary(op, x.buf, y.buf, out.buf)
    return out


def unbroadcast(g, shape):
    """``g`` summed over the axes broadcasting stretched, back to ``shape`` (every binary
    op's gradient ends here)."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = len(g.shape) - len(shape)
    axes = list(range(lead)) + [lead + k for k, n in enumerate(shape) if n == 1 and g.shape[lead + k] != 1]
    return reshape(reduce_sum(g, axis=axes), shape)


#: Ops with a same-shape/scalar kernel (``kernels/elementwise.py``): a Python number
#: operand goes in as a kernel argument (nothing uploaded), and our losses keep their node.
_SCALAR_OPS = {"add": ("add", "add"), "sub": ("sub", "rsub"), "mul": ("mul", "mul"), "div": ("div", "rdiv")}
#: Their gradient rules with a number ``s`` on one side: (t <op> s, s <op> t) -> d/dt.
_SCALAR_GRADS = {
    "add": (lambda g, t, s: g, lambda g, t, s: g),
    "sub": (lambda g, t, s: g, lambda g, t, s: negative(g)),
    "mul": (lambda g, t, s: g * s, lambda g, t, s: g * s),
    "div": (lambda g, t, s: g / s, lambda g, t, s: negative(g) * s / square(t)),
}


def _scalar_path(op, x, y, grad):
    """``x <op> y`` by the scalar/same-shape kernels when one side is a Python number, or a
    loss of the fused path is involved; None when the broadcasting path must run."""
    if not (_number(x) or _number(y) or _is_legacy(x) or _is_legacy(y)):
        return None                              # two tensors, no loss of the fused path
    for k, (t, other) in enumerate(((x, y), (y, x))):
        if isinstance(t, Variable):
            t = as_tensor(t)
        if not isinstance(t, Tensor):
            continue
        number = _number(other)
        same = isinstance(other, Tensor) and other.dev is t.dev and other.dtype == t.dtype and (
            other.shape in ((), t.shape)) and (other.node is None or _is_legacy(other))
        if op in ("mul", "div") and same and other.shape != ():
            same = False      # a loss vector times a vector (sample weights): recorded, below
        if _is_legacy(t) and (number or same):
            return tensor.elementwise(_SCALAR_OPS[op][k], t, other)      # the fused loss path
        if number and (t.dtype.kind == "f" or k == 0 or op in ("add", "mul")):
            out = tensor.elementwise(_SCALAR_OPS[op][k], t, other)
            rule = _SCALAR_GRADS[op][k]
            return autodiff.record(op, (t,), out, lambda g, t=t, other=other, rule=rule: (rule(g, t, other),))
    return None


def _binary(op, x, y, grad):
    """``x <op> y`` as a Tensor, with the gradient rule ``grad(g, x, y, out) -> (dx, dy)``
    (None: no gradient) told to the tape; each part is summed back to its input's shape."""
    if op in _SCALAR_OPS and (out := _scalar_path(op, x, y, grad)) is not None:
        return out
    x, y = _pair(op, x, y)
    out = _broadcast_op(op, x, y)
    if grad is None:
        return out
    return autodiff.record(op, (x, y), out, lambda g, wanted: tuple(
        None if d is None or not w else unbroadcast(d, t.shape)
        for d, t, w in zip(grad(g, x, y, out), (x, y), wanted)), partial=True)


def add(x, y, name=None):
    return _binary("add", x, y, lambda g, x, y, z: (g, g))


def subtract(x, y, name=None):
    return _binary("sub", x, y, lambda g, x, y, z: (g, negative(g)))


def multiply(x, y, name=None):
    return _binary("mul", x, y, lambda g, x, y, z: (g * y, g * x))


def _true_operands(x, y):
    """TensorFlow's truediv: integer operands are cast to floating point first."""
    out = []
    for v in (x, y):
        if isinstance(v, (Tensor, Variable)) and v.dtype.kind in "iub":
            v = cast(as_tensor(v), "float64" if v.dtype.itemsize >= 4 else "float32")
        out.append(v)
    return out


def divide(x, y, name=None):
    x, y = _true_operands(x, y)
    return _binary("div", x, y, lambda g, x, y, z: (g / y, negative(g) * x / square(y)))


def floordiv(x, y, name=None):
    return _binary("floordiv", x, y, lambda g, x, y, z: (None, None))


def floormod(x, y, name=None):
    return _binary("mod", x, y, lambda g, x, y, z: (g, negative(g) * floordiv(x, y)))


def _pow_grad(g, x, y, z):
    gx = g * y * pow(x, y - 1)
    positive = greater(x, 0)
    safe_x = where(positive, x, ones_like(x))
    gy = g * z * where(positive, log(safe_x), zeros_like(x))
    return gx, gy


def pow(x, y, name=None):  # noqa: A001 (tf.pow)
    return _binary("pow", x, y, _pow_grad)


def maximum(x, y, name=None):
    def grad(g, x, y, z):
        mask = greater_equal(x, y)
        return where(mask, g, zeros_like(g)), where(mask, zeros_like(g), g)
    return _binary("maximum", x, y, grad)


def minimum(x, y, name=None):
    def grad(g, x, y, z):
        mask = less_equal(x, y)
        return where(mask, g, zeros_like(g)), where(mask, zeros_like(g), g)
    return _binary("minimum", x, y, grad)


def squared_difference(x, y, name=None):
    def grad(g, x, y, z):
        d = g * 2.0 * (x - y)
        return d, negative(d)
    return _binary("squared_difference", x, y, grad)


def _comparison(op):
    def compare(x, y, name=None):
        return _binary(op, x, y, None)
    compare.__name__ = op
    compare.__doc__ = f"``tf.math.{op}``: elementwise, broadcasting, a bool tensor."
    return compare


less, less_equal, greater, greater_equal, equal, not_equal = (
    _comparison(op) for op in ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal"))


def _logical(op):
    def logic(x, y, name=None):
        x, y = as_tensor(x), as_tensor(y)
        if x.dtype != np.bool_ or y.dtype != np.bool_:
            raise InvalidArgumentError(f"{op} takes bool tensors, got {x.dtype} and {y.dtype}; "
                                       f"compare first (x > 0) or mirrored.cast(t, mirrored.bool).")
        return _binary(op, x, y, None)
    logic.__name__ = op
    return logic


logical_and, logical_or, logical_xor = (_logical(op) for op in ("logical_and", "logical_or", "logical_xor"))


def where(condition, x=None, y=None, name=None):
    """``x`` where ``condition`` else ``y``, the three broadcast together (``tf.where``)."""
    if x is None and y is None:
        raise NotImplementedError("tf.where(condition) alone (the indices of True values) is not "
                                  "implemented: its shape depends on the data. Give x and y.")
    cond = as_tensor(condition)
    if cond.dtype != np.bool_:
        raise InvalidArgumentError(f"where: condition must be a bool tensor, got {cond.dtype}.")
    x, y = _pair("where", x, y)
    if cond.dev is not x.dev:
        raise InvalidArgumentError(f"where: condition on {cond.device}, values on {x.device}.")
    shape = _shape_of("where", cond.shape, x.shape, y.shape)
    out = empty(x.dev, shape, x.dtype)
    if out.buf.size:
        with x.dev.activate():
            x.dev.ops.where(cond.buf, x.buf, y.buf, out.buf)

    def grad(g):
        zero = zeros_like(g)
        return unbroadcast(where(cond, g, zero), x.shape), unbroadcast(where(cond, zero, g), y.shape)
    return autodiff.record("where", (x, y), out, grad)


# --- elementwise of one tensor ----------------------------------------------------------------

def _unary_op(op, x, alpha=0.0):
    x = as_tensor(x)
    if op not in unary_math.INTEGER_OK + unary_math.BOOL_OPS and x.dtype.kind != "f":
        raise InvalidArgumentError(f"{op} takes a floating-point tensor, got {x.dtype}; cast it "
                                   f"first: mirrored.cast(x, mirrored.float32).")
    out = empty(x.dev, x.shape, x.dtype)
    if out.buf.size:
        with x.dev.activate():
            x.dev.ops.unary_math(op, x.buf, out.buf, alpha)
    return x, out


#: op -> the gradient rule g(dy, x, y, alpha) -> dx, written in ops. None: no gradient.
UNARY_GRAD = {
    "neg": lambda g, x, y, a: negative(g),
    "abs": lambda g, x, y, a: g * sign(x),
    "sign": lambda g, x, y, a: zeros_like(g),
    "square": lambda g, x, y, a: g * (x * 2.0),
    "exp": lambda g, x, y, a: g * y,
    "log": lambda g, x, y, a: g / x,
    "log1p": lambda g, x, y, a: g / (x + 1.0),
    "expm1": lambda g, x, y, a: g * (y + 1.0),
    "sqrt": lambda g, x, y, a: g * 0.5 / y,
    "rsqrt": lambda g, x, y, a: g * -0.5 * y * y * y,
    "reciprocal": lambda g, x, y, a: negative(g) * y * y,
    "sin": lambda g, x, y, a: g * cos(x),
    "cos": lambda g, x, y, a: negative(g) * sin(x),
    "tanh": lambda g, x, y, a: g * (1.0 - y * y),
    "sigmoid": lambda g, x, y, a: g * y * (1.0 - y),
    "softplus": lambda g, x, y, a: g * sigmoid(x),
    "relu": lambda g, x, y, a: _relu_grad(g, y),
    "leaky_relu": lambda g, x, y, a: where(greater(x, 0), g, g * a),
    "elu": lambda g, x, y, a: where(greater(x, 0), g, g * (y + a)),
    "round": None, "floor": None, "ceil": None, "logical_not": None,
}


def _relu_grad(g, y):
    """``g`` where the ReLU's output ``y`` > 0, else 0: the engine's fused kernel (float32),
    itself differentiable in ``g`` (the same mask), so nested tapes go through it."""
    if g.dtype != np.float32 or y.dtype != np.float32 or g.shape != y.shape:
        return where(greater(y, 0), g, zeros_like(g))
    out = empty(g.dev, g.shape, g.dtype)
    if out.buf.size:
        with g.dev.activate():
            g.dev.ops.relu_backward(flat(g), flat(y), flat(out))
    return autodiff.record("relu_grad", (g,), out, lambda gg: (_relu_grad(gg, y),))


def _unary(op, doc):
    def fn(x, name=None, alpha=None):
        a = 0.0 if alpha is None else float(alpha)
        if isinstance(x, Tensor) and op == "neg" and _is_legacy(x):
            return tensor.elementwise("mul", x, -1.0)
        x, y = _unary_op(op, x, a)
        rule = UNARY_GRAD[op]
        if rule is None:
            return y
        return autodiff.record(op, (x,), y, lambda g: (rule(g, x, y, a),))
    fn.__name__ = op
    fn.__doc__ = doc
    return fn


negative = _unary("neg", "``-x`` (``tf.negative``).")
abs = _unary("abs", "``|x|`` (``tf.abs``); the gradient at 0 is 0, as TF's sign.")  # noqa: A001
sign = _unary("sign", "-1, 0 or 1 (``tf.sign``).")
square = _unary("square", "``x * x`` (``tf.square``).")
exp = _unary("exp", "``e ** x``.")
log = _unary("log", "natural logarithm (``log(0) = -inf``).")
log1p = _unary("log1p", "``log(1 + x)``, accurate near 0.")
expm1 = _unary("expm1", "``exp(x) - 1``, accurate near 0.")
sqrt = _unary("sqrt", "square root.")
rsqrt = _unary("rsqrt", "``1 / sqrt(x)``.")
reciprocal = _unary("reciprocal", "``1 / x``.")
sin = _unary("sin", "sine.")
cos = _unary("cos", "cosine.")
tanh = _unary("tanh", "hyperbolic tangent.")
sigmoid = _unary("sigmoid", "``1 / (1 + exp(-x))``, without overflow.")
softplus = _unary("softplus", "``log(1 + exp(x))``, without overflow.")
relu = _unary("relu", "``max(x, 0)`` (``tf.nn.relu``).")
round = _unary("round", "rounds half to even, as ``tf.round``.")  # noqa: A001
floor = _unary("floor", "rounds down.")
ceil = _unary("ceil", "rounds up.")
_logical_not = _unary("logical_not", "")


def logical_not(x, name=None):
    x = as_tensor(x)
    if x.dtype != np.bool_:
        raise InvalidArgumentError(f"logical_not takes a bool tensor, got {x.dtype}.")
    return _logical_not(x)


_leaky_relu = _unary("leaky_relu", "")
_elu = _unary("elu", "")


def leaky_relu(features, alpha=0.2, name=None):
    """``x if x > 0 else alpha * x`` (``tf.nn.leaky_relu``; TF's default alpha is 0.2)."""
    return _leaky_relu(features, alpha=alpha)


def elu(features, alpha=1.0, name=None):
    """``x if x > 0 else alpha * (exp(x) - 1)`` (``tf.nn.elu``)."""
    return _elu(features, alpha=alpha)


def cast(x, dtype, name=None):
    """``x`` in ``dtype`` (float -> int truncates toward zero); float -> float keeps the gradient."""
    dtype = as_dtype(dtype)
    if not isinstance(x, (Tensor, Variable)):
        return _cast_no_grad(x, dtype)
    x = as_tensor(x)
    if x.dtype == dtype:
        return x
    if dtype == np.bool_:                              # TF: nonzero -> True
        return not_equal(x, zeros((), x.dtype, device=x.dev))
    if x.dtype == np.bool_:                            # True -> 1, False -> 0
        return where(x, ones((), dtype, device=x.dev), zeros((), dtype, device=x.dev))
    out = _cast_no_grad(x, dtype)
    if dtype.kind != "f" or x.dtype.kind != "f":
        return out
    return autodiff.record("cast", (x,), out, lambda g: (cast(g, x.dtype),))


def stop_gradient(x, name=None):
    """``x``'s value with no gradient through it (``tf.stop_gradient``)."""
    x = as_tensor(x)
    return Tensor(x.buf, x.dev)


def clip_by_value(t, clip_value_min, clip_value_max, name=None):
    return minimum(maximum(t, clip_value_min), clip_value_max)


# --- reductions -----------------------------------------------------------------------------

def _axes(axis, ndim):
    if axis is None:
        return list(range(ndim))
    axes = [axis] if isinstance(axis, (int, np.integer)) else list(np.asarray(axis).reshape(-1))
    out = []
    for a in axes:
        a = int(a)
        if not -ndim <= a < max(ndim, 1):
            raise InvalidArgumentError(f"axis {a} is out of range for a tensor of rank {ndim} "
                                       f"(valid: {-ndim} .. {ndim - 1}).")
        out.append(a % max(ndim, 1))
    return sorted(set(out))


def _reduce_one(op, x, a):
    """``op`` over axis ``a`` of x, keeping the axis (size 1)."""
    outer = int(np.prod(x.shape[:a], dtype=np.int64))
    inner = int(np.prod(x.shape[a + 1:], dtype=np.int64))
    shape = x.shape[:a] + (1,) + x.shape[a + 1:]
    out = empty(x.dev, shape, x.dtype)
    if out.buf.size:
        with x.dev.activate():
            x.dev.ops.reduce_axis(op, x.buf.reshape(outer, x.shape[a], inner), out.buf.reshape(outer, inner))
    return out


def _reduce(op, x, axis, keepdims):
    axes = _axes(axis, x.ndim)
    y = x
    for a in axes:
        y = _reduce_one(op, y, a)
    kept = y
    if not keepdims:
        y = Tensor(y.buf.reshape(tuple(n for k, n in enumerate(x.shape) if k not in axes)), y.dev)
    return kept, y, axes


def reduce_sum(input_tensor, axis=None, keepdims=False, name=None):
    x = input_tensor
    if not isinstance(x, (Tensor, Variable)):
        return tensor.reduce_sum(x, axis, keepdims)
    x = as_tensor(x)
    if _is_legacy(x) and axis is None:
        return tensor.reduce_sum(x, None, keepdims)
    if x.dtype == np.bool_:
        raise InvalidArgumentError("reduce_sum of a bool tensor: cast it first (mirrored.cast(t, mirrored.int32)).")
    kept, y, _ = _reduce("sum", x, axis, keepdims)
    return autodiff.record("reduce_sum", (x,), y, lambda g: (broadcast_to(reshape(g, kept.shape), x.shape),))


def reduce_mean(input_tensor, axis=None, keepdims=False, name=None):
    x = input_tensor
    if not isinstance(x, (Tensor, Variable)):
        return tensor.reduce_mean(x, axis, keepdims)
    x = as_tensor(x)
    if _is_legacy(x) and axis is None:
        return tensor.reduce_mean(x, None, keepdims)
    count = int(np.prod([x.shape[a] for a in _axes(axis, x.ndim)], dtype=np.int64))
    total = reduce_sum(x, axis, keepdims)
    if x.dtype.kind in "iu":                     # TF: the integer mean truncates toward zero
        return cast(total / max(count, 1), x.dtype)
    return total / float(count) if count else total / 0.0


def _extreme(op):
    def reduce(input_tensor, axis=None, keepdims=False, name=None):
        x = as_tensor(input_tensor)
        kept, y, _ = _reduce(op, x, axis, keepdims)

        def grad(g):
            ties = cast(equal(x, kept), g.dtype)
            count = reduce_sum(ties, axis, keepdims=True)
            return (ties / count * reshape(g, kept.shape),)
        return autodiff.record(f"reduce_{op}", (x,), y, grad)
    reduce.__name__ = f"reduce_{op}"
    reduce.__doc__ = (f"``tf.reduce_{op}``; its gradient is shared equally among the elements "
                      f"equal to the {op}imum (TensorFlow's rule for ties).")
    return reduce


reduce_max, reduce_min = _extreme("max"), _extreme("min")


def reduce_prod(input_tensor, axis=None, keepdims=False, name=None):
    x = as_tensor(input_tensor)
    kept, y, _ = _reduce("prod", x, axis, keepdims)
    return autodiff.record("reduce_prod", (x,), y, lambda g: (reshape(g, kept.shape) * kept / x,))


def reduce_any(input_tensor, axis=None, keepdims=False, name=None):
    return _reduce("any", as_tensor(input_tensor), axis, keepdims)[1]


def reduce_all(input_tensor, axis=None, keepdims=False, name=None):
    return _reduce("all", as_tensor(input_tensor), axis, keepdims)[1]


def _arg(op):
    def arg(input, axis=None, output_type=np.int64, name=None):  # noqa: A002 (TF's name)
        x = as_tensor(input)
        a = _axes(0 if axis is None else axis, x.ndim)[0]
        outer = int(np.prod(x.shape[:a], dtype=np.int64))
        inner = int(np.prod(x.shape[a + 1:], dtype=np.int64))
        if x.shape[a] == 0:
            raise InvalidArgumentError(f"{op} over an empty axis (size 0) has no answer.")
        out = empty(x.dev, x.shape[:a] + x.shape[a + 1:], np.int64)
        if out.buf.size:
            with x.dev.activate():
                x.dev.ops.arg_reduce_axis(op, x.buf.reshape(outer, x.shape[a], inner), out.buf.reshape(outer, inner))
        return out if as_dtype(output_type) == np.int64 else cast(out, output_type)
    arg.__name__ = op
    return arg


argmax, argmin = _arg("argmax"), _arg("argmin")


# --- matrix product -------------------------------------------------------------------------

def matmul(a, b, transpose_a=False, transpose_b=False, name=None):
    """``a @ b`` over the last two axes (``tf.matmul``); a batch of matrices times one matrix
    is one GEMM of the batch's rows."""
    a, b = _pair("matmul", a, b)
    if a.ndim < 2 or b.ndim < 2:
        raise InvalidArgumentError(f"matmul needs tensors of rank >= 2, got shapes {a.shape} and "
                                   f"{b.shape}; use tf.expand_dims or tf.tensordot for vectors.")
    if a.ndim > 2 and b.ndim == 2 and not transpose_a:
        lead = a.shape[:-1]
        return reshape(matmul(reshape(a, (-1, a.shape[-1])), b, transpose_b=transpose_b),
                       lead + (b.shape[0] if transpose_b else b.shape[1],))
    if a.ndim > 2 or b.ndim > 2:
        if a.shape[:-2] != b.shape[:-2]:
            raise InvalidArgumentError(f"matmul: batch shapes {a.shape[:-2]} and {b.shape[:-2]} "
                                       f"differ; broadcast them first (tf.broadcast_to).")
        batch = int(np.prod(a.shape[:-2], dtype=np.int64))
        a3, b3 = reshape(a, (batch,) + a.shape[-2:]), reshape(b, (batch,) + b.shape[-2:])
        parts = [matmul(a3[i], b3[i], transpose_a, transpose_b) for i in range(batch)]
        out = stack(parts)
        return reshape(out, a.shape[:-2] + out.shape[-2:])
    m, k = a.shape[::-1] if transpose_a else a.shape
    k2, n = b.shape[::-1] if transpose_b else b.shape
    if k != k2:
        raise InvalidArgumentError(f"matmul: inner dimensions differ: {a.shape}{'^T' if transpose_a else ''} "
                                   f"@ {b.shape}{'^T' if transpose_b else ''} ({k} vs {k2}).")
    if a.dtype != np.float32:
        # our GEMM kernel is float32; other dtypes (float64, int32) as a broadcast product
        # summed over k: m*k*n elements, the same answer on every backend
        a2 = transpose(a) if transpose_a else a
        b2 = transpose(b) if transpose_b else b
        return reduce_sum(expand_dims(a2, 2) * expand_dims(b2, 0), axis=1)
    out = empty(a.dev, (m, n), a.dtype)
    with a.dev.activate():
        if out.buf.size and k:
            a.dev.ops.gemm(a.buf, b.buf, out.buf, trans_a=transpose_a, trans_b=transpose_b)
        elif out.buf.size:
            a.dev.ops.fill(out.buf, 0)

    def grad(g, wanted):
        ga = gb = None
        if wanted[0]:
            ga = matmul(b, g, transpose_a=transpose_b, transpose_b=True) if transpose_a else \
                matmul(g, b, transpose_b=not transpose_b)
        if wanted[1]:
            gb = matmul(g, a, transpose_a=True, transpose_b=transpose_a) if transpose_b else \
                matmul(a, g, transpose_a=not transpose_a)
        return ga, gb
    return autodiff.record("matmul", (a, b), out, grad, partial=True)


# --- shapes, slicing, joining ---------------------------------------------------------------

def reshape(tensor_, shape, name=None):
    """The same values in a new shape (one entry may be -1): a view, no copy."""
    if not isinstance(tensor_, (Tensor, Variable)):
        return tensor.reshape(tensor_, shape)
    x = as_tensor(tensor_)
    y = tensor.reshape(x, shape)
    if y.shape == x.shape and _is_legacy(x):
        return x
    return autodiff.record("reshape", (x,), y, lambda g: (reshape(g, x.shape),))


def expand_dims(input, axis, name=None):  # noqa: A002
    x = as_tensor(input)
    a = int(axis)
    if not -x.ndim - 1 <= a <= x.ndim:
        raise InvalidArgumentError(f"expand_dims: axis {a} is out of range for rank {x.ndim}.")
    a = a % (x.ndim + 1)
    return reshape(x, x.shape[:a] + (1,) + x.shape[a:])


def squeeze(input, axis=None, name=None):  # noqa: A002
    x = as_tensor(input)
    if axis is None:
        return reshape(x, tuple(n for n in x.shape if n != 1))
    axes = _axes(axis, x.ndim)
    for a in axes:
        if x.shape[a] != 1:
            raise InvalidArgumentError(f"squeeze: axis {a} has size {x.shape[a]}, not 1 (shape {x.shape}).")
    return reshape(x, tuple(n for k, n in enumerate(x.shape) if k not in axes))


def _contiguous_strides(shape):
    strides, step = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        strides[k] = step
        step *= shape[k]
    return strides


def _copy_view(x, shape, offset, strides):
    """A new contiguous tensor holding the view (offset, strides, shape) of x."""
    out = empty(x.dev, shape, x.dtype)
    if out.buf.size:
        with x.dev.activate():
            x.dev.ops.strided_copy(flat(x), flat(out), tuple(shape), int(offset), tuple(strides),
                                   0, tuple(_contiguous_strides(shape)))
    return out


def _check_rank(x, what):
    if x.ndim > broadcast.MAX_DIMS:
        raise InvalidArgumentError(f"{what}: tensors of rank <= {broadcast.MAX_DIMS} only, got {x.shape}.")


def transpose(a, perm=None, conjugate=False, name=None):
    x = as_tensor(a)
    _check_rank(x, "transpose")
    perm = list(range(x.ndim))[::-1] if perm is None else [int(p) % max(x.ndim, 1) for p in perm]
    if sorted(perm) != list(range(x.ndim)):
        raise InvalidArgumentError(f"transpose: perm {perm} is not a permutation of 0..{x.ndim - 1}.")
    src = _contiguous_strides(x.shape)
    out = _copy_view(x, tuple(x.shape[p] for p in perm), 0, [src[p] for p in perm])
    inverse = list(np.argsort(perm))
    return autodiff.record("transpose", (x,), out, lambda g: (transpose(g, inverse),))


def broadcast_to(input, shape, name=None):  # noqa: A002
    x = as_tensor(input)
    shape = tuple(int(n) for n in shape)
    if _shape_of("broadcast_to", x.shape, shape) != shape:
        raise InvalidArgumentError(f"broadcast_to: cannot broadcast {x.shape} to {shape}.")
    if shape == x.shape:
        return x
    out = _copy_view(x, shape, 0, broadcast.broadcast_strides(x.shape, shape))
    return autodiff.record("broadcast_to", (x,), out, lambda g: (unbroadcast(g, x.shape),))


def _parse_index(shape, key):
    """Python's indexing (ints, slices, ..., None) -> (offset, strides, shape) of the view."""
    if not isinstance(key, tuple):
        key = (key,)
    for k in key:
        if isinstance(k, (Tensor, Variable, list, np.ndarray)) and not isinstance(k, np.integer):
            raise TypeError("indexing with a tensor or a list (fancy indexing) is not supported: use "
                            "tf.gather(x, indices) or tf.boolean_mask; slices, ints, ... and "
                            "tf.newaxis work.")
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis ('...').")
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > len(shape):
        raise IndexError(f"too many indices ({used}) for a tensor of rank {len(shape)}.")
    if Ellipsis not in key:
        key = key + (Ellipsis,)
    i = key.index(Ellipsis)
    key = key[:i] + (slice(None),) * (len(shape) - used) + key[i + 1:]
    src = _contiguous_strides(shape)
    offset, strides, out_shape, dim = 0, [], [], 0
    for k in key:
        if k is None:
            strides.append(0)
            out_shape.append(1)
            continue
        n = shape[dim]
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            count = len(range(start, stop, step))
            offset += start * src[dim] if count else 0
            strides.append(step * src[dim])
            out_shape.append(count)
        else:
            j = int(k)
            if not -n <= j < n:
                raise IndexError(f"index {j} is out of bounds for axis {dim} with size {n}.")
            offset += (j % n) * src[dim]
        dim += 1
    return offset, strides, tuple(out_shape)


def getitem(x, key):
    """``x[key]`` (TensorFlow's strided slice): a copy of the view the key picks."""
    x = as_tensor(x)
    _check_rank(x, "indexing")
    offset, strides, shape = _parse_index(x.shape, key)
    if len(shape) > broadcast.MAX_DIMS:
        raise InvalidArgumentError(f"indexing: results of rank <= {broadcast.MAX_DIMS} only.")
    out = _copy_view(x, shape, offset, strides)
    return autodiff.record("strided_slice", (x,), out, lambda g: (_slice_grad(g, x.shape, key),))


def _slice_grad(g, shape, key):
    """``g`` copied into zeros of ``shape`` at the place ``key`` picks (slicing's gradient)."""
    offset, strides, view_shape = _parse_index(shape, key)
    out = zeros(shape, g.dtype, device=g.dev)
    if g.buf.size:
        with g.dev.activate():
            g.dev.ops.strided_copy(flat(g), flat(out), view_shape, 0, tuple(_contiguous_strides(view_shape)),
                                   int(offset), tuple(strides))
    return autodiff.record("slice_grad", (g,), out, lambda gg: (getitem(gg, key),))


def concat(values, axis, name=None):
    """The tensors joined along ``axis`` (``tf.concat``): each copied into its slab."""
    parts = [as_tensor(v) for v in values]
    if not parts:
        raise ValueError("concat needs at least one tensor.")
    first = parts[0]
    a = _axes(axis, first.ndim)[0]
    for p in parts[1:]:
        if p.dev is not first.dev or p.dtype != first.dtype or p.ndim != first.ndim or \
                p.shape[:a] + p.shape[a + 1:] != first.shape[:a] + first.shape[a + 1:]:
            raise InvalidArgumentError(f"concat along axis {a}: shapes {[q.shape for q in parts]}, dtypes "
                                       f"{[str(q.dtype) for q in parts]}: every other dimension, the dtype "
                                       f"and the device must agree.")
    total = sum(p.shape[a] for p in parts)
    shape = first.shape[:a] + (total,) + first.shape[a + 1:]
    out = empty(first.dev, shape, first.dtype)
    dst = _contiguous_strides(shape)
    start = 0
    with first.dev.activate():
        for p in parts:
            if p.buf.size:
                first.dev.ops.strided_copy(flat(p), flat(out), p.shape, 0, tuple(_contiguous_strides(p.shape)),
                                           start * dst[a], tuple(dst))
            start += p.shape[a]
    bounds = np.cumsum([0] + [p.shape[a] for p in parts])

    def grad(g):
        return tuple(getitem(g, (slice(None),) * a + (slice(int(lo), int(hi)),))
                     for lo, hi in zip(bounds[:-1], bounds[1:]))
    return autodiff.record("concat", tuple(parts), out, grad)


def stack(values, axis=0, name=None):
    parts = [as_tensor(v) for v in values]
    if not parts:
        raise ValueError("stack needs at least one tensor.")
    return concat([expand_dims(p, axis) for p in parts], axis)


def unstack(value, num=None, axis=0, name=None):
    x = as_tensor(value)
    a = _axes(axis, x.ndim)[0]
    return [getitem(x, (slice(None),) * a + (i,)) for i in range(x.shape[a])]


def shape(input, out_type=np.int32, name=None):  # noqa: A002
    """The shape as a 1-D int32 tensor (``tf.shape``)."""
    x = as_tensor(input)
    return tensor.StaticTensor.of(np.array(x.shape, as_dtype(out_type)), x.dev)   # known on the host


def size(input, out_type=np.int32, name=None):  # noqa: A002
    x = as_tensor(input)
    return tensor.StaticTensor.of(np.array(int(np.prod(x.shape, dtype=np.int64)), as_dtype(out_type)), x.dev)


def rank(input, name=None):  # noqa: A002
    x = as_tensor(input)
    return tensor.StaticTensor.of(np.array(x.ndim, np.int32), x.dev)


def gather(params, indices, validate_indices=None, axis=None, batch_dims=0, name=None):
    """``tf.gather``: the slices of ``params`` along ``axis`` at ``indices`` (any shape of
    integers); the result's shape is params.shape[:axis] + indices.shape + params.shape[axis+1:].

    Written as ``one_hot(indices) @ params`` (the slices stacked as rows): the gradient is then
    matmul's, the scatter-add TensorFlow's gather has, and an index outside [0, n) gives zeros,
    as TensorFlow's gather on a GPU (its CPU kernel raises). Costs n multiply-adds per output
    value: for the vocabulary-sized gathers of large models a row-gather kernel would serve."""
    if batch_dims:
        raise NotImplementedError("gather(batch_dims=...) is not implemented; gather each batch row.")
    x = as_tensor(params)
    idx = as_tensor(indices, device=x.dev)
    if idx.dtype.kind not in "iu":
        raise InvalidArgumentError(f"gather: indices must be integers, got {idx.dtype}.")
    a = _axes(0 if axis is None else axis, x.ndim)[0]
    moved = x if a == 0 else transpose(x, [a] + [k for k in range(x.ndim) if k != a])
    n = moved.shape[0]
    rows = reshape(moved, (n, -1))                                  # (n, L)
    picks = one_hot(reshape(idx, (-1,)), n, dtype=x.dtype)          # (m, n)
    out = reshape(matmul(picks, rows), idx.shape + moved.shape[1:])
    if a == 0:
        return out
    k = idx.ndim                                                    # the gathered axes back in place
    rest = list(range(k, out.ndim))
    return transpose(out, rest[:a] + list(range(k)) + rest[a:])


def gather_nd(params, indices, batch_dims=0, name=None):
    """``tf.gather_nd``: ``indices`` (..., k) integers, each last row an index into the first k
    axes of ``params``; the result's shape is indices.shape[:-1] + params.shape[k:].

    Written as a ``gather`` of the flattened first k axes at the row-major flat index
    ``sum_j indices[..., j] * stride_j`` (the strides of params.shape[:k]): its gradient is
    gather's, an index outside the params gives zeros (TensorFlow's GPU kernel)."""
    if batch_dims:
        raise NotImplementedError("gather_nd(batch_dims=...) is not implemented; gather each batch row.")
    x = as_tensor(params)
    idx = as_tensor(indices, device=x.dev)
    if idx.dtype.kind not in "iu" or idx.ndim < 1:
        raise InvalidArgumentError(f"gather_nd: indices must be integers of rank >= 1 (the last axis "
                                   f"indexes params), got {idx.dtype} of shape {idx.shape}.")
    k = idx.shape[-1]
    if k > x.ndim:
        raise InvalidArgumentError(f"gather_nd: index rows of length {k} for params of rank {x.ndim}; "
                                   f"each row indexes at most every axis of params.")
    strides = np.cumprod((x.shape[1:k] + (1,))[::-1])[::-1].astype(idx.dtype)   # row-major, (k,)
    flat = reduce_sum(idx * as_tensor(strides, device=x.dev), axis=-1)          # indices.shape[:-1]
    rows = reshape(x, (int(np.prod(x.shape[:k], dtype=np.int64)),) + tuple(x.shape[k:]))
    return gather(rows, flat)


# --- creation -------------------------------------------------------------------------------

def zeros(shape, dtype=np.float32, name=None, device=None):
    return fill(shape, 0, dtype, device=device)


def ones(shape, dtype=np.float32, name=None, device=None):
    return fill(shape, 1, dtype, device=device)


def fill(dims, value, dtype=None, name=None, device=None):
    """A tensor of ``dims`` holding ``value`` everywhere (one fill launch, nothing uploaded)."""
    dims = tuple(int(n) for n in (np.asarray(dims).reshape(-1) if not isinstance(dims, tuple) else dims))
    if dtype is None:
        dtype = tensor.infer_host_array(value, None).dtype
    dev = devices.get_device(device) if device is not None else devices.current_device()
    out = empty(dev, dims, dtype)
    if out.buf.size:
        with dev.activate():
            if out.dtype == np.bool_:
                dev.ops.strided_copy(dev.from_numpy(np.array([bool(value)])), flat(out), dims, 0,
                                     (0,) * len(dims), 0, tuple(_contiguous_strides(dims)))
            else:
                dev.ops.fill(out.buf, value)
    return out


def zeros_like(input, dtype=None, name=None):  # noqa: A002
    x = as_tensor(input)
    return zeros(x.shape, dtype or x.dtype, device=x.dev)


def ones_like(input, dtype=None, name=None):  # noqa: A002
    x = as_tensor(input)
    return ones(x.shape, dtype or x.dtype, device=x.dev)


def eye(num_rows, num_columns=None, dtype=np.float32, name=None):
    n, m = int(num_rows), int(num_rows if num_columns is None else num_columns)
    return tensor.constant(np.eye(n, m, dtype=as_dtype(dtype)))


def linspace(start, stop, num, name=None, axis=0):
    """``tf.linspace``: ``num`` evenly spaced values from ``start`` to ``stop`` (both included),
    float32 for Python numbers, as TF (the values computed on the host in float64, as NumPy)."""
    if axis != 0 or np.ndim(start) or np.ndim(stop):
        raise NotImplementedError("linspace of scalars only (axis=0) is implemented here; stack "
                                  "several linspace calls for tensors of end points.")
    dtype = getattr(start, "dtype", None)
    dtype = np.float32 if dtype is None or np.dtype(dtype).kind != "f" else np.dtype(dtype)
    lo, hi = (float(np.asarray(v.numpy() if hasattr(v, "numpy") else v)) for v in (start, stop))
    return tensor.constant(np.linspace(lo, hi, int(num)).astype(dtype))


def one_hot(indices, depth, on_value=None, off_value=None, axis=-1, dtype=None, name=None):
    """``tf.one_hot``: a last axis of ``depth`` with ``on_value`` at each index (an index
    outside [0, depth) gives a row of ``off_value``, as TF)."""
    idx = as_tensor(indices)
    if idx.dtype.kind not in "iu":
        raise InvalidArgumentError(f"one_hot: indices must be integers, got {idx.dtype}.")
    if axis not in (-1, idx.ndim):
        raise NotImplementedError("one_hot with axis other than -1 is not implemented; transpose after.")
    dtype = as_dtype(dtype or np.float32)
    classes = tensor.constant(np.arange(int(depth), dtype=idx.dtype), device=idx.dev)
    hit = equal(expand_dims(idx, -1), classes)
    on = 1 if on_value is None else on_value
    off = 0 if off_value is None else off_value
    return where(hit, fill((), on, dtype, device=idx.dev), fill((), off, dtype, device=idx.dev))


# --- neural-network functions (tf.nn): compositions -------------------------------------------

def softmax(logits, axis=-1, name=None):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` (the max keeps exp finite)."""
    x = as_tensor(logits)
    e = exp(x - stop_gradient(reduce_max(x, axis, keepdims=True)))
    return e / reduce_sum(e, axis, keepdims=True)


def log_softmax(logits, axis=-1, name=None):
    x = as_tensor(logits)
    shifted = x - stop_gradient(reduce_max(x, axis, keepdims=True))
    return shifted - log(reduce_sum(exp(shifted), axis, keepdims=True))


def sigmoid_cross_entropy_with_logits(labels=None, logits=None, name=None):
    """``max(x, 0) - x z + log(1 + exp(-|x|))``: TensorFlow's overflow-free form."""
    x = as_tensor(logits)
    z = as_tensor(labels, dtype=x.dtype, device=x.dev)
    return relu(x) - x * z + log1p(exp(negative(abs(x))))


def softmax_cross_entropy_with_logits(labels, logits, axis=-1, name=None):
    x = as_tensor(logits)
    z = as_tensor(labels, dtype=x.dtype, device=x.dev)
    return negative(reduce_sum(z * log_softmax(x, axis), axis))


def sparse_softmax_cross_entropy_with_logits(labels=None, logits=None, name=None):
    x = as_tensor(logits)
    z = one_hot(as_tensor(labels, device=x.dev), x.shape[-1], dtype=x.dtype)
    return softmax_cross_entropy_with_logits(z, x)


# --- images -----------------------------------------------------------------------------------

def resize(images, size, method="bilinear", preserve_aspect_ratio=False, antialias=False, name=None):
    """``tf.image.resize`` of NHWC (or HWC) float images, ``bilinear`` or ``nearest``
    (TensorFlow 2's half-pixel centres). Integer images come back float32, as TF's."""
    if preserve_aspect_ratio or antialias:
        raise NotImplementedError("resize: preserve_aspect_ratio and antialias are not implemented.")
    method = str(getattr(method, "value", method)).lower()
    if method not in ("bilinear", "nearest"):
        raise NotImplementedError(f"resize: method {method!r}; 'bilinear' and 'nearest' are implemented.")
    x = as_tensor(images)
    single = x.ndim == 3
    if single:
        x = expand_dims(x, 0)
    if x.ndim != 4:
        raise InvalidArgumentError(f"resize: images must be (batch, h, w, c) or (h, w, c), got {x.shape}.")
    if x.dtype != np.float32:
        x = cast(x, np.float32)
    h, w = (int(n) for n in size)
    out = empty(x.dev, (x.shape[0], h, w, x.shape[3]), np.float32)
    if out.buf.size:
        with x.dev.activate():
            x.dev.ops.resize(x.buf, out.buf, method)
    return reshape(out, out.shape[1:]) if single else out


# --- Tensor's and Variable's operators ----------------------------------------------------------

def _reflected(fn):
    return lambda x, y: fn(y, x)


tensor.OPERATORS.update({
    "add": add, "radd": _reflected(add), "sub": subtract, "rsub": _reflected(subtract),
    "mul": multiply, "rmul": _reflected(multiply), "truediv": divide, "rtruediv": _reflected(divide),
    "floordiv": floordiv, "rfloordiv": _reflected(floordiv), "mod": floormod, "rmod": _reflected(floormod),
    "pow": pow, "rpow": _reflected(pow), "matmul": matmul, "rmatmul": _reflected(matmul),
    "neg": negative, "abs": abs, "lt": less, "le": less_equal, "gt": greater, "ge": greater_equal,
    "eq": equal, "ne": not_equal, "and": logical_and, "or": logical_or, "xor": logical_xor,
    "invert": logical_not, "getitem": getitem,
})
