"""From what every rank recorded to one diagnosis: what went wrong, on which rank, at which line.

Pure functions over the workers' snapshots and exit records (plus what torchrun's agent knows
about exit codes), so every rule is testable without starting a process. The order of the
questions matters: a rank that crashed by itself is the cause and the "Connection closed by
peer" of the others its consequence; without a crash, the first collective where the ranks'
sequences differ explains hangs and mismatch errors; without either, the ranks' positions
(one finished, one stuck outside any collective) do.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import re
import statistics
from dataclasses import dataclass
from typing import Any, Iterable

from gradsync.run.faults import FaultSpec
from gradsync.run.flight import join_sites
from gradsync.rundir.records import POINT_TO_POINT, Finding

# Errors a rank gets because another rank left, crashed or misbehaved, not because of its own code.
_CONSEQUENCE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|closed by remote|[Tt]imed out|"
    r"[Tt]imeout|Socket|ECONNRESET|remote process exited|communicator was aborted|NCCL error|"
    r"Application timeout caused pair closure|failed to recv|failed to send",
)
# What Gloo and NCCL say when the two sides of one collective are different collectives.
_MISMATCH_SYMPTOM = re.compile(r"op\.preamble\.length|collective mismatch|[Mm]ismatch|size mismatch")
# PeerError: gradsync's trainer stopping a rank because another rank failed a check.
_CONSEQUENCE_TYPES = {"DistNetworkError", "DistBackendError", "DistStoreError", "PeerError"}
# A message that names the backend: the transport speaking, not the user's own code.
_BACKEND = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")
_UNUSED_HINT = re.compile(r"did not receive grad|Expected to have finished reduction in the prior iteration")


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

    @property
    def records(self) -> list[dict[str, Any]]:
        return (self.snapshot or {}).get("records", [])

    @property
    def location(self) -> str | None:
        return (self.snapshot or {}).get("location")

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


def describe(record: dict[str, Any]) -> str:
    """'all_reduce #12 (DDP gradient bucket 0, float32[1234])' for a record."""
    inside = ", ".join(part for part in (record.get("kind"), record.get("signature")) if part)
    number = f" #{record['seq']}" if record.get("seq") is not None else ""
    group = "" if record.get("group") == "default" else f" on {record.get('group')}"
    return f"{record['op']}{number}{group}" + (f" ({inside})" if inside else "")


def is_consequence(exception: dict[str, Any]) -> bool:
    """Whether an exception says the rank lost its peers rather than failed by itself.

    Decided first by where it was raised (the exit record says which recorded collective it came
    out of, if any): outside every collective it is the script's own failure whatever its words
    (a user's "timed out reading shard 3"), unless the backend itself speaks (collectives gradsync
    does not record, such as compiled ones). Inside one, the transport's words decide here, and a
    peer that was elsewhere decides in `_crash_cause`.
    """
    message = exception["message"]
    if exception["type"] in _CONSEQUENCE_TYPES:
        return True
    if "collective" in exception and exception["collective"] is None:
        return bool(_BACKEND.search(message) and _CONSEQUENCE.search(message))
    return bool(_CONSEQUENCE.search(message))  # inside a collective (or an older exit record)


def is_mismatch_symptom(exception: dict[str, Any]) -> bool:
    return bool(_MISMATCH_SYMPTOM.search(exception["message"]))


# -- comparing sequences ----------------------------------------------------------------------


@dataclass
class Divergence:
    """The first collective where the ranks' sequences on one group differ."""

    group: str
    seq: int
    records: dict[int, dict[str, Any]]  # rank -> its record at seq
    before_window: bool = False  # diverged earlier than the records kept (found by checkpoint CRC)
    # Set when the ranks' collectives already paired different lines (same op and tensors) from
    # `seq` up to this later collective, where they stopped matching.
    surfaced_at: "Divergence | None" = None


def _key(record: dict[str, Any]) -> tuple:
    return (record["op"], record["signature"], record["kind"])


def find_divergence(views: dict[int, RankView]) -> Divergence | None:
    """The earliest collective, over all groups, at which two ranks' records disagree."""
    found: list[Divergence] = []
    # group -> rank -> seq -> record, for the ranks whose snapshot names the group: one pass over
    # each rank's records (not one per group, of which a large job has hundreds).
    by_group: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for rank, view in views.items():
        tables = {group: by_group.setdefault(group, {}).setdefault(rank, {}) for group in (view.snapshot or {}).get("groups", {})}
        for record in view.records:
            table = tables.get(record["group"])
            if table is not None and record["seq"] is not None:
                table[record["seq"]] = record
    for group in sorted(by_group):
        by_rank = by_group[group]
        divergence = _first_difference(group, by_rank, _key)
        if divergence is None and len(by_rank) >= 2:
            divergence = _checkpoint_divergence(views, group, by_rank)
        if divergence is not None:
            found.append(divergence)
    return min(found, key=lambda d: d.seq) if found else None


def find_backend_divergence(views: dict[int, RankView]) -> Divergence | None:
    """The earliest operation at which two ranks' Flight Recorder entries disagree in op or
    tensors: what reached the process groups, collectives gradsync does not record included.
    Compared without the kind, which comes from joining entries to records by time."""
    found: list[Divergence] = []
    # group -> rank -> seq -> entry, in one pass over each rank's entries (not one per group)
    by_group: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for rank, view in views.items():
        for entry in view.flight or ():
            if entry["seq"] is not None:
                by_group.setdefault(entry["group"], {}).setdefault(rank, {})[entry["seq"]] = entry
    for group in sorted(by_group):
        divergence = _first_difference(group, by_group[group], _backend_key)
        if divergence is not None:
            found.append(divergence)
    return min(found, key=lambda d: d.seq) if found else None


# Ops whose input tensors are the same shape on every rank of a healthy job; the others (scatter,
# gather, all_to_all with per-rank splits) differ by design, so only their op is compared.
_SAME_INPUT_EVERYWHERE = frozenset({"all_reduce", "allreduce", "broadcast", "reduce", "all_gather", "allgather", "_allgather_base", "all_gather_into_tensor", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "barrier"})


def _backend_key(entry: dict[str, Any]) -> tuple:
    return (entry["op"], entry["signature"] if entry["op"] in _SAME_INPUT_EVERYWHERE else "")


def _first_difference(group: str, by_rank: dict[int, dict[int, dict[str, Any]]], key: Any) -> Divergence | None:
    if len(by_rank) < 2:
        return None
    for seq in sorted({seq for records in by_rank.values() for seq in records}):
        present = {rank: records[seq] for rank, records in by_rank.items() if seq in records}
        if len(present) >= 2 and len({key(r) for r in present.values()}) > 1:
            return _first_unpaired_line(Divergence(group, seq, present), by_rank, key)
    return None


def _first_unpaired_line(divergence: Divergence, by_rank: dict[int, dict[int, dict[str, Any]]], key: Any = _key) -> Divergence:
    """Where the trouble began: an extra collective with the same op and tensors as the one its
    peers call next pairs with it silently; every later collective is then met by the peers' one
    before, until one no longer matches. The extra one shows as a collective, before the
    mismatch, whose line is the rank's own (no other rank calls a collective there) while the
    line its peers paired it with is one that rank calls too.

    Two branches calling the same collective from different lines (`if rank == 0: broadcast(...)
    else: broadcast(...)`) differ too, but each side's line is its own: not taken for an extra one.
    """
    ranks = list(divergence.records)
    sites = {rank: {r.get("site") for r in by_rank[rank].values()} for rank in ranks}
    for seq in range(divergence.seq - 1, min(min(by_rank[r]) for r in ranks) - 1, -1):
        present = {rank: by_rank[rank].get(seq) for rank in ranks}
        if any(r is None or not r.get("site") for r in present.values()) or len({key(r) for r in present.values()}) > 1:
            break
        own = {rank for rank, r in present.items() if not any(r["site"] in sites[o] for o in ranks if o != rank)}
        if own and len(own) < len(ranks) and len({r["site"] for r in present.values()}) > 1:
            return Divergence(divergence.group, seq, present, surfaced_at=divergence)
    return divergence


