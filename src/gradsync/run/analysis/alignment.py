"""Where the ranks' collective sequences part: the first collective, on any group, at which two
ranks' records (or Flight Recorder entries) disagree, which ranks did the unusual thing there,
and the finding that tells it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from gradsync.run.analysis.paths import Parting, parting
from gradsync.run.analysis.views import RankView, group_members, last_site
from gradsync.run.analysis.wording import SUGGEST_SAME_COLLECTIVES, describe, listing, ranks_text
from gradsync.rundir.records import GROUP_CREATIONS, Finding


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
    # Found where a rank whose backend said "collective mismatch" died, paired with what its peers
    # were in then, rather than by comparing the records' numbers: the backend pairs collectives
    # in the order they reach it, which the records' numbers need not show (a collective issued
    # from a hook inside DDP's backward pass reaches Gloo before the pass's gradient buckets).
    in_flight: bool = False
    # The ranks that made an extra call at `seq`, which their peers did not (with `surfaced_at`:
    # one that paired silently until that later collective).
    extra: tuple[int, ...] = ()


def _key(record: dict[str, Any]) -> tuple:
    return (record["op"], record["signature"], record["kind"])


def find_divergence(views: dict[int, RankView]) -> Divergence | None:
    """The earliest collective, over all groups, at which two ranks' records disagree."""
    found: list[Divergence] = []
    # group -> rank -> seq -> record, for the ranks whose snapshot names the group: one pass over
    # each rank's records (not one per group, of which a large job has hundreds).
    by_group: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for rank, view in views.items():
        # A rank that died before its first snapshot named its groups: the groups of its records.
        groups = (view.snapshot or {}).get("groups") or {record["group"] for record in view.records}
        tables = {group: by_group.setdefault(group, {}).setdefault(rank, {}) for group in groups}
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


# A record's states while its collective has not returned (failed: it came out with an error).
_OPEN = ("entered", "issued", "failed")


def find_mismatch_in_flight(views: dict[int, RankView]) -> Divergence | None:
    """The collective in which a rank's backend said the two sides disagree, paired with each
    peer's record at the same number, or, for a peer that never got that far, the collective it
    was in: what the backend paired it with. None when no rank said so, or none died in a
    recorded collective."""
    found: list[Divergence] = []
    for view in views.values():
        if not view.said("collective_mismatch"):
            continue
        died_in = _died_in(view)
        if died_in is None:
            continue
        group, seq = died_in["group"], died_in["seq"]
        paired = {view.rank: died_in}
        for rank in group_members(view, group, views):
            other = views.get(rank)
            if other is None or rank == view.rank:
                continue
            met = _record_at(other, group, seq) or _newest_open(other, group)
            if met is not None:
                paired[rank] = met
        found.append(Divergence(group, seq, paired, in_flight=True))
    return min(found, key=lambda d: d.seq) if found else None


def _died_in(view: RankView) -> dict[str, Any] | None:
    """The recorded collective the rank ended in: the one its exception came out of, else its
    newest one that never returned."""
    where = (view.exception() or {}).get("collective")
    if where and where.get("seq") is not None:
        return _record_at(view, where["group"], where["seq"])
    return next((r for r in reversed(view.records) if r["state"] in _OPEN and r["seq"] is not None), None)


def _record_at(view: RankView, group: str, seq: int) -> dict[str, Any] | None:
    return next((r for r in reversed(view.records) if r["group"] == group and r["seq"] == seq), None)


def _newest_open(view: RankView, group: str) -> dict[str, Any] | None:
    return next((r for r in reversed(view.records) if r["group"] == group and r["state"] in _OPEN and r["seq"] is not None), None)


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
            return _first_extra_call(Divergence(group, seq, present), by_rank, key)
    return None


