"""Ranks that finished while their peers still needed them: where a finished rank ended, and the
collectives that failed because a peer had already finished without them.

A collective needs every member of its group. When a rank's collective fails and a member that
finished its script never reached that collective (its records stop before that sequence number,
or, for a send or receive, it was the peer), the collective could never have completed: the peer
had left. If the rank survives the failure (an atexit handler's error is printed and ignored, a
`finally:` or `__del__` swallows it), the job still exits 0, and only this finding says that what
the collective was to do did not happen. Decided from the ranks' sequences, whatever the backend
said (Gloo's "Connection closed by peer", a destroyed group's error, NCCL's), and whenever the
collective ran: in the training loop, a `finally:`, a destructor or an exit handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradsync.run.analysis.views import P2P_PEER, RankView, exit_call, exit_site, group_members, reached_on
from gradsync.run.analysis.working import holding_text
from gradsync.run.analysis.wording import clipped, describe, first_line, listing, ranks_text
from gradsync.rundir.records import POINT_TO_POINT, Finding


def where_it_ended(view: RankView) -> str:
    """'after its last collective, all_reduce #22 at train.py:53, and left the process group at
    train.py:68': where a rank that finished its script was last seen communicating, and where it
    destroyed the default group if it did (the `finally:` or the line after the loop it left)."""
    last = view.records[-1] if view.records else None
    said = (f"after its last collective, {describe(last)} at {last.get('site') or '?'}" if last is not None
            else "before any collective")
    left = (view.snapshot or {}).get("left_group")
    said += f", and left the process group at {left['site']}" if left else ""
    call = exit_call(view)
    said += f", and ended the script with {call} at {exit_site(view) or '?'}" if call else ""
    if view.alive and view.held_at_exit is not None:  # the script ended; its threads hold the process
        said += f" ({holding_text(view)})"
    return said


def ended_at(view: RankView) -> str:
    """The one line that says where a finished rank ended: where it ended the script itself (a
    sys.exit or os._exit call), else where it left the group, else its last collective's line,
    else its last known line."""
    left = (view.snapshot or {}).get("left_group")
    last_site = next((r["site"] for r in reversed(view.records) if r.get("site")), None)
    return exit_site(view) or (left or {}).get("site") or last_site or view.location or "?"


@dataclass(frozen=True)
class LateCollective:
    """A collective that failed on `rank` because the peers `gone` had finished without it."""

    rank: int
    record: dict[str, Any]
    gone: tuple[int, ...]
    at_exit: bool  # entered after the rank's script had returned: an exit handler ran it


def late_collectives(views: dict[int, RankView]) -> list[LateCollective]:
    """Every failed collective that a finished peer never reached, but the one a rank's own
    exception came out of: a rank that died of it is explained by the diagnosis's cause
    (rank_exited names the peer), and a warning would only repeat it."""
    found = []
    for rank, view in sorted(views.items()):
        raised_from = (view.exception() or {}).get("collective") or {}
        ended = (view.exit or {}).get("time") if view.finished else None
        for record in view.records:
            if record["state"] != "failed" or _same_collective(record, raised_from):
                continue
            gone = _gone_before(view, record, views)
            if gone:
                at_exit = ended is not None and record["entered"] >= ended
                found.append(LateCollective(rank, record, gone, at_exit))
    return found


def _same_collective(record: dict[str, Any], raised_from: dict[str, Any]) -> bool:
    return bool(raised_from) and all(record.get(key) == raised_from.get(key) for key in ("group", "seq", "op", "site"))


def _gone_before(view: RankView, record: dict[str, Any], views: dict[int, RankView]) -> tuple[int, ...]:
    """The members of the record's group (its peer, for a send or receive) that finished their
    script without reaching it."""
    if record["op"] in POINT_TO_POINT or record.get("seq") is None:
        match = P2P_PEER.search(record.get("signature") or "")
        peers = [int(match.group(2))] if match else []
        return tuple(p for p in peers if p != view.rank and p in views and views[p].finished)
    group, seq = record["group"], record["seq"]
    return tuple(
        peer for peer in dict.fromkeys(group_members(view, group, views))
        if peer != view.rank and peer in views and views[peer].finished and reached_on(views[peer], group) < seq
    )


def late_collective_finding(late: list[LateCollective], views: dict[int, RankView]) -> Finding:
    """One warning for every late collective: each rank's line and what its backend said, and
    where each peer that had left ended."""
    told = listing([
        (item.rank,
         f"rank {item.rank}'s {describe(item.record)} at {item.record.get('site') or '?'}"
         + (" (run at interpreter exit, by an exit handler)" if item.at_exit else "")
         + f" failed because {_peers_text(item.gone)} had already finished without it"
         + (f"; the backend said: {backend_words(item.record['error'])}" if item.record.get("error") else ""))
        for item in late
    ])
    gone = sorted({peer for item in late for peer in item.gone})
    ended = listing([(peer, f"rank {peer} ended {where_it_ended(views[peer])}") for peer in gone])
    ranks = sorted({item.rank for item in late})
    first = late[0]
    return Finding(
        "collective_after_peer_left",
        "warning",
        ranks,
        f"A collective ran after a peer had left: {told}. {ended[0].upper()}{ended[1:]}. "
        f"{ranks_text(ranks)} went on past the failure, so the job's exit code does not show it, but what "
        f"{'that collective was' if len(late) == 1 else 'those collectives were'} to compute or synchronise "
        "did not happen.",
        "A collective needs every rank of its group: run it where every rank runs it, before any rank "
        "finishes (a last all_reduce or barrier in the main code path, not in an atexit handler, a `__del__`, "
        "or a `finally:` or branch only some ranks reach), or do without it on the rank that alone runs it.",
        locations=_first_site_per_rank(late),
        collective=describe(first.record),
        details={"late_collectives": [
            {"rank": item.rank, "op": item.record["op"], "group": item.record["group"], "seq": item.record.get("seq"),
             "site": item.record.get("site"), "error": item.record.get("error"), "peers_gone": list(item.gone),
             "at_exit": item.at_exit}
            for item in late
        ]},
    )


def backend_words(error: str, limit: int = 240) -> str:
    """The first line of a recorded error, at most `limit` characters."""
    return clipped(first_line(error), limit)


def _first_site_per_rank(late: list[LateCollective]) -> dict[str, str]:
    sites: dict[str, str] = {}
    for item in late:
        sites.setdefault(str(item.rank), item.record.get("site") or "?")
    return sites


def _peers_text(peers: tuple[int, ...]) -> str:
    return ("rank " if len(peers) == 1 else "ranks ") + ", ".join(str(p) for p in peers)