def _checkpoint_divergence(views: dict[int, RankView], group: str, ranks: Iterable[int] | None = None) -> Divergence | None:
    """Ranks whose recorded windows agree may still have diverged earlier: compare CRC checkpoints
    (of `ranks`, the group's members, when known: every rank otherwise)."""
    checkpoints: dict[int, dict[int, int]] = {}
    for rank in views if ranks is None else ranks:
        state = (views[rank].snapshot or {}).get("groups", {}).get(group)
        if state:
            checkpoints[rank] = {seq: crc for seq, crc in state["checkpoints"]}
    common = sorted(set.intersection(*(set(c) for c in checkpoints.values()))) if len(checkpoints) > 1 else []
    for seq in common:
        if len({c[seq] for c in checkpoints.values()}) > 1:
            return Divergence(group, seq, {}, before_window=True)
    return None


def _ranks_alone_at_their_line(records: dict[int, dict[str, Any]], views: dict[int, RankView]) -> list[int]:
    """The ranks whose line at this collective no other rank ever called a collective from (the
    extra one), else every rank involved."""
    sites = {rank: {r.get("site") for r in view.records} for rank, view in views.items()}
    callers: dict[str | None, int] = {}  # line -> how many ranks ever called a collective there
    for seen in sites.values():
        for site in seen:
            callers[site] = callers.get(site, 0) + 1
    alone = [
        rank for rank, record in records.items()
        if callers.get(record.get("site"), 0) == (record.get("site") in sites.get(rank, ()))
    ]
    return sorted(alone) if 0 < len(alone) < len(records) else sorted(records)