def _first_extra_call(divergence: Divergence, by_rank: dict[int, dict[int, dict[str, Any]]], key: Any = _key) -> Divergence:
    """Where the trouble began, by aligning the ranks' calls by what they are and where they were
    made. An extra collective with the same op and tensors as the one its peers call next pairs
    with it silently; every later one is then met by the peers' one before, until one no longer
    matches (`divergence`, where the backend finally aborts on the sizes). Up to there each rank's
    calls are aligned with the first rank's by (op, tensors, kind, line) from the start: the first
    call one side made and the other did not (_extra_calls) is the extra one, named on the ranks
    that made it. Two branches calling the same collective from different lines (`if rank
    == 0: broadcast(...) else: broadcast(...)`) are a replacement, not an extra call: `divergence`
    stands. Decided from the records' order alone, whatever the backend said of the later
    collective (its words are the evidence of where it broke, not of where it began)."""
    ranks = sorted(divergence.records)
    start = max(min(by_rank[rank]) for rank in ranks)  # the window every rank still holds

    def calls(rank: int) -> list[dict[str, Any]]:  # to its last record: what follows the parting is the evidence
        return [by_rank[rank][seq] for seq in range(start, max(by_rank[rank]) + 1) if seq in by_rank[rank]]

    def aligned(record: dict[str, Any]) -> tuple:
        return (*key(record), record.get("site"))

    made = {rank: calls(rank) for rank in ranks}
    first = [aligned(r) for r in made[ranks[0]]]
    extras: dict[int, set[int]] = {}  # seq of an extra call -> the ranks that made it there
    for rank in ranks[1:]:
        shift = _extra_calls(first, [aligned(r) for r in made[rank]])
        if shift is not None:
            side, at = shift
            maker = ranks[0] if side == 0 else rank
            extras.setdefault(made[maker][at]["seq"], set()).add(maker)
    if not extras:
        return divergence
    seq = min(extras)
    extra = tuple(sorted(extras[seq]))
    if seq > divergence.seq or len(extra) == len(ranks):
        return divergence
    if seq == divergence.seq:  # the parting itself is the extra call: its maker is the odd one out
        return Divergence(divergence.group, seq, divergence.records, extra=extra)
    present = {rank: by_rank[rank][seq] for rank in ranks if seq in by_rank[rank]}
    return Divergence(divergence.group, seq, present, surfaced_at=divergence, extra=extra)


MOST_EXTRA_CALLS = 4  # extra calls in a row looked for where two ranks' calls first part


def _extra_calls(first: list[tuple], other: list[tuple]) -> tuple[int, int] | None:
    """(0 or 1, position): where one of two ranks' calls made one to MOST_EXTRA_CALLS calls the
    other did not (0: `first` made them, 1: `other`), their calls matching one by one before that
    point and, shifted by those calls, every one after it that both made (at least one, as evidence). None when
    they first part some other way (a different call, not an extra one).

    Aligned from the start, not by the longest common stretch (a diff's way), which in a loop's
    repeated calls can pair a rank's step with the other's previous step."""
    common = min(len(first), len(other))
    part = next((i for i in range(common) if first[i] != other[i]), None)
    if part is None:
        return None
    for count in range(1, MOST_EXTRA_CALLS + 1):
        for side, longer, shorter in ((0, first, other), (1, other, first)):
            # As far as both went: the side with the extra calls may have got further, or not as far.
            after = range(part + count, min(len(longer), len(shorter) + count))
            if after and all(longer[i] == shorter[i - count] for i in after):
                return side, part
    return None


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


def _off_the_common_path(records: dict[int, dict[str, Any]], views: dict[int, RankView]) -> list[int]:
    """The ranks whose line at the parting no other rank ever called a collective from, while the
    other ranks' lines there are ones these ranks called too (a collective only rank 0 makes, met by
    the other rank's next training-loop collective, which rank 0 also made before): they left the
    path the ranks share. Empty when that does not single some ranks out (each side at a line of its
    own: two branches)."""
    sites = {rank: {r.get("site") for r in view.records} for rank, view in views.items()}
    alone = [rank for rank, record in records.items()
             if record.get("site") and not any(record["site"] in seen for other, seen in sites.items() if other != rank)]
    common = [record.get("site") for rank, record in records.items() if rank not in alone]
    if not alone or len(alone) == len(records) or not all(site in sites.get(rank, ()) for rank in alone for site in common):
        return []
    return sorted(alone)


def _retried(records: dict[int, dict[str, Any]], views: dict[int, RankView]) -> list[int]:
    """The ranks whose collective at the parting is the same call, at the same line, as their own
    one before it, which never finished: issued again on those ranks only (a retry after a wait
    that timed out), so it pairs with whatever their peers call next."""
    retried = []
    for rank, record in records.items():
        own = [r for r in views[rank].records if r["group"] == record["group"] and r["seq"] is not None] if rank in views else []
        before = next((r for r in reversed(own) if r["seq"] == record["seq"] - 1), None)
        if (before is not None and before["state"] in ("entered", "issued") and before.get("site") == record.get("site")
                and _key(before) == _key(record)):
            retried.append(rank)
    return sorted(retried) if 0 < len(retried) < len(records) else []


