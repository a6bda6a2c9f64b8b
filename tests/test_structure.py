"""The library's shape, read from its source with ``ast`` (nothing is imported or run).

* No import cycles in ``mirrored`` and ``kernels``: every ``import`` and ``from ... import``
  counts, at module level or inside a function (an import inside a function still ties the
  two files together; moving it there only hides the cycle). A cycle fails the test and
  is printed file by file, with line numbers.
* No module reads another module's private name: ``from m import _x``, or ``m._x`` where
  ``m`` is a module of the library imported under that name, or ``strategy.extended._x``
  outside ``strategy.py`` (the strategy's extended object has public properties for what
  the rest of the library needs: ``replica_offset``, ``num_replicas``, ``num_workers``...).
  What ``ast`` cannot tell reliably (``obj._x`` on an object of another module's class) is
  not checked. Tests are not scanned: they may read private names, sparingly.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mirrored", "kernels")


def _modules():
    """{dotted module name: (path, is_package)} for every .py file of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _base(module, is_package, node):
    """The module a ``from ... import`` names, relative imports resolved."""
    if not node.level:
        return node.module
    package = (module if is_package else module.rpartition(".")[0]).split(".")
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _ours(name):
    """The library module ``name`` is, or is inside (``mirrored.x.f`` -> ``mirrored.x``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module):
    """[(imported library module, line, local name it is bound to or None)] of ``module``."""
    path, is_package = MODULES[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or (alias.name if "." not in alias.name else None)
                found.append((_ours(alias.name), node.lineno, local))
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((_ours(sub if sub in MODULES else base), node.lineno,
                              (alias.asname or alias.name) if sub in MODULES else None))
    return [(m, line, local) for m, line, local in found if m and m != module]


def import_graph():
    """{module: [(imported module, line)]} over both packages."""
    return {m: [(to, line) for to, line, _ in _imports(m)] for m in MODULES}


def find_cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def _describe(graph, cycle):
    inside = set(cycle)
    return "\n".join(f"  {MODULES[v][0].relative_to(ROOT)}:{line} imports {w}"
                     for v in cycle for w, line in graph[v] if w in inside)


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def private_reads():
    """['path:line: what'] for every read of another module's private name."""
    found = []
    for module, (path, is_package) in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        modules_by_name = {local: m for m, _, local in _imports(module) if local}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _ours(_base(module, is_package, node) or "")
                for alias in node.names:
                    if base and base != module and _private(alias.name):
                        found.append(f"{where}:{node.lineno}: from {base} import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                value = node.value
                if isinstance(value, ast.Name) and modules_by_name.get(value.id, module) != module:
                    found.append(f"{where}:{node.lineno}: {value.id}.{node.attr} "
                                 f"({modules_by_name[value.id]}'s private name)")
                elif (module != "mirrored.strategy" and
                      (isinstance(value, ast.Attribute) and value.attr == "extended"
                       or isinstance(value, ast.Name) and value.id == "extended")):
                    found.append(f"{where}:{node.lineno}: extended.{node.attr} (use the public "
                                 f"property of StrategyExtended, strategy.py)")
    return found


def test_the_scan_sees_every_module_and_the_imports_it_must():
    # The checks below pass trivially if the scan finds nothing: make sure it finds the
    # files and the edges everyone knows are there.
    assert {"mirrored.strategy", "mirrored.keras.models", "kernels.gemm", "kernels"} <= set(MODULES)
    graph = import_graph()
    assert "mirrored.keras.step" in {m for m, _ in graph["mirrored.keras.models"]}
    assert any(m == "mirrored.strategy" for m, _ in graph["mirrored.multi_worker"])


def test_the_cycle_finder_finds_a_cycle_and_names_its_lines():
    graph = {"a": [("b", 3)], "b": [("c", 5)], "c": [("a", 7), ("d", 8)], "d": []}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": [("b", 1)], "b": []}) == []


def test_the_private_name_check_finds_each_kind_of_read(tmp_path, monkeypatch):
    package = tmp_path / "mirrored"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("_hidden = 1\nshown = 2\n")
    (package / "b.py").write_text(
        "from mirrored.a import _hidden, shown\n"           # 1: from m import _x
        "from mirrored import a as alias\n"
        "def f(strategy):\n"
        "    from . import a\n"
        "    return (a._hidden, alias._hidden, alias.shown,\n"   # 5: two reads
        "            strategy.extended._num_workers, strategy._own)\n"   # 6: one read
        "def g(extended):\n"
        "    return extended._replica_offset\n")                     # 8: one read
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "MODULES", {
        "mirrored": (package / "__init__.py", True), "mirrored.a": (package / "a.py", False),
        "mirrored.b": (package / "b.py", False)})
    found = private_reads()
    assert sorted(int(f.split(":")[1]) for f in found) == [1, 5, 5, 6, 8], found
    assert "from mirrored.a import _hidden" in found[0]


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (module-level and function-level imports count):\n" + \
        "\n\n".join(_describe(graph, c) for c in cycles)


def test_no_module_reads_another_modules_private_names():
    found = private_reads()
    assert not found, ("private names read across modules (make the name public and "
                       "documented, or move the code):\n" + "\n".join(found))
