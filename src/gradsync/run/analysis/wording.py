"""How the findings say things: a record as 'all_reduce #12 (...)', lists of ranks that stay
readable at a thousand ranks, and the phrases several findings share.

Text only: nothing here reads a rank.
"""

from __future__ import annotations

from typing import Any
from gradsync.rundir.records import GROUP_CREATIONS


def describe(record: dict[str, Any]) -> str:
    """'all_reduce #12 (DDP gradient bucket 0, float32[1234])' for a record."""
    if record.get("group") == GROUP_CREATIONS:
        return f"{record['op']}({record.get('signature') or ''}) (group creation #{record.get('seq')})"
    thread = (record.get("args") or {}).get("thread")
    inside = ", ".join(part for part in (record.get("kind"), record.get("signature"), thread and f"from thread '{thread}'") if part)
    number = f" #{record['seq']}" if record.get("seq") is not None else ""
    group = "" if record.get("group") == "default" else f" on {record.get('group')}"
    return f"{record['op']}{number}{group}" + (f" ({inside})" if inside else "")


def ranks_text(ranks: dict[int, Any] | list[int]) -> str:
    ranks = sorted(ranks)
    return ("Rank " if len(ranks) == 1 else "Ranks ") + ", ".join(str(r) for r in ranks)


LISTED_RANKS = 8  # beyond this many, ranks in the same position are said once


def listing(parts: list[tuple[int, str]]) -> str:
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


def first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""


def clipped(text: str, limit: int = 240) -> str:
    """`text`, cut to `limit` characters with '...' when longer: a quote inside a message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


SUGGEST_SAME_COLLECTIVES = (
    "Every rank must call the same collectives in the same order. Keep collectives out of "
    "rank-dependent branches (e.g. move dist.barrier() out of `if rank == 0:`), give every rank "
    "the same number of batches (DistributedSampler with drop_last=True, or gradsync's "
    "DistributedLoader), and decide to skip a batch or stop early on all ranks together "
    "(gradsync's agree_any, or an all_reduce of the flag)."
)


# How a rank's line and the unreachable finding say a rank whose node never reported.
NEVER_HEARD_OF = "never heard of (the store the nodes share did not answer)"
