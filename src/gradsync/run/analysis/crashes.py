"""Which ranks failed by themselves, and how that is told: a rank that crashed is the cause and
the others' "Connection closed by peer" its consequence; an injected fault is the known cause;
every rank failing alike is one failure of the script; a crash after every rank finished is
teardown, not a failure.
"""

from __future__ import annotations

import heapq
import re
from typing import Any

from gradsync.run.analysis.alignment import Divergence
from gradsync.run.analysis.source import only_forwards
from gradsync.run.analysis.views import RankView, exit_call, exit_site, group_members, last_position, last_site, reached_on, where_is
from gradsync.run.analysis.wording import SUGGEST_SAME_COLLECTIVES, clipped, first_line, ranks_text
from gradsync.rundir.records import Finding


# Errors a rank gets because another rank left, crashed or misbehaved, not because of its own code.
CONSEQUENCE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|closed by remote|[Tt]imed out|"
    r"[Tt]imeout|Socket|ECONNRESET|remote process exited|communicator was aborted|NCCL error|"
    r"Application timeout caused pair closure|failed to recv|failed to send",
)
# What Gloo and NCCL say when the two sides of one collective are different collectives.
MISMATCH_SYMPTOM = re.compile(r"op\.preamble\.length|collective mismatch|[Mm]ismatch|size mismatch")
# Last words of a rank that died because another did (gradsync.run.analysis.last_words).
CONSEQUENCE_FAMILIES = ("peer_lost", "backend_timeout")
# PeerError: gradsync's trainer stopping a rank because another rank failed a check.
_CONSEQUENCE_TYPES = {"DistNetworkError", "DistBackendError", "DistStoreError", "PeerError"}
# A message that names the backend: the transport speaking, not the user's own code.
_BACKEND = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)
# What torch.distributed raises from its own argument checks, before anything reaches the
# backend (a destroyed default group, a wrong tensor type): no peer can cause these, wherever the
# peers were. Transport failures come as RuntimeError or its Dist* subclasses.
_RAISED_BEFORE_SENDING = {"ValueError", "TypeError", "AssertionError", "AttributeError", "KeyError", "IndexError"}
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")
_UNUSED_HINT = re.compile(r"did not receive grad|Expected to have finished reduction in the prior iteration")


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
        return bool(_BACKEND.search(message) and CONSEQUENCE.search(message))
    return bool(CONSEQUENCE.search(message))  # inside a collective (or an older exit record)


def is_mismatch_symptom(exception: dict[str, Any]) -> bool:
    return bool(MISMATCH_SYMPTOM.search(exception["message"]))


def crashed_ranks(views: dict[int, RankView], divergence: Divergence | None, injected: RankView | None) -> list[RankView]:
    """The ranks that failed by themselves: the one an injected fault took down, when one did."""
    positions: dict[tuple, Any] = {}  # shared by the ranks' _peer_elsewhere questions
    crashes = [injected] if injected else [v for v in views.values() if _crash_cause(v, divergence, views, positions)]
    # torchrun's agent stops the remaining workers with SIGTERM once one has failed, possibly
    # before their last snapshot is newer than the failure: SIGTERM is a cause only alone, and
    # not when a rank failed waiting for it (then where it was, is the answer: see
    # positions.position_finding).
    consequences = [v for v in views.values() if v.exception() is not None and v not in crashes]
    return [v for v in crashes if v.signal != "SIGTERM"] or ([] if consequences else crashes)


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
    # A process the backend took down because it lost a peer, or gave up waiting for one, died of
    # another rank's failure, whatever signal ended it.
    if killed and view.last_words is not None and view.said(*CONSEQUENCE_FAMILIES):
        return False
    # Gloo aborts the process (SIGABRT) when the two sides of a collective differ in size.
    return killed and not (divergence is not None and _failed_in_collective(view, divergence))


def _peer_elsewhere(view: RankView, views: dict[int, RankView], positions: dict[tuple, Any] | None = None) -> bool:
    """Did this rank's exception come out of a collective that a peer never reached, or that a
    peer had already failed out of? Then the peer, not this rank, is where to look.

    `positions` keeps, per group, what every rank that failed in it asks again: the two members
    furthest behind and the two that failed first (the first of them that is not the asking rank
    answers for all its peers)."""
    exception = view.exception() or {}
    where = exception.get("collective")
    if not where or where.get("seq") is None or exception.get("type") in _RAISED_BEFORE_SENDING:
        return False
    group, seq = where["group"], where["seq"]
    members = group_members(view, group, views)
    key = (group, tuple(members))
    found = None if positions is None else positions.get(key)
    if found is None:
        others = [(rank, views[rank]) for rank in dict.fromkeys(members) if rank in views]
        behind = heapq.nsmallest(2, ((reached_on(other, group), rank) for rank, other in others))
        failed = heapq.nsmallest(
            2, ((failure_time(other), rank) for rank, other in others if other.exit is not None and not other.finished)
        )
        found = (behind, failed)
        if positions is not None:
            positions[key] = found
    behind, failed = found
    reached = next((value for value, rank in behind if views[rank] is not view), None)
    failed_at = next((value for value, rank in failed if views[rank] is not view), None)
    return (reached is not None and reached < seq) or (failed_at is not None and failed_at < failure_time(view))


