"""Where the ranks' paths through the script part: the function, on every rank's stack, in which
they stand at two different lines when their collectives stopped matching, and what that says
about which ranks went their own way.

The collective a rank waits in is often far from the decision that brought it there: an
`all_gather` inside an accelerator's `gather_for_metrics`, reached from `evaluate()`, called under
`if is_main_process:`; a barrier after a training loop that one rank left early. Read outermost
first, the two ranks' stacks agree down to one function and then stand at two of its lines: that
pair of lines, read against the function's own syntax, tells the story:

- one line inside a loop and the other past its end: the second rank left the loop first (fewer
  batches, a `break` on a condition of its own, a `continue` that skipped a step's collectives);
  the line to change is the condition of that `break`/`return`/`continue`;
- the two lines in the two branches of one `if`: the ranks replaced one collective by another,
  neither is the odd one out;
- one line under an `if` that does not hold the other: that rank took a branch its peer did not
  take this time (an evaluation every N seconds, a rank-0-only log), whichever line comes first
  (the peer may stand earlier in the loop's next turn);
- otherwise the rank at the earlier line is making a collective its peer went past without (the
  peer stands further on in the same function, having made as many collectives).

The line to change on that rank is its line in the shared function: the call under the condition
only it met, or the condition of the loop exit it took.

Stacks come from what each rank left: its last snapshot's main thread for a rank still waiting in
the collective, faulthandler's dump for one a fatal signal stopped there, the traceback of an
exception that came out of it. Source is read from the
rank's working folder; without it (another node, a file since changed) nothing is said.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from typing import Any

from gradsync.callsite import is_user_file, short_path
from gradsync.run.analysis.source import FUNCTIONS, function_holding, own_body_holds, source_tree, spans
from gradsync.run.analysis.views import RankView
from gradsync.run.analysis.wording import ranks_text


@dataclass(frozen=True)
class Parting:
    """The ranks' paths at the function where they part: two sides, each of ranks at one line."""

    path: str  # the file, as the ranks' stacks name it
    function: str
    lines: dict[int, int]  # rank -> its line in that function
    odd: tuple[int, ...]  # the ranks that went their own way (empty: two branches of one `if`)
    took_branch: bool = False  # the odd ranks stand under an `if` the others' line is not under
    left_loop: int | None = None  # the header line of the loop the odd ranks left first
    # The line to change on the odd ranks: the condition of the `break`/`continue` that took them
    # out of the loop (None: the loop has none, it simply ran fewer times on them).
    exit_condition: int | None = None

    def site(self, rank: int) -> str:
        line = self.exit_condition if self.exit_condition is not None and rank in self.odd else self.lines[rank]
        return f"{self.path}:{line}"

    def text(self) -> str:
        """What the parting says, as a sentence of a finding."""
        sides: dict[int, list[int]] = {}
        for rank, line in sorted(self.lines.items()):
            sides.setdefault(line, []).append(rank)
        at = " and ".join(f"{ranks_text(ranks).lower()} at line {line}" for line, ranks in sorted(sides.items(), key=lambda side: side[1]))
        said = f" Their paths parted in {self.function} ({self.path}), {at}"
        if not self.odd:
            return f"{said}: two branches of one `if`, each calling a different collective."
        odd = ranks_text(list(self.odd))
        if self.left_loop is not None:
            how = f"{odd.lower()} had left the loop at line {self.left_loop} while the others were still in it"
            if self.exit_condition is not None:
                how += f" (the condition at line {self.exit_condition} took it out, or past the rest of a step)"
            return f"{said}: {how}."
        line = self.lines[self.odd[0]]
        if self.took_branch:
            return f"{said}: {odd.lower()} took the branch of line {line}, which the others did not take this time."
        return f"{said}: {odd.lower()} made a collective at line {line} that the others went past without making."


def parting(records: dict[int, dict[str, Any]], views: dict[int, RankView]) -> Parting | None:
    """Where the ranks, each stopped in its record of `records` (the collectives at which they
    stopped matching), stand at two different lines of one function, each line held by some of
    them; None without every rank's stack, when the stacks make more than two sides, or when they
    do not meet in one function."""
    stacks = {rank: _user_stack(views[rank], record) for rank, record in records.items() if rank in views}
    if len(stacks) != len(records) or not all(stacks.values()):
        return None
    sides: dict[tuple, list[int]] = {}
    for rank, stack in sorted(stacks.items()):
        sides.setdefault(tuple(stack), []).append(rank)
    if len(sides) != 2:
        return None
    (path_a, ranks_a), (path_b, ranks_b) = sides.items()
    for frame_a, frame_b in zip(path_a, path_b):
        if frame_a == frame_b:
            continue
        (file_a, line_a), (file_b, line_b) = frame_a, frame_b
        if file_a != file_b:
            return None
        function = function_holding(source_tree(views[ranks_a[0]], file_a), line_a, line_b)
        if function is None:
            return None
        return _read_parting(file_a, function, {line_a: ranks_a, line_b: ranks_b})
    return None


