"""line_trace: the second pass, which finds the line after which the ranks' state parted when no recorded write explains it.

The first pass names the write that split the state wherever it was recorded (state_writes: every
tensor-level write and the patched entry points). Some writes are not: a `param_group` entry
assigned (`group["lr"] = ...`, a plain dict), a tensor changed through memory torch's dispatch
does not see (a NumPy view, an extension). The first pass still knows *what* parted and *between
which two steps*; `gradsync doctor` then runs the script again, up to the end of that window,
with only this check, which traces the lines of the user's files inside the window (nowhere else)
and reads that part of the state after each one. The rule compares the ranks' sequences of
changes: the first change some ranks made and the others did not, or made to other values, is
at the line to blame.

Cost: nothing in the first pass. In the second, the script's first K' steps, with a line trace
and a reading of one part of the state (the optimizer's settings, or a sample of the parameters or
gradients) at every line of the user's files in one step window.
"""

from __future__ import annotations

import sys
import types
from typing import Any, TypedDict

from gradsync.callsite import OWN, file_kind, location
from gradsync.doctor.script.compare import odd_ones_out, ranks_text, settings_differ
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts
from gradsync.run.check_primitives import Patches, hyperparameters, tensors_fingerprint
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.rundir.records import Finding

NAME = "line_trace"
CONFIG = "trace"  # the probe config's key: {"window": w, "part": one of PARTS}
MAX_CHANGES = 64  # changes kept per rank
MAX_LINES = 20_000  # lines traced in the window; a window longer keeps its first changes
PARTS = {
    "hyperparameters": "the optimizer's settings",
    "parameters": "the parameters",
    "gradients": "the gradients",
}


def request(window: int, part: str) -> dict[str, Any]:
    """The probe config that asks a run for this second pass."""
    return {CONFIG: {"window": window, "part": part}}


class TraceFacts(TypedDict):
    """What the watch records on one rank (under "line_trace" in its facts file)."""

    request: dict[str, Any] | None  # the window and part traced (None: no second pass asked)
    initial: str | None  # the part as the window began
    changes: list[dict[str, Any]]  # in order: {"site": the line after which the part changed, "value": it then}
    lines: int  # lines traced


