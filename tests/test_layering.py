"""No upward calls by duck typing in the compiled paths (issue 50), read with ``ast``.

The import graph (``test_structure.py``) has no cycles, but a module can still depend on
code above it without importing it: ``graphs.py`` (now ``program/passes.py``) called eleven methods of ``keras/``'s
``Step`` by name on the object it was handed. The import graph cannot see that. This
test can, for the modules of the compiled paths (``COMPILED``):

    A module may use ``obj.name`` only if ``name`` is defined (a ``def``, a class, a class
    or module attribute, an attribute assigned as ``x.name = ...``) in the module itself
    or in a library module it imports, directly or not — or belongs to Python's types or
    to a package outside the library that it imports (``list.append``, ``np.dtype.kind``).

A name defined only in library modules it does not reach is an upward dependency by duck
typing, and fails the test with its line. The cure is an explicit interface at the
module's own level that the code above implements (``passes.StepPasses``, which
``keras/inference.py``'s ``InferencePasses``, hence ``keras/step.py``'s ``Step``,
subclasses), or passing the value down (``reduce_in_trace`` takes the device, not the
strategy).

What it cannot see: a name that code below defines too (``run``, ``close``) is allowed
whatever object it is called on. ``ALLOWED`` lists the names of outside packages the
scan cannot find, each with why; an entry no longer needed fails too.

    python -m pytest -q tests/test_layering.py
"""
import ast
import builtins
import importlib

from test_structure import MODULES, import_graph

#: The compiled paths: the function tracer, compiling ahead, the kernels' launch, and the
#: device program's package (mirrored/program/: record, replay, capture, passes).
COMPILED = ("mirrored.traced_function",
            "kernels.compile_ahead", "kernels.launch")

#: (module, name): why the name is not the library's (the scan sees only imported modules'
#: own attributes and their classes', and numba.cuda is the simulator's under the tests).
ALLOWED = {("kernels.compile_ahead", "stats"): "numba's Dispatcher.stats (a kernel's cache)",
           ("kernels.compile_ahead", "get_memory_info"): "numba's CUDA Context (the simulator's has none)"}

_PY_TYPES = (list, dict, set, frozenset, tuple, str, bytes, int, float, object, type,
             BaseException)


def compiled_modules():
    return [m for m in MODULES if m in COMPILED or m.startswith("mirrored.program")]


def defined_names(path):
    """Names a file defines: defs and classes at any depth, module- and class-level
    assignments, attributes assigned (``self.x = ``, ``x.y += ``), ``setattr(o, "name", v)``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            top |= {id(n) for n in node.body}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name) and id(node) in top:
                        names.add(sub.id)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def used_names(path):
    """{attribute name: first line} of every ``x.name`` in a file."""
    used = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
            used.setdefault(node.attr, node.lineno)
    return used


def outside_names(path):
    """Attributes of Python's types and of the packages outside the library a file imports
    (each imported module's names and its classes' attributes)."""
    names = set(dir(builtins))
    for t in _PY_TYPES:
        names |= set(dir(t))
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    for name in imported:
        if name.split(".")[0] in ("mirrored", "kernels"):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        names |= set(dir(module))
        names |= {a for v in vars(module).values() if isinstance(v, type) for a in dir(v)}
    return names


def upward_uses(modules, graph, paths):
    """``['module:line: .name (defined only above it, in m)']`` for each module of ``modules``."""
    defined = {m: defined_names(paths[m]) for m in paths}
    found = []
    for module in modules:
        below, todo = {module}, [module]
        while todo:
            for to, _ in graph[todo.pop()]:
                if to not in below:
                    below.add(to)
                    todo.append(to)
        visible = set().union(*(defined[m] for m in below)) | outside_names(paths[module])
        above = {}
        for other in sorted(paths):
            if other not in below:
                for name in defined[other]:
                    above.setdefault(name, other)
        for name, line in sorted(used_names(paths[module]).items(), key=lambda kv: kv[1]):
            if name not in visible and name in above and (module, name) not in ALLOWED:
                found.append(f"{module}:{line}: .{name} (defined only above it, in {above[name]})")
    return found


def test_the_compiled_paths_call_nothing_above_them_by_name():
    paths = {m: path for m, (path, _) in MODULES.items()}
    assert set(COMPILED) <= set(paths), "a module of COMPILED moved: update the list"
    found = upward_uses(compiled_modules(), import_graph(), paths)
    assert not found, ("the compiled paths use names that only code above them defines (an upward "
                       "dependency the import graph cannot see): declare what they need in an "
                       "interface at their level (passes.StepPasses) that the code above implements, "
                       "or pass the value down:\n" + "\n".join(found))


def test_every_allowance_is_still_needed():
    paths = {m: path for m, (path, _) in MODULES.items()}
    for module, name in ALLOWED:
        assert name in used_names(paths[module]), f"ALLOWED[{(module, name)}] is no longer used: remove it"


def test_the_scan_finds_a_method_called_on_an_object_from_above(tmp_path):
    """A low module calling a high module's method by name, the way graphs.py called Step's."""
    (tmp_path / "low.py").write_text("import numpy as np\n\n"
                                     "def run(step, xs):\n"
                                     "    xs.append(np.float32(1).dtype.kind)\n"   # Python's, NumPy's: fine
                                     "    own(step)\n"
                                     "    return step.host_part(xs)\n"            # 6: the upward call
                                     "def own(x):\n    x.mine = 1\n    return x.mine\n")
    (tmp_path / "high.py").write_text("import low\n\nclass Step:\n"
                                      "    def host_part(self, b):\n        return low.run(self, b)\n")
    paths = {"low": tmp_path / "low.py", "high": tmp_path / "high.py"}
    graph = {"low": [], "high": [("low", 1)]}
    found = upward_uses(["low"], graph, paths)
    assert found == ["low:6: .host_part (defined only above it, in high)"], found
    (tmp_path / "low.py").write_text((tmp_path / "low.py").read_text() +
                                     "class Passes:\n    def host_part(self, b):\n        raise NotImplementedError\n")
    assert upward_uses(["low"], graph, paths) == [], "an interface at its own level makes it explicit"
