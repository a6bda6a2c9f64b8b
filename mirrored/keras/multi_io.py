"""Functional models with several inputs or outputs (lists or dicts of them), as Keras 3 writes
them::

    image, meta = keras.Input((8,), name="image"), keras.Input((3,), name="meta")
    h = layers.Concatenate()([layers.Dense(4)(image), layers.Dense(4)(meta)])
    model = keras.Model([image, meta], [layers.Dense(2, name="o1")(h), layers.Dense(1, name="o2")(h)])
    model.compile("sgd", loss={"o1": "mse", "o2": "mae"}, loss_weights=[1.0, 0.5], metrics={"o1": "mae"})
    model.fit([xa, xb], [y1, y2])             # or {"image": xa, "meta": xb}, {"o1": y1, "o2": y2}

The engine (``engine.ReplicaProgram``) runs programs of ONE input (tensor 0, (b, features))
and one output (the last node's). A model of several is made one by two kinds of nodes
around its own, so the engine, the packed weights, the ring and the optimizer stay as they
are::

    tensor 0          the inputs side by side: (b, f_0 + f_1 + ...), each flattened
    nodes 0..k-1      InputSlice i: input i's columns of tensor 0, as (b,) + its shape
    ...               the model's own calls (``functional.graph``, ``functional.number``)
    last node         OutputsSideBySide: the outputs flattened and put side by side,
                      (b, g_0 + g_1 + ...), a ``Concatenate`` on the flattened outputs

``call`` runs it: the inputs (a list, or a dict keyed by input names) joined into tensor 0,
the program's forward, and the output cut back into the model's structure. Under a
``GradientTape`` the joined output is ONE model-call node (``tape.ModelOutput``) and each
output a slice of it (an op the tape records), so a loss of any outputs sends its gradient
back through the slices into the one backward of the program; an input the tape follows
(``tape.input_link``) gets its part of the program's input gradient through the join (an op
too). ``fit``, ``evaluate`` and ``predict`` run Keras 3's own steps on such a model
(``custom_step.runs_keras_step``), a replica thread each, with the losses and metrics per
output of ``compile_utils.py``.

Why the join costs little: a copy of the inputs and one of the outputs per step, next to a
program that reads each input several times.

Neighbours: ``functional.py`` (the calls' order), ``engine.py`` (the program), ``merging.py``
(``Concatenate``, ``copy_columns``), ``tape.py`` (``ModelOutput``), ``models.py``
(``Functional``), ``compile_utils.py`` (losses and metrics per output), ``custom_step.py``.
"""
from types import SimpleNamespace

import numpy as np

from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored import nest, ops
from mirrored.keras import functional
from mirrored.keras.base_layer import Layer
from mirrored.keras.engine import Node, ReplicaProgram
from mirrored.keras.merging import Concatenate
from mirrored.keras.step import Step
from mirrored.keras.tape import ModelOutput, input_link
from mirrored.strategy import to_tensor_on
from mirrored.tensor import Tensor

FLOAT = np.dtype(np.float32)


class InputSlice(Layer):
    """Input ``i`` of a model of several: columns [offset, offset + width) of the engine's one
    input (b, total), as (b,) + ``shape``. Backward (only when the input's gradient is asked,
    ``tape.input_link``): dy into those columns of a (b, total) buffer of zeros."""

    def __init__(self, offset, shape, total, name):
        super().__init__(name=name)
        self.offset, self.total = int(offset), int(total)
        self.width = int(np.prod(shape, dtype=np.int64))
        self.input_shape, self.output_shape, self.built = (self.total,), tuple(shape), True

    def make_buffers(self, state, b):
        dev = state.dev
        return SimpleNamespace(y=dev.empty((b,) + self.output_shape, FLOAT),              # (b,) + shape
                               dx=dev.empty((b, self.total), FLOAT) if state.need_dx else None)   # (b, total)

    def forward(self, state, x, training=False):
        b = x.shape[0]
        buf = state.buffers(b)
        state.ops.copy_columns(view(x, (b, self.total)), view(buf.y, (b, self.width)), self.offset, 0, self.width)
        return buf.y

    def backward(self, state, dy):
        if not state.need_dx:
            return None
        b = dy.shape[0]
        buf = state.buffers(b)
        state.ops.fill(buf.dx, 0.0)
        state.ops.copy_columns(view(dy, (b, self.width)), buf.dx, 0, self.offset, self.width)
        return buf.dx