def _odd_ones_out(records: dict[int, dict[str, Any]], views: dict[int, RankView], retried: list[int],
                  parted: Parting | None) -> list[int]:
    """The ranks that did the unusual thing: a minority call site, a collective issued again
    (`retried`, _retried), a line off the path the ranks share, the rank whose path through the
    script went its own way (paths.parting), or a user collective facing DDP's."""
    by_site: dict[tuple, list[int]] = {}
    for rank, record in records.items():
        by_site.setdefault((_key(record), record.get("site")), []).append(rank)
    sizes = sorted(len(ranks) for ranks in by_site.values())
    if len(sizes) > 1 and sizes[0] < sizes[-1]:
        return sorted(r for ranks in by_site.values() if len(ranks) == sizes[0] for r in ranks)
    if retried:
        return retried
    off_path = _off_the_common_path(records, views)
    if off_path:
        return off_path
    if parted is not None:  # its odd ones, or none: two branches of one `if`
        return list(parted.odd) or sorted(records)
    user = sorted(rank for rank, record in records.items() if not record["kind"].startswith("DDP"))
    if 0 < len(user) < len(records):
        return user
    # DDP's own collectives during a forward that does not train (evaluation through the wrapper).
    not_training = sorted(rank for rank, record in records.items() if "(eval" in record["kind"] or "no_grad)" in record["kind"])
    if 0 < len(not_training) < len(records):
        return not_training
    return sorted(records)


_FROM_BACKEND = (
    " (Seen by PyTorch's Flight Recorder, which records every operation that reaches a process group, "
    "and numbers them as the group does: a collective gradsync's recorder does not see, such as a "
    "DTensor's, functional or compiled one, is among them.)"
)


def divergence_finding(divergence: Divergence, views: dict[int, RankView], trigger: str) -> Finding:
    finding = _divergence_finding_of_records(divergence, views, trigger)
    if any(r.get("source") == "flight" for r in divergence.records.values()):
        finding.message += _FROM_BACKEND
    said = backend_said_mismatch(views)
    if said:
        finding.message += " " + said
        finding.details = {**(finding.details or {}), "last_words": _mismatch_words(views)}
    return finding


def _creation_finding(divergence: Divergence, ranks: list[int], locations: dict[str, str]) -> Finding:
    """The ranks' process-group creations part (GROUP_CREATIONS): named at the creation some ranks
    made and the others did not, or made otherwise."""
    records = divergence.records
    sides = listing([(rank, f"rank {rank}: {describe(record)} at {record.get('site') or '?'}") for rank, record in sorted(records.items())])
    if divergence.extra:
        what = (f"{ranks_text(ranks)} created a process group that the other ranks never created ({sides}; the "
                f"others' creation #{divergence.seq} is the next group they all create)")
    else:
        what = f"The ranks' process-group creation #{divergence.seq} differs ({sides})"
    return Finding(
        "group_creation_mismatch",
        "error",
        ranks,
        f"{what}. Every rank of the job must make every process-group creation (new_group, new_subgroups, "
        "split_group, init_device_mesh), members or not, in the same order: torch names each group by counting "
        "the groups created before it, so from there on the ranks' groups differ, and a collective or a later "
        "creation on them waits for good or pairs with the wrong one.",
        "Create every group on every rank, in the same order, before any rank-dependent branch (at start-up, "
        "not lazily inside `if rank == 0:`); a rank that is not a member gets GroupMember.NON_GROUP_MEMBER "
        "back and simply never uses it. new_group(..., use_local_synchronization=True) is the exception: only "
        "its members call it.",
        locations=locations,
        collective="/".join(sorted({r["op"] for r in records.values()})),
    )


def backend_said_mismatch(views: dict[int, RankView]) -> str:
    """'Gloo on rank 0 said so as it aborted: it received 96 bytes where ... ("...")' for the
    ranks whose last words say the two sides of a collective disagreed ("" when none did)."""
    parts = []
    for rank, view in sorted(views.items()):
        if not view.said("collective_mismatch"):
            continue
        words = view.last_words
        how = "as it aborted" if view.signal == "SIGABRT" else "as it failed"
        sizes = f": {words.sizes()}" if words.sizes() else ""
        parts.append(f'The backend on rank {rank} said so {how}{sizes} ("{words.quote()}").')
    return " ".join(parts[:2])


def _mismatch_words(views: dict[int, RankView]) -> dict[str, Any]:
    return {str(rank): view.last_words.as_dict() for rank, view in sorted(views.items()) if view.said("collective_mismatch")}


def _exchange(record: dict[str, Any]) -> str:
    """', sending [3, 2] rows and expecting [2, 2]' for a record that kept what it exchanges per peer."""
    args = record.get("args") or {}
    if "in" not in args or "out" not in args:
        return ""
    return f", sending {args['in']} {args.get('unit', '')} and expecting {args['out']}".replace("  ", " ")


def _side(rank: int, record: dict[str, Any]) -> str:
    return f"rank {rank}: {describe(record)} at {record.get('site') or '?'}{_exchange(record)}"


