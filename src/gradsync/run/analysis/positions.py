"""Where the ranks are, when no rank crashed: ranks whose node stopped reporting; one rank
finished while the others wait; one stays outside any collective; ranks wait for each other in
different places; every rank waits and none progresses.
"""

from __future__ import annotations

import bisect

from gradsync.run.analysis.exits import ended_at, where_it_ended
from gradsync.run.analysis.rank_lines import rank_line, report_age
from gradsync.run.analysis.views import (
    P2P_PEER, RankView, group_members, last_position, reached_on, read_from_outside_text, unrecorded_wait, where_is,
)
from gradsync.run.analysis.working import (
    SUGGEST_BUSY, activity, children_text, held_location, holding_text, is_working, outside_text, waits_on, working_location, working_text,
)
from gradsync.run.analysis.wording import NEVER_HEARD_OF, SUGGEST_SAME_COLLECTIVES, describe, listing, ranks_text
from gradsync.rundir.records import POINT_TO_POINT, Finding


def unreachable_finding(unreachable: list[RankView], views: dict[int, RankView], now: float) -> Finding:
    lost = sorted(unreachable, key=lambda v: v.rank)
    hosts = sorted({(v.snapshot or {}).get("host") for v in lost} - {None})
    described = listing([
        (v.rank, f"rank {v.rank}" + (f" (host {v.snapshot['host']})" if (v.snapshot or {}).get("host") else "")
         + (f", last heard of {now - v.snapshot['time']:.0f} s before this diagnosis at {last_position(v)}" if v.snapshot
            else f", {NEVER_HEARD_OF}"))
        for v in lost
    ])
    here = [v for v in views.values() if not v.unreachable]
    waits = listing([(v.rank, f"rank {v.rank} {rank_line(v, now, None, [])}") for v in sorted(here, key=lambda v: v.rank)])
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
        locations={str(v.rank): last_position(v) for v in lost if v.snapshot},
    )


