"""Keras's functional API: symbolic tensors, the layer calls they record, and the program a
model runs (its nodes in topological order). The training step never comes here: this file
turns how a model was WRITTEN into the list of ``engine.Node``s that ``engine.ReplicaProgram``
runs, once, when the model is made (functional) or first called (subclassed).

Three ways to write a model, one program::

    Sequential([Conv2D(...), MaxPooling2D(), Flatten(), Dense(10)])   a chain: node i reads node i-1

    inputs = keras.Input((28, 28, 1))                                  a symbolic tensor (no data)
    x = Conv2D(32, 3, activation="relu")(inputs)                       each call records a node
    ...
    model = keras.Model(inputs, outputs)                               the nodes between them

    class MyModel(keras.Model):                                        call() is run once per input
        def call(self, inputs, training=None): ...                     shape on symbolic tensors
                                                                       (``call_symbolically``), as tf.function traces

A ``KerasTensor`` holds a shape (batch axis ``None``), a dtype and ``keras_history``:
(the layer that made it, which of that layer's calls, 0), as Keras 3's does. Calling a
layer on one (``Layer.__call__`` -> ``call_layer``) builds the layer for that input shape
(its weights exist from then on, under the strategy in scope) and records a
``SymbolicNode`` in ``layer.inbound_nodes``. A layer called twice has two nodes and one set
of weights (shared). A model called on one (``Sequential([model, Softmax()])``,
``model(keras.Input(...))``, inside a subclassed ``call``) records ONE node too, as Keras does
(``model.layers``, summary and saving see the model); ``program`` then puts the model's own
nodes in its place (``expand``), so the engine runs one flat program.

``graph(inputs, outputs)`` walks back from the outputs as Keras's ``map_graph`` does: a
depth-first search gives each layer its first-visit index, each node its depth (the longest
path to an output); nodes run in decreasing depth, so every node runs after the nodes it
reads (a topological order), ties broken by the search's order, so the order is fixed.
``model.layers`` is Keras's order (layer depth, then first visit): the order of the weights.
``number`` turns the calls into engine nodes that read tensors by number; ``program`` does
both for a model of one input and one output, ``multi_io.py`` for one of several.

Python code that needs a tensor's VALUE while call() is traced (``if x > 0``, ``float(x)``,
``x.numpy()``, ``np.asarray(x)``) has no value to use: it raises, naming the user's line.

Neighbours: ``engine.py`` (``Node``, the program that runs), ``base_layer.py``
(``Layer.__call__``, ``Input``), ``models.py`` (``Model``, ``Functional``, ``Sequential``),
``saving.py`` (Keras 3's "Functional" config, read and written), ``multi_io.py`` (several inputs
or outputs).
"""
import inspect
import os
import traceback

from mirrored import nest
from mirrored.keras.engine import Node

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # mirrored/

SUPPORTED_IN_CALL = ("calling layers on the tensors you are given, loops and branches on Python "
                     "values (the input's shape, `training`, attributes of the model)")


def user_line():
    """'file:line' of the innermost frame outside this library (where the user's code is)."""
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(_PACKAGE):
            return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


class Untraceable(NotImplementedError):
    """A subclassed model's ``call`` that cannot be traced into layer nodes: ops on symbolic
    tensors, or a layer returning several tensors. ``model_call.py`` runs such a call as one node."""


