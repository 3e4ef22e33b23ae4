"""A rank that keeps working while the others wait for it, in words: where it works, for how
long, and whether its Python position stayed (one native call, a one-line loop) or moved (a loop
that never reaches the collective). Read from the activity the rank's own looks published
(gradsync.run.worker, gradsync.run.activity); used by the live note the monitor prints when the
busy clock passes the stall timeout, and by the `rank_stuck` finding when it stops the job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from gradsync.run.analysis.views import RankView
from gradsync.run.analysis.wording import describe, listing
from gradsync.run.stall import WORKING, Busy, activity_of

SUGGEST_BUSY = (
    "That rank computes but never reaches the collective the others wait in: look at the loop or call "
    "at that line (a loop whose exit condition never holds, e.g. a NaN compared with a tolerance or a "
    "quota that cannot be met; a computation far larger than intended). If that rank legitimately works "
    "alone that long, raise --busy-timeout (and, on NCCL, the process group's timeout)."
)


def activity(view: RankView) -> Mapping[str, Any]:
    return activity_of(view.snapshot or {})


def is_working(view: RankView) -> bool:
    """Whether the rank's latest look found it working."""
    return activity(view).get("state") == WORKING


def working_location(view: RankView) -> str | None:
    """The line a working rank has been at: the loop it has not left, else the line it is at; for a
    rank held at its exit, the start of the thread that holds it."""
    if view.held_at_exit is not None:
        return held_location(view)
    position = activity(view).get("position") or {}
    return position.get("loop") or position.get("location") or view.location


def working_text(view: RankView, now: float) -> str:
    """'works at x.py:17, within the loop at x.py:23, for 42 s (its process tree at 100% of a
    core), its Python position moving'."""
    if view.held_at_exit is not None:
        return held_text(view)
    seen = activity(view)
    position = seen.get("position") or {}
    where = position.get("location") or view.location
    if where is None:  # no line yet: the process still imports, or runs code before the script's
        return "works with no position recorded yet (it is still starting: importing or set up)"
    text = f"works at {where}"
    if position.get("loop") and position["loop"] != position.get("location"):
        text += f", within the loop at {position['loop']},"
    since = seen.get("working_since")
    text += f" for {now - since:.0f} s" if since else ""
    share = seen.get("cpu_share")
    if isinstance(share, (int, float)) and share > 0:
        text += f" (its process tree at {share:.0%} of a core)"
    if position.get("moved"):
        text += ", its Python position moving"
    elif position:
        text += f", its Python position unchanged for {now - position['still_since']:.0f} s"
        if seen.get("native_call"):
            text += " while its main thread used CPU (one native call, or a loop that spends its time in one)"
    return text


@dataclass(frozen=True)
class BusyNote:
    """What the monitor prints and records once the busy clock passes the stall timeout: who
    works where and for how long, who waits where, and when the job will be stopped."""

    time: float
    attempt: int
    busy_for_s: float
    busy_timeout_s: float
    working: dict[str, str]  # rank -> the line it works at
    waiting: dict[str, str]  # rank -> the line it waits at
    message: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def busy_note(views: dict[int, RankView], busy: Busy, now: float, attempt: int, stall_timeout_s: float,
              busy_timeout_s: float) -> BusyNote:
    working = [views[r] for r in busy.working if r in views]
    waiting = [views[r] for r in busy.waiting if r in views]
    left = f"in {max(0.0, busy_timeout_s - busy.for_s):.0f} s"
    if busy.outside:
        own = [views[r] for r in busy.outside if r in views]
        message = (
            f"no rank has made progress for {busy.for_s:.0f} s, past the stall timeout ({stall_timeout_s:g} s), and no "
            f"rank is in a collective: {outside_text(own)}. Nobody waits on a peer, so this is no communication hang. "
            f"Not stopped yet: the job is stopped after --busy-timeout ({busy_timeout_s:g} s) without progress, {left}."
        )
        working = own
    else:
        works = listing([(v.rank, f"rank {v.rank} {working_text(v, now)}") for v in working])
        waits = listing([(v.rank, f"rank {v.rank} waits in {_waits_in(v)}") for v in waiting])
        message = (
            f"no rank has made progress for {busy.for_s:.0f} s, past the stall timeout ({stall_timeout_s:g} s), but the "
            f"job is not stalled: {works}; {waits}. Not stopped while it works: the job is stopped after "
            f"--busy-timeout ({busy_timeout_s:g} s) without progress, {left}."
        )
    return BusyNote(
        time=now, attempt=attempt, busy_for_s=round(busy.for_s, 1), busy_timeout_s=busy_timeout_s,
        working={str(v.rank): working_location(v) or "?" for v in working},
        waiting={str(v.rank): _waits_at(v) for v in waiting},
        message=message,
    )


# What a rank outside every collective waits on, told by the innermost frames of its stack (their
# files, as the snapshot writes them): the first of these, most specific first, that one of them runs
# (a DataLoader waits in a queue, which waits on a lock).
INNERMOST_FRAMES = 8
LOADER_WORKERS = "its DataLoader's worker processes"
OTHER_PROCESS = "another process (a multiprocessing queue or pipe)"
SUBPROCESS = "a subprocess"
POOL = "a thread or process pool's futures"
# What the rank's own child processes may be serving: where they are says why the rank waits.
SERVED_BY_CHILDREN = frozenset({LOADER_WORKERS, OTHER_PROCESS, SUBPROCESS, POOL})
_WAITS_ON = (
    ("torch/utils/data/", LOADER_WORKERS),
    ("multiprocessing/", OTHER_PROCESS),
    ("subprocess.py", SUBPROCESS),
    ("concurrent/futures/", POOL),
    ("queue.py", "a queue"),
    ("threading.py", "a lock or an event of another thread"),
    ("socket.py", "the network"),
    ("selectors.py", "a file or socket to become ready"),
)