class TraceWatch:
    """Inside the requested window of one rank, the lines of the user's files after which the
    requested part of the state changed."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.request: dict[str, Any] | None = moments.config.get(CONFIG)
        self.changes: list[dict[str, Any]] = []
        self.lines = 0
        self._optimizers: list[Any] = []
        self._value: str | None = None
        self._initial: str | None = None
        self._site: str | None = None
        self._tracing = False
        if self.request is not None:
            moments.on("wrapped", self._wrapped, self.bookkeeping)
            moments.on("step_starts", self._step_starts, self.bookkeeping)
            moments.on("step_ends", self._step_ends, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        if self.request is None:
            return
        from torch.optim import Optimizer

        watch = self

        def make(original):
            def __init__(optimizer, *args, **kwargs):
                original(optimizer, *args, **kwargs)
                with watch.bookkeeping:
                    watch._optimizers.append(optimizer)  # read from the window's first line on

            return __init__

        patches.wrap(Optimizer, "__init__", make)
        patches.on_undo(self._stop)

    # -- the window ----------------------------------------------------------------------------

    def _wrapped(self, ddp: Any, site: str | None) -> None:
        if self.request["window"] == 0 and not self._tracing:
            self._start()  # window 0: from DDP's construction, which made the states equal

    def _step_ends(self, optimizer: Any, step: int) -> None:
        if step == self.request["window"]:
            self._start()

    def _step_starts(self, optimizer: Any, step: int) -> None:
        if step == self.request["window"] + 1 and self._tracing:
            self._read(location(_user_frame_of(sys._getframe(1))))  # what the last line before the step did
            self._stop()

    def _start(self) -> None:
        if sys.gettrace() is not None:
            return  # a debugger or coverage traces this thread: theirs to keep
        self._value = self._initial = self._reading()
        self._tracing = True
        frame = sys._getframe(1)
        while frame is not None:  # the user's frames already running get line events from now on
            if file_kind(frame.f_code.co_filename) == OWN:
                frame.f_trace = self._line
            frame = frame.f_back
        sys.settrace(self._call)

    def _stop(self) -> None:
        if self._tracing:
            self._tracing = False
            sys.settrace(None)

    # -- the trace -----------------------------------------------------------------------------

    def _call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        return self._line if event == "call" and file_kind(frame.f_code.co_filename) == OWN else None

    def _line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if not self._tracing:
            return None
        if event == "line":
            with self.bookkeeping:
                self.lines += 1
                if self.lines > MAX_LINES:
                    self._stop()
                    return None
                self._read(f"{location(frame)}")
        return self._line

    def _read(self, site: str | None) -> None:
        """The part read now: a change since the last reading happened at the line before this one."""
        value = self._reading()
        if value != self._value and len(self.changes) < MAX_CHANGES:
            self.changes.append({"site": self._site, "value": value})
        self._value, self._site = value, site

    def _reading(self) -> str:
        part = self.request["part"]
        if part == "hyperparameters":
            return " || ".join(hyperparameters(optimizer) for optimizer in self._optimizers)
        parameters = [p for optimizer in self._optimizers for p in self.moments.stepped_parameters(optimizer)]
        if part == "gradients":
            return str(tensors_fingerprint(p.grad for p in parameters if p.grad is not None))
        return str(tensors_fingerprint(parameters))

    def facts(self) -> TraceFacts:
        return {"request": self.request, "initial": self._initial, "changes": self.changes, "lines": self.lines}


def _user_frame_of(frame: types.FrameType | None) -> types.FrameType | None:
    while frame is not None and file_kind(frame.f_code.co_filename) != OWN:
        frame = frame.f_back
    return frame


def line_trace(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None or any(facts["request"] is None for facts in recorded.values()):
        return []
    asked = next(iter(recorded.values()))["request"]
    sequences = {rank: facts["changes"] for rank, facts in recorded.items()}
    for index in range(max(len(changes) for changes in sequences.values())):
        at = {rank: (changes[index]["site"], changes[index]["value"]) if index < len(changes) else None
              for rank, changes in sequences.items()}
        if len({repr(value) for value in at.values()}) == 1:
            continue
        blamed = [rank for rank in odd_ones_out({rank: repr(value) for rank, value in at.items()}) if at[rank] is not None]
        blamed = blamed or sorted(rank for rank, value in at.items() if value is not None)
        site = at[blamed[0]][0] or "?"
        others = sorted(set(at) - set(blamed))
        changed_alike = all(value is not None and value[0] == site for value in at.values())
        what = PARTS[asked["part"]]
        # Each rank's part after that change: for a rank that made none, what it held before.
        held = {rank: at[rank][1] if at[rank] else (sequences[rank][index - 1]["value"] if 0 < index <= len(sequences[rank])
                                                    else recorded[rank].get("initial") or "")
                for rank in at}
        if asked["part"] == "hyperparameters":
            values = settings_differ(held)
        else:
            values = "fingerprints " + ", ".join(f"rank {r} {value}" for r, value in sorted(held.items()))
        how = (f"on every rank, to other values ({values})" if changed_alike
               else f"on {ranks_text(blamed)}" + (f", and not on {ranks_text(others)}" if others else "") + f" ({values})")
        window = asked["window"]
        between = "between DDP's construction and the first step" if window == 0 else f"between optimizer steps {window} and {window + 1}"
        return [Finding(
            "state_parted_at_line",
            "error",
            blamed,
            f"Traced line by line in a second run, {between}: {what} changed at {site} {how}. No write the first "
            "run records (a tensor operation, load_state_dict, a scheduler) explains it: the line changes the state "
            "another way (a param_group entry assigned, memory written outside torch).",
            "Make that change on every rank, with the same value: an optimizer setting computed from the rank's own "
            "data (its batch size, its loss) needs an all-reduce first; a change only some ranks should make belongs "
            "nowhere in the training state.",
            locations={str(rank): at[rank][0] or "?" for rank in blamed},
            step=window + 1,
            details={"part": asked["part"], "window": window},
        )]
    return []


CHECK = Check(
    name=NAME,
    summary="the second pass: the line after which the ranks' state parted, traced in one step window",
    categories={
        "state_parted_at_line": Category(
            ("error",),
            "traced line by line in a second run: the line after which a part of the ranks' state parted",
            "`gradsync doctor`'s second pass, run when a part of the state (the optimizer's settings, the parameters, "
            "the gradients) parted between two steps and no recorded write explains it: the script runs again up to "
            "that window, its lines traced there, and the line after which the ranks' part changed differently (only "
            "on some ranks, or to other values) is named",
        ),
    },
    rule=line_trace,
    watch=TraceWatch,
    facts=TraceFacts,
    explains={"state_parted_at_line": ("update_differs", "parameters_diverged")},
)