def _failed_in_collective(view: RankView, divergence: Divergence) -> bool:
    """Did this rank fail, or die, inside a collective at or after the point of divergence, or
    inside the one the divergence paired with its peers' (found where the backend said so)?"""
    paired = divergence.records.get(view.rank)
    if paired is not None and paired["state"] in ("failed", "entered", "issued"):
        return True
    return any(
        r["state"] in ("failed", "entered", "issued") and r["group"] == divergence.group and (r["seq"] or 0) >= divergence.seq
        for r in view.records
    )


def failure_time(view: RankView) -> float:
    if view.exit and view.exit.get("time"):
        return view.exit["time"]
    return (view.snapshot or {}).get("time", float("inf"))


def failure_signature(view: RankView) -> tuple:
    """What identifies a failure across ranks: the same exception type at the same line, the same
    exit code, or the same signal (messages may name the rank or its data, so they are left out)."""
    exception = view.exception()
    if exception is not None:
        return ("exception", exception["type"], exception["location"] or first_line(exception["message"]))
    if view.exit and view.exit.get("status") == "exit_code":
        return ("exit", view.exit.get("code"))
    return ("signal", view.signal, view.exitcode)


def first_crash_finding(crashes: list[RankView], views: dict[int, RankView]) -> Finding:
    """The finding for the rank that failed first, told once for all when every rank failed alike."""
    gathered = _gathered_failure(crashes)
    if gathered is not None:
        return gathered
    first = min(crashes, key=failure_time)
    alike = [v for v in crashes if failure_signature(v) == failure_signature(first)]
    return _crash_finding(first, views, alike if len(views) > 1 and len(alike) == len(views) else [first])


