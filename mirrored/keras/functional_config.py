"""Keras 3's "Functional" config: how a functional model's layers and their calls are written
to a .keras file's config.json, and read back (keras/src/models/functional.py, ``get_config``
and ``functional_from_config``; keras/src/ops/node.py).

The layout (one entry per layer, Keras's order, the input layer first)::

    {"module": "keras.src.models.functional", "class_name": "Functional",
     "registered_name": "Functional",
     "config": {"name": "functional", "trainable": true,
                "layers": [{"module": "keras.layers", "class_name": "InputLayer",
                            "config": {"batch_shape": [null, 8], ...}, "name": "input_layer",
                            "inbound_nodes": []},
                           {"module": "keras.layers", "class_name": "Dense", "config": {...},
                            "build_config": {"input_shape": [null, 8]}, "name": "dense",
                            "inbound_nodes": [{"args": [<keras tensor>], "kwargs": {}}]}, ...],
                "input_layers": ["input_layer", 0, 0],
                "output_layers": ["dense_1", 0, 0]}}

A model of several inputs or outputs has an InputLayer entry per input, and its
``input_layers``/``output_layers`` are lists of references, or dicts of them (a model made
with dicts), as Keras 3 writes them (``references``).

    <keras tensor> = {"class_name": "__keras_tensor__",
                      "config": {"shape": [null, 8], "dtype": "float32",
                                 "keras_history": [layer name, node index, tensor index]}}

A layer's ``inbound_nodes`` are its calls in this model, in order; a layer called on a list
(a merge layer) has the list as its one argument: ``"args": [[<tensor>, <tensor>]]``. The node
index in ``keras_history`` counts the calls of that layer within this model (Keras renumbers
them so when a layer also serves other models). Reading replays the calls, layer by layer, as
often as needed: a shared layer's second call may read a layer listed after it (Keras does the
same). The older layout (``inbound_nodes: [[[name, node, tensor, kwargs], ...]]``) is read too.

Neighbours: ``saving.py`` (the archive, Sequential's config, the layers' configs),
``functional.py`` (the symbolic tensors: replaying a call is calling the layer), ``models.py`` (``Functional``).
"""
MODULE = "keras.src.models.functional"
TENSOR = "__keras_tensor__"


def functional_config(model, layer_entry):
    """Keras's config of a ``Functional`` model; ``layer_entry(layer)``: a layer's serialised
    entry (``saving.py``'s, module/class_name/config/registered_name)."""
    own = [x.node for x in model.inputs] + list(model.symbolic_nodes)
    own_ids = {id(n) for n in own}

    def node_index(node):                    # among the layer's calls in this model
        calls = [n for n in node.layer.inbound_nodes if id(n) in own_ids]
        return next(i for i, n in enumerate(calls) if n is node)

    def history(t):
        return [t.node.layer.name, node_index(t.node), 0]

    def tensor(t):
        return {"class_name": TENSOR, "config": {"shape": list(t.shape), "dtype": t.dtype,
                                                 "keras_history": history(t)}}

    entries = [{"module": "keras.layers", "class_name": "InputLayer",
                "config": {"batch_shape": list(x.shape), "dtype": "float32", "sparse": False,
                           "name": x.node.layer.name},
                "registered_name": None, "name": x.node.layer.name, "inbound_nodes": []} for x in model.inputs]
    for layer in model.layers:
        entry = layer_entry(layer)
        shape = layer.input_shape
        multi = isinstance(shape, list)
        entry["build_config"] = {"input_shape": [[None] + list(s) for s in shape] if multi
                                 else [None] + list(shape)}
        entry["name"] = layer.name
        entry["inbound_nodes"] = [
            {"args": [[tensor(t) for t in n.inputs] if n.multi else tensor(n.inputs)], "kwargs": {}}
            for n in layer.inbound_nodes if id(n) in own_ids]
        entries.append(entry)
    return {"module": MODULE, "class_name": "Functional", "registered_name": "Functional",
            "config": {"name": model.name, "trainable": model.trainable, "layers": entries,
                       "input_layers": references(model.input, history),
                       "output_layers": references(model.output, history)}}


def references(structure, history):
    """Keras 3's ``input_layers``/``output_layers``: ``[name, node, tensor]`` of one tensor, a
    list of them for a list, a dict of them for a dict."""
    if isinstance(structure, dict):
        return {k: history(t) for k, t in structure.items()}
    if isinstance(structure, (list, tuple)):
        return [history(t) for t in structure]
    return history(structure)


