"""What a rank does between two real progresses, as its own snapshot thread sees it: the CPU
time of its whole process tree, and where its main thread's Python position stays or moves.

This is the evidence behind the rank's state (gradsync.run.stall.rank_state) and behind the
verdict on a rank that keeps working while the others wait for it: the line it has been at, and
whether its position stayed there (one native call, a one-line loop) or moved (a loop that never
ends, named by the loop's own line, found in the source's syntax tree rather than guessed from
the lines seen, which a sample of one look per second rarely puts on the loop's header).
The same reading of the source serves the doctor's checks: the loop around a line, and the line
that last assigned a name before another (where an argument a collective was given was built).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import threading
import time
import types
from dataclasses import dataclass

import psutil

from gradsync.callsite import OWN, file_kind, short_path, user_frame
from gradsync.run.stall import CpuReading

# One frame of the user's code, as gradsync.callsite.user_frames gives it: (file, function,
# the function's first line, current line, current instruction). The instruction counts: the
# snapshot thread mostly gets the GIL when the main thread releases it inside a native op, so a
# loop whose ops all sit on one line is seen on that line at every look, at different ops.
Frame = tuple[str, str, int, int, int]


class TreeCpu:
    """Reads the CPU seconds this rank's process tree has used (CpuReading), from inside the rank.

    The process's own time covers all its threads, native ones included (a BLAS call, a DataLoader
    pin-memory thread); gradsync's threads are taken out, since the snapshot thread's Flight
    Recorder dump alone can cost a tenth of a core when it happens. Descendants count with the
    children they reaped, and the rank with the children it reaped, so a subprocess that ended
    between two looks still counts as the work it was.
    """

    def __init__(self) -> None:
        self._process = psutil.Process()

    def read(self) -> CpuReading | None:
        """The current reading; None when the process table could not be read this time."""
        now = time.monotonic()
        try:
            times = self._process.cpu_times()
            threads = {t.id: t.user_time + t.system_time for t in self._process.threads()}
            children = self._process.children(recursive=True)
        except psutil.Error:
            return None
        own = {t.native_id for t in threading.enumerate() if t.name.startswith("gradsync")}
        tree = times.user + times.system + times.children_user + times.children_system
        tree -= sum(threads.get(native_id, 0.0) for native_id in own)
        for child in children:
            try:
                used = child.cpu_times()
            except psutil.Error:
                continue  # ended since it was listed: its time is its parent's once reaped
            tree += used.user + used.system + used.children_user + used.children_system
        return CpuReading(now, tree, threads.get(threading.main_thread().native_id, 0.0))


@dataclass(frozen=True)
class Position:
    """Where a rank's main thread has been during one spell of work without real progress.

    `location`: file:line of the user's innermost frame at the latest look. `loop`: file:line of
    the innermost `for`/`while` loop that holds every line seen in the deepest function all looks
    of the latter half of the spell passed through (None when there is none): the loop the rank
    has not left. Only the latter half, because the spell often begins before the loop does (in
    set-up, or the step before it), and the looks from then would hide the loop. `moved`: its
    position kept changing rather than staying at one place, to the instruction, for the latter
    half of the spell. `since`: when the spell began (its first look); `still_since`: since when
    every look found exactly the same frames; `looks`: how many looks there were.

    Where "stayed" comes from: the look is taken by a thread that must hold the GIL, and it
    mostly gets it when the main thread releases it inside a native op, so a loop that spends its
    time in one op can look as still as one native call. Both are then named by the line, and
    the loop around it by `loop`, which the source's syntax tree gives whatever the looks saw.
    """

    location: str
    loop: str | None
    moved: bool
    since: float
    still_since: float
    looks: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PositionTrail:
    """The user frames of each look at the main thread during one spell of work: the recent
    looks (for the loop the rank has not left) and how long the stack has been exactly the same."""

    # Looks kept for the loop; at one look a second, the latest quarter hour of a spell.
    KEPT_LOOKS = 1024

    def __init__(self, since: float = 0.0) -> None:
        self.reset(since)

    def reset(self, since: float) -> None:
        """Start afresh: a spell of work began at `since`."""
        self.since = since
        self._looks: collections.deque[tuple[float, list[Frame]]] = collections.deque(maxlen=self.KEPT_LOOKS)
        self._count = 0
        self._still_since = since

    def look(self, frames: list[Frame], at: float) -> None:
        """One look at the main thread's user frames (outermost first), taken at `at`. A look
        without any (the main thread in the interpreter's start-up, or gradsync's own code)
        tells nothing of where the user's code is."""
        if not frames:
            return
        if not self._looks or frames != self._looks[-1][1]:
            self._still_since = at
        self._looks.append((at, list(frames)))
        self._count += 1

    def position(self, now: float) -> Position | None:
        """Where the rank has been, judged at `now`; None before any look of the user's code."""
        if not self._looks:
            return None
        # Stayed: exactly one place for at least the latter half of the spell (a native call that
        # came after a little Python work is still one call).
        half = self.since + (now - self.since) / 2
        moved = self._still_since > half
        file, _, _, line, _ = self._looks[-1][1][-1]
        recent = [frames for at, frames in self._looks if at >= half] or [self._looks[-1][1]]
        return Position(f"{short_path(file)}:{line}", _loop(recent), moved, self.since, self._still_since, self._count)


