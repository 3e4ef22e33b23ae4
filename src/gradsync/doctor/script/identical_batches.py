"""identical_batches: every rank fed DDP the same inputs, as without a DistributedSampler.

The ranks then train on identical batches: N processes do the work of one (every batch is
computed N times) and the run is no faster than on one process, and nothing fails. Said only
when every training forward compared (one whose inputs every rank fingerprinted) agrees across
the ranks. Every rank drawing the same samples is also why their shares overlap: that is this
finding, and `sampler_overlap` is not reported beside it.
"""

from __future__ import annotations

from typing import Any

from gradsync.rundir.records import Finding
from gradsync.doctor.script.unit import Category, Check, RankFacts


def identical_batches(checks: RankFacts) -> list[Finding]:
    if len(checks) < 2:
        return []
    forwards = {rank: facts["forwards"] for rank, facts in checks.items()}
    compared = [
        index
        for index in range(min(len(f) for f in forwards.values()))
        if all(f[index]["fingerprint"] is not None for f in forwards.values())
    ]
    if not compared or any(len({f[i]["fingerprint"] for f in forwards.values()}) > 1 for i in compared):
        return []
    first = {rank: f[compared[0]] for rank, f in forwards.items()}
    loaders = sorted({forward["loader"] for forward in first.values() if forward["loader"]})
    source = f", batches from the DataLoader iterated at {', '.join(loaders)}" if loaders else ""
    causes = {rank: _chosen_at(checks[rank], forward) for rank, forward in first.items()}
    ranks = sorted(checks)
    cause = causes[ranks[0]]
    if cause is not None:
        source += (f": the IterableDataset's loop at {cause[1]} yields every sample on every rank" if cause[0] == "dataset"
                   else f", built at {cause[1]} without a DistributedSampler")
    return [
        Finding(
            "no_distributed_sampler",
            "error",
            ranks,
            f"Every rank fed DDP the same inputs in each of the {len(compared)} training forwards compared "
            f"(at {first[ranks[0]]['site'] or '?'}{source}): the ranks train on identical batches, so the "
            f"{len(ranks)} processes do the work of one (every batch is computed {len(ranks)} times) and the run "
            "is no faster than on one process.",
            "Give each rank its own share of the data: DataLoader(dataset, sampler=DistributedSampler(dataset)) "
            "(an IterableDataset yields only the samples of its rank: every world_size-th from its rank on) "
            "with sampler.set_epoch(epoch) at the start of each epoch, or gradsync's loader "
            "(trainer.prepare(model, optimizer, dataset, batch_size=...)). Data generated on each rank needs "
            "a different seed per rank.",
            locations={str(rank): causes[rank][1] if causes[rank] else forward["site"] or "?"
                       for rank, forward in sorted(first.items())},
            details={"forwards_compared": len(compared)},
        )
    ]


def _chosen_at(facts: dict[str, Any], forward: dict[str, Any]) -> tuple[str, str] | None:
    """Where the samples of a forward's DataLoader were chosen: the loop of its IterableDataset's
    __iter__ ("dataset"), else the line that built the loader ("loader"); None when unknown."""
    loader = next((entry for entry in facts["loaders"] if entry["site"] == forward["loader"]), None) if forward["loader"] else None
    if loader is None:
        return None
    if loader.get("dataset_loop"):
        return "dataset", loader["dataset_loop"]
    return ("loader", loader["built_at"]) if loader.get("built_at") else None


CHECK = Check(
    name="identical_batches",
    summary="every rank fed DDP the same batches (no DistributedSampler)",
    categories={
        "no_distributed_sampler": Category(
            ("error",),
            "every rank fed DDP identical inputs: the ranks train on the same batches",
            "every rank's DDP forwards saw identical inputs: each rank trains on all the data. Named where the samples "
            "were chosen: the line that built the DataLoader without a DistributedSampler, or the loop of an "
            "IterableDataset's `__iter__` that yields every sample on every rank",
        ),
    },
    rule=identical_batches,
    explains={"no_distributed_sampler": ("sampler_overlap",)},
)
