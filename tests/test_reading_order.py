"""The reading order in ``mirrored/__init__.py`` states the real sizes of the files it names.

The package docstring lists the files that tell one ``fit`` step, in order, each with its
line count, and the total. Those numbers are what a student plans a reading by, so they
must be the files' (a file that grows or shrinks fails this test until the list is
updated). The README's section names the same files in the same order.

    python -m pytest -q tests/test_reading_order.py
"""
import re
from pathlib import Path

import mirrored

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mirrored"
#: A student reads one step in an evening: at most this many lines in all (issue 29).
MOST_LINES = 1500
ENTRY = re.compile(r"^\s+(\d)\. (\S+\.py)\s+([\d,]+)\s", re.M)


def reading_order():
    """[(file relative to mirrored/, stated lines)] and the stated total."""
    doc = mirrored.__doc__
    total = re.search(r"lines at this writing; ([\d,]+) in all", doc)
    assert total, "mirrored/__init__.py: the reading order's heading lost its total"
    entries = ENTRY.findall(doc)
    assert [int(n) for n, _, _ in entries] == list(range(1, len(entries) + 1)), entries
    return [(f, int(lines.replace(",", ""))) for _, f, lines in entries], int(total.group(1).replace(",", ""))


def test_the_stated_line_counts_are_the_files():
    files, total = reading_order()
    assert 1 <= len(files) <= 6, f"the reading order names {len(files)} files (at most 6)"
    real = {f: len((PACKAGE / f).read_text().splitlines()) for f, _ in files}
    wrong = {f: (stated, real[f]) for f, stated in files if stated != real[f]}
    assert not wrong, f"stated vs real line counts: {wrong}; update mirrored/__init__.py"
    assert total == sum(real.values()), (total, sum(real.values()))
    assert total <= MOST_LINES, (f"the reading order is {total} lines, over {MOST_LINES} (issue 29): "
                                 f"move what the step does not need out of its files, or shorten them")


def test_the_readme_names_the_same_files_in_order():
    files, _ = reading_order()
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## How one step works"):]
    section = section[:section.index("\n## ", 1)]
    named = [m.group(1) for m in re.finditer(r"`((?:keras/)?\w+\.py)`", section)]
    order = [f for f in named if f in dict(files)]
    first = []
    for f in order:                                  # first mention of each, in order
        if f not in first:
            first.append(f)
    assert first == [f for f, _ in files], (first, files)
