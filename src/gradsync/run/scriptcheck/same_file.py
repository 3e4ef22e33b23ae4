"""same_file: several ranks of one host wrote the same path.

The writes overlap, and the file that survives holds one random rank's data, or a mix of several:
a torn checkpoint with torch.save (an error), a garbled file with the script's own open (a
warning). Each host's own disk is its own: only ranks of one host are compared. At most three
paths are named.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gradsync.rundir.records import Finding
from gradsync.run.scriptcheck.compare import ranks_text
from gradsync.run.scriptcheck.shared_facts import consistency_recorded
from gradsync.run.scriptcheck.unit import Category, Check, RankFacts


def same_file_written(checks: RankFacts) -> list[Finding]:
    if not consistency_recorded(checks):
        return []
    writers: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        for write in facts["writes"]:
            writers.setdefault((facts["host"], write["path"]), {}).setdefault(rank, write)
    findings = []
    for (host, path), by_rank in sorted(writers.items()):
        if len(by_rank) < 2:
            continue
        ranks = sorted(by_rank)
        saves = any(w["how"] == "torch.save" for w in by_rank.values())
        together = Counter(w["step"] for w in by_rank.values()).most_common(1)[0][1] > 1
        site = by_rank[ranks[0]]["site"] or "?"
        findings.append(Finding(
            "same_file_written",
            "error" if saves else "warning",
            ranks,
            f"{ranks_text(ranks).capitalize()} on host {host} all wrote {path} (with {by_rank[ranks[0]]['how']} at {site})"
            f"{', at the same step' if together else ''}: the writes overlap, and the file that survives holds one "
            "random rank's data, or a mix of several" + (" (a torn checkpoint)." if saves else "."),
            "Write from one rank (`if dist.get_rank() == 0:` and a barrier before others read it), or give each rank "
            "its own path (f'...rank{rank}.pt'); for sharded state use torch.distributed.checkpoint, "
            "which writes one file per rank by design.",
            locations={str(r): by_rank[r]["site"] or "?" for r in ranks},
            details={"path": path},
        ))
        if len(findings) >= 3:
            break
    return findings


CHECK = Check(
    name="same_file",
    summary="several ranks writing the same file",
    categories={
        "same_file_written": Category(
            ("error", "warning"),
            "several ranks wrote the same file: overlapping writes",
            "several ranks of one host wrote the same path (error with `torch.save`, warning with the user's own "
            "`open`): overlapping writes, a torn or random rank's file",
        ),
    },
    rule=same_file_written,
)
