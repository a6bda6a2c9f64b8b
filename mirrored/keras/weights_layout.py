"""Where a model's weights go in Keras 3's files: the paths of its walk, nothing written.

Keras 3 (keras/src/saving/saving_lib.py, ``_save_state``, ``_walk_saveable``,
``_save_container_state``) saves a model by walking it: each object's own variables go to
``<path>/vars``, then the walk goes into what it holds, each layer or model once (where it
is met first). ``saving.py`` writes and reads ``.weights.h5`` files, and the weights of
``.keras`` archives, along the same walk (``weight_entries``)::

    vars                                   the model's own (a Sequential's or functional model's: none)
    layers/dense/vars/0                    a Sequential's or functional model's layers, keyed by class
    layers/input_layer/vars                a functional model's input layer (no weights)
    layers/sequential/vars                 a model used as a layer: its own group, empty,
    layers/sequential/layers/dense/vars/0  ... and its layers under it, keyed within it
    head/vars/0                            a subclassed model's layers by ATTRIBUTE name, in
    inner/layers/dense/vars/0              order of name; its ``layers`` property is one of the
    layers/block/dense_a/vars/0            names (a layer first met there is saved there);
                                           a layer of layers: its sublayers by attribute

A key is NOT the layer's name (names differ from run to run): it is the class in snake case,
numbered within its container in order (``dense``, ``dense_1``...), a number used up even by a
layer saved elsewhere already. Earlier versions of this library wrote every layer of
``model.layers`` at ``layers/<key>`` with all its weights (``earlier_entries``: still read).

Neighbours: ``saving.py`` (the files), ``models.py`` (registers the model classes here),
``base_layer.py`` (layers, their ``_sublayers``).
"""
from mirrored.keras import layers as L


#: The model classes ``load_model`` can rebuild, by Keras's class name: ``models.py`` registers
#: ``Model``, ``Sequential`` and ``Functional`` (``register_model_class``), as Keras's ``register_keras_serializable`` does,
#: so that this module and ``saving.py``, which ``models.py`` imports, need not import ``models.py``.
#: The walk below tells models from layers by them.
MODEL_CLASSES = {}


def register_model_class(cls):
    """Class decorator: ``load_model`` rebuilds configs whose class_name is ``cls.__name__``."""
    MODEL_CLASSES[cls.__name__] = cls
    return cls


def layer_keys(layers):
    """Keras's paths for a model's layers: class name in snake case, ``_1``, ``_2``... per class."""
    used, keys = {}, []
    for layer in layers:
        name = L.snake_case(type(layer).__name__)
        if name in used:
            used[name] += 1
            name = f"{name}_{used[name]}"
        else:
            used[name] = 0
        keys.append(name)
    return keys


def is_container(layer):
    """A Sequential or functional model (or a subclass of one): Keras 3 walks its ``layers``
    first (saving_lib's ``_walk_saveable``: "layers" first for these two kinds)."""
    return any(isinstance(layer, MODEL_CLASSES[name]) for name in ("Sequential", "Functional") if name in MODEL_CLASSES)


def _saveable(value):
    """A layer or a model: what Keras 3's walk saves (its ``KerasSaveable``s that hold weights)."""
    return isinstance(value, L.Layer) or ("Model" in MODEL_CLASSES and isinstance(value, MODEL_CLASSES["Model"]))


def _walked(value):
    """A layer or model, or a list/tuple/dict holding some: what the walk goes into."""
    if isinstance(value, dict):
        value = list(value.values())
    return _saveable(value) or isinstance(value, (list, tuple)) and any(_saveable(v) or _walked(v) for v in value)


def sublayers(model):
    """The layers Keras 3 walks inside a Sequential or functional ``model``: a functional
    model's input layers (weightless, each with a group), then ``model.layers``; a
    Sequential's ``layers`` (no input layer)."""
    inputs = [t.node.layer for t in (getattr(model, "inputs", None) or ())]
    return inputs + model.layers


def children(obj):
    """What Keras 3 walks after ``obj``'s own variables (saving_lib's ``_walk_saveable``), as
    ``[(attribute name, a layer, a model, or a list of them)]``: a Sequential's or functional
    model's ``layers`` first; then, in order of name, the public attributes that hold layers
    or models (a subclassed model's ``self.head = Dense(2)``; its ``layers`` property among
    them, so a layer is reached by its attribute's name when that sorts before "layers").
    Attributes named with ``_`` are not walked here (ours are the library's bookkeeping), nor
    a model's ``nodes`` (its program: the layers met already, or ``model_call.ModelCall``)."""
    skip = ("nodes",) if _saveable(obj) and hasattr(obj, "nested_nodes") else ()
    found = {k: v for k, v in vars(obj).items() if not k.startswith("_") and k not in skip and _walked(v)}
    if is_container(obj):
        return [("layers", sublayers(obj))] + sorted(found.items())
    if "Model" in MODEL_CLASSES and isinstance(obj, MODEL_CLASSES["Model"]):
        found["layers"] = obj.layers
    return sorted(found.items())


