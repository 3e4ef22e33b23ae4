"""One rank as the diagnosis sees it (RankView), and the questions asked of a single rank: what
it waits in, how far it got on a group, where it was last seen.

Pure readings of a rank's snapshot, exit record and Flight Recorder dump, which every other
module of the analysis asks.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from gradsync.run.analysis.last_words import LastWords
from gradsync.run.flight import join_sites


@dataclass
class RankView:
    """Everything known about one rank when the diagnosis is made."""

    rank: int
    snapshot: dict[str, Any] | None = None  # the exit record when there is one, else the last snapshot
    exit: dict[str, Any] | None = None
    exitcode: int | None = None  # from torchrun's agent; negative: killed by that signal
    signal: str | None = None
    stopped_by_gradsync: bool = False
    alive: bool = False
    injected: dict[str, Any] | None = None  # the record of an --inject-fault that fired on this rank
    # Of another node, and silent: its state stopped coming and its node's agent never said how it
    # ended. What it last reported is where it was, not where it is.
    unreachable: bool = False
    # The user's frames of the thread a fatal signal stopped, innermost first, from faulthandler's
    # dump (None: no dump, the rank ended otherwise): where a native crash was called from.
    fatal_stack: list[str] | None = None
    # The same, of one of its DataLoader worker processes, when the rank raised because a worker
    # died ("DataLoader worker (pid(s) N) exited unexpectedly"): where the worker's native call was made.
    loader_worker_fatal_stack: list[str] | None = None
    # The tail of the rank's log and what it says the rank died of (None: no log on this node).
    last_words: LastWords | None = None

    @property
    def records(self) -> list[dict[str, Any]]:
        return (self.snapshot or {}).get("records", [])

    @property
    def location(self) -> str | None:
        return (self.snapshot or {}).get("location")

    @property
    def held_at_exit(self) -> dict[str, Any] | None:
        """For a rank whose script ended and whose process still waits for the script's non-daemon
        threads (gradsync.run.script_exit): how it ended, and the threads that hold it."""
        return (self.snapshot or {}).get("ending")

    def waiting_on(self) -> dict[str, Any] | None:
        """The collective this rank is blocked in, if any: an open record of gradsync's recorder,
        else the first collective Flight Recorder saw the backend leave unfinished (one the
        recorder never sees, or on NCCL one whose Python call returned long ago)."""
        recent = self.records[-16:]
        for record in recent:
            if record["state"] == "entered":
                return record
        for record in recent:
            if record["state"] in ("issued", "failed") and record["seq"] is not None:
                return record
        return self.unfinished_in_backend()

    @functools.cached_property
    def flight(self) -> list[dict[str, Any]] | None:
        """The rank's Flight Recorder entries (oldest first) with their lines, None without a dump.

        Lines come from the recorded calls that span the entries; the newest entry, when the
        dump is current and the backend has not finished it, is where the rank blocks: its
        line is the rank's own (a DTensor's or functional collective has no record)."""
        dump = (self.snapshot or {}).get("flight")
        if not dump:
            return None
        entries = join_sites(dump.get("entries") or [], self.records)
        if entries and entries[-1]["state"] == "entered" and not entries[-1].get("site") and self._flight_current():
            entries[-1] = {**entries[-1], "site": self.location}
        return entries

    def _flight_current(self) -> bool:
        """Whether the dump was taken after the rank's last progress, so its unfinished entries
        still say where it waits."""
        dump = (self.snapshot or {}).get("flight") or {}
        return dump.get("time", 0.0) >= (self.snapshot or {}).get("last_progress", 0.0)

    def unfinished_in_backend(self) -> dict[str, Any] | None:
        """The oldest collective Flight Recorder shows unfinished, when its dump is current."""
        if not self.flight or not self._flight_current():
            return None
        for entry in self.flight:
            if entry["state"] == "entered" and entry["seq"] is not None:
                return {**entry, "site": entry.get("site") or self.location}
        return None

    @functools.cached_property
    def reached(self) -> dict[str, int]:
        """group -> the highest sequence number the rank's records show on it (one pass, kept)."""
        return _highest_seqs(self.records)

    @functools.cached_property
    def flight_reached(self) -> dict[str, int]:
        """group -> the highest sequence number the rank's Flight Recorder entries show on it."""
        return _highest_seqs(self.flight or [])

    def flight_groups(self) -> dict[str, list[int]]:
        return ((self.snapshot or {}).get("flight") or {}).get("groups") or {}

    def exception(self) -> dict[str, Any] | None:
        return self.exit if self.exit and self.exit.get("status") == "exception" else None

    def said(self, *families: str) -> bool:
        """Whether the rank's last words belong to one of `families`."""
        return self.last_words is not None and self.last_words.family in families

    @property
    def finished(self) -> bool:
        return bool(self.exit) and self.exit.get("status") == "finished"


