"""Keras's merge layers: ``Add``, ``Subtract``, ``Multiply``, ``Average``, ``Concatenate``.

A merge layer is called on a LIST of tensors (``layers.Add()([x, skip])``) and makes one.
It has no weights; what it teaches is the backward of a layer with several inputs: one
gradient per input, from the one gradient of its output::

    y = x0 + x1 + ... + x(n-1)        dx_i = dy                  (a sum hands dy on unchanged)
    y = x0 - x1                       dx0 = dy,  dx1 = -dy
    y = x0 * x1 * ... * x(n-1)        dx_i = dy * (the product of every OTHER input)
    y = (x0 + ... + x(n-1)) / n       dx_i = dy / n
    y = concatenate(x0, x1, ...)      dx_i = the slice of dy where x_i was put

The multi-input protocol (what the engine, ``keras/engine.py``, calls; single-input layers
follow the same one with one x, ``layers.py``):

    output_shape_for(shapes), build(shapes)   ``shapes``: a list, one per-example shape (no
                                              batch axis) per input; checked as Keras checks
                                              them, errors name the layer and the shapes
    make_buffers(state, b)                    y, and the inputs' gradients, per batch size
    forward(state, xs, training)              xs: a list of (b,) + shape_i arrays (the model's
                                              input may come flattened to (b, features):
                                              the layer takes a free view) -> y, its own buffer
    backward(state, dy)                       -> [dx_0, dx_1, ...]: None where
                                              ``state.need_dx[i]`` is False

Nothing here writes into its inputs or into dy. What a backward returns is a buffer of
this layer, except where it says "dy itself": ``Add`` hands dy on as the gradient of the
FIRST input that needs one and copies it for the others; ``Subtract`` hands it on to its
first input. Why not dy to every input: the layer that gets a
gradient may write into it (Dense's and Conv2D's ReLU backward, Dropout's mask, in
place), which would change the other inputs' gradients under them.

The sums are in a fixed order, input 0 first (``((x0 + x1) + x2) + ...``, as Keras's
``Add`` and ``Average`` add), so every replica and every run gets the same bits. The
math runs in ``state.ops`` (``mirrored/backends.py``): ``binary``/``binary_scalar``/
``unary`` of ``kernels/elementwise.py`` for the four elementwise layers, and
``kernels/merge.py``'s column-block copy for Concatenate (whose docstring shows why a
concatenation along any axis is one such copy per input).

Neighbours: ``base_layer.py`` (``Layer``), ``layers.py`` (the single-input layers and
the protocol they follow), ``keras/__init__.py`` (exports these as ``tf.keras.layers.*``),
``saving.py`` (``get_config``), ``tests/test_merge_layers.py``.
"""
import math
from types import SimpleNamespace

import numpy as np

from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from kernels.merge import concat_matrix_shape
from mirrored.keras.base_layer import Layer

FLOAT = np.dtype(np.float32)


