"""The user's source as the analysis reads it: a rank's file parsed once per version, the function
that holds a line, and whether a function only forwards to another call.

Read from the rank's working folder, on the machine that diagnoses; a file that is not there (a
rank of another node) or does not parse gives None, and whoever asked says nothing more.
"""

from __future__ import annotations

import ast
import functools
import os

from gradsync.run.analysis.views import RankView

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def source_tree(view: RankView, path: str) -> ast.Module | None:
    """The parsed file `path` (as the rank's stacks name it: relative to its working folder)."""
    filename = os.path.join((view.snapshot or {}).get("cwd") or ".", path)
    try:
        status = os.stat(filename)
    except OSError:
        return None
    return _parsed(filename, status.st_mtime_ns, status.st_size)


@functools.lru_cache(maxsize=64)  # the monitor diagnoses again at every poll; keyed by version
def _parsed(filename: str, mtime_ns: int, size: int) -> ast.Module | None:
    try:
        with open(filename, encoding="utf-8") as source:
            return ast.parse(source.read(), filename)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def spans(node: ast.AST, line: int) -> bool:
    return node.lineno <= line <= (node.end_lineno or node.lineno)


def function_holding(tree: ast.Module | None, *lines: int) -> ast.AST | None:
    """The innermost function (or the module) whose own statements hold every one of `lines`."""
    if tree is None:
        return None
    found: ast.AST = tree
    while True:
        inner = next((node for node in ast.walk(found) if node is not found and isinstance(node, FUNCTIONS)
                      and all(spans(node, line) for line in lines)), None)
        if inner is None:
            break
        found = inner
    return found if all(own_body_holds(found, line) for line in lines) else None


def own_body_holds(function: ast.AST, line: int) -> bool:
    """Whether `line` is in `function`'s own statements, not in a function defined inside it."""
    return not any(isinstance(node, FUNCTIONS) and node is not function and spans(node, line) for node in ast.walk(function))


def only_forwards(view: RankView, site: str) -> bool:
    """Whether the line `site` ('path:line') is the one statement of a function (its docstring
    aside): a thin wrapper such as `def release(self): lib.free(self.ptr)`, whose caller, not the
    wrapper, decides when and with what it runs."""
    path, _, line = site.rpartition(":")
    if not line.isdigit():
        return False
    function = function_holding(source_tree(view, path), int(line))
    if not isinstance(function, FUNCTIONS):
        return False
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    return len(body) == 1 and spans(body[0], int(line))
