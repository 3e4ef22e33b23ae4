"""loss_scale: a loss divided by the world size although DDP already averages the gradients.

DDP averages gradients over the ranks; a loss that also divides by the world size makes every
update 1/world of the one-process update, and the learning rate falls as ranks are added. Read
from the autograd graph down to the loss's reduction; an accumulation over as many micro-steps as
ranks is scaled the same way, and is not judged.
"""

from __future__ import annotations

import statistics

from gradsync.rundir.records import Finding
from gradsync.run.scriptcheck.shared_facts import consistency_recorded
from gradsync.run.scriptcheck.unit import Category, Check, RankFacts


_SCALE_TOLERANCE = 1e-4  # relative: a loss scale equal to 1/world size up to float rounding


def _close(value: float, target: float) -> bool:
    return abs(value - target) <= _SCALE_TOLERANCE * abs(target)


def loss_divided_by_world_size(checks: RankFacts) -> list[Finding]:
    if not consistency_recorded(checks):
        return []
    world = len(checks)
    findings = []
    for rank, facts in sorted(checks.items()):
        walks = [w for w in facts["loss_walks"] if w.get("scale") is not None]
        micro = statistics.median(facts["backwards_per_step"]) if facts["backwards_per_step"] else 1
        if not walks or _close(1 / world, 1 / micro) or _close(1 / world, 1.0):
            continue  # an accumulation over as many micro-steps as ranks is scaled the same way
        if not all(_close(w["scale"], 1 / world) or _close(w["scale"], 1 / (world * micro)) for w in walks):
            continue
        site = walks[0]["site"] or "?"
        division = walks[0].get("factor_site")  # where the constant factor was applied, when anomaly mode saw it
        reduction = "sum" if walks[0]["reduction"] == "sum" else "mean"
        findings.append(Finding(
            "loss_scaled_by_world_size",
            "warning",
            sorted(checks),
            f"The loss passed to backward at {site} is the {reduction} over this rank's {walks[0]['elements']} "
            f"samples (or elements) times {walks[0]['factor']:.6g}"
            f"{f' (the factor applied at {division})' if division else ''}: with {world} ranks that is 1/{world} of "
            "this rank's mean loss, as if normalised by the global batch. DDP already averages the gradients over the "
            f"ranks, so every update is 1/{world} of the intended one, and the effective learning rate falls as ranks "
            "are added.",
            "Normalise the loss as on one process, by this rank's own batch (the mean over its samples): DDP's "
            "average over ranks then gives the mean over the global batch. Divide only by the accumulation steps.",
            locations={str(r): division or site for r in sorted(checks)},
            details={"scale": walks[0]["scale"], "world_size": world},
        ))
        break  # the same code on every rank: one finding
    return findings


CHECK = Check(
    name="loss_scale",
    summary="a loss divided by the world size (DDP averages already)",
    categories={
        "loss_scaled_by_world_size": Category(
            ("warning",),
            "the loss divides by the world size although DDP averages: updates 1/world",
            "the loss passed to backward is a mean (or a sum over the local batch) times 1/world size, read from "
            "the autograd graph down to its reduction: every update is 1/world of the intended one. Not judged "
            "when the accumulation steps equal the world size, or when the loss adds terms",
        ),
    },
    rule=loss_divided_by_world_size,
)
