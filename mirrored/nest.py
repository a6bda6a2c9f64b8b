"""Nested structures (tuples, lists, dicts, namedtuples) as ``tf.nest`` sees them.

Strategies pass structures of values between replicas: ``run`` unpacks the
``PerReplica`` leaves of its arguments, ``merge_call`` regroups what every
replica passed, ``all_reduce`` reduces every leaf of a structure at once.
"""


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(x, "_fields")


def is_nested(x):
    return isinstance(x, (list, tuple, dict))


def flatten(structure):
    """The leaves, depth first (dicts in sorted key order, as tf.nest)."""
    if isinstance(structure, dict):
        return [leaf for k in sorted(structure) for leaf in flatten(structure[k])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in flatten(item)]
    return [structure]


def pack_sequence_as(structure, leaves):
    """Rebuild ``structure``'s shape from a flat list of ``leaves``."""
    return _build(structure, iter(leaves))


def _build(s, it):
    # A module-level function, not a closure over ``it`` calling itself: such a closure
    # is a reference cycle (the function, its cell, the iterator over the leaves) that
    # keeps every leaf alive until the garbage collector runs, so a returned tensor's
    # buffer would look held (traced_function.OutputPool) and memory would be freed late.
    if isinstance(s, dict):
        built = {k: _build(s[k], it) for k in sorted(s)}
        return type(s)((k, built[k]) for k in s)
    if _is_namedtuple(s):
        return type(s)(*[_build(v, it) for v in s])
    if isinstance(s, (list, tuple)):
        return type(s)(_build(v, it) for v in s)
    return next(it)


def map_structure(fn, *structures):
    """Apply ``fn`` to corresponding leaves of structures of the same shape."""
    flats = [flatten(s) for s in structures]
    if any(len(f) != len(flats[0]) for f in flats):
        raise ValueError("the structures do not have the same number of elements: "
                         f"{[len(f) for f in flats]}.")
    return pack_sequence_as(structures[0], [fn(*leaves) for leaves in zip(*flats)])


def structure_of(structure):
    """A hashable picture of how ``structure`` nests, its leaves left out: two values
    regroup leaf by leaf exactly when their pictures are equal."""
    if isinstance(structure, dict):
        return ("dict", tuple((k, structure_of(structure[k])) for k in sorted(structure)))
    if isinstance(structure, (list, tuple)):
        return (type(structure).__name__, tuple(structure_of(item) for item in structure))
    return "*"


def describe(picture):
    """``structure_of``'s picture as Python-like text: ``(*, [*, *])``, ``{'a': *}``."""
    if picture == "*":
        return "a single value"
    return _text(picture)


def _text(picture):
    if picture == "*":
        return "*"
    kind, items = picture
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_text(v)}" for k, v in items) + "}"
    inner = ", ".join(_text(v) for v in items)
    return f"[{inner}]" if kind == "list" else f"({inner}{',' if len(items) == 1 else ''})"