class _Merge(Layer):
    """What the five share: a list of inputs, their shapes' checks, no weights, buffers."""

    #: How many inputs the layer takes: at least 1, as Keras 3's merge layers (Subtract: 2).
    min_inputs, max_inputs = 1, None

    def __init__(self, name=None, **kwargs):
        # ``name`` spelled out: saving.py passes a config's keys that the signature names
        super().__init__(name=name, **kwargs)

    # -- shapes
    def _shapes(self, input_shapes):
        """The per-example shapes as a list of tuples, after checking there is a list of
        them, as many as the layer takes."""
        what = f"{type(self).__name__} {self.name!r}"
        if (not isinstance(input_shapes, (list, tuple))
                or not all(isinstance(s, (list, tuple)) for s in input_shapes)):
            raise ValueError(f"{what} is a merge layer: call it on a LIST of tensors, e.g. "
                             f"layers.{type(self).__name__}()([x1, x2]); got the input shape(s) "
                             f"{input_shapes!r}, not a list of shapes.")
        shapes = [tuple(int(d) for d in s) for s in input_shapes]
        n = len(shapes)
        if n < self.min_inputs or (self.max_inputs is not None and n > self.max_inputs):
            count = (f"exactly {self.min_inputs}" if self.min_inputs == self.max_inputs
                     else f"at least {self.min_inputs}")
            raise ValueError(f"{what} takes {count} input(s), got {n} (shapes {shapes}); "
                             f"call it on a list of {count}.")
        return shapes

    def output_shape_for(self, input_shapes):
        """Add, Subtract, Multiply, Average: every input of the same shape, which y has."""
        shapes = self._shapes(input_shapes)
        first = shapes[0]
        for i, shape in enumerate(shapes[1:], start=1):
            if shape == first:
                continue
            what = (f"{type(self).__name__} {self.name!r}: input {i} has examples of shape "
                    f"{shape}, input 0 of shape {first} (all shapes: {shapes})")
            if _broadcastable(first, shape):
                raise NotImplementedError(
                    f"{what}. Keras would broadcast them; broadcasting between merge inputs is "
                    f"not implemented here: give every input the same shape (e.g. a Dense with "
                    f"the same units on each branch).")
            raise ValueError(f"{what}: the shapes are incompatible. Give every input the same "
                             f"shape.")
        return first

    def build(self, input_shapes):
        """``input_shape`` is the list of the inputs' per-example shapes (tuples)."""
        self.input_shape = self._shapes(input_shapes)
        self.output_shape = tuple(self.output_shape_for(self.input_shape))
        self.built = True

    def get_config(self):
        return self.base_config()

    # -- buffers
    def _need_dx(self, state):
        """``state.need_dx`` as a tuple of bools, one per input (a clear error otherwise)."""
        need = state.need_dx
        if not isinstance(need, (tuple, list)) or len(need) != len(self.input_shape):
            raise ValueError(f"{type(self).__name__} {self.name!r} has {len(self.input_shape)} inputs, "
                             f"so state.need_dx must be a tuple of as many bools, one per input; "
                             f"got {need!r}.")
        return tuple(bool(n) for n in need)

    def make_buffers(self, state, b):
        """y (b,) + output shape, and a gradient buffer (b,) + shape_i for each input that
        needs one (not for the input that gets dy itself: ``dy_goes_to``)."""
        dev, need = state.dev, self._need_dx(state)
        first = self.dy_goes_to(need)
        return SimpleNamespace(
            y=dev.empty((b,) + self.output_shape, FLOAT),                          # (b,) + output shape
            dx=[dev.empty((b,) + shape, FLOAT) if n and i != first else None      # (b,) + shape_i
                for i, (shape, n) in enumerate(zip(self.input_shape, need))],
            xs=None)                        # Multiply: the last forward's inputs, not owned

    def dy_goes_to(self, need):
        """The input that gets dy itself as its gradient (it gets no buffer), or None."""
        return None

    def _inputs(self, xs):
        """xs as a list of (b,) + shape_i views (free), b from the first; a clear error for a
        list of the wrong length."""
        if not isinstance(xs, (list, tuple)) or len(xs) != len(self.input_shape):
            raise ValueError(f"{type(self).__name__} {self.name!r} was built for "
                             f"{len(self.input_shape)} inputs; forward got "
                             f"{len(xs) if isinstance(xs, (list, tuple)) else 'one array, not a list'}.")
        b = xs[0].shape[0]
        return b, [view(x, (b,) + shape) for x, shape in zip(xs, self.input_shape)]

    def _grads(self, state, dy, each):
        """[dx_i]: None where no gradient is needed; dy itself for input ``dy_goes_to``; else
        ``each(i, dy, dx_i's buffer)`` writes the buffer."""
        b = dy.shape[0]
        buf = state.buffers(b)
        dy = view(dy, (b,) + self.output_shape)                                      # (b,) + output shape
        grads = []
        for i, need in enumerate(self._need_dx(state)):
            if not need:
                grads.append(None)
            elif buf.dx[i] is None:                 # dy_goes_to: this input takes dy itself
                grads.append(dy)
            else:
                each(i, dy, buf.dx[i])                                               # (b,) + shape_i
                grads.append(buf.dx[i])
        return grads


def _broadcastable(a, b):
    """True where NumPy would broadcast per-example shapes ``a`` and ``b`` (what Keras does)."""
    return all(p == q or p == 1 or q == 1 for p, q in zip(a[::-1], b[::-1]))


def _copy(ops, src, dst):
    """dst[...] = src for two buffers of one shape: the column copy over all the columns."""
    rows = dst.shape[0]
    cols = math.prod(dst.shape[1:])
    ops.copy_columns(view(src, (rows, cols)), view(dst, (rows, cols)), 0, 0, cols)


def _sum(ops, xs, out):
    """out = ((x0 + x1) + x2) + ...: in input order, always (same bits on every replica)."""
    if len(xs) == 1:
        _copy(ops, xs[0], out)
        return out
    ops.binary("add", xs[0], xs[1], out)
    for x in xs[2:]:
        ops.binary("add", out, x, out)          # in place: each thread reads then writes its own element
    return out