def variables_of(obj):
    """The variables ``obj``'s own ``vars`` group holds, Keras's order: a Sequential's or
    functional model's none (its layers hold them); a subclassed model's those made on it
    (``add_weight``); a layer's its weights less its sublayers' (trainable, then not)."""
    if is_container(obj):
        return []
    if "Model" in MODEL_CLASSES and isinstance(obj, MODEL_CLASSES["Model"]):
        return list(obj.own_variables)
    inner = {id(w) for layer in obj.__dict__.get("_sublayers", ()) for w in layer.weights}
    return [v for v in obj.weights if id(v) not in inner]


def own_weights(obj):
    """``[(name, shape)]`` of ``variables_of(obj)``: what a built object's group must hold."""
    return [(v.name, v.shape) for v in variables_of(obj)]


def container_entries(items, path, seen, want_of):
    """saving_lib's ``_save_container_state``: each item under ``path`` by its class in snake
    case, numbered per container (a name is used up even by an item saved already)."""
    items = list(items.values()) if isinstance(items, dict) else list(items)
    keyed = [v for v in items if _saveable(v)]
    out, lists = [], 0
    keys = iter(layer_keys(keyed))
    for value in items:
        if _saveable(value):
            out += _walk(value, f"{path}/{next(keys)}", seen, want_of)
        elif isinstance(value, (list, tuple, dict)) and _walked(value):
            out += container_entries(value, f"{path}/container" + (f"_{lists}" if lists else ""), seen, want_of)
            lists += 1
    return out


def _walk(obj, path, seen, want_of):
    """saving_lib's ``_save_state`` from ``obj`` at ``path``: ``[(path, object, want)]``,
    each object once (``visited_saveables``: one shared by two models is saved where it is
    met first)."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    out = [(path, obj, want_of(obj))]
    for name, value in children(obj):
        where = f"{path}/{name}".lstrip("/")
        out += _walk(value, where, seen, want_of) if _saveable(value) else container_entries(value, where, seen, want_of)
    return out


def weight_entries(model, want_of=own_weights):
    """Keras 3's paths of ``model``'s weights (saving_lib's walk, nothing written):
    ``[(path, object, want)]``, ``path`` "" for the model itself (its group is ``vars``), else
    e.g. ``layers/sequential`` (a nested model: its own group empty),
    ``layers/sequential/layers/dense``, ``head`` (a subclassed model's ``self.head``);
    ``want``: ``want_of(object)``, the ``[(name, shape)]`` its group holds (``own_weights``:
    a built model's; or what a config gives it, ``None`` where unknown)."""
    return _walk(model, "", set(), want_of)


def planned_entries(plan):
    """``weight_entries`` of a Sequential or functional model not made yet, from its layers'
    ``plan`` (``[(layer, [(name, shape)] or None)]``, ``weight_shapes.py``: the weights the
    config gives each, nothing built): a layer of the plan wants its planned weights (a layer
    of layers: unknown, None, until it is built); a model used as a layer in it, made and
    built already, its layers their own."""
    wants = {id(layer): want for layer, want in plan}

    def want_of(obj):
        if is_container(obj):
            return []
        if id(obj) in wants and not children(obj):
            return wants[id(obj)]
        return own_weights(obj) if obj.built else None
    return [("", None, [])] + container_entries([layer for layer, _ in plan], "layers", set(), want_of)


def layer_key(path):
    """How errors name an entry: its path less the leading ``layers/`` (``dense``,
    ``sequential/layers/dense``, ``head``)."""
    return path[len("layers/"):] if path.startswith("layers/") else path


def group_name(path):
    """The HDF5 group of an entry's variables: ``<path>/vars`` (``vars`` for the model)."""
    return f"{path}/vars" if path else "vars"


def earlier_entries(model):
    """The layout earlier versions of this library wrote: every layer of ``model.layers``
    (a functional model's input layers first) at ``layers/<key>`` with ALL its weights, a
    model used as a layer's and a layer of layers' included, and a subclassed model's layers
    keyed by class, not by attribute. Read when Keras 3's layout does not fit the file."""
    layers = sublayers(model)
    return [("", model, [])] + [(f"layers/{key}", layer, [(v.name, v.shape) for v in layer.weights])
                                for key, layer in zip(layer_keys(layers), layers)]


def earlier_variables(path, obj):
    """The variables ``_earlier_entries`` put at ``path``: all of the layer's."""
    return list(obj.weights) if path else []


def all_reached(model, entries, variables=lambda path, obj: variables_of(obj)):
    """``model.weights``, each of which the walk reached (``weight_entries``): a weight held
    where Keras 3's walk does not look (a layer kept only in an attribute named with ``_``)
    could be neither written nor read: refused by name."""
    reached = {id(v) for path, obj, _ in entries for v in variables(path, obj)}
    lost = [v.name for v in model.weights if id(v) not in reached]
    if lost:
        raise NotImplementedError(f"the weights {lost} of {model.name!r} are held where Keras 3's file layout "
                                  f"does not look (a layer kept in an attribute whose name starts with '_', or "
                                  f"in a structure other than a list, tuple or dict): keep it in a public "
                                  f"attribute, self.name = layer.")
    return model.weights
