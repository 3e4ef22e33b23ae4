"""uneven_batches: the ranks get different numbers of batches per epoch from one DataLoader.

Every training batch all-reduces gradients, so when the ranks with fewer batches leave the loop,
the others wait for partners that never come: the job hangs at the end of the epoch (or pairs
their gradients with a different collective). Only loaders that feed training count, and a loop
under `Join` (which shadows the missing steps) is left alone.
"""

from __future__ import annotations

from typing import Any

from gradsync.rundir.records import Finding
from gradsync.doctor.script.compare import odd_ones_out
from gradsync.doctor.script.unit import Category, Check, RankFacts


def uneven_batches(checks: RankFacts) -> list[Finding]:
    by_key: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        for loader in facts["loaders"]:
            by_key.setdefault(loader["key"], {})[rank] = loader
    findings = []
    reported_sites = set()
    for entries in by_key.values():
        site = next(iter(entries.values()))["site"]
        batches = {rank: loader["batches"] for rank, loader in entries.items()}
        if (
            len(entries) < 2
            or site in reported_sites
            or None in batches.values()
            or len(set(batches.values())) == 1
            or not any(loader["feeds_training"] for loader in entries.values())
            or any(loader["under_join"] for loader in entries.values())  # Join shadows the missing steps
        ):
            continue
        reported_sites.add(site)
        counts = ", ".join(
            f"rank {rank}: {n} batches" + (f" ({entries[rank]['samples']} samples)" if entries[rank]["samples"] is not None else "")
            for rank, n in sorted(batches.items())
        )
        findings.append(
            Finding(
                "uneven_batches",
                "error",
                odd_ones_out(batches),
                f"The ranks have different numbers of batches per epoch from the DataLoader iterated at {site} "
                f"({counts}). Every training batch all-reduces gradients, so when the ranks with fewer batches "
                "leave the loop, the others wait for partners that never come: the job will hang at the end of "
                "the epoch (or pair their gradients with a different collective).",
                "Give every rank the same number of batches: DistributedSampler (it pads every rank to the same "
                "number of samples, or trims with drop_last=True) or gradsync's loader instead of a hand-made "
                "shard; if uneven inputs are intended, train inside `with Join([ddp]):` "
                "(torch.distributed.algorithms.join).",
                locations={str(rank): site or "?" for rank in sorted(entries)},
                details={"batches": {str(r): n for r, n in sorted(batches.items())}},
            )
        )
    return findings


CHECK = Check(
    name="uneven_batches",
    summary="ranks with different numbers of batches per epoch (a hang at its end)",
    categories={
        "uneven_batches": Category(
            ("error",),
            "ranks have different numbers of batches per epoch: a hang at the epoch's end",
            "ranks' loaders have different lengths: the job will hang at the end of the epoch",
        ),
    },
    rule=uneven_batches,
)