def _loop(looks: list[list[Frame]]) -> str | None:
    """The innermost loop holding every line seen in the deepest function common to all `looks`."""
    common = [frame[:3] for frame in looks[0]]
    for frames in looks[1:]:
        depth = 0
        while depth < min(len(common), len(frames)) and common[depth] == frames[depth][:3]:
            depth += 1
        del common[depth:]
    for depth in reversed(range(len(common))):
        file, _, first_line = common[depth]
        loop = enclosing_loop(file, first_line, {frames[depth][3] for frames in looks})
        if loop is not None:
            return f"{short_path(file)}:{loop}"
    return None


def enclosing_loop(file: str, first_line: int, lines: set[int]) -> int | None:
    """The first line of the innermost `for` or `while` loop of `file` that starts at or after
    `first_line` (inside the function that begins there) and spans every line of `lines`; None
    when there is none, or the file cannot be read or parsed."""
    spans = [(start, end) for start, end in _loops(file) if first_line <= start <= min(lines) and end >= max(lines)]
    return max(spans)[0] if spans else None


def loop_around_call(frame: types.FrameType | None) -> str | None:
    """file:line of the innermost loop that holds the user's call at `frame` without being that
    call's own line (a `for batch in loader:` line is itself a loop): the epoch loop around a pass
    over the data, looked for in the calling function first, then in its callers."""
    found = _loop_around(frame)
    return f"{short_path(found[0].f_code.co_filename)}:{found[1]}" if found else None


def loop_iterations(frame: types.FrameType | None) -> int | None:
    """How many times the loop `loop_around_call` names runs in all, where it is a `for` over
    `range(...)` of plain values (names, attributes, numbers, arithmetic, `len`), read now in
    the frame that runs it: the epochs of an epoch loop. None where it is anything else (a
    `while`, an iterator, a call of the script's own)."""
    found = _loop_around(frame)
    if found is None:
        return None
    frame, start = found
    tree = _tree(frame.f_code.co_filename)
    loop = next((node for node in ast.walk(tree) if isinstance(node, ast.For) and node.lineno == start), None) if tree else None
    if loop is None or not (isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Name)
                            and loop.iter.func.id == "range" and 1 <= len(loop.iter.args) <= 3 and not loop.iter.keywords):
        return None
    try:
        bounds = [_plain_value(arg, frame) for arg in loop.iter.args]
    except _NotPlain:
        return None
    return len(range(*bounds)) if all(isinstance(b, int) for b in bounds) else None


class _NotPlain(Exception):
    """An expression `_plain_value` does not evaluate (it might call the script's code)."""


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b}