def stack_waits_on(stack: list[str]) -> str | None:
    """What a thread's stack ('file:line in function', outermost first) says it waits on; None when
    it says nothing (a C call: a sleep, a read, a native lock)."""
    places = [line.split(" in ", 1)[0] for line in stack[-INNERMOST_FRAMES:]]
    return next((what for marker, what in _WAITS_ON if any(marker in place for place in places)), None)


def waits_on(view: RankView) -> str | None:
    """What the rank's main thread waits on, outside every collective (stack_waits_on)."""
    return stack_waits_on((view.snapshot or {}).get("stack") or [])


def holding_text(view: RankView) -> str:
    """"its process waits for its non-daemon thread 'uploader' (started at x.py:30), at x.py:22,
    waiting on a queue": what keeps a rank whose script ended from exiting."""
    ending = view.held_at_exit or {}
    threads = ending.get("threads") or []
    if ending.get("after_exit_handlers"):
        return f"its process did not end after the script's exit handlers began: {_holding_at_exit(view)}"
    if not threads:
        return "its process has not exited yet"
    said = []
    for thread in threads:
        made = [f"{what} at {thread[key]}" for what, key in (("created", "created_at"), ("started", "started_at"))
                if thread.get(key) and (key == "created_at" or thread[key] != thread.get("created_at"))]
        text = f"'{thread.get('thread')}'" + (f" ({', '.join(made)})" if made else "")
        text += f", at {thread['at']}" if thread.get("at") else ""
        what = stack_waits_on(thread.get("stack") or [])
        said.append(text + (f", waiting on {what}" if what else ""))
    kind = "thread" if len(said) == 1 else "threads"
    return f"its process waits for its non-daemon {kind} {'; '.join(said)}"


def _holding_at_exit(view: RankView) -> str:
    """What holds a process past its exit handlers, as read from outside: an atexit handler's wait,
    or, where Python had shut down, native code at interpreter exit (a library's destructor)."""
    snapshot = view.snapshot or {}
    read = snapshot.get("outside_read")
    if read:
        stack = snapshot.get("stack") or []
        what = stack_waits_on(stack)
        inner = " <- ".join(reversed([frame.split("/")[-1] for frame in stack[-3:]]))
        return (f"an exit handler holds it (its main thread, read from outside: {inner or 'no Python frame'}"
                + (f", waiting on {what}" if what else "") + ")")
    failed = snapshot.get("outside_read_failed")
    if failed is None:  # not read yet (a note at the stall timeout)
        return "an exit handler or a library's destructor holds it"
    return ("native code at interpreter exit holds it, past Python's own shutdown (a library's destructor or exit "
            f"hook joining a thread that never stops; it could not be read from outside: {failed})")


def held_text(view: RankView) -> str:
    """"ended its script (finished) 14 s before, and its process waits for ...": a rank held at its exit."""
    ending, seen = view.held_at_exit or {}, (view.snapshot or {}).get("time")
    how = {"finished": "finished", "exit_code": f"sys.exit({ending.get('code')})", "exception": f"raised {ending.get('type')}"}
    ago = f" {seen - ending['time']:.0f} s before its last report" if isinstance(seen, (int, float)) and ending.get("time") else ""
    return f"ended its script ({how.get(ending.get('status'), ending.get('status'))}){ago}, and {holding_text(view)}"


def held_location(view: RankView) -> str | None:
    """Where to change a rank held at its exit: where the first thread holding it was created
    (where `daemon=` is decided), else started, else the line it is at."""
    threads = (view.held_at_exit or {}).get("threads") or []
    found = next((where for t in threads if (where := t.get("created_at") or t.get("started_at") or t.get("at"))), None)
    # Held past its exit handlers: no thread of the script's to name, the line where the script ended.
    return found or ((view.held_at_exit or {}).get("location") if (view.held_at_exit or {}).get("after_exit_handlers") else None)


def children_text(view: RankView) -> str:
    """' (its child processes, read from outside: pid 812 at data.py:40, not running; ...)' for a rank
    whose child processes the launcher read (gradsync.run.outside.read_children); '' otherwise."""
    children = (view.snapshot or {}).get("children") or []
    said = [f"pid {c['pid']} " + (f"could not be read ({c['failed']})" if c.get("failed") else
                                  f"at {c.get('location') or 'no line of yours'}, {'running' if c.get('running') else 'not running'}")
            for c in children]
    return f" (its child processes, read from outside: {'; '.join(said)})" if said else ""


def outside_text(views: list[RankView]) -> str:
    """'rank 0 at x.py:48, waiting on its DataLoader's worker processes; rank 1 at ...'."""
    return listing([(v.rank, f"rank {v.rank} {held_text(v)}" if v.held_at_exit is not None else
                     f"rank {v.rank} at {v.location or '?'}" + (f", waiting on {what}{children_text(v)}" if (what := waits_on(v)) else ""))
                    for v in views])


def _waits_in(view: RankView) -> str:
    record = view.waiting_on()
    if record is None:
        return f"a collective at {view.location or '?'}"
    return f"{describe(record)} at {record.get('site') or view.location or '?'}"


def _waits_at(view: RankView) -> str:
    record = view.waiting_on() or {}
    return record.get("site") or view.location or "?"