def _crash_finding(view: RankView, views: dict[int, RankView], alike: list[RankView]) -> Finding:
    """The finding for the first rank that failed by itself; `alike`: the ranks that failed the
    same way (every rank, or just this one)."""
    exception = view.exception()
    consequence = _reactions(view, views) if len(alike) == 1 else ""
    # What the rank's last words say it died of, before how it died: an allocation that failed
    # reads the same as any exception or abort otherwise.
    if view.said("out_of_memory"):
        return _memory_finding(view, views, alike, consequence)
    if view.said("collective_mismatch"):
        return _mismatch_without_records(view, consequence)
    if exception is not None:
        unused = _unused_from_ddp_error(view, exception)
        if unused is not None:
            names = ", ".join(unused) or "(see the message)"
            stopped = f"every rank ({', '.join(str(v.rank) for v in alike)})" if len(alike) > 1 else f"rank {view.rank}"
            raised = exception.get("location") or view.location or "?"
            built = _ddp_built_at(view)
            return Finding(
                "unused_parameters",
                "error",
                sorted(v.rank for v in alike),
                f"DDP stopped {stopped} at {raised}: parameters got no gradient in the previous iteration "
                f"({names}), so its gradient reduction never finished"
                + (f"; the DDP wrapper was built at {built} without find_unused_parameters" if built else "")
                + f".{consequence}",
                "Make the forward pass use every parameter that requires a gradient on every rank (a head only some "
                "ranks' data reach: add its output times zero to the loss), freeze the unused ones "
                "(requires_grad=False), or pass find_unused_parameters=True to DDP (it costs an extra graph "
                "traversal and some overlap each step).",
                # Where the fix usually goes: the wrapper's construction, else where it stopped.
                locations={str(v.rank): _ddp_built_at(v) or (v.exception() or {}).get("location") or v.location or "?"
                           for v in alike},
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
                f"{first_line(exception['message'])} (at {where}).{consequence} The others may well have failed "
                "the same way had they got that far.",
                "Fix that error: before the ranks first communicate, it is as likely in code every rank runs as in "
                "this rank's own input or environment.",
                locations={str(view.rank): where},
                details=_traceback_details(view),
            )
        if view.loader_worker_fatal_stack:
            # The worker's own stack at the signal: the dataset's line that made the native call.
            crashed_at = _native_call_site(view, view.loader_worker_fatal_stack)
            return Finding(
                "rank_crashed",
                "error",
                [view.rank],
                f"Rank {view.rank} failed first: one of its DataLoader's worker processes died of a fatal signal "
                f"inside a call made at {crashed_at} (the worker's Python stack, read from faulthandler's dump: "
                f"{' <- '.join(view.loader_worker_fatal_stack[:3])}), and the rank raised {exception['type']}: "
                f"{first_line(exception['message'])} (at {where}).{consequence}",
                "Look at the native call made at that line in the dataset's code (a C library reached through ctypes, "
                "an extension, memory read past its end); run the loader with num_workers=0 to see it in the rank itself.",
                locations={str(view.rank): crashed_at},
                step=(view.snapshot or {}).get("backward_passes"),
                details={**_traceback_details(view), "loader_worker_fatal_stack": {str(view.rank): view.loader_worker_fatal_stack}},
            )
        return Finding(
            "rank_crashed",
            "error",
            [view.rank],
            f"Rank {view.rank} failed first: {exception['type']}: {first_line(exception['message'])} "
            f"(at {where}).{consequence}",
            "Fix the error on that rank; the other ranks only stopped because it left.",
            locations={str(view.rank): where},
            step=(view.snapshot or {}).get("backward_passes"),
            details=_traceback_details(view),
        )
    if view.exit and view.exit.get("status") == "exit_code":
        where = exit_site(view) or view.location or last_site(view) or "?"
        call = exit_call(view) or f"sys.exit({view.exit.get('code')})"
        return Finding(
            "rank_crashed",
            "error",
            [view.rank],
            f"Rank {view.rank} called {call} at {where} while the others still needed it.{consequence}",
            "Exit with an error on every rank together, or fix what made this rank exit.",
            locations={str(view.rank): where},
        )
    last = last_position(view)
    how, suggestion = _SIGNALS.get(view.signal or "", _OTHER_SIGNAL)
    if view.fatal_stack:
        # faulthandler's stack at the signal: the call the rank was in when it died, not the last
        # place it reported (a snapshot a second old, or a collective long finished).
        where = _native_call_site(view, view.fatal_stack)
        called = " <- ".join(view.fatal_stack[:3])
        said = (f"Rank {view.rank} was killed by {view.signal or 'a signal'} (exit code {view.exitcode}) inside a call "
                f"made at {where} (its Python stack at the signal, read from faulthandler's dump: {called}); its last "
                f"recorded position before that was {last}. {how}")
        suggestion = (f"Look at the native call made at {where}: an extension, a C library reached through ctypes, or "
                      "a tensor whose memory was freed or shared while in use."
                      + ("" if view.signal == "SIGSEGV" else f" {suggestion}"))  # SIGSEGV's own advice: get this stack
    else:
        where = last
        said = f"Rank {view.rank} was killed by {view.signal or 'a signal'} (exit code {view.exitcode}); its last " \
               f"recorded position was {where}. {how}"
    details = _last_words_details(view)
    if view.fatal_stack is not None:
        details["fatal_stack"] = {str(view.rank): view.fatal_stack}
    return Finding(
        "rank_crashed",
        "error",
        [view.rank],
        f"{said}{_last_words_text(view)}{consequence}",
        suggestion,
        locations={str(view.rank): where},
        step=(view.snapshot or {}).get("backward_passes"),
        details=details,
    )


# How a rank that a signal ended, with no last words that say why, is told: the signal alone
# decides what to look at. Only SIGKILL, which nothing in the process can catch or report, is
# the OOM killer's mark; an abort is native code giving up, and says so on its way out.
_SIGNALS = {
    "SIGKILL": (
        "Nothing in a process can report a SIGKILL: the kernel's out-of-memory killer ends processes "
        "this way, as do schedulers enforcing a memory or time limit.",
        "Check the system log on that host (dmesg for the OOM killer) and the job scheduler's log.",
    ),
    "SIGABRT": (
        "An abort is native code (the backend, torch's C++ side, an extension) giving up on an error "
        "it could not raise to Python: an uncaught C++ exception or a failed check.",
        "Read the rank's last words in its log (RUN_DIR/workers/attemptN/rankR.log): the failed check or "
        "the C++ exception is printed there just before the abort.",
    ),
    "SIGSEGV": (
        "A segmentation fault is native code reading memory it does not own: a C++ or CUDA extension, "
        "mismatched library builds, or a tensor freed while still in use.",
        "Rerun with PYTHONFAULTHANDLER=1 to print the Python stack at the fault, and read the rank's log.",
    ),
}
_OTHER_SIGNAL = ("", "Read the rank's own output in its log, and the system log on that host.")


