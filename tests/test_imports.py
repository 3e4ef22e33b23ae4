"""The import graph of src/gradsync: no loops between its parts, no reach into another part's
private names, and no import of the package root from inside (it would load the trainer).

A "part" is a subpackage (run, metrics, ...) or a top-level module (trainer, config, ...). Data
flows one way (see gradsync.rundir), and the imports follow: a loop between parts means two of
them each need the other, which is how a package ends up importing everything at start.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness import REPO_ROOT

PACKAGE = REPO_ROOT / "src" / "gradsync"
# The demo is an example of the public API, written as a user writes it: `import gradsync`.
MAY_IMPORT_THE_ROOT = {"demo"}


def _part(module: str) -> str:
    """'gradsync.run.worker' -> 'run'; 'gradsync.trainer' -> 'trainer'; 'gradsync' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _submodules() -> set[str]:
    return {_module_name(path) for path in PACKAGE.rglob("*.py")} | {
        ".".join(path.relative_to(PACKAGE.parent).parts) for path in PACKAGE.rglob("*") if path.is_dir() and (path / "__init__.py").exists()
    }


def imports() -> list[tuple[str, str, list[str]]]:
    """(importing module, imported gradsync module, names taken from it) for every import statement."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(module, alias.name, []) for alias in node.names if alias.name.split(".")[0] == "gradsync"]
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                if target.split(".")[0] == "gradsync":
                    found.append((module, target, [alias.name for alias in node.names]))
    return found


def _loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return loops


def test_the_parts_of_gradsync_import_each_other_without_loops():
    edges: dict[str, set[str]] = {}
    for importer, imported, names in imports():
        source = _part(importer)
        targets = {_part(imported)}
        if not _part(imported):  # `from gradsync import compat, events`: submodules of the root
            targets = {name for name in names if f"gradsync.{name}" in _submodules()}
        for target in targets - {source, ""}:
            edges.setdefault(source, set()).add(target)
    assert _loops(edges) == [], "parts of gradsync that import each other (directly or through others)"


def test_no_part_reaches_into_another_parts_private_names():
    reaches = [
        f"{importer} imports {name} from {imported}"
        for importer, imported, names in imports()
        for name in names
        if name.startswith("_") and not name.endswith("__") and _part(importer) != _part(imported)
    ]
    assert reaches == []


def test_nothing_inside_imports_the_package_root():
    submodules = _submodules()
    roots = [
        f"{importer}: {'import gradsync' if not names else 'from gradsync import ' + ', '.join(names)}"
        for importer, imported, names in imports()
        if imported == "gradsync" and importer != "gradsync" and _part(importer) not in MAY_IMPORT_THE_ROOT
        and (not names or any(f"gradsync.{name}" not in submodules for name in names))
    ]
    assert roots == []


def test_the_checker_finds_a_loop():
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _loops({"a": {"b"}, "b": set()}) == []