def connections(model):
    """[(layer, ['name[node][tensor]' of each input of each of its calls])], the input layers
    first: summary's "Connected to" column (calls numbered within this model, as Keras)."""
    own = [x.node for x in model.inputs] + list(model.symbolic_nodes)
    own_ids = {id(n) for n in own}

    def ref(t):
        calls = [n for n in t.node.layer.inbound_nodes if id(n) in own_ids]
        return f"{t.node.layer.name}[{next(i for i, n in enumerate(calls) if n is t.node)}][0]"
    rows = [(x.node.layer, []) for x in model.inputs]
    for layer in model.layers:
        rows.append((layer, [ref(t) for n in layer.inbound_nodes if id(n) in own_ids for t in n.input_tensors]))
    return rows


def functional_from_config(config, make_layer, make_input, make_model):
    """Rebuild a functional model from Keras's config (``config["config"]``).

    ``make_layer(entry)``: a new layer from a layer's entry; ``make_input(entry)``: the symbolic
    tensor of an InputLayer's entry; ``make_model(inputs, outputs, name)``: the model."""
    inner = config["config"]
    outputs = {}                    # (layer name, node index) -> the KerasTensor that call made
    pending, layers = [], {}
    for entry in inner["layers"]:
        name = entry.get("name") or entry["config"].get("name")
        if entry["class_name"] == "InputLayer":
            outputs[(name, 0)] = make_input(entry)
            continue
        layers[name] = make_layer(entry)
        pending.append((name, list(entry.get("inbound_nodes") or [])))
    while any(nodes for _, nodes in pending):
        progressed = False
        for name, nodes in pending:
            while nodes:
                args = _inputs(nodes[0], outputs)
                if args is None:            # reads a call not replayed yet: later
                    break
                count = sum(1 for key in outputs if key[0] == name)
                outputs[(name, count)] = layers[name](args)
                nodes.pop(0)
                progressed = True
        if not progressed:
            stuck = sorted(name for name, nodes in pending if nodes)
            raise ValueError(f"Invalid Functional model configuration: the calls of {stuck} read layers "
                             f"or calls the config does not have (a loop, or a damaged file).")

    def tensor_of(ref):
        if isinstance(ref, dict):                        # a dict of inputs or outputs
            return {k: tensor_of(v) for k, v in ref.items()}
        if isinstance(ref, list) and not _is_leaf(ref):   # a list of them (Keras writes one as a list of one)
            return [tensor_of(r) for r in ref] if len(ref) != 1 else tensor_of(ref[0])
        ref = _leaf(ref, "input_layers/output_layers")
        key = (ref[0], int(ref[1]))
        if key not in outputs:
            raise ValueError(f"Invalid Functional model configuration: no layer call {key}.")
        return outputs[key]
    return make_model(tensor_of(inner["input_layers"]), tensor_of(inner["output_layers"]), inner.get("name"))


def _is_leaf(ref):
    return isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str)


def _leaf(ref, what):
    """[name, node, tensor] from a reference or a list of one (Keras writes either)."""
    if isinstance(ref, list) and len(ref) == 1 and isinstance(ref[0], list):
        ref = ref[0]
    if not _is_leaf(ref):
        raise NotImplementedError(f"{what} {ref!r}: a reference is [layer name, node index, tensor index].")
    return ref


def _inputs(node, outputs):
    """The symbolic inputs of one serialised call, or None while one is not made yet."""
    if isinstance(node, list):                                      # the older layout
        refs = [_leaf(ref[:3], "inbound node") for ref in node]
        got = [outputs.get((r[0], int(r[1]))) for r in refs]
        if any(g is None for g in got):
            return None
        return got if len(got) > 1 else got[0]
    args = node.get("args") or []
    if len(args) != 1:
        raise NotImplementedError(f"a layer call with {len(args)} positional arguments is not implemented here.")
    arg = args[0]
    refs = arg if isinstance(arg, list) else [arg]
    got = []
    for ref in refs:
        if not (isinstance(ref, dict) and ref.get("class_name") == TENSOR):
            raise NotImplementedError(f"a layer call on {ref!r}: only calls on tensors are read here.")
        history = ref["config"]["keras_history"]
        got.append(outputs.get((history[0], int(history[1]))))
    if any(g is None for g in got):
        return None
    return got if isinstance(arg, list) else got[0]


def is_functional(config):
    return config.get("class_name") in ("Functional", "Model") and "input_layers" in config.get("config", {})