def _odd_ones_out(records: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks that did the unusual thing: a minority call site, or a user collective facing DDP's."""
    by_site: dict[tuple, list[int]] = {}
    for rank, record in records.items():
        by_site.setdefault((_key(record), record.get("site")), []).append(rank)
    sizes = sorted(len(ranks) for ranks in by_site.values())
    if len(sizes) > 1 and sizes[0] < sizes[-1]:
        return sorted(r for ranks in by_site.values() if len(ranks) == sizes[0] for r in ranks)
    user = sorted(rank for rank, record in records.items() if not record["kind"].startswith("DDP"))
    if 0 < len(user) < len(records):
        return user
    # DDP's own collectives during a forward that does not train (evaluation through the wrapper).
    not_training = sorted(rank for rank, record in records.items() if "(eval" in record["kind"] or "no_grad)" in record["kind"])
    if 0 < len(not_training) < len(records):
        return not_training
    return sorted(records)


# -- the diagnosis ------------------------------------------------------------------------------


SUGGEST_SAME_COLLECTIVES = (
    "Every rank must call the same collectives in the same order. Keep collectives out of "
    "rank-dependent branches (e.g. move dist.barrier() out of `if rank == 0:`), give every rank "
    "the same number of batches (DistributedSampler with drop_last=True, or gradsync's "
    "DistributedLoader), and decide to skip a batch or stop early on all ranks together "
    "(gradsync's agree_any, or an all_reduce of the flag)."
)


def diagnose(
    views: dict[int, RankView],
    *,
    trigger: str,
    now: float,
    world_size: int | None = None,
    stragglers: list[Finding] | None = None,
    script_check: list[Finding] | None = None,
) -> dict[str, Any]:
    """The diagnosis of one attempt of a job; `trigger` is 'stall', 'failure' or 'exit'.

    `script_check`: what --doctor-steps found by comparing the ranks' facts.
    """
    findings: list[Finding] = []
    lines: dict[int, str] = {}
    divergence = find_divergence(views)
    if divergence is None and trigger != "exit":
        # What reached the process groups, for a job that failed or hung (one that ended is judged
        # from the recorded calls alone: a false alarm there would fail a healthy job).
        divergence = find_backend_divergence(views)

    injected = _fired_fault(views, trigger)
    positions: dict[tuple, Any] = {}  # shared by the ranks' _peer_elsewhere questions
    crashes = [injected] if injected else [v for v in views.values() if _crash_cause(v, divergence, views, positions)]
    # torchrun's agent stops the remaining workers with SIGTERM once one has failed, possibly
    # before their last snapshot is newer than the failure: SIGTERM is a cause only alone, and
    # not when a rank failed waiting for it (then where it was, is the answer: see _position_finding).
    consequences = [v for v in views.values() if v.exception() is not None and v not in crashes]
    crashes = [v for v in crashes if v.signal != "SIGTERM"] or ([] if consequences else crashes)
    unreachable = [v for v in views.values() if v.unreachable]
    teardown = [v for v in views.values() if v.finished and v.exitcode not in (None, 0)]
    everyone_finished = all(v.finished for v in views.values())
    if injected:
        findings.append(_injected_finding(injected, views))
    elif crashes:
        first = min(crashes, key=_failure_time)
        alike = [v for v in crashes if _failure_signature(v) == _failure_signature(first)]
        findings.append(_crash_finding(first, views, alike if len(views) > 1 and len(alike) == len(views) else [first]))
    elif unreachable:
        # Before comparing positions: an unreachable rank's records stop where it was last heard
        # of, and read as current they would pair up wrongly with its peers'.
        findings.append(_unreachable_finding(unreachable, views, now))
    elif divergence is not None and (trigger != "exit" or everyone_finished):
        findings.append(_divergence_finding(divergence, views, trigger))
    elif trigger in ("stall", "failure") and not everyone_finished:
        finding = _position_finding(views, now, trigger)
        if finding is not None:
            findings.append(finding)
    if teardown and not crashes:
        findings.append(_teardown_finding(teardown, views))
    findings += _health_findings(views)
    findings += script_check or []
    findings += stragglers or []

    _blame_differing_meshes(findings, views)

    failed_job = trigger == "stall" or any(
        v.exitcode not in (None, 0) and v not in teardown and not v.stopped_by_gradsync for v in views.values()
    )
    if failed_job and not any(f.severity == "error" for f in findings):
        findings.insert(0, _unexplained_failure(views, trigger))
    # Ranks that ended by themselves before the launcher stopped the rest.
    failed = [v for v in views.values() if v.exit is not None and not v.finished]
    for rank, view in sorted(views.items()):
        lines[rank] = _rank_line(view, now, divergence, crashes, failed)
    status = "failed" if any(f.severity == "error" for f in findings) else "ok"
    return {
        "status": status,
        "trigger": trigger,
        "world_size": world_size or len(views),
        "findings": [f.as_dict() for f in findings],
        "ranks": {str(rank): line for rank, line in lines.items()},
    }


def _blame_differing_meshes(findings: list[Finding], views: dict[int, RankView]) -> None:
    """When the ranks built different device meshes, that is the cause of the error found.

    A mesh's groups are created collectively, one per dimension: ranks that asked for different
    shapes hold groups their peers do not, so their collectives meet the wrong peers or none.
    Whatever that looked like (a hang, a mismatch, a crash), the first differing mesh is named.
    """
    error = next((f for f in findings if f.severity == "error" and "injected" not in f.details), None)
    meshes = {r: v.snapshot.get("meshes") for r, v in sorted(views.items()) if v.snapshot and v.snapshot.get("meshes") is not None}
    if error is None or len(meshes) < 2:
        return
    for index in range(max(len(m) for m in meshes.values())):
        built = {r: m[index] if index < len(m) else None for r, m in meshes.items()}
        if len({None if b is None else (tuple(b["shape"]), tuple(b["names"] or ())) for b in built.values()}) < 2:
            continue
        sides = _listing([
            (r, f"rank {r}: " + ("none" if b is None else
                                 f"shape {tuple(b['shape'])}" + (f" {tuple(b['names'])}" if b["names"] else "") + f" at {b['site'] or '?'}"))
            for r, b in built.items()
        ])
        error.message = (
            f"The ranks built different device meshes (their mesh #{index + 1}: {sides}), so each holds process "
            f"groups the others do not and their collectives met the wrong peers. What followed: {error.message}"
        )
        error.suggestion = (
            "Build every device mesh from values all ranks share (the world size, a config read the same way "
            "everywhere), never from a rank's own environment. " + error.suggestion
        )
        # The line to fix is where the meshes were built, whatever line the symptom showed at.
        error.locations = {str(r): b["site"] or "?" for r, b in built.items() if b is not None}
        error.details["meshes"] = {str(r): b for r, b in built.items()}
        return


# Injected faults that leave the rank alive and quiet: only a stall makes them the cause.
STALLING_FAULTS = ("hang", "stop")


def _fired_fault(views: dict[int, RankView], trigger: str) -> RankView | None:
    """The rank an injected fault took down: the known cause, whatever its peers went through.

    A hang only explains a stall: a job stopped for another reason is diagnosed as usual.
    """
    for view in sorted(views.values(), key=lambda v: v.rank):
        if view.injected and (view.injected["action"] not in STALLING_FAULTS or trigger == "stall"):
            return view
    return None


def _fault_place(fault: dict[str, Any]) -> str:
    if fault["at"] == "checkpoint":
        return f"while writing the checkpoint of step {fault['step']}"
    return f"at step {fault['step']}"


def _fault_outcome(fault: dict[str, Any]) -> str:
    """'was killed (SIGKILL) at step 3' for the record of a fault that fired."""
    outcome = {"kill": "was killed (SIGKILL)", "exit": f"exited with code {fault['code']}", "hang": "hung",
               "stop": "was frozen (SIGSTOP)"}[fault["action"]]
    return f"{outcome} {_fault_place(fault)}"


def _injected_finding(view: RankView, views: dict[int, RankView]) -> Finding:
    fault = view.injected
    others = ", ".join(f"rank {r}" for r in sorted(views) if r != view.rank)
    hang = fault["action"] in STALLING_FAULTS
    consequence = ""
    if others:
        consequence = (
            f" The others ({others}) waited for it until the stall timeout." if hang else f" The others ({others}) only stopped because it left."
        )
    return Finding(
        "rank_stuck" if hang else "rank_crashed",
        "error",
        [view.rank],
        f"Rank {view.rank} {_fault_outcome(fault)} of attempt {fault['attempt']}: injected by "
        f"--inject-fault {fault['spec']}, not a fault of the script.{consequence}",
        "Nothing to fix: this rehearses a failure. Check that the job recovered as intended (--max-restarts, "
        "resuming from the last checkpoint), and drop --inject-fault for real runs.",
        locations={str(view.rank): _where(view)},
        step=fault["step"],
        details={"injected": fault["spec"]},
    )


def _failure_time(view: RankView) -> float:
    if view.exit and view.exit.get("time"):
        return view.exit["time"]
    return (view.snapshot or {}).get("time", float("inf"))


def _crash_cause(
    view: RankView, divergence: Divergence | None, views: dict[int, RankView], positions: dict[tuple, Any] | None = None
) -> bool:
    """Did this rank fail by itself (not because a peer left or the collectives mismatched)?"""
    if view.stopped_by_gradsync:
        return False
    exception = view.exception()
    if exception is not None:
        if is_consequence(exception):
            return False
        if divergence is not None and (is_mismatch_symptom(exception) or _failed_in_collective(view, divergence)):
            return False
        return not _peer_elsewhere(view, views, positions)
    if view.exit and view.exit.get("status") == "exit_code":
        return True
    killed = view.exit is None and view.exitcode is not None and view.exitcode < 0 and view.signal is not None
    # Gloo aborts the process (SIGABRT) when the two sides of a collective differ in size.
    return killed and not (divergence is not None and _failed_in_collective(view, divergence))


def _members(view: RankView, group: str, views: dict[int, RankView]) -> list[int]:
    """The ranks of `group` as `view`'s rank knows them (every rank when neither its snapshot nor
    its Flight Recorder dump says)."""
    recorded = ((view.snapshot or {}).get("groups", {}).get(group) or {}).get("ranks")
    return recorded or view.flight_groups().get(group) or list(views)


def _reached(view: RankView, group: str, source: dict[str, Any] | None = None) -> int | None:
    """The highest sequence number the rank shows on `group` (-1: none), counted as `source` counts:
    gradsync's records number Python calls, Flight Recorder the backend's operations (one DDP
    backward pass is one record but one entry per bucket). None when the rank left no Flight
    Recorder dump to compare a Flight Recorder entry with."""
    if source is not None and source.get("source") == "flight":
        if view.flight is None:
            return None
        return view.flight_reached.get(group, -1)
    return view.reached.get(group, -1)


def _peer_elsewhere(view: RankView, views: dict[int, RankView], positions: dict[tuple, Any] | None = None) -> bool:
    """Did this rank's exception come out of a collective that a peer never reached, or that a
    peer had already failed out of? Then the peer, not this rank, is where to look.

    `positions` keeps, per group, what every rank that failed in it asks again: the two members
    furthest behind and the two that failed first (the first of them that is not the asking rank
    answers for all its peers)."""
    exception = view.exception() or {}
    where = exception.get("collective")
    if not where or where.get("seq") is None:
        return False
    group, seq = where["group"], where["seq"]
    members = _members(view, group, views)
    key = (group, tuple(members))
    found = None if positions is None else positions.get(key)
    if found is None:
        others = [(rank, views[rank]) for rank in dict.fromkeys(members) if rank in views]
        behind = heapq.nsmallest(2, ((_reached(other, group), rank) for rank, other in others))
        failed = heapq.nsmallest(
            2, ((_failure_time(other), rank) for rank, other in others if other.exit is not None and not other.finished)
        )
        found = (behind, failed)
        if positions is not None:
            positions[key] = found
    behind, failed = found
    reached = next((value for value, rank in behind if views[rank] is not view), None)
    failed_at = next((value for value, rank in failed if views[rank] is not view), None)
    return (reached is not None and reached < seq) or (failed_at is not None and failed_at < _failure_time(view))


def _failure_signature(view: RankView) -> tuple:
    """What identifies a failure across ranks: the same exception type at the same line, the same
    exit code, or the same signal (messages may name the rank or its data, so they are left out)."""
    exception = view.exception()
    if exception is not None:
        return ("exception", exception["type"], exception["location"] or _first_line(exception["message"]))
    if view.exit and view.exit.get("status") == "exit_code":
        return ("exit", view.exit.get("code"))
    return ("signal", view.signal, view.exitcode)


def _same_failure_finding(first: RankView, alike: list[RankView]) -> Finding:
    """Every rank failed in the same way: one failure of the script, told once."""
    ranks = sorted(v.rank for v in alike)
    before_any_collective = all(not v.records for v in alike)
    when = " at start-up, before its first collective" if before_any_collective else ""
    exception = first.exception()
    if exception is not None:
        where = exception["location"] or first.location or "?"
        what = f"{exception['type']}: {_first_line(exception['message'])} (at {where})"
        suggestion = "Fix that error in the script: it is not one rank's problem, every rank hits it."
    elif first.exit and first.exit.get("status") == "exit_code":
        where = first.location or _last_site(first) or "?"
        what = f"it exited with code {first.exit.get('code')} (at {where})"
        suggestion = ("Read the script's own message above (a bad command-line argument ends an argparse "
                      "script with code 2 on every rank).")
    else:
        where = _last_position(first)
        what = f"every rank was killed by {first.signal or 'a signal'} (exit code {first.exitcode}; last position {where})"
        suggestion = "Check the system log (dmesg for the OOM killer) and the ranks' log files in RUN_DIR/workers/."
    return Finding(
        "script_failed",
        "error",
        ranks,
        f"The script failed on every rank{when}: {what}.",
        suggestion,
        locations={str(v.rank): (v.exception() or {}).get("location") or v.location or _last_site(v) or "?" for v in alike},
        details=_traceback_details(first),
    )


def _traceback_details(view: RankView) -> dict[str, Any]:
    exception = view.exception()
    if exception is None or not exception.get("traceback"):
        return {}
    return {"exception": exception["type"], "traceback": exception["traceback"], "traceback_rank": view.rank}


def _failed_in_collective(view: RankView, divergence: Divergence) -> bool:
    """Did this rank fail, or die, inside a collective at or after the point of divergence?"""
    return any(
        r["state"] in ("failed", "entered", "issued") and r["group"] == divergence.group and (r["seq"] or 0) >= divergence.seq
        for r in view.records
    )


def _crash_finding(view: RankView, views: dict[int, RankView], alike: list[RankView]) -> Finding:
    """The finding for the first rank that failed by itself; `alike`: the ranks that failed the
    same way (every rank, or just this one)."""
    exception = view.exception()
    consequence = _reactions(view, views) if len(alike) == 1 else ""
    if exception is not None:
        unused = _unused_from_ddp_error(view, exception)
        if unused is not None:
            names = ", ".join(unused) or "(see the message)"
            stopped = f"every rank ({', '.join(str(v.rank) for v in alike)})" if len(alike) > 1 else f"rank {view.rank}"
            return Finding(
                "unused_parameters",
                "error",
                sorted(v.rank for v in alike),
                f"DDP stopped {stopped}: parameters got no gradient in the previous iteration "
                f"({names}), so its gradient reduction never finished.{consequence}",
                "Make the forward pass use every parameter that requires a gradient, freeze the unused "
                "ones (requires_grad=False), or pass find_unused_parameters=True to DDP (it costs an "
                "extra graph traversal and some overlap each step).",
                locations={str(v.rank): (v.exception() or {}).get("location") or v.location or "?" for v in alike},
                details={"parameters": unused},
            )
    if len(alike) > 1:
        return _same_failure_finding(view, alike)
    if exception is not None:
        where = exception["location"] or view.location or "?"
        if not any(v.records for v in views.values()):
            # Nobody had communicated yet: the others may simply not have got that far.
            return Finding(
                "rank_crashed",
                "error",
                [view.rank],
                f"Rank {view.rank} failed at start-up, before the ranks' first collective: {exception['type']}: "
                f"{_first_line(exception['message'])} (at {where}).{consequence} The others may well have failed "
                "the same way had they got that far.",
                "Fix that error: before the ranks first communicate, it is as likely in code every rank runs as in "
                "this rank's own input or environment.",
                locations={str(view.rank): where},
                details=_traceback_details(view),
            )
        return Finding(
            "rank_crashed",
            "error",
            [view.rank],
            f"Rank {view.rank} failed first: {exception['type']}: {_first_line(exception['message'])} "
            f"(at {where}).{consequence}",
            "Fix the error on that rank; the other ranks only stopped because it left.",
            locations={str(view.rank): where},
            step=(view.snapshot or {}).get("backward_passes"),
            details=_traceback_details(view),
        )
    if view.exit and view.exit.get("status") == "exit_code":
        where = view.location or _last_site(view) or "?"
        return Finding(
            "rank_crashed",
            "error",
            [view.rank],
            f"Rank {view.rank} called sys.exit({view.exit.get('code')}) while the others still needed it.{consequence}",
            "Exit with an error on every rank together, or fix what made this rank exit.",
            locations={str(view.rank): where},
        )
    where = _last_position(view)
    return Finding(
        "rank_crashed",
        "error",
        [view.rank],
        f"Rank {view.rank} was killed by {view.signal or 'a signal'} (exit code {view.exitcode}); its last "
        f"recorded position was {where}. Out-of-memory kills (SIGKILL), segmentation faults (SIGSEGV) and "
        f"aborts (SIGABRT) look like this.{consequence}",
        "Check the system log on that host (dmesg for the OOM killer) and the rank's own output.",
        locations={str(view.rank): where},
        step=(view.snapshot or {}).get("backward_passes"),
    )


def _reactions(view: RankView, views: dict[int, RankView]) -> str:
    """What the other ranks did once `view`'s rank failed, from their own states: consequences all."""
    stopped, lost, left = [], [], []
    for rank, other in sorted(views.items()):
        if rank == view.rank:
            continue
        if other.signal == "SIGTERM" and other.exit is None:
            stopped.append(rank)
        elif other.exception() is not None:
            lost.append(rank)
        else:
            left.append(rank)
    parts = []
    if lost:
        parts.append(f"{_rank_list(lost)} failed as a consequence, having lost {'its' if len(lost) == 1 else 'their'} "
                     "peer in the middle of a collective")
    if stopped:
        parts.append(f"{_rank_list(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped by the launcher once "
                     f"rank {view.rank} had failed")
    if left:
        parts.append(f"{_rank_list(left)} only stopped because it left")
    return f" The others are consequences: {'; '.join(parts)}." if parts else ""


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


LISTED_RANKS = 8  # beyond this many, ranks in the same position are said once


def _listing(parts: list[tuple[int, str]]) -> str:
    """'; '-joined "rank R ..." texts; in a large job, ranks whose text is the same but for the
    rank are said once ("rank 1 waits in barrier #5 at train.py:9 (likewise ranks 2-1023)"), so a
    message stays readable at a thousand ranks."""
    if len(parts) <= LISTED_RANKS:
        return "; ".join(text for _, text in parts)
    alike: dict[str, list[tuple[int, str]]] = {}
    for rank, text in parts:
        alike.setdefault(text.replace(f"rank {rank}", "rank", 1), []).append((rank, text))
    said = []
    for same in alike.values():
        text, others = same[0][1], [rank for rank, _ in same[1:]]
        said.append(text + (f" (likewise {_rank_ranges(others)})" if others else ""))
    return "; ".join(said)


def _rank_ranges(ranks: list[int]) -> str:
    """'ranks 2-5, 9, 11-1023' for sorted ranks."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _unused_from_ddp_error(view: RankView, exception: dict[str, Any]) -> list[str] | None:
    if not _UNUSED_HINT.search(exception["message"]):
        return None
    order = ((view.snapshot or {}).get("ddp_parameters") or [[]])[0]
    match = _UNUSED_INDICES.search(exception["message"])
    if match is None:
        return []
    indices = [int(i) for i in match.group(1).split()]
    return [order[i] if i < len(order) else f"#{i}" for i in indices]


_FROM_BACKEND = (
    " (Seen by PyTorch's Flight Recorder, which records every operation that reaches a process group, "
    "and numbers them as the group does: a collective gradsync's recorder does not see, such as a "
    "DTensor's, functional or compiled one, is among them.)"
)


def _divergence_finding(divergence: Divergence, views: dict[int, RankView], trigger: str) -> Finding:
    finding = _divergence_finding_of_records(divergence, views, trigger)
    if any(r.get("source") == "flight" for r in divergence.records.values()):
        finding.message += _FROM_BACKEND
    return finding


def _divergence_finding_of_records(divergence: Divergence, views: dict[int, RankView], trigger: str) -> Finding:
    group = "the default group" if divergence.group == "default" else divergence.group
    if divergence.before_window:
        return Finding(
            "desync",
            "error",
            sorted(views),
            f"The ranks' collective sequences on {group} differ at or before collective #{divergence.seq}, "
            "earlier than the recorded window: the ranks paired different collectives with each other.",
            SUGGEST_SAME_COLLECTIVES,
            locations={str(r): v.location or "?" for r, v in views.items()},
        )
    records = divergence.records
    locations = {str(rank): record.get("site") or "?" for rank, record in sorted(records.items())}
    for rank, view in views.items():
        locations.setdefault(str(rank), view.location or _last_site(view) or "?")
    ranks = _odd_ones_out(records)
    sides = _listing([(rank, f"rank {rank}: {describe(record)} at {record.get('site') or '?'}") for rank, record in sorted(records.items())])
    if divergence.surfaced_at is not None:
        later = divergence.surfaced_at
        later_sides = _listing([(rank, f"rank {rank}: {describe(r)} at {r.get('site') or '?'}") for rank, r in sorted(later.records.items())])
        extra = _ranks_alone_at_their_line(records, views)
        return Finding(
            "collective_mismatch",
            "error",
            extra,
            f"From collective #{divergence.seq} on {group} the ranks' collectives paired different lines "
            f"({sides}): the same op and tensors, so the backend matched them, but {_ranks_text(extra).lower()} had "
            f"called an extra collective there, and from then on each one met another's, until #{later.seq} "
            f"no longer matched ({later_sides}).",
            SUGGEST_SAME_COLLECTIVES,
            locations=locations,
            collective="/".join(sorted({r["op"] for r in records.values()})),
        )
    ops = {r["op"] for r in records.values()}
    sites = {r.get("site") for r in records.values()}
    signatures = {(r["op"], r["signature"]) for r in records.values()}
    collective = "/".join(sorted(ops))
    if len(ops) == 1 and len(signatures) == 1:
        # Same op, same tensors, different context: DDP's broadcast during eval on one rank and
        # during training on another. Nothing fails; the ranks are simply no longer in step.
        return Finding(
            "desync",
            "error",
            ranks,
            f"Collective #{divergence.seq} on {group} paired different things across ranks ({sides}). "
            "The backend cannot tell, so nothing failed, but from here on the ranks exchange data out of "
            "step (e.g. rank 0's evaluation-time buffer broadcast was matched with a training one).",
            "Evaluate through the underlying module (ddp.module) when only some ranks evaluate, or "
            "run the DDP wrapper's forward on every rank. " + SUGGEST_SAME_COLLECTIVES,
            locations=locations,
            collective=collective,
        )
    if len(ops) == 1 and len(sites) == 1:
        return Finding(
            "shape_mismatch",
            "error",
            sorted(records),
            f"Collective #{divergence.seq} on {group} is the same {collective} on every rank but with "
            f"different tensors ({sides}).",
            "Make the tensor shape and dtype identical on every rank (pad to a common size, or use "
            "all_gather_object / pass the sizes first for variable-size data).",
            locations=locations,
            collective=collective,
        )
    verb = "hung" if trigger == "stall" else "failed"
    return Finding(
        "collective_mismatch",
        "error",
        ranks,
        f"The job {verb} because the ranks' collectives stopped matching at collective #{divergence.seq} "
        f"on {group}: {sides}.",
        SUGGEST_SAME_COLLECTIVES,
        locations=locations,
        collective=collective,
    )


def _position_finding(views: dict[int, RankView], now: float, trigger: str) -> Finding | None:
    waiting = {r: v for r, v in views.items() if v.waiting_on() is not None and not v.finished}
    finished = {r: v for r, v in views.items() if v.finished or (v.exit and v.exit.get("status") == "finished")}
    # Running: alive, or stopped by the launcher once a peer failed waiting for it (where it was
    # then, by its last snapshot, is the answer).
    running = {
        r: v for r, v in views.items()
        if (v.alive or (v.signal == "SIGTERM" and v.exit is None)) and r not in waiting and r not in finished
    }
    locations = {str(r): _where(v) for r, v in sorted(views.items())}
    waits = _listing([(r, f"rank {r} waits in {describe(v.waiting_on())} at {v.waiting_on().get('site') or '?'}") for r, v in sorted(waiting.items())])
    if finished and (waiting or trigger == "failure"):
        counts = ", ".join(f"rank {r}: {(v.snapshot or {}).get('collectives', '?')}" for r, v in sorted(views.items()))
        return Finding(
            "rank_exited",
            "error",
            sorted(finished),
            f"{_ranks_text(finished)} finished the script while the other ranks still expected "
            f"{'it' if len(finished) == 1 else 'them'} in collectives ({waits or 'they lost their peer'}). "
            f"Collectives issued per rank: {counts}. A rank left the training loop early: fewer batches, a "
            "rank-local early stop or a skipped step.",
            SUGGEST_SAME_COLLECTIVES,
            locations=locations,
        )
    unrecorded = {r: wait for r, v in running.items() if (wait := unrecorded_wait(v)) is not None}
    if unrecorded and waiting:
        inside = _listing([(r, f"rank {r} waits in {wait} at {running[r].location or '?'}") for r, wait in sorted(unrecorded.items())])
        return Finding(
            "collective_mismatch",
            "error",
            sorted({*unrecorded, *waiting}),
            f"The ranks wait in different collectives: {inside} (one gradsync does not record: DTensor, "
            f"functional or compiled collectives); {waits}. Neither can finish without the other.",
            "Make every rank of the group reach the same collectives: a DTensor's full_tensor() or "
            "redistribute() is a collective too, so it cannot sit in a rank-dependent branch "
            "(gather on every rank, then let rank 0 save). " + SUGGEST_SAME_COLLECTIVES,
            locations=locations,
        )
    if running and waiting:
        stuck = _listing([(r, f"rank {r} at {v.location or '?'}") for r, v in sorted(running.items())])
        return Finding(
            "rank_stuck",
            "error",
            sorted(running),
            f"{_ranks_text(running)} stayed outside any collective ({stuck}) while the others "
            f"waited for it ({waits}).",
            "Look at what that rank runs at that line (its full stack is in diagnosis.json): a "
            "blocking call only it makes (sleep, input, a lock, a file or network read, a data "
            "loader worker that died).",
            locations=locations,
            details={"stacks": {str(r): (v.snapshot or {}).get("stack", [])[-12:] for r, v in sorted(running.items())}},
        )
    elsewhere = _waiting_for_ranks_elsewhere(waiting, views)
    if elsewhere:
        blocked = sorted({r for pair in elsewhere for r in pair})
        lines = _listing([
            (r, f"rank {r} waits in {describe(views[r].waiting_on())} at {views[r].waiting_on().get('site') or '?'} for rank {peer}, "
                f"{'which waits in ' + describe(views[peer].waiting_on()) if views[peer].waiting_on() else 'which is at ' + (views[peer].location or '?')}")
            for r, peer in sorted(elsewhere)
        ])
        return Finding(
            "collective_mismatch",
            "error",
            sorted({peer for _, peer in elsewhere}),
            f"The ranks wait for each other in different places, so none can go on ({lines}). A rank skipped "
            "a send or a collective its peers make, or runs one on a group (or with a peer) the others do not.",
            SUGGEST_SAME_COLLECTIVES,
            locations={str(r): _where(views[r]) for r in blocked} | locations,
        )
    if waiting:
        return Finding(
            "hang",
            "error",
            sorted(waiting),
            f"Every rank waits in a collective and none progresses ({waits}); their recorded sequences "
            "agree, so the backend or the network is not delivering (a peer on another host, a firewall, "
            "a wrong network interface).",
            "Run `gradsync doctor` on the same hosts; check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME.",
            locations=locations,
        )
    return None


def _waiting_for_ranks_elsewhere(waiting: dict[int, RankView], views: dict[int, RankView]) -> list[tuple[int, int]]:
    """(rank, peer) for each waiting rank and a peer it needs that is not in the same place: for a
    point-to-point message, a peer not waiting in the matching one; for a collective, a member of
    its group that has not reached it. Positions, not time: who waits for whom."""
    pairs = []
    # Per group (as the waiting rank knows its members, counted as its record counts): the peers
    # that can hold it up, furthest behind first, so the ones behind a collective are a prefix.
    holding: dict[tuple, tuple[list[int], list[tuple[int, int, int]]]] = {}
    for rank, view in sorted(waiting.items()):
        record = view.waiting_on()
        if record["op"] in POINT_TO_POINT:
            match = _P2P_PEER.search(record.get("signature") or "")
            peer = int(match.group(2)) if match else None
            if peer is None or peer not in views:
                continue
            other = views[peer].waiting_on()
            wanted = _P2P_MATCH.get(match.group(1))
            expected = f"{'dst' if match.group(1) == 'src' else 'src'}={rank}"
            if not (other and other["op"] in POINT_TO_POINT and other["op"] in wanted and (other.get("signature") or "").endswith(expected)):
                pairs.append((rank, peer))
            continue
        if record.get("seq") is None:
            continue
        group = record["group"]
        members = _members(view, group, views)
        key = (group, record.get("source") == "flight", tuple(members))
        if key not in holding:
            candidates = []
            for position, peer in enumerate(members):
                other = views.get(peer)
                if other is None or other.finished or not (peer in waiting or other.exit is not None):
                    continue
                reached = _reached(other, group, record)
                if reached is not None:
                    candidates.append((reached, position, peer))
            candidates.sort()
            holding[key] = ([reached for reached, _, _ in candidates], candidates)
        levels, candidates = holding[key]
        behind = candidates[: bisect.bisect_left(levels, record["seq"])]
        pairs += [(rank, peer) for _, _, peer in sorted(behind, key=lambda c: c[1]) if peer != rank]
    return pairs


_P2P_PEER = re.compile(r" (src|dst)=(\d+)$")
# What the peer must be blocked in, by what this rank waits in: a receive needs a send, and back.
_P2P_MATCH = {"src": ("send", "isend", "batch_isend_irecv"), "dst": ("recv", "irecv", "batch_isend_irecv")}


_NEVER_HEARD_OF = "never heard of (the store the nodes share did not answer)"


def _unreachable_finding(unreachable: list[RankView], views: dict[int, RankView], now: float) -> Finding:
    lost = sorted(unreachable, key=lambda v: v.rank)
    hosts = sorted({(v.snapshot or {}).get("host") for v in lost} - {None})
    described = _listing([
        (v.rank, f"rank {v.rank}" + (f" (host {v.snapshot['host']})" if (v.snapshot or {}).get("host") else "")
         + (f", last heard of {now - v.snapshot['time']:.0f} s before this diagnosis at {_last_position(v)}" if v.snapshot
            else f", {_NEVER_HEARD_OF}"))
        for v in lost
    ])
    here = [v for v in views.values() if not v.unreachable]
    waits = _listing([(v.rank, f"rank {v.rank} {_rank_line(v, now, None, [])}") for v in sorted(here, key=lambda v: v.rank)])
    node = "its node" if len(lost) == 1 else "their nodes"
    where = f"host {', '.join(hosts)}" if hosts else node
    return Finding(
        "rank_unreachable",
        "error",
        [v.rank for v in lost],
        f"{described[0].upper()}{described[1:]}: "
        + (f"{node} stopped reporting and never said how its ranks ended" if all(v.snapshot for v in lost) else f"{node} cannot be reached")
        + f", so {where} or the network to it went away (a dead host, a cut link, a hung node)."
        + (f" The others only waited or failed for want of it: {waits}." if here else ""),
        f"Check that {where} is up and reachable from the others (`gradsync doctor` on every host checks the "
        "network). With --max-restarts and c10d rendezvous (--rdzv-backend c10d) the job waits for it and resumes "
        "from the last checkpoint once it is back.",
        locations={str(v.rank): _last_position(v) for v in lost if v.snapshot},
    )


def _teardown_finding(teardown: list[RankView], views: dict[int, RankView]) -> Finding:
    # torchrun's agent stops the remaining workers with SIGTERM once one has failed: those are
    # not crashes of their own.
    teardown = [v for v in teardown if v.signal != "SIGTERM"] or teardown
    names = ", ".join(f"rank {v.rank} ({v.signal or f'exit code {v.exitcode}'})" for v in teardown)
    return Finding(
        "teardown_failure",
        "warning",
        sorted(v.rank for v in teardown),
        f"Every rank finished its script; afterwards {names} crashed while shutting down (process-group "
        "teardown at interpreter exit). Training results are complete.",
        "Call dist.destroy_process_group() at the end of the script on every rank; a crash there is a "
        "known Gloo teardown race and does not affect what the script produced.",
        locations={str(v.rank): v.location or "?" for v in teardown},
    )


def _nonfinite_finding(nonfinite: dict[int, dict[str, Any]], world_size: int) -> Finding:
    """Where NaN/inf first appeared: the earliest pass's ranks, in their gradients or their loss."""
    first_step = min(info["step"] for info in nonfinite.values())
    origin = {r: info for r, info in nonfinite.items() if info["step"] == first_step}
    names = sorted({name for info in origin.values() for name in info["parameters"]})
    locations = {str(r): info.get("site") or "?" for r, info in origin.items()}
    suggestion = (
        "Check that rank's data and loss at that step (a bad sample, log of zero, a too-large "
        "learning rate); skip non-finite steps on all ranks together (gradsync's Trainer does), "
        "or use a GradScaler for fp16."
    )
    source = "gradients" if any(info.get("source", "gradients") == "gradients" for info in origin.values()) else "loss"
    if source == "gradients":
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        message = (
            f"{_ranks_text(origin)} produced non-finite (NaN/inf) gradients first, at backward pass "
            f"{first_step}, before averaging spread them to every rank; parameters: {shown or '?'}."
        )
    elif len(origin) < world_size:
        message = (
            f"{_ranks_text(origin)} backpropagated a non-finite (NaN/inf) loss first, at backward pass "
            f"{first_step}; DDP's averaging then spread it to every rank's gradients."
        )
    else:
        # Every loss went bad at once: the parameters already were, so the cause lies in the pass
        # before (a gradient that alone went bad), which the per-pass check cannot see.
        message = (
            f"Every rank's loss became non-finite (NaN/inf) at backward pass {first_step}: the parameters "
            "were already non-finite, so a gradient went bad in the pass before (while the losses were "
            "still finite), or every rank's data is bad."
        )
        suggestion = (
            "Rerun with `gradsync run --record-buckets` to check every rank's gradients before averaging: "
            "it names the rank and the parameters where NaN/inf started. " + suggestion
        )
    return Finding(
        "nonfinite_gradients",
        "warning",
        sorted(origin),
        message,
        suggestion,
        locations=locations,
        step=first_step,
        details={"parameters": names, "source": source},
    )


def _health_findings(views: dict[int, RankView]) -> list[Finding]:
    findings = []
    nonfinite = {r: v.snapshot["first_nonfinite"] for r, v in views.items() if (v.snapshot or {}).get("first_nonfinite")}
    if nonfinite:
        findings.append(_nonfinite_finding(nonfinite, len(views)))
    unused = {r: v.snapshot["unused_parameters"] for r, v in views.items() if (v.snapshot or {}).get("unused_parameters")}
    if unused:
        names = list(dict.fromkeys(n for ns in unused.values() for n in ns))
        findings.append(
            Finding(
                "unused_parameters",
                "warning",
                sorted(unused),
                f"These parameters never got a gradient: {', '.join(names)}. With "
                "find_unused_parameters=True DDP still reduces them (zeros) and walks the graph every step.",
                "Remove or freeze (requires_grad=False) parameters the forward never uses; then "
                "find_unused_parameters can be turned off, which gives back overlap.",
                details={"parameters": names},
            )
        )
    return findings


def _unexplained_failure(views: dict[int, RankView], trigger: str) -> Finding:
    failed = sorted(r for r, v in views.items() if v.exitcode not in (None, 0)) or sorted(views)
    return Finding(
        "rank_crashed",
        "error",
        failed,
        "The job " + ("stopped making progress" if trigger == "stall" else "failed") + " and the records do "
        "not show why: " + "; ".join(f"rank {r} {_rank_line(views[r], 0, None, [])}" for r in failed) + ".",
        "Read the ranks' own output above; rerun with a shorter --stall-timeout to catch the moment.",
        locations={str(r): _where(views[r]) for r in failed},
    )


def _rank_line(
    view: RankView, now: float, divergence: Divergence | None, crashes: list[RankView], failed: list[RankView] = ()
) -> str:
    if view.injected is not None:
        return f"{_fault_outcome(view.injected)}, injected by --inject-fault {view.injected['spec']}"
    if view.unreachable:
        if view.snapshot is None:
            return f"unreachable: {_NEVER_HEARD_OF}"
        return f"unreachable: not heard of for {now - view.snapshot['time']:.0f} s; last seen at {_last_position(view)}"
    exception = view.exception()
    if exception is not None:
        where = exception["location"] or view.location or "?"
        if view in crashes:
            alone = view is min(crashes, key=_failure_time) and not any(
                _failure_signature(other) == _failure_signature(view) for other in crashes if other is not view
            )
            return f"failed{' first' if alone else ''}: {exception['type']}: {_first_line(exception['message'])[:160]} (at {where})"
        symptom = _CONSEQUENCE.search(exception["message"]) or _MISMATCH_SYMPTOM.search(exception["message"])
        failed_in = next((r for r in reversed(view.records) if r["state"] == "failed"), None)
        inside = f" in {describe(failed_in)}" if failed_in else ""
        said = f'"{symptom.group(0)}"' if symptom else f"{exception['type']}"
        return f"failed as a consequence ({said}){inside}" + (f" at {where}" if where != "?" else "")
    if view.finished:
        tail = f"; crashed afterwards ({view.signal or view.exitcode})" if view.exitcode not in (None, 0) else ""
        collectives = (view.snapshot or {}).get("collectives", "?")
        stopped = view.exit.get("stopped_after_steps")
        if stopped:
            return f"stopped after optimizer step {stopped} (--doctor-steps) and {collectives} collectives{tail}"
        return f"finished its script after {collectives} collectives{tail}"
    waiting = view.waiting_on()
    if view.signal == "SIGTERM" and crashes and view not in crashes and view.exit is None:
        # torchrun's agent stops the other workers once one has failed; which came first, its
        # SIGTERM or the backend's "connection closed", is a race, so where it was is said either way.
        position = f"waiting in {describe(waiting)} at {waiting.get('site') or '?'}" if waiting is not None else _last_position(view)
        where = "" if position == "?" else f"; it was {'' if waiting is not None else 'at '}{position}"
        return f"stopped by the launcher (SIGTERM) once rank {min(crashes, key=_failure_time).rank} had failed{where}"
    if view.signal and not view.stopped_by_gradsync and view.exit is None:
        if view.signal == "SIGTERM" and failed:
            return f"stopped by the launcher (SIGTERM) once rank {min(failed, key=_failure_time).rank} had failed; it was at {_last_position(view)}"
        return f"killed by {view.signal}; last seen at {_last_position(view)}"
    if waiting is not None:
        since = f" for {now - waiting['entered']:.0f} s" if now else ""
        return f"waiting in {describe(waiting)} at {waiting.get('site') or '?'}{since}"
    if view.snapshot is None:
        return "never reported (it died before the recorder started, or runs on another host)"
    wait = unrecorded_wait(view)
    if wait is not None:
        return f"waiting in {wait} at {view.location or '?'}"
    return f"running outside collectives at {view.location or '?'}"


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


def _where(view: RankView) -> str:
    waiting = view.waiting_on()
    return (waiting or {}).get("site") or view.location or _last_site(view) or "?"


def _last_position(view: RankView) -> str:
    """Where a rank that left no exit record (killed) was last seen: inside its last collective if
    it never left it, else the newer of its last snapshot's line and its last collective's site."""
    last = view.records[-1] if view.records else None
    if last is None or not last.get("site"):
        return view.location or "?"
    if last["state"] == "entered" or view.location is None:
        return last["site"]
    snapshot_time = (view.snapshot or {}).get("time", 0.0)
    return view.location if snapshot_time >= (last.get("finished") or last["entered"]) else last["site"]


def _last_site(view: RankView) -> str | None:
    for record in reversed(view.records):
        if record.get("site"):
            return record["site"]
    return None


def _ranks_text(ranks: dict[int, Any] | list[int]) -> str:
    ranks = sorted(ranks)
    return ("Rank " if len(ranks) == 1 else "Ranks ") + ", ".join(str(r) for r in ranks)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""


# -- the job: attempts, injected faults, a stop from outside ------------------------------------


def earlier_attempts_finding(failed: dict[int, dict[str, Any]], final_status: str, last: int) -> Finding:
    """What the attempts before the last (`last`) went through: a job that recovered still lost
    work."""
    told = []
    for attempt, diagnosis in sorted(failed.items()):
        errors = [f for f in diagnosis["findings"] if f["severity"] == "error"]
        cause = f"{errors[0]['category']}: {_first_sentence(errors[0]['message'])}" if errors else "no cause recorded"
        told.append(f"attempt {attempt} failed ({cause})")
    ending = f"attempt {last} finished" if final_status == "ok" else f"attempt {last} failed too"
    return Finding(
        "restarted",
        "warning",
        sorted({r for d in failed.values() for f in d["findings"] if f["severity"] == "error" for r in f["ranks"]}),
        f"The workers were restarted {'once' if len(failed) == 1 else f'{len(failed)} times'}: {'; '.join(told)}; {ending}.",
        "Each attempt's diagnosis is in RUN_DIR/workers/attemptN/diagnosis.json. A restart costs the steps "
        "since the last checkpoint: fix what failed, unless it was injected with --inject-fault.",
        details={"failed_attempts": sorted(failed)},
    )


def regrouped_finding(regrouped: dict[int, int]) -> Finding:
    """The attempts torchrun's agent stopped to take in a node that joined (`regrouped`: attempt
    -> its world size): no failure, but the job's world size changed."""
    told = ", ".join(f"attempt {a} ({size} rank{'s' if size != 1 else ''})" if size else f"attempt {a}"
                     for a, size in sorted(regrouped.items()))
    return Finding(
        "regrouped",
        "warning",
        [],
        f"The workers were restarted {'once' if len(regrouped) == 1 else f'{len(regrouped)} times'} to take in a node "
        f"that joined the job, not for a failure: {told} stopped for it.",
        "Nothing to fix in an elastic job (--nnodes MIN:MAX). Its world size changed, so its result is not bitwise "
        "equal to a run on one world size; gradsync's trainer resumes each new group from the last checkpoint with "
        "every sample of the epoch seen once.",
        details={"regrouped_attempts": sorted(regrouped)},
    )


def unfired_fault_findings(specs: Iterable[FaultSpec], fired: dict[int, dict[int, dict[str, Any]]], last_attempt: int) -> list[Finding]:
    """Faults asked for that never fired (`fired`: attempt -> rank -> record), so were not rehearsed."""
    findings = []
    for spec in specs:
        if any(record["spec"] == str(spec) for record in fired.get(spec.attempt, {}).values()):
            continue
        if spec.attempt > last_attempt:
            why = f"attempt {spec.attempt} never ran (the job ended with attempt {last_attempt})"
        else:
            place = "the checkpoint of step" if spec.at == "checkpoint" else "step"
            why = f"rank {spec.rank} never reached {place} {spec.step} in attempt {spec.attempt}"
        findings.append(
            Finding(
                "fault_not_fired",
                "warning",
                [spec.rank],
                f"--inject-fault {spec} did not fire: {why}, so this run did not rehearse that failure.",
                "Choose a step the job reaches (without gradsync's Trainer a step is a backward pass whose "
                "gradients DDP synchronises; at=checkpoint needs gradsync's checkpoints) and an attempt "
                "within --max-restarts.",
                details={"injected": str(spec)},
            )
        )
    return findings


def stopped_by_signal(diagnosis: dict[str, Any], signal_name: str, grace_s: float) -> dict[str, Any]:
    """The diagnosis of a job stopped from outside (a scheduler's SIGTERM, Ctrl-C): not a failure of its own.

    Each rank's ending is a reaction to the stop, so only the warnings about its health are kept.
    """
    ranks = sorted(int(r) for r in diagnosis.get("ranks", {}))
    stop = Finding(
        "stopped_by_signal",
        "warning",
        ranks,
        f"gradsync run got {signal_name}: torchrun's agent passed it to the workers and gave them {grace_s:g} s "
        "to save and exit before SIGKILL. The job did not finish.",
        "Resume from the last checkpoint. If the workers need longer to save, raise --shutdown-timeout "
        "(or TORCH_ELASTIC_SHUTDOWN_TIMEOUT).",
        details={"signal": signal_name, "grace_s": grace_s},
    )
    warnings = [f for f in diagnosis["findings"] if f["severity"] == "warning"]
    *earlier, last = diagnosis["attempts"]
    attempts = [*earlier, {**last, "status": "stopped"}]
    return {**diagnosis, "status": "stopped", "trigger": "signal", "findings": [stop.as_dict(), *warnings], "attempts": attempts}


def _first_sentence(message: str) -> str:
    return _first_line(message).split(". ")[0].rstrip(".")


# -- stragglers ----------------------------------------------------------------------------------


class StragglerTracker:
    """How late each rank arrives at collectives, from the enter times in successive snapshots.

    The rank everyone waits for arrives last; a rank that is typically late by a good share of
    the step is a straggler (slow data loading, a throttled GPU, a noisy neighbour).
    """

    def __init__(self, ratio: float, min_s: float, max_samples: int = 4000):
        self.ratio = ratio
        self.min_s = min_s
        self.max_samples = max_samples
        self.entered: dict[tuple[str, int], dict[int, float]] = {}
        self.lateness: dict[int, list[float]] = {}
        self.starts: list[float] = []
        self.done: dict[str, int] = {}  # per group, the collectives measured so far (bounded memory)

    def observe(self, snapshots: dict[int, dict[str, Any]]) -> None:
        """Every process group counts: a rank late to its subgroup's collectives (a pipeline stage,
        a tensor-parallel group) is as much a straggler as one late on the default group."""
        members: dict[str, set[int]] = {}
        for rank, snapshot in snapshots.items():
            for group, state in snapshot.get("groups", {}).items():
                members[group] = set(state.get("ranks") or snapshots) & set(snapshots)
            for record in snapshot.get("records", []):
                if record["seq"] is None or record["seq"] <= self.done.get(record["group"], -1):
                    continue
                self.entered.setdefault((record["group"], record["seq"]), {})[rank] = record["entered"]
                members.setdefault(record["group"], set(snapshots))  # a snapshot without its groups: every rank
        for key in [k for k in self.entered if len(members.get(k[0], ())) < 2]:
            del self.entered[key]  # a group with one rank in view has no one to be late for
        complete = [key for key, times in self.entered.items() if set(times) >= members[key[0]]]
        for key in sorted(complete, key=lambda k: min(self.entered[k].values())):
            times = self.entered.pop(key)
            first = min(times.values())
            self.starts.append(first)
            for rank, entered in times.items():
                self.lateness.setdefault(rank, []).append(entered - first)
            self.done[key[0]] = max(self.done.get(key[0], -1), key[1])
        for key in [k for k in self.entered if k[1] <= self.done.get(k[0], -1)]:
            del self.entered[key]  # passed by: a rank's record of it left its window unseen
        for samples in self.lateness.values():
            del samples[: max(0, len(samples) - self.max_samples)]
        del self.starts[: max(0, len(self.starts) - self.max_samples)]

    def findings(self) -> list[Finding]:
        return straggler_findings(self.starts, self.lateness, self.ratio, self.min_s)


# Fewer measured collectives than this say nothing about a rank's typical lateness.
STRAGGLER_MIN_COLLECTIVES = 10


def straggler_findings(starts: list[float], lateness: dict[int, list[float]], ratio: float, min_s: float) -> list[Finding]:
    """The straggler finding, from what StragglerTracker measured: when each collective began
    (its first rank entered), in order, and how late each rank entered each one.

    A rank is a straggler when its typical (median) lateness exceeds `ratio` of the typical
    interval between collectives and `min_s`. When every rank is that late, the first to arrive
    changes from one collective to the next: no rank is the one the others wait for.
    """
    if len(starts) < STRAGGLER_MIN_COLLECTIVES:
        return []
    gaps = [b - a for a, b in zip(starts, starts[1:]) if b > a]
    typical_gap = statistics.median(gaps) if gaps else 0.0
    typical = {rank: statistics.median(samples) for rank, samples in lateness.items() if samples}
    limit = max(min_s, ratio * typical_gap)
    slow = sorted(rank for rank, late in typical.items() if late > limit)
    if not slow or len(slow) == len(typical):
        return []
    text = ", ".join(f"rank {r} by {typical[r] * 1000:.0f} ms" for r in slow)
    return [
        Finding(
            "straggler",
            "warning",
            slow,
            f"The other ranks typically wait for {text} at each collective (the typical interval "
            f"between collectives is {typical_gap * 1000:.0f} ms, measured over {len(starts)} collectives).",
            "Look at what only that rank does (extra logging or evaluation, slower data loading, a "
            "shared or throttled device); the whole job runs at the slowest rank's pace.",
            details={"typical_lateness_s": {str(r): round(typical[r], 4) for r in typical}},
        )
    ]