class OutputsSideBySide(Concatenate):
    """The last node of a model of several outputs: each output flattened, side by side."""


def engine_program(inputs, outputs):
    """The program of ``keras.Model(inputs, outputs)`` (module docstring): ``(nodes, layers,
    symbolic)`` as ``functional.program`` gives them, and the one example shape the engine takes,
    ``(total features,)``. The inputs and outputs are taken in their flat order (a dict's in
    sorted key order, as ``tf.nest``)."""
    xs, ys = functional.flat_tensors(inputs, "inputs"), functional.flat_tensors(outputs, "outputs")
    names = [x.name for x in xs]
    if len(set(names)) != len(names) or (isinstance(inputs, dict) and sorted(inputs) != sorted(names)):
        raise ValueError(f"keras.Model: every input needs its own name (keras.Input(..., name=...)), and a "
                         f"dict of inputs is keyed by those names; got the names {names}"
                         + (f" for the keys {sorted(inputs)}." if isinstance(inputs, dict) else "."))
    order, layers = functional.graph(xs, ys)
    for node in order:
        if getattr(node.layer, "activation", None) == "softmax" and len(ys) > 1:
            raise NotImplementedError(
                f"{type(node.layer).__name__} {node.layer.name!r} has activation='softmax' in a model of several "
                f"outputs: here that softmax is fused into the loss of a model's one output. Give the layer no "
                f"activation and add keras.layers.Softmax() after it (or train on logits, from_logits=True).")
    widths = [int(np.prod(x.shape[1:], dtype=np.int64)) for x in xs]
    total = sum(widths)
    nodes, ids = [], {}
    if len(xs) == 1:
        ids[id(xs[0])] = 0                          # one input: tensor 0 itself
    else:
        for i, (x, w) in enumerate(zip(xs, widths)):
            nodes.append(Node(InputSlice(sum(widths[:i]), x.shape[1:], total, f"{x.name}_slice"), (0,), False))
            ids[id(x)] = i + 1
    functional.number(order, ids, nodes)
    if len(ys) > 1:
        gather = OutputsSideBySide(name="outputs_side_by_side")
        gather.build([(int(np.prod(y.shape[1:], dtype=np.int64)),) for y in ys])
        nodes.append(Node(gather, tuple(ids[id(y)] for y in ys), True))
    elif ids[id(ys[0])] != len(nodes):
        raise ValueError(f"keras.Model: the output {ys[0].name} is not the last call of the model.")
    return nodes, layers, order, (total,)


class StructuredStep(Step):
    """``Step`` for a model of several inputs or outputs: the engine sees one input of the
    inputs' features side by side (``EngineView``); the rest is ``Step``'s."""

    def __init__(self, model, devices, cross_device_ops):
        super().__init__(EngineView(model), devices, cross_device_ops)
        self.model = model


class EngineView:
    """The model as ``Step`` builds its programs from it: ``input_shape`` (None, features of
    every input); anything else the model's own."""

    def __init__(self, model):
        self.__dict__["model"] = model

    @property
    def input_shape(self):
        return (None,) + tuple(self.model.engine_input_shape)

    def __getattr__(self, name):
        return getattr(self.model, name)


# -- calling the model -------------------------------------------------------------------------
def flat_inputs(model, inputs):
    """``inputs`` as the list of the model's inputs in order (``model.inputs``): a list or tuple in
    that order, or a dict keyed by the inputs' names (Keras 3 takes either); of a model of one
    input, the array itself too. A clear error otherwise."""
    names = [x.name for x in model.inputs]
    if isinstance(inputs, dict):
        missing = [n for n in names if n not in inputs]
        extra = sorted(k for k in inputs if k not in names)
        if missing or extra:
            raise ValueError(f"model {model.name!r} takes the inputs {names}; the dict given has the keys "
                             f"{sorted(inputs)} (missing: {missing}, unknown: {extra}). Key the arrays by the "
                             f"names given to keras.Input(..., name=...).")
        return [inputs[n] for n in names]
    several = isinstance(inputs, (list, tuple)) and all(isinstance(x, (np.ndarray, Tensor)) for x in inputs)
    if several and len(inputs) == len(names):
        return list(inputs)
    if len(names) == 1 and not several:
        return [inputs]                                     # one input: the array (or nested lists)
    got = f"a {type(inputs).__name__} of {len(inputs)}" if isinstance(inputs, (list, tuple)) else \
        f"one {type(inputs).__name__}"
    raise ValueError(f"model {model.name!r} takes {len(names)} inputs, {names}, as a list in that order or a "
                     f"dict keyed by those names; got {got}.")


