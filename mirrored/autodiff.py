"""Reverse-mode differentiation of any composition of ops: the tape's graph and its walk.

micrograd's design, with TensorFlow's rules. Every differentiable op (``mirrored/ops.py``)
ends with ``record(name, inputs, output, grad_fn)``. If a tape of this thread is recording
and one of ``inputs`` is *tracked* by it (watched, a trainable variable read inside it, or
the output of an op it recorded), the output gets a ``Node``: the op's name, its inputs,
its gradient rule and the tapes that recorded it. Nothing is recorded otherwise, so code
outside any tape pays nothing.

``gradient(tape, target, sources)`` then walks the nodes back from ``target`` in reverse
topological order, calling each rule with the gradient of its output and adding what it
returns into its inputs' gradients (in the order the rules run: the same bits every time).
The rules are written in ops, so while an outer tape records, the walk itself is recorded
and a second ``gradient`` of the result gives second derivatives (nested tapes).

Three kinds of leaves end the walk:
    a watched tensor                  ``tape.watch(x)``: its gradient is returned for ``x``
    a variable read                   ``ReadNode(variable)``: reading a trainable variable
                                      inside a tape watches it (``watch_accessed_variables``)
    a model's output (``keras/tape.py``)  the model call is ONE node: its backward is the
                                      engine's fused backward (``model_backward``)

TensorFlow's rules kept here: the gradient of a non-scalar target is that of its sum; an
integer or bool tensor gets no gradient (None); a source the target does not depend on gets
None (``unconnected_gradients='none'``) or zeros (``'zero'``); a tape records only in its
own thread; ``stop_recording()`` pauses it.

Neighbours: ``ops.py`` (every op and its gradient rule), ``keras/tape.py`` (``GradientTape``,
the model-call node and the fused loss path the course's loop takes).
"""
import threading

import numpy as np

_local = threading.local()       # .tapes: this thread's recording tapes, innermost last


def recording_tapes():
    """The tapes recording in this thread (innermost last)."""
    tapes = getattr(_local, "tapes", None)
    if tapes is None:
        tapes = _local.tapes = []
    return tapes


def push(tape):
    recording_tapes().append(tape)


def pop(tape):
    tapes = recording_tapes()
    if tape in tapes:
        tapes.remove(tape)


class Node:
    """How a tensor was computed: ``op`` on ``inputs`` (tensors, or None where the rule
    gives nothing), ``grad_fn(dy) -> (d input_0, d input_1, ...)``, and which tapes saw it."""

    __slots__ = ("op", "inputs", "grad_fn", "tapes", "partial")

    def __init__(self, op, inputs, grad_fn, tapes, partial=False):
        self.op, self.inputs, self.grad_fn, self.tapes = op, tuple(inputs), grad_fn, tapes
        #: the rule takes ``wanted`` (a bool per input) and computes only those parts
        #: (``matmul``: a GEMM saved for the input of a first layer, which nothing needs)
        self.partial = partial


class ReadNode:
    """A leaf: the value of ``variable`` as an op read it (its gradient is the variable's)."""

    __slots__ = ("variable", "tapes")
    op = "read_variable"
    inputs = ()

    def __init__(self, variable, tapes):
        self.variable, self.tapes = variable, tapes


def differentiable(dtype):
    """Float tensors carry gradients; integers and bools do not (TensorFlow's rule)."""
    return np.dtype(dtype).kind in "fc"


def tracked_by(tape, t):
    """Whether ``tape`` follows tensor ``t``: watched by it, or computed by an op it recorded
    (a model's output and our losses' nodes count as recorded by every tape: they are made
    from the model's variables, which every tape watches)."""
    if tape.is_watched(t):
        return True
    node = getattr(t, "node", None)
    if node is None:
        return False
    tapes = getattr(node, "tapes", None)
    return tapes is None or tape in tapes


def record(op, inputs, output, grad_fn, partial=False):
    """Give ``output`` a Node when a tape of this thread follows one of ``inputs``.
    Returns ``output``. ``inputs``: tensors (others are constants to the tape).
    ``partial``: ``grad_fn(dy, wanted)`` computes only the inputs' parts that are wanted."""
    tapes = recording_tapes()
    if not tapes or not differentiable(output.dtype):
        return output
    following = tuple(tape for tape in tapes if tape.recording and
                      any(x is not None and differentiable(x.dtype) and tracked_by(tape, x)
                          for x in inputs))
    if following:
        output.node = Node(op, inputs, grad_fn, frozenset(following), partial)
    return output


