"""pyproject.toml against the repository: what `pip install .` would leave out.

Building and installing into a fresh venv takes minutes (too slow for the suite; the
install was checked by hand, see the issue-16 report). These checks are cheap and catch
what goes wrong in practice: a new subpackage not listed, a data file not shipped, a
dependency added to requirements.txt but not to pyproject.toml (or the reverse).
"""
import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement):
    """'numba-cuda[cu12]>=0.30.4' -> 'numba-cuda[cu12]>=0.30.4' normalised (no spaces)."""
    return re.sub(r"\s+", "", requirement)


def requirement_lines():
    lines = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def test_dependencies_match_requirements_txt():
    project = _pyproject()["project"]
    declared = [_name(d) for d in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        declared += [_name(d) for d in extra]
    listed = [_name(r) for r in requirement_lines() if not r.startswith("-")]
    assert sorted(declared) == sorted(listed), (
        "pyproject.toml's dependencies (with extras) and requirements.txt differ: "
        f"only in pyproject {sorted(set(declared) - set(listed))}, "
        f"only in requirements.txt {sorted(set(listed) - set(declared))}")
    assert project["requires-python"] == ">=3.11"


def test_requirements_txt_installs_the_package_itself():
    assert "-e ." in requirement_lines(), "requirements.txt should end with '-e .' (this repository)"


def test_every_package_directory_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".")
             for top in ("mirrored", "kernels", "benchmarks") for p in (ROOT / top).rglob("__init__.py")}
    found.add("mirrored._data")          # data only, no __init__.py: shipped as a namespace package
    assert found == listed, f"packages on disk {sorted(found)}, in pyproject.toml {sorted(listed)}"


def test_bundled_data_is_package_data():
    globs = _pyproject()["tool"]["setuptools"]["package-data"]["mirrored._data"]
    files = [str(p.relative_to(ROOT / "mirrored" / "_data"))
             for p in (ROOT / "mirrored" / "_data").rglob("*") if p.is_file()]
    assert any(f.endswith("train-images-idx3-ubyte.gz") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, f"files under mirrored/_data that pip install . would leave out: {missing}"