def _plain_value(node: ast.expr, frame: types.FrameType) -> object:
    """The value of an expression made of numbers, names, attributes of plain objects, arithmetic
    and `len(...)`, read in `frame`; _NotPlain for anything that could run code of the script's."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name):
        scope = frame.f_locals if node.id in frame.f_locals else frame.f_globals
        if node.id not in scope:
            raise _NotPlain
        return scope[node.id]
    if isinstance(node, ast.Attribute):
        owner = _plain_value(node.value, frame)
        # Only attributes held in an instance's own dict (an argparse Namespace, a config object):
        # a property or __getattr__ would run the script's code.
        held = getattr(owner, "__dict__", None)
        if not isinstance(held, dict) or node.attr not in held:
            raise _NotPlain
        return held[node.attr]
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _plain_value(node.left, frame), _plain_value(node.right, frame)
        if not all(isinstance(v, (int, float)) for v in (left, right)):
            raise _NotPlain
        return _ARITHMETIC[type(node.op)](left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("len", "int") and len(node.args) == 1:
        value = _plain_value(node.args[0], frame)
        if node.func.id == "int" and isinstance(value, (int, float)):
            return int(value)
        if node.func.id == "len" and isinstance(value, (list, tuple, dict, str, range)):
            return len(value)
    raise _NotPlain


def _loop_around(frame: types.FrameType | None) -> tuple[types.FrameType, int] | None:
    """(the user's frame, the first line of the loop) for `loop_around_call`."""
    frame = user_frame(frame)
    while frame is not None:
        code = frame.f_code
        if file_kind(code.co_filename) == OWN:
            spans = [(start, end) for start, end in _loops(code.co_filename)
                     if code.co_firstlineno <= start < frame.f_lineno <= end]
            if spans:
                return frame, max(spans)[0]
        frame = frame.f_back
    return None


def generator_loop(function: object) -> str | None:
    """file:line of the loop around the first `yield` of a generator function of the user's (an
    IterableDataset's `__iter__`: the loop that walks the records); else the function's own first
    line; None for a function that is not the user's Python."""
    code = getattr(function, "__code__", None)
    if code is None or file_kind(code.co_filename) != OWN:
        return None
    tree = _tree(code.co_filename)
    defined = next((node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and code.co_firstlineno in (node.lineno, *(d.lineno for d in node.decorator_list))), None) if tree else None
    yields = sorted(node.lineno for node in ast.walk(defined) if isinstance(node, (ast.Yield, ast.YieldFrom))) if defined else []
    loop = enclosing_loop(code.co_filename, code.co_firstlineno, {yields[0]}) if yields else None
    return f"{short_path(code.co_filename)}:{loop or code.co_firstlineno}"


def choosing_condition(frame: types.FrameType | None) -> str | None:
    """file:line of the condition that chose to run the user's call at `frame`: the test of the
    innermost `if` (or `x if test else y`) around it in its function, or, where that test is a
    plain name (`if not sync:`), the line that last assigned the name before the call; None when
    no condition holds the call."""
    frame = user_frame(frame)
    if frame is None:
        return None
    code, line = frame.f_code, frame.f_lineno
    tree = _tree(code.co_filename)
    if tree is None:
        return None
    choices = [node for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp))
               and code.co_firstlineno <= node.lineno <= line and (
                   line <= (node.end_lineno or node.lineno) if isinstance(node, ast.IfExp)
                   else any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in node.body + node.orelse))]
    if not choices:
        return None
    test = max(choices, key=lambda node: (node.lineno, node.col_offset)).test
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    assigned = assigned_at(code.co_filename, code.co_firstlineno, test.id, line) if isinstance(test, ast.Name) else None
    return f"{short_path(code.co_filename)}:{assigned or test.lineno}"


def argument_line(frame: types.FrameType | None, callee: str, keyword: str, position: int | None) -> str | None:
    """file:line where the user's call of `callee` at `frame` got its argument `keyword` (or the
    one at `position`): the line that last assigned it before the call, where it is passed as a
    plain name (`T_max=total_steps`), else the line of the expression itself; None when the call
    or the argument is not found."""
    frame = user_frame(frame)
    if frame is None:
        return None
    code, line = frame.f_code, frame.f_lineno
    tree = _tree(code.co_filename)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno)
             and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == callee] if tree else []
    if not calls:
        return None
    call = max(calls, key=lambda node: (node.lineno, node.col_offset))
    given = next((k.value for k in call.keywords if k.arg == keyword), None)
    if given is None and position is not None and position < len(call.args):
        given = call.args[position]
    if given is None:
        return None
    assigned = assigned_at(code.co_filename, code.co_firstlineno, given.id, call.lineno) if isinstance(given, ast.Name) else None
    return f"{short_path(code.co_filename)}:{assigned or given.lineno}"


@functools.lru_cache(maxsize=64)
def _tree(file: str) -> ast.Module | None:
    """A source file's syntax tree; None when it cannot be read or parsed. Cached: asked once a look at most."""
    try:
        with open(file, encoding="utf-8") as source:
            return ast.parse(source.read(), file)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _loops(file: str) -> tuple[tuple[int, int], ...]:
    """(first line, last line) of every loop in a source file."""
    tree = _tree(file)
    return () if tree is None else tuple((node.lineno, node.end_lineno or node.lineno) for node in ast.walk(tree)
                                         if isinstance(node, (ast.For, ast.AsyncFor, ast.While)))


def assigned_at(file: str, first_line: int, name: str, before: int) -> int | None:
    """The line of the latest assignment to the plain name `name` in `file` after `first_line` (the
    start of the function that holds it) and before line `before`; None when there is none, or the
    file cannot be read or parsed."""
    lines = [line for line, target in _assignments(file) if target == name and first_line <= line < before]
    return max(lines) if lines else None


def _assignments(file: str) -> tuple[tuple[int, str], ...]:
    """(line, name) of every assignment to a plain name in a source file."""
    tree = _tree(file)
    if tree is None:
        return ()
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name):
                    found.append((node.lineno, leaf.id))
    return tuple(found)