def read_variable(variable, tensor):
    """A variable's value as an op reads it: ``tensor`` (the variable's storage) wrapped in a
    new Tensor with a ``ReadNode``, when a tape watches it (or watches accessed variables)."""
    tapes = recording_tapes()
    if not tapes or not differentiable(tensor.dtype):
        return tensor
    following = []
    for tape in tapes:
        if not tape.recording:
            continue
        if tape.watch_accessed_variables and getattr(variable, "trainable", True):
            tape.watch_variable(variable)
        if tape.is_watched(variable):
            following.append(tape)
    if not following:
        return tensor
    read = type(tensor)(tensor.buf, tensor.dev)
    read.node = ReadNode(variable, frozenset(following))
    return read


# --- the walk -------------------------------------------------------------------------------

def _order(tape, target):
    """The tensors ``tape`` recorded between the leaves and ``target``, target first, each
    after every tensor computed from it (reverse topological order, iteratively)."""
    order, seen, stack = [], set(), [(target, False)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        node = getattr(t, "node", None)
        if isinstance(node, Node) and tape in node.tapes:
            for x in node.inputs:
                if x is not None and id(x) not in seen:
                    stack.append((x, False))
    order.reverse()
    return order


def _needed(tape, order, keep, variables):
    """The ids of the tensors whose gradient leads somewhere: a kept source, a variable read
    among ``variables`` (None: any), a model's output (the caller decides), or an input of
    one of those. A rule is asked only for these parts."""
    needed = set()
    for t in reversed(order):                    # inputs before what is computed from them
        node = getattr(t, "node", None)
        if id(t) in keep:
            needed.add(id(t))
        elif isinstance(node, ReadNode):
            if variables is None or id(node.variable) in variables:
                needed.add(id(t))
        elif isinstance(node, Node) and tape in node.tapes:
            if any(x is not None and id(x) in needed for x in node.inputs):
                needed.add(id(t))
        elif node is not None:
            needed.add(id(t))
    return needed


def gradient(tape, target, output_gradient, add, keep=(), variables=None):
    """d target / d every tensor ``tape`` followed, starting from ``output_gradient``.

    Returns (kept, var_grads, leaves): ``kept`` {id(tensor): gradient} for the tensors whose
    ids are in ``keep`` (watched sources); ``var_grads`` {id(variable): (variable, gradient)}
    for the variables whose ids are in ``variables`` (None: every one read); ``leaves``
    [(tensor, gradient)] for the tensors reached whose node is not an autodiff one (a
    model's output, our losses' nodes): the caller (``keras/tape.py``) runs their fused
    backward. ``add(a, b)``: the op that sums two gradients. Only the parts on a way to
    one of these are computed."""
    order = _order(tape, target)
    needed = _needed(tape, order, keep, variables)
    grads = {id(target): output_gradient}
    kept, var_grads, leaves = {}, {}, []
    for t in order:
        g = grads.pop(id(t), None)
        if g is None or id(t) not in needed:
            continue
        if id(t) in keep:
            kept[id(t)] = g
        node = getattr(t, "node", None)
        if isinstance(node, ReadNode):
            key = id(node.variable)
            prev = var_grads.get(key)
            var_grads[key] = (node.variable, g if prev is None else add(prev[1], g))
        elif isinstance(node, Node) and tape in node.tapes:
            wanted = tuple(x is not None and id(x) in needed and differentiable(x.dtype) for x in node.inputs)
            parts = node.grad_fn(g, wanted) if node.partial else node.grad_fn(g)
            for x, gx, w in zip(node.inputs, parts, wanted):
                if not w or gx is None:
                    continue
                prev = grads.get(id(x))
                grads[id(x)] = gx if prev is None else add(prev, gx)
        elif node is not None:
            leaves.append((t, g))                # a model's output or one of our losses
    return kept, var_grads, leaves
