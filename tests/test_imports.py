"""The import graph of src/gradsync: no loops between its parts, no reach into another part's
private names, and no import of the package root from inside (it would load the trainer).

A "part" is a subpackage (run, metrics, ...) or a top-level module (trainer, config, ...). Data
flows one way (see gradsync.rundir), and the imports follow: a loop between parts means two of
them each need the other, which is how a package ends up importing everything at start.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
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


def _module_edges() -> dict[str, set[str]]:
    """Importing module -> the gradsync modules it imports: `from gradsync.x import y` is an edge
    to gradsync.x.y when y is a module and to gradsync.x (its __init__) otherwise."""
    submodules = _submodules()
    edges: dict[str, set[str]] = {}
    for importer, imported, names in imports():
        targets = {f"{imported}.{name}" if f"{imported}.{name}" in submodules else imported for name in names or [""]}
        edges.setdefault(importer, set()).update(targets - {importer})
    return edges


def _cycle_through(start: str, edges: dict[str, set[str]], among: set[str]) -> list[str]:
    """The shortest path of imports from start back to start, staying inside `among` (a strongly
    connected part, so the path is there)."""
    came_from = {start: start}
    queue = deque([start])
    while True:
        node = queue.popleft()
        for other in sorted(edges.get(node, set()) & among):
            if other == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if other not in came_from:
                came_from[other] = node
                queue.append(other)


def _file_loops(edges: dict[str, set[str]]) -> list[str]:
    """Each loop as 'a -> b -> a', enough of them that every file in a knot of files is on one."""
    loops = []
    for component in _loops(edges):
        shown: set[str] = set()
        for node in component:
            if node not in shown:
                cycle = _cycle_through(node, edges, set(component))
                shown.update(cycle)
                loops.append(" -> ".join(cycle))
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


def test_the_files_of_gradsync_import_each_other_without_loops():
    """Two files that need each other are one piece split in two: neither can be read, tested or
    loaded alone, and which one Python loads first decides what the other sees half-built. The
    graph counts imports inside functions (a loop that waits for the first call is still a loop)
    and under `if TYPE_CHECKING:` (a type-only import still ties the two files together: neither
    can be type-checked or moved without the other)."""
    loops = _file_loops(_module_edges())
    assert loops == [], (
        "files of gradsync that import each other (directly or through others):\n  "
        + "\n  ".join(loops)
        + "\nMove the piece both need into a module that both import, or pass it in (an argument) "
        "instead of importing it."
    )


def test_the_file_checker_finds_a_loop_made_by_an_import_inside_a_function(tmp_path, monkeypatch):
    package = tmp_path / "gradsync"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    # The __init__ imports its submodule, which imports a name from the package back, in a function.
    (package / "sub" / "__init__.py").write_text("from gradsync.sub import helpers\n\nLIMIT = 3\n")
    (package / "sub" / "helpers.py").write_text("def helper():\n    from gradsync.sub import LIMIT\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert _file_loops(_module_edges()) == ["gradsync.sub -> gradsync.sub.helpers -> gradsync.sub"]
    (package / "sub" / "helpers.py").write_text("def helper():\n    pass\n")
    assert _file_loops(_module_edges()) == []