class KerasTensor:
    """A symbolic tensor: shape and dtype, no data (Keras 3's ``KerasTensor``).

    ``shape``: ``(None,) + one example's shape``; ``keras_history``: (layer, node index,
    tensor index); ``node``: the ``SymbolicNode`` that made it.
    """

    def __init__(self, shape, node, node_index, dtype="float32", name=None):
        self.shape = (None,) + tuple(shape)
        self.dtype = dtype
        self.node = node
        self.keras_history = (node.layer, node_index, 0)
        self.name = name or f"keras_tensor_{next(_COUNT)}"
        self.ndim = len(self.shape)

    def __repr__(self):
        return f"<KerasTensor shape={self.shape}, dtype={self.dtype}, name={self.name}>"

    def _no_value(self, what):
        raise TypeError(
            f"{user_line()}: {what} needs the value of the symbolic tensor {self.name} "
            f"(shape {self.shape}), and a symbolic tensor has none: it stands for every batch the "
            f"model will see. While a model is defined (keras.Input -> layer calls) or its call() "
            f"is traced, what is supported is {SUPPORTED_IN_CALL}. Compute on values in a "
            f"layer, or after the model has run (model.predict(x)).")

    def __bool__(self):
        self._no_value("Python control flow on a tensor (if/while/and/or/not, bool())")

    def __float__(self):
        self._no_value("float()")

    def __int__(self):
        self._no_value("int()")

    def __index__(self):
        self._no_value("using a tensor as an index")

    def __len__(self):
        self._no_value("len()")

    def __iter__(self):
        self._no_value("iterating over a tensor")

    def __array__(self, dtype=None, copy=None):
        self._no_value("np.asarray() / NumPy")

    def numpy(self):
        self._no_value(".numpy()")

    def _op(self, name, layer):
        raise Untraceable(
            f"{user_line()}: `{name}` on symbolic tensors is not implemented here: use the "
            f"layer, keras.layers.{layer}()([a, b]), which Keras records the same way.")

    def __add__(self, other):
        self._op("+", "Add")

    __radd__ = __add__

    def __sub__(self, other):
        self._op("-", "Subtract")

    __rsub__ = __sub__

    def __mul__(self, other):
        self._op("*", "Multiply")

    __rmul__ = __mul__

    def __gt__(self, other):
        self._no_value("comparing a tensor")

    __lt__ = __ge__ = __le__ = __gt__


def _counter():
    n = 0
    while True:
        yield n
        n += 1


_COUNT = _counter()


class SymbolicNode:
    """One call of ``layer`` on symbolic ``inputs`` (a KerasTensor, a list of them, or none
    for an input layer's node); ``output``: the KerasTensor it made."""

    def __init__(self, layer, inputs, multi):
        self.layer, self.inputs, self.multi = layer, inputs, multi
        self.output = None

    @property
    def input_tensors(self):
        if self.inputs is None:
            return []
        return list(self.inputs) if self.multi else [self.inputs]


def input_tensor(layer, shape, name=None):
    """The symbolic tensor an input layer stands for (``keras.Input``): a node with no inputs."""
    node = SymbolicNode(layer, None, False)
    layer.inbound_nodes.append(node)
    node.output = KerasTensor(shape, node, len(layer.inbound_nodes) - 1, name=name or layer.name)
    return node.output


def is_symbolic(inputs):
    return isinstance(inputs, KerasTensor) or (
        isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, KerasTensor) for x in inputs))


def call_layer(layer, inputs, kwargs):
    """``layer(inputs, **kwargs)`` on symbolic tensors: build the layer for their shapes (once),
    record the node, return its output. ``training`` is accepted: the step tells every layer
    at run time whether it is training (``fit``) or not (``evaluate``, ``predict``)."""
    name = f"{type(layer).__name__} {layer.name!r}"
    unknown = sorted(k for k in kwargs if k != "training")
    if unknown:
        raise NotImplementedError(f"{user_line()}: {name} called with {unknown}: only the inputs and "
                                  f"training= are taken here.")
    if not is_symbolic(inputs):
        raise NotImplementedError(
            f"{user_line()}: {name} was called on {type(inputs).__name__}, not on symbolic tensors. "
            f"Here layers are called while a model is defined: x = keras.Input(shape); "
            f"y = layer(x); model = keras.Model(x, y); then model(data) or model.predict(data).")
    multi = isinstance(inputs, (list, tuple))
    shapes = [tuple(x.shape[1:]) for x in inputs] if multi else tuple(inputs.shape[1:])
    if hasattr(layer, "nested_nodes"):          # a model used as a layer: one node, expanded by program
        if multi:
            raise NotImplementedError(f"{user_line()}: the model {layer.name!r} was called on a list of "
                                      f"{len(inputs)} tensors: a model takes one input here.")
        out_shape = layer.nested_output_shape(shapes)
    elif layer.built:
        if _shape_key(shapes) != _shape_key(layer.input_shape):
            raise ValueError(f"{user_line()}: {name} was built for inputs of shape {layer.input_shape} and is "
                             f"now called on {shapes}: a layer called twice shares its weights and takes "
                             f"the same shape each time here. Use a new layer for the new shape.")
        out_shape = layer.output_shape
    else:
        layer.output_shape_for(shapes)           # checks the shapes before any weight exists
        layer.build(shapes)
        out_shape = layer.output_shape
    if isinstance(out_shape, list):
        raise Untraceable(f"{user_line()}: {name} returns {len(out_shape)} tensors; a layer called on symbolic "
                          f"tensors returns one here. Inside a subclassed model's call it works (the call "
                          f"then runs as one node, model_call.py).")
    node = SymbolicNode(layer, list(inputs) if multi else inputs, multi)
    layer.inbound_nodes.append(node)
    node.output = KerasTensor(out_shape, node, len(layer.inbound_nodes) - 1)
    return node.output


