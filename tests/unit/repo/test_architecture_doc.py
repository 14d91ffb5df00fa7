"""docs/architecture.md stays true: every file it names exists, every function, class or method it names after a
file (`path.py`: `Name`, `Class.method`) is defined in that file, and every type a sample travels as in the hop
table is defined somewhere in the project. A move or rename that forgets the page fails here."""

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from paths import ROOT

DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("flows", "tasks", "storage", "models", "infra")
# `some/file.py`: `name`, `Other.name` -- the names right after a file, up to the first word that is not one.
NAMED = re.compile(r"`((?:flows|tasks|storage|models|infra)/[\w/]+\.py)`:\s*((?:`[\w.]+`(?:\s*(?:,|/|->)\s*)?)+)")
PATH = re.compile(r"`((?:flows|tasks|storage|models|infra|tests|docs|benchmarks|examples)/[\w/.-]*)`")
TYPE = re.compile(r"`([A-Z][A-Za-z]+)`")


@cache
def definitions(path: Path) -> set[str]:
    """Top-level functions, classes and assignments of `path`, and `Class.method` for each class's methods."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{m.name}" for m in node.body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}  # fmt: skip
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def named_definitions(text: str) -> list[tuple[str, str]]:
    found = []
    for m in NAMED.finditer(text):
        found += [(m.group(1), name) for name in re.findall(r"`([\w.]+)`", m.group(2))]
    return found


def hop_types(text: str) -> set[str]:
    """The CamelCase names in the last column ("travels as") of the hop table."""
    rows = [line for line in text.splitlines() if re.match(r"\| \d+\. ", line)]
    return {t for row in rows for t in TYPE.findall(row.rsplit("|", 2)[-2])}


def test_the_parsers_see_what_the_page_writes():
    line = "| 2. x | `tasks/a.py`: `Rollout.sample` -> `tasks/b.py`: `gen`, `parse` (with `flag` on) | `Row` (`x`) |"
    assert named_definitions(line) == [("tasks/a.py", "Rollout.sample"), ("tasks/b.py", "gen"), ("tasks/b.py", "parse")]
    assert hop_types(line) == {"Row"}


def test_every_named_file_exists():
    text = DOC.read_text()
    missing = sorted({p for p in PATH.findall(text) if "..." not in p and not (ROOT / p.rstrip("/")).exists()})
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_function_and_type_named_after_a_file_is_defined_there():
    pairs = named_definitions(DOC.read_text())
    assert len(pairs) >= 20, "the page's hop table was not parsed"
    missing = sorted(f"{path}: {name}" for path, name in pairs
                     if (ROOT / path).exists() and name not in definitions(ROOT / path))  # fmt: skip
    assert not missing, f"docs/architecture.md names what these files do not define: {missing}"


@pytest.mark.parametrize("type_name", sorted(hop_types(DOC.read_text())))
def test_every_type_a_sample_travels_as_is_defined(type_name):
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert any(type_name in definitions(p) for p in files), f"{type_name} is defined nowhere in {PACKAGES}"
