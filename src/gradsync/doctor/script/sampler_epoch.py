"""sampler_epoch: a shuffling DistributedSampler started another pass with the same epoch (no set_epoch).

Its shuffle is seeded by its epoch, so every epoch repeats the same order. Passes are compared
per sampler and per line that iterates it: a script may iterate a sampler twice in one epoch on
purpose (list(sampler) to warm a cache, then the DataLoader), each at its own line. Only samplers
that feed training (or are used without any DataLoader seen) count: an evaluation order repeated
each epoch is harmless.
"""

from __future__ import annotations

from typing import Any

from gradsync.rundir.records import Finding
from gradsync.doctor.script.compare import ranks_text
from gradsync.doctor.script.unit import Category, Check, RankFacts


def sampler_epoch_not_set(checks: RankFacts) -> list[Finding]:
    repeats: dict[int, dict[str, Any]] = {}
    for rank, facts in sorted(checks.items()):
        attached = {loader["sampler"] for loader in facts["loaders"] if loader["sampler"] is not None}
        training = {loader["sampler"] for loader in facts["loaders"] if loader["feeds_training"] and loader["sampler"] is not None}
        # Per sampler and per line that iterates it: a script may iterate a sampler twice in one
        # epoch on purpose (list(sampler) to warm a cache, then the DataLoader), each at its own line.
        last: dict[tuple[int, str | None], dict[str, Any]] = {}
        for sampler_pass in facts["sampler_passes"]:
            key = sampler_pass["sampler"]
            # An evaluation order repeated each epoch is harmless: only samplers feeding training
            # (or used without any DataLoader seen) count.
            relevant = key in training or key not in attached
            previous = last.get((key, sampler_pass["site"]))
            if (
                sampler_pass["shuffle"]
                and relevant
                and previous is not None
                and previous["epoch"] == sampler_pass["epoch"]
                and previous.get("set_epoch_calls", 0) == sampler_pass.get("set_epoch_calls", 0)
            ):
                repeats[rank] = sampler_pass
                break
            last[(key, sampler_pass["site"])] = sampler_pass
    if not repeats:
        return []
    epochs = sorted({p["epoch"] for p in repeats.values()})
    # Named at the loop around the pass (the epoch loop): where the missing set_epoch call belongs.
    loops = sorted({p.get("epoch_loop") or p["site"] or "?" for p in repeats.values()})
    return [
        Finding(
            "sampler_epoch_not_set",
            "warning",
            sorted(repeats),
            f"A shuffling DistributedSampler started another pass with the same epoch ({', '.join(map(str, epochs))}) "
            f"as its previous pass on {ranks_text(list(repeats))} (pass at "
            f"{', '.join(sorted({p['site'] or '?' for p in repeats.values()}))}, in the loop at {', '.join(loops)}): "
            "every epoch repeats the same order, because the sampler's shuffle is seeded by its epoch and the loop "
            "never calls set_epoch.",
            f"Call sampler.set_epoch(epoch) at the start of the loop at {loops[0]}, before iterating the DataLoader "
            "(gradsync's trainer.epochs() does it for its loader).",
            locations={str(rank): p.get("epoch_loop") or p["site"] or "?" for rank, p in sorted(repeats.items())},
            details={"epoch": epochs[0]},
        )
    ]


CHECK = Check(
    name="sampler_epoch",
    summary="a shuffling DistributedSampler repeating its order (no set_epoch)",
    categories={
        "sampler_epoch_not_set": Category(
            ("warning",),
            "a shuffling DistributedSampler repeated an epoch's order (no set_epoch)",
            "a shuffling `DistributedSampler` was iterated again at the same line with the same epoch and no "
            "`set_epoch` in between: same order every epoch. Named at the loop around the pass, where `set_epoch` "
            "belongs. Two passes in one epoch at two lines "
            "(`list(sampler)` to warm a cache, then the DataLoader) are not this",
        ),
    },
    rule=sampler_epoch_not_set,
)
