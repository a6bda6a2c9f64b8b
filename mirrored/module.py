"""``mirrored.Module``: TensorFlow's ``tf.Module``, a container that finds its variables.

TF's "Basic training loops" and "Introduction to modules" guides write a model as

    class MyModel(tf.Module):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.w = tf.Variable(5.0)
            self.b = tf.Variable(0.0)
        def __call__(self, x):
            return self.w * x + self.b

    model.trainable_variables     # (b, w): found in the attributes, sorted by name, as TF

What TF does, and this file the same: ``variables`` walks the module's attributes in sorted
order, depth first, into lists, tuples, dicts and other modules (Keras layers and models
too: their own ``variables``), and lists each variable once. ``trainable_variables`` keeps the
trainable ones; ``submodules`` the modules found. The walk happens on each access, as in TF,
so a variable assigned after ``__init__`` is found.

Neighbours: ``values.py`` (``Variable``), ``keras/base_layer.py`` (Keras's layers, which are
not Modules here but are walked into).
"""
import re

from mirrored.values import Variable


def _snake_case(name):
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


class Module:
    """TF's ``tf.Module``: ``name``, ``variables``, ``trainable_variables``, ``submodules``."""

    def __init__(self, name=None):
        if name is not None and not re.fullmatch(r"[A-Za-z_][\w.-]*", str(name)):
            raise ValueError(f"{name!r} is not a valid module name: use letters, digits and _ "
                             f"(a Python identifier), as tf.Module asks.")
        self._name = name or _snake_case(type(self).__name__)

    @property
    def name(self):
        return self._name

    @property
    def name_scope(self):
        return self._name + "/"

    @property
    def variables(self):
        """Every variable this module holds, its submodules' included, each once (TF's order)."""
        return tuple(v for v in _walk(self, set(), Variable))

    @property
    def trainable_variables(self):
        return tuple(v for v in self.variables if v.trainable)

    @property
    def non_trainable_variables(self):
        return tuple(v for v in self.variables if not v.trainable)

    @property
    def submodules(self):
        return tuple(_walk(self, set(), Module))

    @classmethod
    def with_name_scope(cls, method):
        """TF's decorator (name scopes only name ops there): the method as it is."""
        return method


def _walk(module, seen, kind):
    """Depth first through ``module``'s attributes (sorted by name, as TF): what is a ``kind``."""
    for key in sorted(vars(module)):
        if key == "_name":
            continue
        yield from _found(vars(module)[key], seen, kind)


def _found(value, seen, kind):
    if id(value) in seen:
        return
    if isinstance(value, Variable):
        seen.add(id(value))
        if kind is Variable:
            yield value
    elif isinstance(value, Module):
        seen.add(id(value))
        if kind is Module:
            yield value
        yield from _walk(value, seen, kind)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            yield from _found(value[k], seen, kind)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _found(item, seen, kind)
    elif kind is Variable and hasattr(value, "trainable_weights") and hasattr(value, "variables"):
        seen.add(id(value))                        # a Keras layer or model: its own variables
        for v in value.variables:
            if id(v) not in seen:
                seen.add(id(v))
                yield v
