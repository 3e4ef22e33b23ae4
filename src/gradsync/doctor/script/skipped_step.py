"""skipped_step: after a backward pass DDP averaged, some ranks stepped the optimizer and others did not.

DDP hands every rank the same averaged gradient; a rank that then skips the step (a loss-spike or
non-finite guard reading its own loss, a `continue` on a rank-local condition) leaves its replica
behind the others, and from then on the ranks also count different numbers of steps. Nothing
fails until the step counts decide something the ranks must agree on: a schedule, a checkpoint,
the last collective.

Each rank records, for each synchronised backward pass, whether an optimizer step followed it
before the next training forward; when none did, the line where the rank went on instead: the
last line it ran before control jumped back above the backward call (a `continue`, or the `if`
whose branch holds the step). That line is read by tracing the lines of the user's frame only in
the window between the backward's end and the step (or the next forward), and only when nobody
else traces the thread (a debugger, coverage). A skip every rank makes alike (a guard on the
averaged loss, a GradScaler that found an inf) is the script's choice and is left alone.
"""

from __future__ import annotations

import sys
import types
from typing import Any, TypedDict

from gradsync.rundir.records import Finding
from gradsync.callsite import OWN, file_kind, short_path, user_frame
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "skipped_step"
MAX_SKIPS = 64  # skips recorded per rank
MAX_LINES = 512  # lines traced in one window (a window that runs longer keeps its first ones)


class SkipFacts(TypedDict):
    """What the watch records on one rank (under "skipped_step" in its facts file)."""

    synced_backwards: int  # synchronised backward passes seen
    skipped: list[dict[str, Any]]  # {"backward": its number, "site": where the rank went on}


