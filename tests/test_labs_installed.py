"""The labs need nothing but what ``pip install ".[labs,mpi]"`` installs (issue 28).

A student on Colab installs the package and opens a notebook from any folder: no checkout
beside it. What ``pip install .`` ships is pyproject.toml's package list (each listed
package's own ``*.py`` files: setuptools does not recurse into unlisted subfolders) plus its
package data. These checks read the six notebooks' code cells and fail when a cell imports,
or runs with ``python -m``, a module of this repository that the list leaves out, or names a
file of the checkout outside the shipped packages. They are cheap (no build, no venv).

The whole install was checked by hand (too slow for the suite): ``python3 -m venv
/tmp/freshvenv; /tmp/freshvenv/bin/pip install "<checkout>[labs,mpi]" nbclient`` (36 s from
this machine's local wheel index), then from a folder outside the checkout, with
MIRRORED_OFFLINE=1 MIRRORED_QUICK=1 and no PYTHONPATH, ``jupyter nbconvert --to notebook
--execute`` on each lab: all six ran without an error, lab 06 with its two mpiexec workers and
``benchmarks.multiworker``'s link fit (2-core machine, no GPU, under load from other work:
01 8.5 s, 02 6.8 s, 03 7.7 s, 04 26.8 s, 05 7.9 s, 06 7.7 s).
"""
import ast
import fnmatch
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_packaging import ROOT, _pyproject

NOTEBOOKS = sorted((ROOT / "labs").glob("*.ipynb"))


def ignored(paths):
    """The paths (under ROOT) that git ignores: the README's ``.venv`` made inside the
    checkout, ``build/``, caches. They are not the repository's files, so a module loaded
    from them (numpy from ``.venv``) is not one the install leaves out. ``git check-ignore``
    decides where git and the checkout's .git are there; else .gitignore's folder and
    name patterns (``.venv/``, ``/build/``, ``*.egg-info/``) are matched part by part."""
    paths = [Path(p).resolve() for p in paths]
    rel = [str(p.relative_to(ROOT)) for p in paths]
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--stdin"], input="\n".join(rel),
                              capture_output=True, text=True, timeout=60)
        if done.returncode in (0, 1):                        # 1: none ignored
            hits = set(done.stdout.splitlines())
            return {p for p, r in zip(paths, rel) if r in hits}
    except (OSError, subprocess.SubprocessError):
        pass
    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def matches(parts):
        for pattern in patterns:
            anchored, name = pattern.startswith("/"), pattern.strip("/")
            for i, part in enumerate(parts):
                if (not anchored or i == 0) and fnmatch.fnmatch(part, name):
                    return True
        return False

    return {p for p, r in zip(paths, rel) if matches(Path(r).parts)}


def shipped_files():
    """The repository files ``pip install .`` puts into site-packages, relative to ROOT."""
    tool = _pyproject()["tool"]["setuptools"]
    files = set()
    for package in tool["packages"]:
        folder = ROOT / package.replace(".", "/")
        files |= {p.relative_to(ROOT) for p in folder.glob("*.py")}
        for pattern in tool.get("package-data", {}).get(package, []):
            files |= {p.relative_to(ROOT) for p in folder.glob(pattern) if p.is_file()}
    return files