def _read_parting(path: str, function: ast.AST, sides: dict[int, list[int]]) -> Parting:
    """What the two lines of `function` (line -> the ranks there) say, in the order of the module's
    docstring: two branches, a loop left first, a branch only one side took, else the earlier line."""
    name = getattr(function, "name", "<module>")
    lines = {rank: line for line, ranks in sides.items() for rank in ranks}
    (line_a, ranks_a), (line_b, ranks_b) = sorted(sides.items())
    if _branches_of_one_if(function, line_a, line_b):
        return Parting(path, name, lines, ())
    loop = _loop_left(function, inside=line_a, past=line_b)
    if loop is not None:
        return Parting(path, name, lines, tuple(ranks_b), left_loop=loop.lineno, exit_condition=_exit_condition(loop))
    conditional_a, conditional_b = _under_own_condition(function, line_a, line_b), _under_own_condition(function, line_b, line_a)
    if conditional_a != conditional_b:
        return Parting(path, name, lines, tuple(ranks_b if conditional_b else ranks_a), took_branch=True)
    return Parting(path, name, lines, tuple(ranks_a))


def _user_stack(view: RankView, record: dict[str, Any]) -> list[tuple[str, int]]:
    """The rank's user frames (file, line), outermost first, while it stood in `record`: the
    traceback of an exception that came out of it, faulthandler's stack if a signal stopped the
    rank there, its main thread's last stack if it still waits there; [] else."""
    snapshot = view.snapshot or {}
    cwd = snapshot.get("cwd") or "."
    failed = view.exception()
    if failed is not None:
        if not _same(failed.get("collective") or {}, record):
            return []
        frames = (_TRACEBACK_FRAME.match(line) for line in str(failed.get("traceback") or "").splitlines())
        return [(short_path(found["file"], cwd), int(found["line"])) for found in frames
                if found is not None and is_user_file(found["file"])]
    if view.fatal_stack and view.records and _same(view.records[-1], record):
        return [_frame(site) for site in reversed(view.fatal_stack) if _frame(site)]
    waiting = view.waiting_on() if view.alive or not view.exit else None
    if waiting is None or not _same(waiting, record):
        return []
    frames = []
    for entry in snapshot.get("stack") or []:
        frame = _frame(entry.split(" in ", 1)[0])
        if frame and not frame[0].startswith("<") and is_user_file(os.path.join(cwd, frame[0])):
            frames.append(frame)
    return frames


_TRACEBACK_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+), in ')


def _same(one: dict[str, Any], other: dict[str, Any]) -> bool:
    return one.get("group") == other.get("group") and one.get("seq") == other.get("seq") and one.get("op") == other.get("op")


def _frame(site: str) -> tuple[str, int] | None:
    path, _, line = site.rpartition(":")
    return (path, int(line)) if path and line.isdigit() else None


_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _branches_of_one_if(function: ast.AST, line_a: int, line_b: int) -> bool:
    """Whether the two lines stand in the two branches (body and else) of one `if` of `function`."""
    for node in ast.walk(function):
        if isinstance(node, ast.If) and node.orelse:
            body = any(spans(statement, line_a) for statement in node.body), any(spans(statement, line_b) for statement in node.body)
            orelse = any(spans(statement, line_a) for statement in node.orelse), any(spans(statement, line_b) for statement in node.orelse)
            if (body[0] and orelse[1]) or (body[1] and orelse[0]):
                return True
    return False


def _under_own_condition(function: ast.AST, line: int, other: int) -> bool:
    """Whether `line` is inside an `if` of `function` that does not hold `other`: a rank there took
    a branch the other rank, in the same loop or not, did not take this time."""
    return any(isinstance(node, ast.If) and spans(node, line) and not spans(node, other) and node.test.lineno != line
               for node in ast.walk(function))


def _loop_left(function: ast.AST, inside: int, past: int) -> ast.AST | None:
    """The outermost loop of `function` that holds line `inside` and ended before line `past`; None
    when a loop holds both lines: the rank past the inner loop may stand in an earlier turn of the
    outer one than its peer (a validation after the epoch's batches, the peer already in the next
    epoch's), so which rank left first is not told by the lines."""
    loops = [node for node in ast.walk(function) if isinstance(node, _LOOPS) and own_body_holds(function, node.lineno)]
    if any(spans(node, inside) and spans(node, past) for node in loops):
        return None
    left = [node for node in loops if spans(node, inside) and (node.end_lineno or node.lineno) < past]
    return min(left, key=lambda node: node.lineno) if left else None


def _exit_condition(loop: ast.AST) -> int | None:
    """The line of the condition that takes a rank out of `loop` early (a `break` or `return` of
    the loop itself), else past the rest of a step (a `continue`): the `if` that guards it, or the
    statement itself. None when the loop has neither: it simply ran fewer times."""
    found: dict[type, int] = {}

    def visit(node: ast.AST, guard: int | None, depth: int) -> None:  # depth: loops inside `loop` around node
        if isinstance(node, (*FUNCTIONS, ast.ClassDef, ast.Lambda)):
            return
        if isinstance(node, ast.Return) or (isinstance(node, (ast.Break, ast.Continue)) and depth == 0):
            found.setdefault(ast.Continue if isinstance(node, ast.Continue) else ast.Break, guard or node.lineno)
        inner, guard = depth + isinstance(node, _LOOPS), node.lineno if isinstance(node, ast.If) else guard
        for child in ast.iter_child_nodes(node):
            visit(child, guard, inner)

    for statement in getattr(loop, "body", []):
        visit(statement, None, 0)
    return found.get(ast.Break, found.get(ast.Continue))