class SkipWatch:
    """The synchronised backward passes of one rank that no optimizer step followed, and where it went on."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.synced = 0  # synchronised backward passes seen
        self.skipped: list[dict[str, Any]] = []  # {"backward": its number, "site": where the rank went on}
        self._waiting = False  # a synchronised backward ended and no step has followed it yet
        self._frame: types.FrameType | None = None  # the user's frame being traced
        self._above = 0  # a jump to a line above this one, in the traced frame, left the backward's iteration
        self._lines: list[tuple[int, int]] = []  # (line, the frame's line it jumped from) of the traced frame
        moments.on("backward_ends", self._backward_ends, self.bookkeeping)
        moments.on("step_starts", self._step_starts, self.bookkeeping)
        moments.on("forward_starts", self._forward_starts, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        """Nothing beyond the host's moments; the tracing is undone by the moments that end a window."""

    # -- the moments -------------------------------------------------------------------------

    def _backward_ends(self, synchronised: bool) -> None:
        if not synchronised:
            return
        if self._waiting:
            self._skip()  # a second synchronised backward without a step in between
        self.synced += 1
        self._waiting = True
        self._trace(user_frame(sys._getframe(1)))

    def _step_starts(self, optimizer: Any, step: int) -> None:
        self._waiting = False
        self._stop_tracing()

    def _forward_starts(self, ddp: Any, forward: dict[str, Any]) -> None:
        if self._waiting:
            self._skip()

    def _skip(self) -> None:
        site = self._went_on_at()
        self._stop_tracing()
        self._waiting = False
        if len(self.skipped) < MAX_SKIPS:
            self.skipped.append({"backward": self.synced, "site": site})

    # -- tracing the window ------------------------------------------------------------------

    def _trace(self, frame: types.FrameType | None) -> None:
        self._stop_tracing()
        if frame is None or file_kind(frame.f_code.co_filename) != OWN or sys.gettrace() is not None:
            return  # not the user's own frame, or the thread is someone else's to trace
        self._frame, self._above, self._lines = frame, frame.f_lineno, []
        frame.f_trace_lines = True
        frame.f_trace = self._local
        sys.settrace(_no_new_frames)  # local tracing runs only while the thread traces

    def _local(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        with self.bookkeeping:
            if frame is not self._frame:
                return None
            if event == "line" and len(self._lines) < MAX_LINES:
                previous = self._lines[-1][0] if self._lines else self._above
                self._lines.append((frame.f_lineno, previous))
            elif event == "return":
                # The backward ran inside a function (a train_step) that returned: the decision is its caller's.
                caller = frame.f_back
                self._stop_tracing()
                if caller is not None and file_kind(caller.f_code.co_filename) == OWN:
                    self._trace(caller)
                return None
        return self._local

    def _went_on_at(self) -> str | None:
        """The last line the traced frame ran before it jumped back above the backward call: where
        this iteration ended without a step."""
        if self._frame is None:
            return None
        for line, came_from in self._lines:
            if line < self._above <= came_from:
                return f"{short_path(self._frame.f_code.co_filename)}:{came_from}"
        return None

    def _stop_tracing(self) -> None:
        if self._frame is not None:
            self._frame.f_trace = None
            self._frame = None
        if sys.gettrace() is _no_new_frames:
            sys.settrace(None)

    def facts(self) -> SkipFacts:
        self._stop_tracing()  # the facts are written at the end: leave the thread as it was
        return {"synced_backwards": self.synced, "skipped": self.skipped}


def _no_new_frames(frame: types.FrameType, event: str, arg: Any) -> None:
    """The thread's trace function while a window is traced: it traces no frame it was not given."""
    return None


def skipped_on_some_ranks(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    skips = {rank: {skip["backward"]: skip for skip in facts["skipped"]} for rank, facts in recorded.items()}
    compared = min(facts["synced_backwards"] for facts in recorded.values())
    for backward in range(1, compared + 1):
        skipping = sorted(rank for rank, skipped in skips.items() if backward in skipped)
        if not skipping or len(skipping) == len(recorded):
            continue  # every rank stepped, or every rank skipped alike (the script's choice)
        stepping = sorted(set(recorded) - set(skipping))
        sites = {rank: skips[rank][backward]["site"] for rank in skipping}
        where = next((site for site in sites.values() if site), None)
        counts = {rank: len(skipped) for rank, skipped in skips.items()}
        return [Finding(
            "step_skipped_on_some_ranks",
            "error",
            skipping,
            f"After synchronised backward pass {backward}, {ranks_text(skipping)} took no optimizer step and went on to "
            f"the next batch{f' at {where}' if where else ''}, while {ranks_text(stepping)} stepped with the same averaged "
            "gradient: the decision to skip was made on a rank-local value (a loss-spike or non-finite guard on the "
            "rank's own loss). From there the replicas differ and the ranks count different numbers of steps ("
            + ", ".join(f"rank {rank}: {count} skipped" for rank, count in sorted(counts.items()))
            + f" in the first {compared} synchronised passes).",
            "Decide to skip on every rank together: all_reduce the flag (or the loss) first, e.g. "
            "`flag = torch.tensor(float(skip)); dist.all_reduce(flag, op=dist.ReduceOp.MAX)` (gradsync's "
            "agree_any), and skip when any rank wants to.",
            locations={str(rank): site or "?" for rank, site in sites.items()},
            details={"backward": backward, "skipped": {str(rank): count for rank, count in sorted(counts.items())}},
        )]
    return []


CHECK = Check(
    name="skipped_step",
    summary="an optimizer step skipped on some ranks only",
    categories={
        "step_skipped_on_some_ranks": Category(
            ("error",),
            "after a synchronised backward pass some ranks stepped the optimizer and others did not",
            "after a backward pass DDP averaged, some ranks took no optimizer step before their next training "
            "forward while the others stepped (a skip decided on the rank's own loss): named where the skipping "
            "ranks went on (the `continue`, or the `if` around the step). Skips every rank makes alike (a guard on "
            "the averaged loss, a GradScaler's inf) are left alone",
        ),
    },
    rule=skipped_on_some_ranks,
    # The update that differs, the replicas, the optimizer state that follow it, and the doctor's
    # stop at step K, which then finds the ranks at different collectives.
    explains={"step_skipped_on_some_ranks": ("update_differs", "parameters_diverged", "buffers_diverged",
                                             "state_written_on_some_ranks", "rank_exited", "collective_after_peer_left")},
    watch=SkipWatch,
    facts=SkipFacts,
)