def _highest_seqs(records: list[dict[str, Any]]) -> dict[str, int]:
    highest: dict[str, int] = {}
    for record in records:
        seq = record["seq"]
        if seq is not None and seq > highest.get(record["group"], -1):
            highest[record["group"]] = seq
    return highest


def group_members(view: RankView, group: str, views: dict[int, RankView]) -> list[int]:
    """The ranks of `group` as `view`'s rank knows them (every rank when neither its snapshot nor
    its Flight Recorder dump says)."""
    recorded = ((view.snapshot or {}).get("groups", {}).get(group) or {}).get("ranks")
    return recorded or view.flight_groups().get(group) or list(views)


def reached_on(view: RankView, group: str, source: dict[str, Any] | None = None) -> int | None:
    """The highest sequence number the rank shows on `group` (-1: none), counted as `source` counts:
    gradsync's records number Python calls, Flight Recorder the backend's operations (one DDP
    backward pass is one record but one entry per bucket). None when the rank left no Flight
    Recorder dump to compare a Flight Recorder entry with."""
    if source is not None and source.get("source") == "flight":
        if view.flight is None:
            return None
        return view.flight_reached.get(group, -1)
    return view.reached.get(group, -1)


def read_from_outside_text(view: RankView) -> str:
    """' (read from outside ...)' for a rank whose position py-spy read because its own reports had
    stopped (gradsync.run.outside), saying how old its last report was and who held the GIL; the
    reason, where the read failed; '' for a rank that reported itself."""
    snapshot = view.snapshot or {}
    read, silent = snapshot.get("outside_read"), snapshot.get("silent_s")
    if read:
        running = "running" if read.get("running") else "not running"
        if read.get("gil") == "the main thread":
            state = f"its main thread held the GIL, {running}: a native call that keeps it, so its reports could not run"
        else:
            state = f"its main thread was {running}; {read['gil'] + ' held the GIL' if read.get('gil') else 'no thread held the GIL'}"
        return f" (read from outside by py-spy, its own reports stopped {silent:.0f} s before: {state})"
    if snapshot.get("outside_read_failed"):
        return f" (its last report, {silent:.0f} s old: {snapshot['outside_read_failed']})"
    return ""


def exit_call(view: RankView) -> str | None:
    """"sys.exit(3)", or "os._exit(1) from thread 'watchdog'", for a rank whose script ended itself
    with one (gradsync.run.script_exit); None otherwise."""
    ending = view.exit or {}
    if ending.get("how") not in ("sys.exit", "os._exit"):
        return None
    thread = f" from thread '{ending['thread']}'" if ending.get("thread") else ""
    return f"{ending['how']}({ending.get('code', 0)}){thread}"


def exit_site(view: RankView) -> str | None:
    """The user's line where the script ended itself (a sys.exit or os._exit call), if known."""
    return (view.exit or {}).get("location") if exit_call(view) else None


def where_is(view: RankView) -> str:
    """The line a rank is at: where it waits, else its last snapshot's line, else its last collective's."""
    waiting = view.waiting_on()
    return (waiting or {}).get("site") or view.location or last_site(view) or "?"


def last_position(view: RankView) -> str:
    """Where a rank that left no exit record (killed) was last seen: inside its last collective if
    it never left it, else the newer of its last snapshot's line and its last collective's site."""
    last = view.records[-1] if view.records else None
    if last is None or not last.get("site"):
        return view.location or "?"
    if last["state"] == "entered" or view.location is None:
        return last["site"]
    snapshot_time = (view.snapshot or {}).get("time", 0.0)
    return view.location if snapshot_time >= (last.get("finished") or last["entered"]) else last["site"]


def last_site(view: RankView) -> str | None:
    for record in reversed(view.records):
        if record.get("site"):
            return record["site"]
    return None


# The peer at the end of a point-to-point record's signature: " src=R" or " dst=R".
P2P_PEER = re.compile(r" (src|dst)=(\d+)$")


def message_tensor(signature: str | None) -> str:
    """'float32[2, 16]' from 'float32[2, 16] src=0': what a send or receive holds, without its peer."""
    return P2P_PEER.sub("", signature or "")


# Where, on a stack, a rank blocks in a collective the recorder does not see.
_UNRECORDED_WAIT = re.compile(r"torch/distributed/(_functional_collectives\.py|distributed_c10d\.py|tensor/)\S* in (\w+)")


def unrecorded_wait(view: RankView) -> str | None:
    """'an unrecorded collective (_functional_collectives.py, wait_tensor)' when the rank's last
    stack is blocked inside torch.distributed's collective code although no record is open: a
    DTensor, functional or compiled collective."""
    for frame in reversed((view.snapshot or {}).get("stack") or []):
        found = _UNRECORDED_WAIT.search(frame)
        if found:
            return f"an unrecorded collective ({found.group(1).rstrip('/')}, {found.group(2)})"
    return None
