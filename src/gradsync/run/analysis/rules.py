"""The diagnosis of one attempt: the ordered questions, read top to bottom.

The order matters: a rank that crashed by itself is the cause and the "Connection closed by
peer" of the others its consequence; without a crash, the first collective where the ranks'
sequences differ explains hangs and mismatch errors; without either, the ranks' positions (one
finished, one stuck outside any collective) do. Each answer comes from the module that owns
that question.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from gradsync.run.analysis.alignment import (
    Divergence,
    divergence_finding,
    find_backend_divergence,
    find_divergence,
    find_mismatch_in_flight,
)
from gradsync.run.analysis.crashes import crashed_ranks, fired_fault, first_crash_finding, injected_finding, teardown_finding
from gradsync.run.analysis.exits import late_collective_finding, late_collectives
from gradsync.run.analysis.health import health_findings
from gradsync.run.analysis.meshes import blame_differing_meshes
from gradsync.run.analysis.pipelines import pipeline_finding
from gradsync.run.analysis.positions import position_finding, unreachable_finding
from gradsync.run.analysis.rank_lines import rank_lines, unexplained_failure
from gradsync.run.analysis.views import RankView
from gradsync.rundir.records import Finding


def diagnose(
    views: dict[int, RankView],
    *,
    trigger: str,
    now: float,
    world_size: int | None = None,
    stragglers: list[Finding] | None = None,
    script_check: list[Finding] | None = None,
    explained: Collection[str] = (),
) -> dict[str, Any]:
    """The diagnosis of one attempt of a job; `trigger` is 'stall', 'failure' or 'exit'.

    `script_check`: what --doctor-steps found by comparing the ranks' facts; `explained`: the
    categories those findings explain, left out of what the run itself found (an optimizer step
    skipped on some ranks is why --doctor-steps stopped them at different collectives).
    """
    # Where the sequences differ, from the recorded calls; for a job that failed or hung, else from
    # what reached the process groups (one that ended is judged from the recorded calls alone: a
    # false alarm there would fail a healthy job).
    divergence = find_divergence(views)
    if divergence is None and trigger != "exit":
        divergence = find_backend_divergence(views)
    # Else, where a rank's backend said, as it died, that the two sides of a collective disagree:
    # its last collective, paired with what its peers were in.
    if divergence is None:
        divergence = find_mismatch_in_flight(views)
    injected = fired_fault(views, trigger)
    # After the divergence: an error from a collective that mismatched is not a crash of its own.
    crashes = crashed_ranks(views, divergence, injected)
    teardown = [v for v in views.values() if v.finished and v.exitcode not in (None, 0)]

    cause = _cause(views, trigger, now, divergence, injected, crashes)
    findings = [] if cause is None else [cause]
    # A crash while shutting down once every rank finished: a warning, unless a rank crashed for real.
    if teardown and not crashes:
        findings.append(teardown_finding(teardown, views))
    # Collectives that failed because a peer had finished without them, on ranks that went on:
    # the exit code says nothing of them.
    late = late_collectives(views)
    if late:
        findings.append(late_collective_finding(late, views))
    # Warnings about the training, and what the caller measured, whatever the cause.
    findings += health_findings(views)
    findings = [finding for finding in findings if finding.category not in explained]
    findings += script_check or []
    findings += stragglers or []
    # Over whatever error was found, from any question: ranks that built different meshes caused it.
    blame_differing_meshes(findings, views)
    # A job that failed with no error found still gets one, first: what each rank did.
    failed_job = trigger == "stall" or any(
        v.exitcode not in (None, 0) and v not in teardown and not v.stopped_by_gradsync for v in views.values()
    )
    if failed_job and not any(f.severity == "error" for f in findings):
        findings.insert(0, unexplained_failure(views, trigger))
    status = "failed" if any(f.severity == "error" for f in findings) else "ok"
    diagnosis = {
        "status": status,
        "trigger": trigger,
        "world_size": world_size or len(views),
        "findings": [f.as_dict() for f in findings],
        "ranks": rank_lines(views, now, divergence, crashes),
    }
    # Every thread's stack where the ranks last had them (an exit record, a quiet rank's
    # snapshot): what `gradsync stacks` would have shown at the end (gradsync.run.stacks).
    stacks = {str(rank): v.snapshot["threads"] for rank, v in sorted(views.items()) if (v.snapshot or {}).get("threads")}
    if stacks:
        diagnosis["stacks"] = stacks
    return diagnosis


def _cause(
    views: dict[int, RankView],
    trigger: str,
    now: float,
    divergence: Divergence | None,
    injected: RankView | None,
    crashes: list[RankView],
) -> Finding | None:
    """The error that explains the attempt: the answer to the first of these questions that has one."""
    # An injected fault is the known cause, whatever its peers went through.
    if injected:
        return injected_finding(injected, views)
    # A pipeline's stages pair their sends and receives by order, so one that waits for good (or
    # whose backend aborted on the sizes) is explained by what its stage and its peer disagree on:
    # schedule, micro-batch count, the message's shape, and without a crash the steps run.
    if trigger != "exit" and (pipeline := pipeline_finding(views, crashes)) is not None:
        return pipeline
    # A rank that failed by itself: the others' "Connection closed by peer" are its consequences.
    if crashes:
        return first_crash_finding(crashes, views)
    # Before comparing sequences or positions: an unreachable rank's records stop where it was last
    # heard of, and read as current they would pair up wrongly with its peers'.
    unreachable = [v for v in views.values() if v.unreachable]
    if unreachable:
        return unreachable_finding(unreachable, views, now)
    # Without a crash, where the sequences differ explains hangs and mismatch errors (in a job that
    # ended, only once every rank finished).
    everyone_finished = all(v.finished for v in views.values())
    if divergence is not None and (trigger != "exit" or everyone_finished):
        return divergence_finding(divergence, views, trigger)
    # Without either, the ranks' positions do: one finished, one stuck outside any collective, one
    # whose script ended but whose threads keep its process from exiting.
    held = any(v.alive and v.held_at_exit is not None for v in views.values())
    if trigger in ("stall", "failure") and (not everyone_finished or held):
        return position_finding(views, now, trigger)
    return None
