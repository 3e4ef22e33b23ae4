"""sampler_overlap: in one pass of a training DataLoader, the ranks' shares of the dataset overlap.

They must not overlap (beyond a DistributedSampler's padding), and a whole pass must cover the
dataset (beyond what drop_last trims): otherwise the ranks train on overlapping data, and part of
the dataset is never seen, every epoch. Read from the indices each rank drew, mapped through
Subset to the dataset. Ranks that drew exactly the same indices draw one share together (the
tensor-parallel ranks of one data-parallel rank) and count once. When every rank drew the same
(no_distributed_sampler) or a random_split differs (data_split_differs), that finding is said
instead of this one.
"""

from __future__ import annotations

from typing import Any

from gradsync.rundir.records import Finding
from gradsync.run.scriptcheck.compare import odd_ones_out, ranks_text
from gradsync.run.scriptcheck.shared_facts import consistency_recorded
from gradsync.run.scriptcheck.unit import Category, Check, RankFacts


def sampler_overlap(checks: RankFacts) -> list[Finding]:
    if not consistency_recorded(checks):
        return []
    passes: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        training = {loader["key"] for loader in facts["loaders"] if loader["feeds_training"]}
        for draw in facts.get("loader_draws", []):
            if draw["loader"] in training and draw["indices"] is not None:
                passes.setdefault((draw["loader"], draw["pass"]), {})[rank] = draw
    for key in sorted(passes):
        draws = passes[key]
        if len(draws) != len(checks):
            continue
        first = draws[min(draws)]
        size = first["dataset_size"]
        if any(d["dataset_size"] != size for d in draws.values()):
            continue  # different datasets per rank: a hand-made shard, judged by uneven_batches
        # Partial passes (stopped at step K) are compared on the samples every rank has drawn so far.
        length = min(len(d["indices"]) for d in draws.values())
        shares = {tuple(d["indices"][:length]): rank for rank, d in sorted(draws.items(), reverse=True)}
        if len(shares) < 2:
            continue
        drawers: dict[int, set[int]] = {}
        for share, rank in shares.items():
            for index in share:
                drawers.setdefault(index, set()).add(rank)
        twice = sum(1 for ranks in drawers.values() if len(ranks) > 1)
        samplers = {rank: d["sampler"] for rank, d in draws.items()}
        distributed = all(samplers.values())
        total = first["sampler"]["total_size"] if distributed else size
        complete = all(d["complete"] and len(d["indices"]) == length for d in draws.values())
        never = size - len(drawers) if complete else 0
        allowed_never = max(0, size - total) if distributed else len(shares) - 1  # drop_last, a shard's remainder
        if twice <= max(0, total - size) and never <= allowed_never:
            continue
        ranks, cause = _overlap_cause(samplers, len(checks))
        sites = {rank: (s["site"] if s else None) or draws[rank]["site"] or "?" for rank, s in samplers.items()}
        built = f"the DistributedSampler built at {sites[min(sites)]}" if distributed else f"the DataLoader iterated at {first['site'] or '?'}"
        drawn = f"{twice} of the {size} samples to more than one rank" + (f" and {never} to none" if complete else
                                                                          f" in the first {length} samples of each rank's pass")
        epoch = f"epoch {first['sampler']['epoch']}" if distributed else f"pass {key[1]}"
        return [Finding(
            "sampler_overlap",
            "error",
            ranks,
            f"In {epoch}, {built} gave {drawn}: {cause}. The ranks train on overlapping data"
            + (" and part of the dataset is never seen" if never else "") + ", every epoch.",
            "Split one shared order: DataLoader(dataset, sampler=DistributedSampler(dataset)) with the same seed on "
            "every rank (the default, or seed=args.seed without the rank), taking rank and num_replicas from the "
            "process group, and sampler.set_epoch(epoch) each epoch.",
            locations={str(rank): sites[rank] for rank in ranks},
            details={"pass": key[1], "drawn_twice": twice, "never_drawn": never, "samples": size, "complete": complete},
        )]
    return []


def _overlap_cause(samplers: dict[int, dict[str, Any] | None], world: int) -> tuple[list[int], str]:
    """(the ranks to blame, why their shares overlap), from what their samplers say."""
    if not any(samplers.values()):
        return sorted(samplers), ("no rank uses a DistributedSampler: each one draws from the whole dataset in its "
                                  "own order")
    if not all(samplers.values()):
        ranks = sorted(r for r, s in samplers.items() if s is None)
        return ranks, f"{ranks_text(ranks)} draw without a DistributedSampler while the others use one"
    seeds = {rank: s["seed"] for rank, s in samplers.items()}
    if len(set(seeds.values())) > 1:
        return odd_ones_out(seeds), (
            f"the samplers' seeds differ ({', '.join(f'rank {r}: seed={v}' for r, v in sorted(seeds.items()))}), so each "
            "rank slices its share out of a different permutation")
    positions = {rank: (s["rank"], s["num_replicas"]) for rank, s in samplers.items()}
    replicas = next(iter(positions.values()))[1]
    if len({p[0] for p in positions.values()}) < min(replicas, world) or len({p[1] for p in positions.values()}) > 1:
        return odd_ones_out(positions), ("the samplers' rank/num_replicas do not match the job's (" +
                                         ", ".join(f"rank {r}: rank={p[0]} of {p[1]}" for r, p in sorted(positions.items())) + ")")
    return sorted(samplers), "the ranks' samplers did not split the same order"


CHECK = Check(
    name="sampler_overlap",
    summary="ranks' shares of the data overlapping, or leaving samples out",
    categories={
        "sampler_overlap": Category(
            ("error",),
            "the ranks' DistributedSamplers drew overlapping samples and left others out",
            "in one pass of a training DataLoader, the ranks' shares overlap beyond a `DistributedSampler`'s "
            "padding (or a whole pass leaves out more than `drop_last` trims), read from the indices each rank's "
            "loader drew, mapped through `Subset` to the dataset: sampler seeds that differ per rank, a hand-set "
            "`rank`/`num_replicas`, or no `DistributedSampler` at all with a shuffle per rank (no batch is "
            "identical, yet every rank walks the whole dataset). A pass stopped at step K is compared on what was "
            "drawn so far. Ranks that drew exactly the same indices (tensor-parallel ranks of one data-parallel "
            "rank) count once; samplers drawing with replacement are left alone; named at the sampler's "
            "construction, or at the loop without one",
        ),
    },
    rule=sampler_overlap,
)
