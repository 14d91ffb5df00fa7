"""The project's import graph, read from the source: which `sluiceway.*` module imports which, cycles, closures.

Each import is one of three kinds, by where it sits in the file:
    top       runs when the module is imported (module body, class bodies, `if`/`try` at the top)
    typing    under `if TYPE_CHECKING:` (never runs, but still a dependency of the module's meaning)
    lazy      inside a function (runs when the function is called)

`from a.b import c` is an edge to `a.b.c` where that is a module, else to `a.b`. Importing `a.b.c` also runs the
`__init__.py` of `a` and `a.b`; `closure` counts those, `cycles` does not (a package importing its own submodules
is how packages work, not a circle).

Run as a script (the tests' helpers use the same functions):
    python tests/import_graph.py cycles [--lazy]     circles among project modules (top + typing; --lazy adds lazy)
    python tests/import_graph.py closure MODULE...   the project modules importing MODULE runs (top imports)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "tasks", "storage", "models", "infra")
TOP, TYPING, LAZY = "top", "typing", "lazy"


@cache
def module_files() -> dict[str, Path]:
    """{'sluiceway.tasks.train.trainer': path} for every module of the five packages."""
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("sluiceway", *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST, kind: str = TOP) -> Iterable[tuple[str, ast.Import | ast.ImportFrom]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield kind, node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from import_nodes(node, LAZY)
        elif isinstance(node, ast.If) and kind == TOP and _is_type_checking(node.test):
            for child in node.body:
                yield from import_nodes(ast.Module(body=[child], type_ignores=[]), TYPING)
            for child in node.orelse:
                yield from import_nodes(ast.Module(body=[child], type_ignores=[]), TOP)
        else:
            yield from import_nodes(node, kind)


def _absolute(module: str, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    package = module.split(".") if module_files()[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports_of(module: str) -> dict[str, str]:
    """{imported project module: kind} for `module`; where one is imported more than one way, the kind that
    runs soonest wins (top, then typing, then lazy)."""
    path, known, found = module_files()[module], module_files(), {}
    rank = {TOP: 0, TYPING: 1, LAZY: 2}
    for kind, node in import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = _absolute(module, node)
            if base is None:
                continue
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        for target in targets:
            while target not in known and "." in target:  # `import a.b.c` of a name we do not have: its package
                target = target.rsplit(".", 1)[0]
            if target in known and target != module and rank[kind] < rank.get(found.get(target), 9):
                found[target] = kind
    return found


def edges(kinds: Iterable[str] = (TOP, TYPING)) -> dict[str, set[str]]:
    kinds = set(kinds)
    return {m: {t for t, k in imports_of(m).items() if k in kinds} for m in module_files()}


def cycles(kinds: Iterable[str] = (TOP, TYPING)) -> list[list[str]]:
    """The project's circles over imports of `kinds` (see `circles`)."""
    return circles(edges(kinds))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each a set of modules that import each other
    round a circle), largest first, each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=lambda c: (-len(c), c))


def chain(root: str, target: str, kinds: Iterable[str] = (TOP,)) -> list[str]:
    """The shortest run of imports from `root` to `target` (packages' `__init__` on the way included), or []."""
    graph, known = edges(kinds), module_files()
    came_from: dict[str, str | None] = {root: None}
    todo = [root]
    while todo:
        m = todo.pop(0)
        if m == target:
            path = [m]
            while came_from[path[-1]] is not None:
                path.append(came_from[path[-1]])
            return path[::-1]
        for n in [p for p in _parents(m) if p in known] + sorted(graph.get(m, ())):
            if n not in came_from:
                came_from[n] = m
                todo.append(n)
    return []


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def closure(*roots: str, kinds: Iterable[str] = (TOP,)) -> set[str]:
    """The project modules that importing `roots` runs (with `LAZY` in `kinds`: also what their functions may
    import), the packages' `__init__` modules on the way included."""
    graph, known = edges(kinds), module_files()
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m in seen or m not in known:
            continue
        seen.add(m)
        todo += [p for p in _parents(m) if p in known] + sorted(graph[m])
    return seen


def third_party_imports(modules: Iterable[str], kinds: Iterable[str] = (TOP,)) -> set[str]:
    """The top-level names of the non-project packages `modules` import (`deltalake`, `torch`, ...)."""
    kinds, found = set(kinds), set()
    for module in modules:
        path = module_files()[module]
        for kind, node in import_nodes(ast.parse(path.read_text(), str(path))):
            if kind not in kinds:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            found |= {n.split(".")[0] for n in names if n and n.split(".")[0] != "sluiceway"}
    return found


def main(argv: list[str]) -> int:
    if argv[:1] == ["cycles"]:
        kinds = (TOP, TYPING, LAZY) if "--lazy" in argv else (TOP, TYPING)
        found = cycles(kinds)
        for c in found:
            print(" <-> ".join(m.removeprefix("sluiceway.") for m in c))
        print(f"{len(found)} cycle(s) over {'+'.join(kinds)} imports")
        return 0
    if argv[:1] == ["closure"] and len(argv) > 1:
        kinds = (TOP, LAZY) if "--lazy" in argv else (TOP,)
        mods = closure(*[a for a in argv[1:] if not a.startswith("--")], kinds=kinds)
        for m in sorted(mods):
            print(m)
        print(f"{len(mods)} project modules; third-party: {' '.join(sorted(third_party_imports(mods, kinds)))}")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
