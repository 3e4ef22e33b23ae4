"""data_split: random_split split the dataset differently per rank.

Without a generator it draws from torch's generator, which a script may seed differently per
rank: each rank's training set then holds samples another rank holds out for validation, so
validation measures samples the model was trained on. Named at the split. A split that differs is
also why the ranks' shares of it overlap: while it is reported, `sampler_overlap` is not.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, TypedDict

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import odd_ones_out, ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "data_split"
MAX_SPLITS = 64  # random_split calls kept per rank
MAX_INDICES = 200_000  # a split larger than this keeps its CRCs only (too large to compare sample by sample)


class SplitFacts(TypedDict):
    """What the watch records on one rank (under "data_split" in its facts file)."""

    splits: list[dict[str, Any]]  # {"site", "generator_given", "lengths", "crcs", "indices"}


class SplitWatch:
    """Each `random_split` one rank made: its line, whether it was given a generator, and its splits."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.splits: list[dict[str, Any]] = []

    def install(self, patches: Patches) -> None:
        import torch.utils.data as data
        import torch.utils.data.dataset as dataset_module

        watch = self
        original_split = dataset_module.random_split

        @functools.wraps(original_split)
        def random_split(dataset, lengths, *args, **kwargs):
            subsets = original_split(dataset, lengths, *args, **kwargs)
            with watch.bookkeeping:
                watch._split(subsets, generator_given=len(args) > 0 or "generator" in kwargs)
            return subsets

        for owner in (data, dataset_module):  # where scripts import it from
            if getattr(owner, "random_split", None) is original_split:
                patches.replace(owner, "random_split", random_split)

    def _split(self, subsets: list[Any], generator_given: bool) -> None:
        if len(self.splits) >= MAX_SPLITS:
            return
        indices = [list(map(int, subset.indices)) for subset in subsets]
        keep = sum(len(i) for i in indices) <= MAX_INDICES
        self.splits.append({
            "site": caller_location(),
            "generator_given": generator_given,
            "lengths": [len(i) for i in indices],
            "crcs": [zlib.crc32(repr(i).encode()) for i in indices],
            "indices": indices if keep else None,
        })

    def facts(self) -> SplitFacts:
        return {"splits": self.splits}


def splits_differ(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    count = min(len(facts["splits"]) for facts in recorded.values())
    findings = []
    for index in range(count):
        splits = {rank: facts["splits"][index] for rank, facts in recorded.items()}
        if len({tuple(s["crcs"]) for s in splits.values()}) == 1:
            continue
        ranks = odd_ones_out({rank: tuple(s["crcs"]) for rank, s in splits.items()})
        first = splits[min(splits)]
        leak = ""
        other = next((r for r in sorted(splits) if tuple(splits[r]["crcs"]) != tuple(first["crcs"])), None)
        if other is not None and first["indices"] and splits[other]["indices"] and len(first["indices"]) > 1:
            shared = len(set(first["indices"][0]) & set(splits[other]["indices"][1]))
            leak = (f" {shared} of rank {min(splits)}'s {len(first['indices'][0])} samples in the first split are in "
                    f"rank {other}'s second one.")
        generator = "" if first["generator_given"] else " without a generator,"
        findings.append(Finding(
            "data_split_differs",
            "error",
            ranks,
            f"random_split at {first['site'] or '?'} split the dataset differently on {ranks_text(ranks)}:{generator} it "
            "draws from torch's generator, which this script seeds differently per rank. Each rank's training set "
            f"holds samples another rank holds out for validation, so validation measures samples the model was "
            f"trained on.{leak}",
            "Split the same way on every rank: random_split(dataset, lengths, generator=torch.Generator()."
            "manual_seed(42)), or split before seeding per rank, or split once on disk.",
            locations={str(rank): splits[rank]["site"] or "?" for rank in ranks},
            details={"lengths": first["lengths"]},
        ))
    return findings


CHECK = Check(
    name="data_split",
    summary="random_split splitting the dataset differently per rank",
    categories={
        "data_split_differs": Category(
            ("error",),
            "random_split split the dataset differently per rank: training and validation overlap",
            "a `random_split` gave different splits on different ranks (no generator, after per-rank seeding): "
            "each rank trains on samples another holds out for validation; named at the split",
        ),
    },
    rule=splits_differ,
    explains={"data_split_differs": ("sampler_overlap",)},
    watch=SplitWatch,
    facts=SplitFacts,
)