def _shape_key(shapes):
    if isinstance(shapes, list) or (shapes and isinstance(shapes[0], (tuple, list))):
        return [tuple(s) for s in shapes]
    return tuple(shapes)


def single(tensors, what):
    """The one KerasTensor in ``tensors`` (a tensor or a list of one), else a clear error."""
    flat = flat_tensors(tensors, what)
    if isinstance(tensors, dict) or len(flat) != 1:
        raise ValueError(f"keras.Model: expected one tensor as {what}, got {len(flat)}.")
    return flat[0]


def flat_tensors(tensors, what):
    """The KerasTensors of ``tensors`` (one, a list, or a dict: keys in sorted order, as
    ``tf.nest`` and Keras 3 flatten them), checked."""
    flat = nest.flatten(tensors)
    if not flat or not all(isinstance(t, KerasTensor) for t in flat):
        raise TypeError(f"keras.Model: {what} must be symbolic tensors (keras.Input(...) and the "
                        f"outputs of layer calls on them), alone, in a list or in a dict; got {tensors!r}.")
    return flat


def structured(inputs, outputs):
    """True for a model of several inputs or outputs, or of dicts of them (``multi_io.py``
    runs it); a tensor or a list of one is one."""
    return any(isinstance(s, dict) or len(nest.flatten(s)) > 1 for s in (inputs, outputs))


def program(inputs, outputs):
    """The nodes between ``inputs`` and ``outputs`` in Keras's order (one input, one output).

    Returns ``(nodes, layers, symbolic)``: ``engine.Node``s in topological order (tensor 0
    the input, tensor i + 1 node i's output, the last node's output the model's),
    ``model.layers`` in Keras's order, and the ``SymbolicNode`` of each engine node."""
    x, y = single(inputs, "inputs"), single(outputs, "outputs")
    order, layers = graph([x], [y])
    return number(order, {id(x): 0}, []), layers, order


def graph(xs, ys):
    """The calls between the input tensors ``xs`` and the output tensors ``ys`` (lists), in
    the order they run, and ``model.layers`` in Keras's order (module docstring)."""
    for x in xs:
        if x.node.inputs is not None:
            raise ValueError(f"keras.Model: inputs must be the tensors keras.Input(...) returned; "
                             f"{x.name} is a layer's output.")
    inputs = {id(x) for x in xs}
    first_visit, finished, order, in_progress = {}, set(), [], set()

    def visit(tensor):                        # Keras's _build_map_helper: post-order DFS
        node = tensor.node
        if id(node) in finished:
            return
        if id(tensor) in inputs or node.inputs is None:
            finished.add(id(node))
            return
        if id(node) in in_progress:
            raise ValueError(f"the layer {node.layer.name!r} is part of a cycle.")
        first_visit.setdefault(id(node.layer), len(first_visit))
        in_progress.add(id(node))
        for t in node.input_tensors:
            visit(t)
        in_progress.discard(id(node))
        finished.add(id(node))
        order.append(node)

    for y in ys:
        if id(y) in inputs:
            raise ValueError(f"keras.Model: the output {y.name} is an input itself; call at least one "
                             f"layer on it.")
        visit(y)
        if y.node.inputs is None:
            raise ValueError(f"Graph disconnected: the output {y.name} is a keras.Input that is not among "
                             f"the model's inputs; give it to keras.Model's inputs, or call a layer on it.")
    depth, layer_depth = {id(y.node): 0 for y in ys}, {}
    for node in reversed(order):                  # Keras's map_graph: longest path to an output
        d = depth.setdefault(id(node), 0)
        layer_depth[id(node.layer)] = d = max(d, layer_depth.get(id(node.layer), 0))
        depth[id(node)] = d
        for t in node.input_tensors:
            if t.node.inputs is not None and id(t) not in inputs:
                depth[id(t.node)] = max(depth.get(id(t.node), 0), d + 1)
    position = {id(n): i for i, n in enumerate(order)}
    order.sort(key=lambda n: (-depth[id(n)], position[id(n)]))
    by_layer = {}
    for node in order:
        by_layer.setdefault(id(node.layer), node.layer)
    layers = sorted(by_layer.values(), key=lambda l: (-layer_depth[id(l)], first_visit[id(l)]))
    names = [l.name for l in layers]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"The name(s) {duplicated} are used by several layers of the model. All layer "
                         f"names should be unique (they key the saved weights and the config).")
    return order, layers