def code_cells(path):
    """Each code cell's source as Python: IPython's %magic and !shell lines dropped."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            yield "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


def what_cells_use(path):
    """(modules imported or run with ``-m``, string constants) over a notebook's code cells,
    including the sources it hands to a child Python (``python -c`` strings are parsed too)."""
    modules, strings = set(), set()
    sources = list(code_cells(path))
    while sources:
        tree = ast.parse(sources.pop())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module)
                # `from kernels import gemm`: gemm may be a module
                modules |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.List):
                items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                modules |= {items[i + 1] for i, item in enumerate(items[:-1])
                            if item == "-m" and isinstance(items[i + 1], str)}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
                if "import " in node.value:              # a child's source (lab 04, lab 06)
                    try:
                        sources.append(__import__("textwrap").dedent(node.value))
                    except SyntaxError:
                        pass
    return modules, strings


def repository_module_file(name):
    """The file under ROOT that ``name`` imports from, or None (stdlib, a dependency, or a
    name in ``from x import name`` that is not a module)."""
    if name.split(".")[0] not in {p.split(".")[0] for p in _pyproject()["tool"]["setuptools"]["packages"]} | {
            p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "build"}:
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not Path(spec.origin).resolve().is_relative_to(ROOT) \
            or ignored([spec.origin]):
        return None
    return Path(spec.origin).resolve().relative_to(ROOT)


@pytest.mark.parametrize("use_git", [True, False])
def test_ignored_folders_are_not_the_repositorys_files(monkeypatch, use_git):
    """The README makes ``.venv`` inside the checkout: its numpy is not a repository file
    (issue 37: 1,355 of them were counted as files ``pip install .`` leaves out)."""
    if not use_git:                                          # a checkout without git: .gitignore read
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
    inside = [ROOT / ".venv/lib/python3.12/site-packages/numpy/__init__.py",
              ROOT / "build/lib/mirrored/__init__.py", ROOT / "mirrored/__pycache__/ring.cpython-312.pyc",
              ROOT / "mirrored.egg-info/PKG-INFO"]
    ours = [ROOT / "mirrored/__init__.py", ROOT / "labs/setup_cell.py", ROOT / "kernels/gemm.py"]
    assert ignored(inside + ours) == {p.resolve() for p in inside}


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) == 6, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_every_repository_module_a_lab_uses_is_installed(notebook):
    modules, _ = what_cells_use(notebook)
    used = {m: repository_module_file(m) for m in sorted(modules)}
    used = {m: f for m, f in used.items() if f is not None}
    missing = {m: str(f) for m, f in used.items() if f not in shipped_files()}
    assert not missing, (f"{notebook.name} uses modules that pip install . would leave out "
                         f"(add their package to pyproject.toml's packages): {missing}")
    assert any(m.startswith("mirrored") for m in used), f"{notebook.name}: found no import of mirrored"


def test_what_those_modules_import_is_installed_too():
    """Import every repository module the labs use; every repository file then loaded
    (tests/ aside) must be shipped: a helper the benchmarks import counts as much as they do."""
    wanted = set()
    for notebook in NOTEBOOKS:
        wanted |= {m for m in what_cells_use(notebook)[0] if repository_module_file(m)}
    assert {"benchmarks.launch", "benchmarks.multiworker", "benchmarks.kernels"} <= wanted
    for name in sorted(wanted):
        importlib.import_module(name)
    loaded = {Path(m.__file__).resolve().relative_to(ROOT) for m in list(sys.modules.values())
              if getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(ROOT)}
    loaded = {f for f in loaded if f.parts[0] != "tests"}
    loaded -= {f.relative_to(ROOT) for f in ignored(ROOT / f for f in loaded)}   # .venv, build/
    assert not loaded - shipped_files(), (
        f"repository files the labs' modules import that pip install . leaves out: "
        f"{sorted(map(str, loaded - shipped_files()))}")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_lab_reads_a_checkout_file_outside_the_packages(notebook):
    """A string naming a file or folder of the checkout (``"benchmarks/results"``,
    ``"labs/data.csv"``) is a path an installed copy does not have, unless it is shipped."""
    shipped = shipped_files()
    shipped_dirs = {parent for f in shipped for parent in f.parents}
    _, strings = what_cells_use(notebook)
    strings.discard("pyproject.toml")        # the set-up cell's test for "am I in a checkout?"
    outside = sorted(s for s in strings
                     if s[:1].isalnum() and "\n" not in s and len(s) < 200
                     and (ROOT / s).exists() and Path(s) not in shipped | shipped_dirs
                     and not ignored([ROOT / s]))
    assert not outside, f"{notebook.name} names checkout paths an install lacks: {outside}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_lab_imports_a_benchmarks_module(notebook):
    """Teaching apart from measurement (issue 29): a lab RUNS a benchmark program in a child
    (``python -m benchmarks.kernels``), as a student would from a shell, and never imports
    one, so no measuring code sits in the lesson's own process."""
    imported = set()
    for source in code_cells(notebook):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module)
    bench = sorted(m for m in imported if m == "benchmarks" or m.startswith("benchmarks."))
    assert not bench, f"{notebook.name} imports {bench}: run the program instead (python -m ...)"