def _unmatched_exchanges(divergence: Divergence, views: dict[int, RankView]) -> tuple[str, list[int]]:
    """'rank 1 sends 3 rows to rank 0, which expects 2', and those ranks, from the split sizes the
    ranks kept: what one rank sends another must be what that one expects from it."""
    records = divergence.records
    some = next(iter(records))
    members = group_members(views[some], divergence.group, views) if some in views else sorted(records)
    position = {rank: index for index, rank in enumerate(members)}
    said, ranks = [], set()
    for sender, sent in sorted(records.items()):
        for receiver, received in sorted(records.items()):
            send, expect = (sent.get("args") or {}).get("in"), (received.get("args") or {}).get("out")
            if send is None or expect is None or receiver not in position or sender not in position:
                continue
            if position[receiver] >= len(send) or position[sender] >= len(expect):
                continue
            count, wanted = send[position[receiver]], expect[position[sender]]
            if count != wanted:
                unit = (sent.get("args") or {}).get("unit", "")
                said.append(f"rank {sender} sends {count} {unit} to rank {receiver}, which expects {wanted}".replace("  ", " "))
                ranks.update((sender, receiver))
    return "; ".join(said[:4]), sorted(ranks)


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
        locations.setdefault(str(rank), view.location or last_site(view) or "?")
    parted = None if divergence.group == GROUP_CREATIONS else parting(records, views)
    retried = _retried(records, views)
    ranks = list(divergence.extra) or _odd_ones_out(records, views, retried, parted)
    if divergence.group == GROUP_CREATIONS:
        return _creation_finding(divergence, ranks, locations)
    sides = listing([(rank, _side(rank, record)) for rank, record in sorted(records.items())])
    if divergence.surfaced_at is not None:
        later = divergence.surfaced_at
        later_sides = listing([(rank, f"rank {rank}: {describe(r)} at {r.get('site') or '?'}") for rank, r in sorted(later.records.items())])
        extra = list(divergence.extra)
        return Finding(
            "collective_mismatch",
            "error",
            extra,
            f"From collective #{divergence.seq} on {group} the ranks' collectives paired different lines "
            f"({sides}): the same op and tensors, so the backend matched them, but {ranks_text(extra).lower()} had "
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
    # The backend saying the sides disagree outweighs records that look alike: they do not keep
    # everything the sides must agree on (an all_to_all's split sizes are not compared).
    backend_said = any(view.said("collective_mismatch") for view in views.values())
    if len(ops) == 1 and len(signatures) == 1 and not backend_said:
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
    if len(ops) == 1 and len(sites) == 1 and len({r["seq"] for r in records.values()}) == 1:
        unmatched, pair = _unmatched_exchanges(divergence, views)
        if len(signatures) > 1:
            what = f"with different tensors ({sides})."
        elif unmatched:
            what = f"what the ranks exchange does not agree: {unmatched} ({sides})."
        else:
            what = f"the sizes the ranks exchanged did not agree ({sides})."
        return Finding(
            "shape_mismatch",
            "error",
            pair or ranks,
            f"Collective #{divergence.seq} on {group} is the same {collective} on every rank but {what}",
            "Make the tensor shape and dtype identical on every rank (pad to a common size, or use "
            "all_gather_object / pass the sizes first for variable-size data); for all_to_all, exchange "
            "the split sizes first (an all_to_all_single of the counts) so what each rank expects is what "
            "its peers send.",
            locations=locations,
            collective=collective,
        )
    verb = "hung" if trigger == "stall" else "failed"
    ahead = ""
    if divergence.in_flight:
        ahead_ranks = _ahead_of_peers(records)
        if ahead_ranks:
            ranks = ahead_ranks
            ahead = (f" {ranks_text(ahead_ranks)} had called a collective its peers never reached (one issued where "
                     "they do not issue it, such as inside a hook during backward), so the backend paired it with the "
                     "collective they were in.")
    if retried and retried == sorted(ranks):
        ahead += (f" {ranks_text(retried)} issued it again while {'its' if len(retried) == 1 else 'their'} own call at "
                  "the same line before it had not finished: a collective re-issued on some ranks only (a retry after "
                  "a wait that timed out) pairs with whatever the others call next. Keep waiting on the first call, "
                  "or decide to retry on every rank together.")
    parting_text = ""
    # Told where it agrees with the ranks named (an older rule may have decided otherwise).
    if parted is not None and not ahead and sorted(parted.odd or records) == sorted(ranks):
        parting_text = parted.text()
        for rank in parted.odd:
            locations[str(rank)] = parted.site(rank)
    return Finding(
        "collective_mismatch",
        "error",
        ranks,
        f"The job {verb} because the ranks' collectives stopped matching at collective #{divergence.seq} "
        f"on {group}: {sides}.{ahead}{parting_text}",
        SUGGEST_SAME_COLLECTIVES,
        locations=locations,
        collective=collective,
    )


def _ahead_of_peers(records: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks whose record is numbered beyond every other's: they issued one the others did not."""
    ahead = []
    for rank, record in records.items():
        others = [r["seq"] for other, r in records.items() if other != rank]
        if others and record["seq"] > max(others):
            ahead.append(rank)
    return sorted(ahead)