def number(order, tensor_ids, nodes):
    """The engine nodes of the calls ``order`` appended to ``nodes`` (the nodes before them:
    none, or ``multi_io.py``'s input slices), each reading tensors by number: ``tensor_ids``
    {id(KerasTensor): number} holds the inputs' and gets each call's output (the number of
    the node that made it, plus one). Returns ``nodes``."""
    for node in order:
        ids = []
        for t in node.input_tensors:
            if id(t) not in tensor_ids:
                raise ValueError(f"Graph disconnected: the layer {node.layer.name!r} reads {t.name}, "
                                 f"which is not computed from the model's inputs: every branch "
                                 f"must start at a keras.Input given to keras.Model.")
            ids.append(tensor_ids[id(t)])
        nodes += expand(node.layer, tuple(ids), node.multi, len(nodes))
        tensor_ids[id(node.output)] = len(nodes)
    return nodes


def expand(layer, inputs, multi, before):
    """The engine nodes of one call of ``layer`` on the tensors numbered ``inputs``, placed
    after ``before`` nodes: the call itself, or, for a model used as a layer, its own nodes
    (``model.nested_nodes()``: models within models expanded already), their tensor 0 read
    from ``inputs[0]`` and their tensor t > 0 renumbered ``before + t``. So the engine runs
    a nested model's layers as the outer model's, with the same weights (one program). A layer
    whose activation its kernels do not apply (``Dense(activation='tanh')``) is followed by
    that activation's node (``composed_layers.unfused_activation``)."""
    nested = getattr(layer, "nested_nodes", None)
    if nested is None:
        after = getattr(layer, "activation_layer", None)     # Dense(activation='tanh'): a node more
        if after is None:
            return [Node(layer, inputs, multi)]
        if after.input_shape != layer.output_shape:
            after.build(layer.output_shape)                  # the owner's output, one example
        return [Node(layer, inputs, multi), Node(after, (before + 1,), False)]
    return [Node(n.layer, tuple(inputs[0] if t == 0 else before + t for t in n.inputs), n.multi)
            for n in nested()]


def call_symbolically(model, input_shape, training, input_layer):
    """Run a subclassed model's ``call`` on a symbolic input of ``input_shape`` (one example's
    shape): the program it builds (``program``'s answer). ``input_layer``: an ``InputLayer``
    made by the caller (this file does not import the layers)."""
    x = input_tensor(input_layer, input_shape)
    call = model.call
    try:
        takes_training = "training" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        takes_training = False
    y = call(x, training=training) if takes_training else call(x)
    if not isinstance(y, KerasTensor):
        raise TypeError(f"{type(model).__name__}.call returned {type(y).__name__}: call must return the "
                        f"output of a layer called on its inputs (one tensor).")
    return program(x, y)


def same_program(a, b, skip):
    """True when the node lists ``a`` and ``b`` compute the same thing once the nodes whose
    layer ``skip(layer)`` is true (Dropout: the identity outside training) are left out."""
    def kept(nodes):
        alias, out = {0: 0}, []
        for i, node in enumerate(nodes):
            inputs = tuple(alias[t] for t in node.inputs)
            if skip(node.layer) and not node.multi:
                alias[i + 1] = inputs[0]
                continue
            alias[i + 1] = ("node", len(out))
            out.append((id(node.layer), inputs, node.multi))
        return out, alias[len(nodes)]
    return kept(a) == kept(b)