def position_finding(views: dict[int, RankView], now: float, trigger: str) -> Finding | None:
    waiting = {r: v for r, v in views.items() if v.waiting_on() is not None and not v.finished}
    finished = {r: v for r, v in views.items() if v.finished or (v.exit and v.exit.get("status") == "finished")}
    alive = sorted(r for r, v in views.items() if v.alive and r not in finished)
    held = [v for _, v in sorted(views.items()) if v.alive and v.held_at_exit is not None]
    if trigger == "stall" and held and not waiting:
        return _held_at_exit(held)
    if trigger == "stall" and alive and not waiting and not finished:
        return _outside_collectives([views[r] for r in alive])
    # Running: alive, or stopped by the launcher once a peer failed waiting for it (where it was
    # then, by its last snapshot, is the answer).
    running = {
        r: v for r, v in views.items()
        if (v.alive or (v.signal == "SIGTERM" and v.exit is None)) and r not in waiting and r not in finished
    }
    locations = {str(r): where_is(v) for r, v in sorted(views.items())}
    waits = listing([(r, f"rank {r} {_waits_or_failed(v.waiting_on())} {describe(v.waiting_on())} at {v.waiting_on().get('site') or '?'}")
                     for r, v in sorted(waiting.items())])
    if finished and (waiting or trigger == "failure"):
        counts = ", ".join(f"rank {r}: {(v.snapshot or {}).get('collectives', '?')}" for r, v in sorted(views.items()))
        ended = listing([(r, f"rank {r} ended {where_it_ended(v)}") for r, v in sorted(finished.items())])
        return Finding(
            "rank_exited",
            "error",
            sorted(finished),
            f"{ranks_text(finished)} finished the script while the other ranks still expected "
            f"{'it' if len(finished) == 1 else 'them'} in collectives ({waits or 'they lost their peer'}): "
            f"{ended}. Collectives issued per rank: {counts}. A rank left the training loop early: fewer "
            "batches, a rank-local early stop, a skipped step, or an error it caught and returned from.",
            SUGGEST_SAME_COLLECTIVES,
            locations=locations | {str(r): ended_at(v) for r, v in finished.items()},
        )
    unrecorded = {r: wait for r, v in running.items() if (wait := unrecorded_wait(v)) is not None}
    if unrecorded and waiting:
        inside = listing([(r, f"rank {r} waits in {wait} at {running[r].location or '?'}") for r, wait in sorted(unrecorded.items())])
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
        # A rank that kept working is named where it worked (the loop it moved within, or the line
        # it stayed at), with that evidence; an idle one where it stands.
        busy = {r for r, v in running.items() if is_working(v)}
        stuck = listing([(r, f"rank {r} {working_text(v, now)}" if r in busy
                          else f"rank {r} at {v.location or '?'}{read_from_outside_text(v) or report_age(v, now)}{children_text(v)}")
                         for r, v in sorted(running.items())])
        details = {"stacks": {str(r): (v.snapshot or {}).get("stack", [])[-12:] for r, v in sorted(running.items())}}
        if busy:
            details["activity"] = {str(r): activity(running[r]) for r in sorted(busy)}
        return Finding(
            "rank_stuck",
            "error",
            sorted(running),
            f"{ranks_text(running)} stayed outside any collective ({stuck}) while the others "
            f"waited for it ({waits}).",
            SUGGEST_BUSY if busy else
            "Look at what that rank runs at that line (its full stack is in diagnosis.json): a "
            "blocking call only it makes (sleep, input, a lock, a file or network read, a data "
            "loader worker that died).",
            locations=locations | {str(r): working_location(running[r]) or locations[str(r)] for r in busy},
            details=details,
        )
    elsewhere = _waiting_for_ranks_elsewhere(waiting, views)
    if elsewhere:
        blocked = sorted({r for pair in elsewhere for r in pair})
        lines = listing([
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
            locations={str(r): where_is(views[r]) for r in blocked} | locations,
        )
    if finished and running and not waiting and trigger == "stall":
        return _idle_after_peers_finished(running, finished, locations)
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


def _waits_or_failed(record: dict) -> str:
    """How a rank stands in the collective it is held at: a record that failed (its peer left) is no longer waited in."""
    return "failed in" if record.get("state") == "failed" else "waits in"


def _idle_after_peers_finished(running: dict[int, RankView], finished: dict[int, RankView], locations: dict[str, str]) -> Finding:
    """Some ranks finished their script, the others stand still outside any collective, and no
    collective waits: whatever the finished ranks issued, the others matched. So the finished
    ranks are not what the others wait for in a collective; the ones still running stopped by
    themselves (a lock, a sleep, a read), or wait for a finished rank by other means (a file it
    was to write, a store key, a queue), which never come either way."""
    stuck = listing([(r, f"rank {r} at {v.location or '?'}") for r, v in sorted(running.items())])
    ended = listing([(r, f"rank {r} ended {where_it_ended(v)}") for r, v in sorted(finished.items())])
    return Finding(
        "rank_stuck",
        "error",
        sorted(running),
        f"{ranks_text(running)} stayed outside any collective ({stuck}) after the other ranks had finished "
        f"their script ({ended}). Every collective the finished ranks issued was matched, so no collective "
        "waits for them.",
        "Look at what that rank runs at that line (its full stack is in diagnosis.json): a blocking call "
        "only it makes (sleep, input, a lock, a file or network read), or a wait for something a finished "
        "rank was to provide by other means than a collective (a file, a store key), which now never comes.",
        locations=locations | {str(r): ended_at(v) for r, v in finished.items()},
        details={"stacks": {str(r): (v.snapshot or {}).get("stack", [])[-12:] for r, v in sorted(running.items())}},
    )


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
            match = P2P_PEER.search(record.get("signature") or "")
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
        members = group_members(view, group, views)
        key = (group, record.get("source") == "flight", tuple(members))
        if key not in holding:
            candidates = []
            for position, peer in enumerate(members):
                other = views.get(peer)
                if other is None or other.finished or not (peer in waiting or other.exit is not None):
                    continue
                reached = reached_on(other, group, record)
                if reached is not None:
                    candidates.append((reached, position, peer))
            candidates.sort()
            holding[key] = ([reached for reached, _, _ in candidates], candidates)
        levels, candidates = holding[key]
        behind = candidates[: bisect.bisect_left(levels, record["seq"])]
        pairs += [(rank, peer) for _, _, peer in sorted(behind, key=lambda c: c[1]) if peer != rank]
    return pairs


# What the peer must be blocked in, by what this rank waits in: a receive needs a send, and back.
_P2P_MATCH = {"src": ("send", "isend", "batch_isend_irecv"), "dst": ("recv", "irecv", "batch_isend_irecv")}


def _held_at_exit(held: list[RankView]) -> Finding:
    """Ranks whose script ended but whose process never exited, waiting for the script's
    non-daemon threads (gradsync.run.script_exit), and no rank waits in a collective: the job
    would hang there for good under plain torchrun too."""
    ranks = {v.rank: v for v in held}
    alike: dict[str, list[int]] = {}  # ranks held alike are said once
    for view in held:
        alike.setdefault(holding_text(view), []).append(view.rank)
    if all((v.held_at_exit or {}).get("after_exit_handlers") for v in held):
        why = (". The script's threads were joined; what waits comes after them: an atexit handler (multiprocessing's "
               "own joins a queue's feeder thread, which waits for good to hand a reader that is gone what was put "
               "on the queue) or a native library's destructor at interpreter exit.")
        fix = ("Release what the exit waits for before the script returns: read or drop what is left on a "
               "multiprocessing queue (or call its cancel_join_thread()), stop a native library's background "
               "threads with its own stop or shutdown call at the end of training.")
    else:
        why = (". Python joins every non-daemon thread before it runs the atexit handlers, so a thread that "
               "nothing stops before the script returns (or only an atexit handler does) keeps the process, and "
               "the job, alive for good.")
        fix = ("Stop and join the thread before the script returns (a `finally:` after the training loop, not "
               "an atexit handler, which runs only after the join), or start it with daemon=True if it may be "
               "cut off at exit.")
    return Finding(
        "exit_held_by_threads",
        "error",
        sorted(ranks),
        f"{ranks_text(ranks)} ended {'its' if len(held) == 1 else 'their'} script, but "
        f"{'its process' if len(held) == 1 else 'their processes'} never exited: "
        + "; ".join(f"{ranks_text(members).lower()}: {text}" for text, members in alike.items()) + why,
        fix,
        locations={str(v.rank): held_location(v) or last_position(v) for v in held},
        details={"threads": {str(v.rank): (v.held_at_exit or {}).get("threads") or [] for v in held}},
    )


def _outside_collectives(alive: list[RankView]) -> Finding:
    """No rank in a collective when the job was stopped (only at the busy timeout: gradsync.run.stall):
    nobody waited on a peer, so it is no communication hang; named where each rank stood."""
    return Finding(
        "stalled_outside_collectives",
        "error",
        [v.rank for v in alive],
        f"No rank made progress until the busy timeout, and none was in a collective: {outside_text(alive)}. "
        "Nobody waited on a peer, so this is no communication hang: each rank waited on something of its own.",
        "Look at what each rank waits on at its line (its full stack is in diagnosis.json): DataLoader workers "
        "that hang or died (num_workers=0 shows the error in the main process), a lock two threads take in "
        "opposite orders, a subprocess or a file that never answers. If the work is only slow (workers opening "
        "their shards), raise --busy-timeout.",
        locations={str(v.rank): v.location or "?" for v in alive},
        details={"stacks": {str(v.rank): (v.snapshot or {}).get("stack", [])[-12:] for v in alive},
                 "waits_on": {str(v.rank): waits_on(v) for v in alive},
                 **({"children": children} if (children := {str(v.rank): v.snapshot["children"] for v in alive
                                                            if (v.snapshot or {}).get("children")}) else {})},
    )