def rows_of(model, xs):
    """The batch size the inputs share, each checked against its keras.Input's shape."""
    sizes = set()
    for x, spec in zip(xs, model.inputs):
        shape = tuple(np.shape(x)) if not isinstance(x, Tensor) else tuple(x.shape)
        want = tuple(spec.shape[1:])
        if shape[1:] != want and shape[1:] + (1,) != want:
            raise ValueError(f"model {model.name!r}: the input {spec.name!r} takes examples of shape {want}, "
                             f"got an array of shape {shape}; give it shape (batch,) + {want}.")
        sizes.add(shape[0])
    if len(sizes) != 1:
        raise ValueError(f"model {model.name!r}: the inputs have different numbers of examples, "
                         f"{[int(np.shape(x)[0]) for x in xs]}; give every input the same batch.")
    return int(sizes.pop())


def joined(xs, b, dev):
    """Tensor 0 of the program: the inputs flattened and side by side, (b, total) float32. Of
    NumPy inputs, one upload to ``dev``; where one is a Tensor, made with ops on its device, so a
    tape that follows it sees the join (and the program's input gradient goes back through it)."""
    widths = [int(np.prod(np.shape(x)[1:], dtype=np.int64)) for x in xs]
    if not any(isinstance(x, Tensor) for x in xs):
        flat = [np.asarray(x, np.float32).reshape(b, w) for x, w in zip(xs, widths)]
        with dev.activate():
            return Tensor(dev.from_numpy(np.ascontiguousarray(np.concatenate(flat, axis=1))), dev)
    home = next(x for x in xs if isinstance(x, Tensor)).dev
    parts = []
    with home.activate():
        for x, w in zip(xs, widths):
            t = to_tensor_on(x, home)
            if t.dtype != FLOAT:
                t = ops.cast(t, np.float32)
            parts.append(ops.reshape(t, (b, w)))
        return ops.concat(parts, axis=1) if len(parts) > 1 else parts[0]


def call(model, inputs, training, r):
    """``model(inputs)`` on replica ``r``: the outputs in the model's structure (module
    docstring)."""
    xs = flat_inputs(model, inputs)
    b = rows_of(model, xs)
    model.use_own_weights()
    program = model.step.programs[r]
    x = joined(xs, b, program.dev)
    link = input_link(x)                        # tapes that follow the inputs: they want d loss / d x
    if link:
        program = input_grad_program(model, r)
    dev = program.dev
    with dev.activate():
        buf = (x.buf if x.dev is dev else dev.copy_from(x.buf, x.dev)).reshape(b, program.in_dim)   # (b, total)
        out = program.forward(buf, training=training, probabilities=True)
        y = Tensor(dev.copy_from(out, dev), dev, ModelOutput(model, program, buf, x, link))
    ys = model.outputs
    if len(ys) == 1:
        parts = [y]
    else:
        parts, offset = [], 0
        for t in ys:
            w = int(np.prod(t.shape[1:], dtype=np.int64))
            parts.append(ops.reshape(y[:, offset:offset + w], (b,) + tuple(t.shape[1:])))
            offset += w
    return nest.pack_sequence_as(model.output_structure, parts)


def input_grad_program(model, r):
    """Replica ``r``'s program whose backward also gives d loss / d its input (``input_grad``),
    made on first use: a model called in a GradientTape on a tensor the tape follows (a
    generator's output into a discriminator; any model, of one input or several). The same
    nodes and packed weights as ``step.programs[r]``, buffers of its own; ``fit`` never runs it."""
    programs = model.__dict__.setdefault("input_grad_programs", {})
    if r not in programs:
        strategy = model.distribute_strategy
        programs[r] = ReplicaProgram(model.nodes, model.step.pack, r, model.step.in_dim,
                                     strategy.extended.replica_offset, strategy.num_replicas_in_sync,
                                     input_grad=True)
    return programs[r]