def _last_words_text(view: RankView) -> str:
    """' Its last words: "..."' when the rank's log ends with something worth quoting."""
    words = view.last_words
    if words is None or not words.lines:
        return ""
    quote = words.quote() or words.lines[-1][:240]
    return f' Its last words: "{quote}".'


def _last_words_details(view: RankView) -> dict[str, Any]:
    return {"last_words": {str(view.rank): view.last_words.as_dict()}} if view.last_words is not None else {}


def _memory_finding(view: RankView, views: dict[int, RankView], alike: list[RankView], consequence: str) -> Finding:
    """A rank whose last words say an allocation failed: a memory verdict, whatever ended it."""
    ranks = sorted(v.rank for v in alike)
    exception = view.exception()
    where = (exception or {}).get("location") or (last_position(view) if exception is None else view.location) or "?"
    who = f"Rank {view.rank}" if len(ranks) == 1 else f"Every rank ({', '.join(map(str, ranks))})"
    how = f"raised {exception['type']}" if exception is not None else f"was killed by {view.signal or 'a signal'}"
    return Finding(
        "out_of_memory",
        "error",
        ranks,
        f"{who} ran out of memory at {where}: it {how} after an allocation failed "
        f'("{view.last_words.quote()}").{consequence}',
        "Make the rank need less memory (a smaller batch or model shard, fewer or lighter DataLoader workers, "
        "activation checkpointing) or give it more: check the limits its processes run under (ulimit -v, the "
        "container's or the job scheduler's memory limit, and on a GPU what other processes hold).",
        locations={str(v.rank): (v.exception() or {}).get("location") or last_position(v) for v in alike},
        step=(view.snapshot or {}).get("backward_passes"),
        details={**_traceback_details(view), **_last_words_details(view)},
    )


def _mismatch_without_records(view: RankView, consequence: str) -> Finding:
    """A rank whose backend said the two sides of a collective disagree, outside every recorded
    collective (a DTensor's, a functional or a compiled one): the words and where it was."""
    exception = view.exception()
    where = (exception or {}).get("location") or last_position(view)
    words = view.last_words
    sizes = f" ({words.sizes()})" if words.sizes() else ""
    ended = f"raised {exception['type']}" if exception is not None else f"was killed by {view.signal or 'a signal'}"
    return Finding(
        "collective_mismatch",
        "error",
        [view.rank],
        f"Rank {view.rank}'s backend found the two sides of a collective disagreeing{sizes}, and the rank {ended} "
        f'at {where}: "{words.quote()}". No collective gradsync recorded shows the other side: it was one the '
        f"recorder does not see (a DTensor's, a functional or a compiled one).{consequence}",
        SUGGEST_SAME_COLLECTIVES,
        locations={str(view.rank): where},
        details=_last_words_details(view),
    )


def _same_failure_finding(first: RankView, alike: list[RankView]) -> Finding:
    """Every rank failed in the same way: one failure of the script, told once."""
    ranks = sorted(v.rank for v in alike)
    before_any_collective = all(not v.records for v in alike)
    when = " at start-up, before its first collective" if before_any_collective else ""
    exception = first.exception()
    if exception is not None:
        where = exception["location"] or first.location or "?"
        what = f"{exception['type']}: {first_line(exception['message'])} (at {where})"
        suggestion = "Fix that error in the script: it is not one rank's problem, every rank hits it."
    elif first.exit and first.exit.get("status") == "exit_code":
        where = exit_site(first) or first.location or last_site(first) or "?"
        what = f"it exited with code {first.exit.get('code')} (at {where})"
        suggestion = ("Read the script's own message above (a bad command-line argument ends an argparse "
                      "script with code 2 on every rank).")
    else:
        where = last_position(first)
        what = f"every rank was killed by {first.signal or 'a signal'} (exit code {first.exitcode}; last position {where})"
        suggestion = _SIGNALS.get(first.signal or "", _OTHER_SIGNAL)[1]
    return Finding(
        "script_failed",
        "error",
        ranks,
        f"The script failed on every rank{when}: {what}.",
        suggestion,
        locations={str(v.rank): (v.exception() or {}).get("location") or v.location or last_site(v) or "?" for v in alike},
        step=None if before_any_collective else (first.snapshot or {}).get("backward_passes"),
        details=_traceback_details(first),
    )