class Add(_Merge):
    """``y = x0 + x1 + ...`` (Keras's ``layers.Add``): inputs of one shape, added in order.

    Backward: the gradient of a sum with respect to each term is dy: the first input that
    needs it gets dy itself, the others a copy (one ``copy_columns`` launch each).
    """

    def dy_goes_to(self, need):
        return need.index(True) if any(need) else None          # the first input that needs one

    def forward(self, state, xs, training=False):
        b, xs = self._inputs(xs)
        return _sum(state.ops, xs, state.buffers(b).y)                   # y: (b,) + shape

    def backward(self, state, dy):
        return self._grads(state, dy, lambda i, dy, dx: _copy(state.ops, dy, dx))


class Subtract(_Merge):
    """``y = x0 - x1`` (Keras's ``layers.Subtract``): exactly two inputs of one shape.

    Backward: dx0 = dy (dy itself), dx1 = -dy (one ``unary("neg")`` launch).
    """

    min_inputs = max_inputs = 2

    def dy_goes_to(self, need):
        return 0 if need[0] else None                            # dx0 = dy; never dx1 (= -dy)

    def forward(self, state, xs, training=False):
        b, (x0, x1) = self._inputs(xs)
        return state.ops.binary("sub", x0, x1, state.buffers(b).y)       # y: (b,) + shape

    def backward(self, state, dy):
        # only input 1 has a buffer (input 0 takes dy itself): dx1 = -dy
        return self._grads(state, dy, lambda i, dy, dx: state.ops.unary("neg", dy, dx))


class Multiply(_Merge):
    """``y = x0 * x1 * ...`` (Keras's ``layers.Multiply``): inputs of one shape, multiplied
    in order.

    Backward (the product rule): dx_i = dy * x_j * x_k ... over every input j != i, in
    input order: one ``binary("mul")`` launch per factor, into x_i's gradient buffer. So the
    forward keeps references to its inputs (``buf.xs``, as Dense keeps ``buf.x``): the
    engine must not overwrite them between forward and backward.
    """

    def forward(self, state, xs, training=False):
        b, xs = self._inputs(xs)
        buf = state.buffers(b)
        buf.xs = xs                                                      # kept for backward
        if len(xs) == 1:
            _copy(state.ops, xs[0], buf.y)
            return buf.y
        state.ops.binary("mul", xs[0], xs[1], buf.y)
        for x in xs[2:]:
            state.ops.binary("mul", buf.y, x, buf.y)                     # in place, in order
        return buf.y                                                     # y: (b,) + shape

    def backward(self, state, dy):
        xs = state.buffers(dy.shape[0]).xs

        def each(i, dy, dx):
            others = xs[:i] + xs[i + 1:]
            if not others:                  # one input: y = x0, dx0 = dy
                _copy(state.ops, dy, dx)
                return
            state.ops.binary("mul", dy, others[0], dx)                   # dy * x_j
            for x in others[1:]:
                state.ops.binary("mul", dx, x, dx)                       # * x_k, in place
        return self._grads(state, dy, each)


class Average(_Merge):
    """``y = (x0 + x1 + ...) / n`` (Keras's ``layers.Average``): the sum in input order, then
    one division by n, as Keras computes it (a division, not a product with 1/n: the same
    bits as TensorFlow's forward).

    Backward: dx_i = dy / n for every input, each into its own buffer (one
    ``binary_scalar("div")`` launch per input).
    """

    def forward(self, state, xs, training=False):
        b, xs = self._inputs(xs)
        y = _sum(state.ops, xs, state.buffers(b).y)
        return state.ops.binary_scalar("div", y, len(xs), y)             # y: (b,) + shape

    def backward(self, state, dy):
        n = len(self.input_shape)
        return self._grads(state, dy, lambda i, dy, dx: state.ops.binary_scalar("div", dy, n, dx))


