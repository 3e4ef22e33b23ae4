"""accumulation: gradients all-reduced on every micro-step of a gradient accumulation (no `no_sync`).

Only the sum at the last micro-step is used, so synchronising the others is k× the needed
gradient traffic. Judged on the median step: a few steps a GradScaler skipped (their passes
synced, no step) do not count.
"""

from __future__ import annotations

import statistics

from gradsync.rundir.records import Finding
from gradsync.doctor.script.compare import ranks_text
from gradsync.doctor.script.unit import Category, Check, RankFacts


def accumulation_without_no_sync(checks: RankFacts) -> list[Finding]:
    # The median per step ignores a few steps a GradScaler skipped (their passes synced, no step).
    affected = {
        rank: facts
        for rank, facts in sorted(checks.items())
        if facts["syncs_per_step"] and statistics.median(facts["syncs_per_step"]) >= 2
    }
    if not affected:
        return []
    ratios = {rank: sum(f["syncs_per_step"]) / len(f["syncs_per_step"]) for rank, f in affected.items()}
    ratio = max(ratios.values())
    facts = next(iter(affected.values()))
    return [
        Finding(
            "accumulation_without_no_sync",
            "warning",
            sorted(affected),
            f"Gradients were all-reduced on {ratio:.3g} backward passes per optimizer step "
            f"({sum(facts['syncs_per_step'])} synchronised passes for {len(facts['syncs_per_step'])} steps on "
            f"{ranks_text([next(iter(affected))])}): the micro-steps of an accumulation synchronise although only "
            f"the sum at the last one is used, {ratio:.3g}× the needed gradient traffic.",
            "Run the forward and backward of every micro-step but the last under `with ddp.no_sync():` (the "
            "summed gradient is the same), or let gradsync accumulate: gradsync.setup(accumulation_steps=N).",
            locations={str(rank): f["backward_site"] or "?" for rank, f in affected.items()},
            details={"syncs_per_step": {str(rank): round(r, 3) for rank, r in ratios.items()}},
        )
    ]


CHECK = Check(
    name="accumulation",
    summary="gradient accumulation without no_sync (k× the gradient traffic)",
    categories={
        "accumulation_without_no_sync": Category(
            ("warning",),
            "gradients were all-reduced on micro-steps that end in no optimizer step",
            "gradients all-reduced on every micro-step (k× the needed traffic); use `no_sync()`",
        ),
    },
    rule=accumulation_without_no_sync,
)