# torch.distributed.checkpoint runs each step on every rank, gathers the ranks' errors and raises
# them on every rank as one CheckpointException, whose message lists the ranks that failed and,
# per rank, its traceback: "CheckpointException ranks:dict_keys([1])\nTraceback ... (RANK 1)\n...".
_GATHERED = re.compile(r"^CheckpointException ranks:dict_keys\(\[(?P<ranks>[\d, ]+)\]\)")


def _gathered_failure(crashes: list[RankView]) -> Finding | None:
    """Every rank raised the error a checkpoint library gathered from some of them: named on the
    ranks it came from (their own words, the last line of their traceback), not on all."""
    said = [(view, _GATHERED.match((view.exception() or {}).get("message") or "")) for view in crashes]
    if not said or not all(found for _, found in said):
        return None
    failed = sorted({int(rank) for rank in said[0][1]["ranks"].split(",")})
    origin = [view for view, _ in said if view.rank in failed]
    if not origin or len(failed) == len(crashes):
        return None
    message = origin[0].exception()["message"]
    inner = next((line for line in reversed(message.splitlines()) if line.strip() and not line.startswith(" ")), "")
    return Finding(
        "rank_crashed",
        "error",
        failed,
        f"{ranks_text(failed)} failed inside torch.distributed.checkpoint, which gathered the error and raised it on "
        f"every rank (CheckpointException): {clipped(inner, 300)}. The other ranks raised it only because the "
        "checkpoint step is collective.",
        "Fix what failed on that rank (a path, a file or a state only it has: every rank must pass the same "
        "checkpoint_id and see the same storage); the others only report it.",
        locations={str(view.rank): (view.exception() or {}).get("location") or view.location or "?" for view in origin},
        details=_traceback_details(origin[0]),
    )


def _traceback_details(view: RankView) -> dict[str, Any]:
    exception = view.exception()
    if exception is None or not exception.get("traceback"):
        return {}
    return {"exception": exception["type"], "traceback": exception["traceback"], "traceback_rank": view.rank}


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


def _unused_from_ddp_error(view: RankView, exception: dict[str, Any]) -> list[str] | None:
    if not _UNUSED_HINT.search(exception["message"]):
        return None
    order = ((view.snapshot or {}).get("ddp_parameters") or [[]])[0]
    match = _UNUSED_INDICES.search(exception["message"])
    if match is None:
        return []
    indices = [int(i) for i in match.group(1).split()]
    return [order[i] if i < len(order) else f"#{i}" for i in indices]


# Injected faults that leave the rank alive and quiet: only a stall makes them the cause.
STALLING_FAULTS = ("hang", "stop")


def fired_fault(views: dict[int, RankView], trigger: str) -> RankView | None:
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


def fault_outcome(fault: dict[str, Any]) -> str:
    """'was killed (SIGKILL) at step 3' for the record of a fault that fired."""
    outcome = {"kill": "was killed (SIGKILL)", "exit": f"exited with code {fault['code']}", "hang": "hung",
               "stop": "was frozen (SIGSTOP)"}[fault["action"]]
    return f"{outcome} {_fault_place(fault)}"


def injected_finding(view: RankView, views: dict[int, RankView]) -> Finding:
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
        f"Rank {view.rank} {fault_outcome(fault)} of attempt {fault['attempt']}: injected by "
        f"--inject-fault {fault['spec']}, not a fault of the script.{consequence}",
        "Nothing to fix: this rehearses a failure. Check that the job recovered as intended (--max-restarts, "
        "resuming from the last checkpoint), and drop --inject-fault for real runs.",
        locations={str(view.rank): where_is(view)},
        step=fault["step"],
        details={"injected": fault["spec"]},
    )


def teardown_finding(teardown: list[RankView], views: dict[int, RankView]) -> Finding:
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


def _ddp_built_at(view: RankView) -> str | None:
    """The user's line that built the rank's DDP wrapper (its construction's record), if recorded."""
    return next((r.get("site") for r in view.records if r.get("kind", "").startswith("DDP construction") and r.get("site")), None)


def _native_call_site(view: RankView, frames: list[str]) -> str:
    """The user's line that made the native call a fatal signal stopped, from the user's frames
    (innermost first) of the thread it stopped, the rank's or its DataLoader worker's: the innermost,
    or its caller when the innermost only forwards the call (a one-line `release()` around
    `lib.free`), since the caller decides when and with what it runs."""
    frames = frames or ["?"]
    if len(frames) > 1 and only_forwards(view, frames[0]):
        return frames[1]
    return frames[0]
