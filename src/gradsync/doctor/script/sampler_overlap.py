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

import weakref
from typing import Any, TypedDict

import torch
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches, index_sampler
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import odd_ones_out, ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "sampler_overlap"
MAX_INDICES = 200_000  # a sampler pass longer than this keeps no indices (too large to compare)
INDEXED_PASSES = 4  # passes per DataLoader whose indices are kept
MAX_DRAWS = 64  # passes kept per rank


class ShareFacts(TypedDict):
    """What the watch records on one rank (under "sampler_overlap" in its facts file)."""

    loader_draws: list[dict[str, Any]]  # per pass: {"loader", "site", "pass", "dataset_size", "indices", "complete", "sampler", ...}


class ShareWatch:
    """The dataset indices each DataLoader pass of one rank draws (mapped through `Subset` to the
    dataset underneath), with its DistributedSampler's seed, rank and line. Not for an
    IterableDataset (no indices), nor for a sampler that draws with replacement (shares overlap
    by design)."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.loader_draws: list[dict[str, Any]] = []
        self._sampler_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._passes: dict[str, int] = {}  # DataLoader key -> passes seen
        self._starting: tuple[dict[str, Any], list[Any]] | None = None  # a pass whose iterator is being built
        self._draws: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # iterator -> (its pass's record, Subset chain)
        moments.on("loader_pass", self._loader_pass, self.bookkeeping)
        moments.on("iterator_made", self._iterator_made, self.bookkeeping)
        moments.on("drew", self._drew, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        watch = self

        def make_sampler_init(original):
            def __init__(sampler, *args, **kwargs):
                original(sampler, *args, **kwargs)
                with watch.bookkeeping:
                    watch._sampler_sites[sampler] = caller_location()

            return __init__

        patches.wrap(DistributedSampler, "__init__", make_sampler_init)

    def _loader_pass(self, loader: Any, entry: dict[str, Any]) -> None:
        self._starting = None
        sampler = index_sampler(loader)
        passes = self._passes[entry["key"]] = self._passes.get(entry["key"], 0) + 1
        if (
            passes > INDEXED_PASSES
            or len(self.loader_draws) >= MAX_DRAWS
            or isinstance(loader.dataset, torch.utils.data.IterableDataset)
            or getattr(sampler, "replacement", False)
        ):
            return
        dataset, chain = loader.dataset, []
        while isinstance(dataset, Subset):
            chain.append(dataset.indices)
            dataset = dataset.dataset
        try:
            size = len(dataset)
        except TypeError:
            return
        record: dict[str, Any] = {"loader": entry["key"], "site": entry["site"], "pass": passes, "dataset_size": size,
                                  "over_subset": bool(chain), "complete": False, "indices": [], "sampler": None}
        if isinstance(sampler, DistributedSampler):
            record["sampler"] = {"site": self._sampler_sites.get(sampler), "epoch": sampler.epoch, "seed": sampler.seed,
                                 "rank": sampler.rank, "num_replicas": sampler.num_replicas,
                                 "total_size": sampler.total_size}
        self.loader_draws.append(record)
        self._starting = (record, chain)

    def _iterator_made(self, iterator: Any) -> None:
        """The indices the iterator draws from now on go to the pass started last."""
        if self._starting is not None:
            self._draws[iterator] = self._starting
            self._starting = None

    def _drew(self, iterator: Any, index: Any) -> None:
        # Before the iterator is made: with workers, its constructor already draws the first batches.
        followed = self._draws.get(iterator) or self._starting
        if followed is None:
            return
        record, chain = followed
        if index is None:  # the pass is over
            record["complete"] = True
            return
        for i in index if isinstance(index, (list, tuple)) else [index]:
            if len(record["indices"]) >= MAX_INDICES:
                self._draws.pop(iterator, None)
                self._starting = None
                record["indices"] = None  # too many to compare
                return
            for indices in chain:
                i = indices[i]
            record["indices"].append(int(i))

    def facts(self) -> ShareFacts:
        return {"loader_draws": self.loader_draws}


def sampler_findings(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    return _positions_wrong(checks, recorded) or sampler_overlap(checks, recorded)


def _training_samplers(checks: RankFacts, recorded: dict[int, Any]) -> dict[int, list[dict[str, Any]]]:
    """rank -> the DistributedSamplers of its training DataLoaders, in the order their passes started."""
    found: dict[int, list[dict[str, Any]]] = {}
    for rank, facts in checks.items():
        training = {loader["key"] for loader in facts["loaders"] if loader["feeds_training"]}
        samplers = found[rank] = []
        for draw in recorded[rank]["loader_draws"]:
            if draw["loader"] in training and draw["sampler"] and draw["pass"] == 1:
                samplers.append(draw["sampler"])
    return found


def _positions_wrong(checks: RankFacts, recorded: dict[int, Any]) -> list[Finding]:
    """A DistributedSampler must be told where its rank stands among the data-parallel replicas: the
    process group's rank and size (the default). One given a rank every replica shares, or another
    count of replicas, draws the same share on several ranks, or leaves shares undrawn."""
    if any(facts.get("tp_modules") for facts in checks.values()) or not all(facts.get("models") for facts in checks.values()):
        # Tensor-parallel ranks of one replica share a sampler position on purpose; without a DDP
        # model, which ranks are one model's replicas is not known (pipeline stages, meshes).
        return []
    groups = {rank: facts["models"][0].get("group") or sorted(checks) for rank, facts in checks.items()}
    samplers = _training_samplers(checks, recorded)
    for members in {tuple(group) for group in groups.values()}:
        members = [rank for rank in members if rank in samplers]
        if len(members) < 2:
            continue
        for index in range(min(len(samplers[rank]) for rank in members)):
            positions = {rank: (samplers[rank][index]["rank"], samplers[rank][index]["num_replicas"]) for rank in members}
            wrong_count = sorted(rank for rank, (_, count) in positions.items() if count != len(members))
            taken: dict[int, list[int]] = {}
            for rank, (position, _) in positions.items():
                taken.setdefault(position, []).append(rank)
            shared = sorted(rank for ranks in taken.values() if len(ranks) > 1 for rank in ranks)
            # Of the ranks that share a position, those not at their own place in the group took another's.
            blamed = wrong_count or [rank for rank in shared if positions[rank][0] != members.index(rank)] or shared
            if not blamed:
                continue
            site = samplers[blamed[0]][index]["site"] or "?"
            said = "; ".join(f"rank {rank}: rank={p[0]}, num_replicas={p[1]}" for rank, p in sorted(positions.items()))
            return [Finding(
                "sampler_position_wrong",
                "error",
                blamed,
                f"The DistributedSampler built at {site} was told another place among the replicas than the process "
                f"group's ({said}), where {len(members)} data-parallel ranks ({', '.join(map(str, members))}) each need "
                "a share of their own: "
                + (f"{ranks_text(shared)} draw the same share, and the others' shares are never drawn"
                   if shared else f"it splits the data {positions[wrong_count[0]][1]} ways among {len(members)} ranks, "
                   "so shares are drawn twice or never")
                + ". Nothing fails; every epoch trains on part of the data, several times.",
                "Build the sampler without rank= and num_replicas= (it takes them from the process group), or pass "
                "dist.get_rank() and dist.get_world_size() (the global ones: LOCAL_RANK repeats on every host; under "
                "tensor parallelism, the data-parallel rank and size of the mesh).",
                locations={str(rank): samplers[rank][index]["site"] or "?" for rank in blamed},
                details={"positions": {str(rank): list(p) for rank, p in positions.items()}},
            )]
    return []


def sampler_overlap(checks: RankFacts, recorded: dict[int, Any]) -> list[Finding]:
    passes: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        training = {loader["key"] for loader in facts["loaders"] if loader["feeds_training"]}
        for draw in recorded[rank]["loader_draws"]:
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
        "sampler_position_wrong": Category(
            ("error",),
            "a training DistributedSampler was given a rank or replica count other than the process group's",
            "the `DistributedSampler` of a training DataLoader was built with a `rank` several data-parallel ranks "
            "share (the local rank on every host, a rank read from the wrong variable) or a `num_replicas` other than "
            "their number: shares are drawn twice and others never. Named at the sampler's construction, before the "
            "identical or overlapping batches it causes",
        ),
    },
    rule=sampler_findings,
    explains={"sampler_position_wrong": ("no_distributed_sampler", "sampler_overlap")},
    watch=ShareWatch,
    facts=ShareFacts,
)
