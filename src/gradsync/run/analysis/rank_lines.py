"""The one line per rank that ends every diagnosis ("failed as a consequence ...", "waiting in
barrier #5 at train.py:9 for 31 s"), and the finding made of those lines when no rule explains a
failure.
"""

from __future__ import annotations

from gradsync.run.analysis.alignment import Divergence
from gradsync.run.analysis.crashes import CONSEQUENCE, MISMATCH_SYMPTOM, failure_signature, failure_time, fault_outcome
from gradsync.run.analysis.views import RankView, last_position, read_from_outside_text, unrecorded_wait, where_is
from gradsync.run.analysis.working import holding_text, is_working, working_location
from gradsync.run.analysis.wording import NEVER_HEARD_OF, describe, first_line
from gradsync.rundir.records import Finding


def rank_lines(views: dict[int, RankView], now: float, divergence: Divergence | None, crashes: list[RankView]) -> dict[str, str]:
    """Every rank's line, by rank."""
    # Ranks that ended by themselves before the launcher stopped the rest.
    failed = [v for v in views.values() if v.exit is not None and not v.finished]
    return {str(rank): rank_line(view, now, divergence, crashes, failed) for rank, view in sorted(views.items())}


def rank_line(
    view: RankView, now: float, divergence: Divergence | None, crashes: list[RankView], failed: list[RankView] = ()
) -> str:
    if view.injected is not None:
        return f"{fault_outcome(view.injected)}, injected by --inject-fault {view.injected['spec']}"
    if view.unreachable:
        if view.snapshot is None:
            return f"unreachable: {NEVER_HEARD_OF}"
        return f"unreachable: not heard of for {now - view.snapshot['time']:.0f} s; last seen at {last_position(view)}"
    exception = view.exception()
    if exception is not None:
        where = exception["location"] or view.location or "?"
        if view in crashes:
            alone = view is min(crashes, key=failure_time) and not any(
                failure_signature(other) == failure_signature(view) for other in crashes if other is not view
            )
            return f"failed{' first' if alone else ''}: {exception['type']}: {first_line(exception['message'])[:160]} (at {where})"
        symptom = CONSEQUENCE.search(exception["message"]) or MISMATCH_SYMPTOM.search(exception["message"])
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
        if view.alive and view.held_at_exit is not None:
            return f"finished its script after {collectives} collectives, but {holding_text(view)}{tail}"
        return f"finished its script after {collectives} collectives{tail}"
    waiting = view.waiting_on()
    if view.signal == "SIGTERM" and crashes and view not in crashes and view.exit is None:
        # torchrun's agent stops the other workers once one has failed; which came first, its
        # SIGTERM or the backend's "connection closed", is a race, so where it was is said either way.
        position = f"waiting in {describe(waiting)} at {waiting.get('site') or '?'}" if waiting is not None else last_position(view)
        where = "" if position == "?" else f"; it was {'' if waiting is not None else 'at '}{position}"
        return f"stopped by the launcher (SIGTERM) once rank {min(crashes, key=failure_time).rank} had failed{where}"
    if view.signal and not view.stopped_by_gradsync and view.exit is None:
        if view.signal == "SIGTERM" and failed:
            return f"stopped by the launcher (SIGTERM) once rank {min(failed, key=failure_time).rank} had failed; it was at {last_position(view)}"
        return f"killed by {view.signal}{_words(view)}; last seen at {last_position(view)}"
    if waiting is not None:
        since = f" for {now - waiting['entered']:.0f} s" if now else ""
        return f"waiting in {describe(waiting)} at {waiting.get('site') or '?'}{since}"
    if view.snapshot is None:
        return "never reported (it died before the recorder started, or runs on another host)"
    wait = unrecorded_wait(view)
    if wait is not None:
        return f"waiting in {wait} at {view.location or '?'}"
    if is_working(view):  # its own looks found its process tree using CPU, or its position moving
        return f"working outside collectives at {working_location(view) or '?'}{report_age(view, now)}"
    outside = read_from_outside_text(view)
    return f"running outside collectives at {view.location or '?'}{outside or report_age(view, now)}"


STALE_REPORT_S = 2.0  # a rank reports about once a second: a position older than this says its age


def report_age(view: RankView, now: float) -> str:
    """' (as its report of 12 s before said)' for a position older than a report or two: where the
    rank was then, not necessarily where it is."""
    seen = (view.snapshot or {}).get("time")
    if not now or not isinstance(seen, (int, float)) or now - seen < STALE_REPORT_S:
        return ""
    return f" (as its report of {now - seen:.0f} s before said)"


def unexplained_failure(views: dict[int, RankView], trigger: str) -> Finding:
    failed = sorted(r for r, v in views.items() if v.exitcode not in (None, 0)) or sorted(views)
    return Finding(
        "rank_crashed",
        "error",
        failed,
        "The job " + ("stopped making progress" if trigger == "stall" else "failed") + " and the records do "
        "not show why: " + "; ".join(f"rank {r} {rank_line(views[r], 0, None, [])}" for r in failed) + ".",
        "Read the ranks' own output above; rerun with a shorter --stall-timeout to catch the moment.",
        locations={str(r): where_is(views[r]) for r in failed},
    )


def _words(view: RankView) -> str:
    """' (its last words: "...")' for a rank whose last words told what it died of."""
    quote = view.last_words.quote() if view.last_words is not None else ""
    return f' (its last words: "{quote if len(quote) <= 160 else quote[:157] + "..."}")' if quote else ""
