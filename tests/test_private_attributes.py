"""No new reads of another module's private attributes (``obj._x``), read from the source.

``tests/test_structure.py`` checks what ``ast`` can tell for sure (``from m import _x``,
``m._x``, ``extended._x``). This test checks the rest by a rule of thumb: ``obj._x`` where
``obj`` is not ``self`` or ``cls`` and no class of the reading module defines ``_x`` (as a
method, a class attribute, a ``__slots__`` entry or ``self._x = ...``) is a read of another
module's private attribute. The reads there are today are listed in ``KNOWN``, each with
why it stays; a new one fails the test, with the public name to use or add.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mirrored", "kernels")

#: (file, expression) of the reads that stay, and why.
KNOWN = {
    ("kernels/launch.py", "arr._ary"),                       # numba's device-array internals
    ("mirrored/devices.py", "buf._ary"),                     # numba's device-array internals
    ("kernels/launch_cache.py", "ctypes._SimpleCData"),      # ctypes' base class of C scalars
    ("kernels/launch_cache.py", "overload._prepare_args"),   # numba's dispatcher internals
    ("kernels/launch_cache.py", "overload._codelibrary"),    # numba's dispatcher internals
    ("kernels/registry.py", "k._device"),                    # numba's kernel attribute
    ("kernels/disk_cache.py", "kernel._cache"),              # numba's dispatcher: its disk cache, guarded
    ("kernels/disk_cache.py", "kernel._cache_hits"),         # ... and its count of loads from it
    ("mirrored/workers.py", "os._exit"),                     # the standard library's name
    ("mirrored/strategy.py", "MirroredVariable._build"),     # the strategy builds its variables
    ("mirrored/strategy.py", "comp._handle_name"),           # ... and names their copies
    ("mirrored/values.py", "strategy._create_variable"),     # ... when Variable() is called in scope
    ("mirrored/tensor.py", "other._as_tensor"),              # a Variable, duck-typed (no import cycle)
}


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _defined_here(tree):
    """Private names some class of this module defines."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign):
                    for target in item.targets:
                        if isinstance(target, ast.Name):
                            own.add(target.id)
                            if target.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                                own.update(e.value for e in item.value.elts if isinstance(e, ast.Constant))
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
    return own


def private_attribute_reads(source, path="<string>"):
    """[(line, expression)] of the reads of private attributes no class here defines."""
    tree = ast.parse(source, path)
    own = _defined_here(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_rule_finds_reads_and_spares_a_modules_own_names():
    source = ("class A:\n"
              "    __slots__ = ('_slot',)\n"
              "    def __init__(self):\n"
              "        self._mine = 1\n"
              "    def _helper(self, other):\n"
              "        return other._mine, other._slot, other._helper\n"   # 6: this module's own
              "def f(t, opt):\n"
              "    return t._buf, opt._step, self._x\n")                    # 8: two reads (self spared)
    assert private_attribute_reads(source) == [(8, "t._buf"), (8, "opt._step")]


def test_no_new_reads_of_other_modules_private_attributes():
    found = set()
    where = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, expr in private_attribute_reads(path.read_text(), str(path)):
                found.add((rel, expr))
                where.setdefault((rel, expr), line)
    new = sorted(found - KNOWN)
    assert not new, ("reads of another module's private attribute (use its public name, or add "
                     "one, documented, to the class that owns it):\n" +
                     "\n".join(f"  {f}:{where[(f, e)]}: {e}" for f, e in new))