class Concatenate(_Merge):
    """Keras's ``layers.Concatenate(axis=-1)``: inputs of one shape but along ``axis``, put
    side by side along it.

    ``axis`` counts the batch axis, as Keras's does: -1 (the default) is the last axis,
    1 the first axis of an example; the batch axis itself (0) is refused. Forward: one
    ``copy_columns`` launch per input into its block of columns of y seen as a matrix
    (``kernels/merge.py``); backward: the same copies the other way, dy's block of columns
    into each input's gradient buffer.
    """

    def __init__(self, axis=-1, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise ValueError(f"Concatenate {self.name!r}: axis must be an integer (an axis of the "
                             f"batched tensors, -1 the last), got {axis!r}.")
        self.axis = int(axis)
        self._cols = None               # [(offset, width)] of each input in y's matrix (build)
        self._width = None              # W: y's columns, the sum of the widths (build)

    def get_config(self):
        return dict(self.base_config(), axis=self.axis)

    def _example_axis(self, shapes):
        """``axis`` as an axis of one example (no batch axis), checked against the rank."""
        rank = len(shapes[0])
        axis = self.axis + rank + 1 if self.axis < 0 else self.axis    # of the batched tensor
        if axis == 0:
            raise NotImplementedError(
                f"Concatenate {self.name!r}: axis={self.axis} is the batch axis for examples of "
                f"shape {shapes[0]}; concatenating batches is not implemented here. Use an axis "
                f"of the examples (-1, the default, or 1 to {rank}).")
        if not 0 < axis <= rank:
            raise ValueError(f"Concatenate {self.name!r}: axis={self.axis} is out of range for "
                             f"batches of examples of shape {shapes[0]} ({rank + 1} axes with the "
                             f"batch); use -1 (the default) or an axis from 1 to {rank}.")
        return axis - 1

    def output_shape_for(self, input_shapes):
        shapes = self._shapes(input_shapes)
        if len({len(s) for s in shapes}) != 1:
            raise ValueError(f"Concatenate {self.name!r}: the inputs have examples of different "
                             f"ranks, {shapes}; give them the same number of axes (a Reshape or "
                             f"Flatten first).")
        a = self._example_axis(shapes)
        rest = [s[:a] + s[a + 1:] for s in shapes]
        for i, shape in enumerate(shapes):
            if rest[i] != rest[0]:
                raise ValueError(
                    f"Concatenate {self.name!r} (axis={self.axis}): input {i} has examples of shape "
                    f"{shape}, input 0 of shape {shapes[0]}; all axes but the concatenation axis "
                    f"must match (all shapes: {shapes}). Change the axis or the inputs' shapes.")
        return shapes[0][:a] + (sum(s[a] for s in shapes),) + shapes[0][a + 1:]

    def build(self, input_shapes):
        super().build(input_shapes)
        a = self._example_axis(self.input_shape)
        widths = [concat_matrix_shape(1, s, a)[1] for s in self.input_shape]
        self._cols = [(sum(widths[:i]), w) for i, w in enumerate(widths)]     # (offset, width)
        self._width = sum(widths)

    def _matrices(self, b, arrays):
        """y's rows R for a batch of b, and each of ``arrays`` (one per input) as (R, w_i)."""
        a = self._example_axis(self.input_shape)
        rows = concat_matrix_shape(b, self.output_shape, a)[0]
        return rows, [view(x, (rows, w)) for x, (_, w) in zip(arrays, self._cols)]

    def forward(self, state, xs, training=False):
        b, xs = self._inputs(xs)
        buf = state.buffers(b)
        rows, mats = self._matrices(b, xs)
        y = view(buf.y, (rows, self._width))                                 # (R, W)
        for x, (off, w) in zip(mats, self._cols):
            state.ops.copy_columns(x, y, 0, off, w)                          # y[:, off:off+w] = x_i
        return buf.y                                                         # (b,) + output shape

    def backward(self, state, dy):
        b = dy.shape[0]
        rows = self._matrices(b, [])[0]
        dy2 = view(dy, (rows, self._width))                                  # (R, W)

        def each(i, dy, dx):
            off, w = self._cols[i]
            state.ops.copy_columns(dy2, view(dx, (rows, w)), off, 0, w)      # dx_i = dy[:, off:off+w]
        return self._grads(state, dy, each)


# --- Keras's functional forms: ``layers.add([x1, x2])`` is ``layers.Add()([x1, x2])`` -----------
def add(inputs, **kwargs):
    return Add(**kwargs)(inputs)


def subtract(inputs, **kwargs):
    return Subtract(**kwargs)(inputs)


def multiply(inputs, **kwargs):
    return Multiply(**kwargs)(inputs)


def average(inputs, **kwargs):
    return Average(**kwargs)(inputs)


def concatenate(inputs, axis=-1, **kwargs):
    return Concatenate(axis=axis, **kwargs)(inputs)


#: The names ``keras/__init__.py`` exports as ``tf.keras.layers.*``.
__all__ = ["Add", "Subtract", "Multiply", "Average", "Concatenate",
           "add", "subtract", "multiply", "average", "concatenate"]
