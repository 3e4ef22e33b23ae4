"""shared_random_draws: every rank drew the same random numbers in training, from a generator seeded alike after DDP was built.

Seeding alike before building the model is how DDP scripts start (identical initial weights);
seeding alike afterwards only makes dropout and augmentation repeat on every rank, so the global
batch holds one rank's worth of random draws. Named at the seeding line.

Each rank records its seeding calls (torch, CUDA, `random`, NumPy's global generator) with their
lines, and a CRC of every process-wide generator's state around each recorded training forward:
a generator that moved inside a forward drew dropout, one that moved between two forwards drew
augmentation in this process.
"""

from __future__ import annotations

import functools
import random
import sys
import zlib
from typing import Any, TypedDict

import torch

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches, tensor_hash
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "shared_random_draws"
MAX_SEEDS = 64  # seeding calls kept per rank


def generator_states() -> dict[str, int]:
    """A CRC of each process-wide random generator's state: what dropout and augmentation draw from."""
    states = {"torch": tensor_hash(torch.get_rng_state()), "random": zlib.crc32(repr(random.getstate()).encode())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = tensor_hash(torch.cuda.get_rng_state())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = zlib.crc32(memoryview(numpy.random.get_state()[1]))
    return states


class DrawFacts(TypedDict):
    """What the watch records on one rank (under "shared_random_draws" in its facts file)."""

    seeds: list[dict[str, Any]]  # {"generator", "site", "after_ddp", "forwards_before", "value"}
    forwards: list[dict[str, Any]]  # per recorded training forward: {"site", "rng_before", "rng_after"}


class DrawWatch:
    """The seeding calls of one rank, and its generators' states around each recorded training forward."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.seeds: list[dict[str, Any]] = []
        self.forwards: list[dict[str, Any]] = []  # per recorded training forward: its site, the states around it
        moments.on("forward_starts", self._forward_starts, self.bookkeeping)
        moments.on("forward_ends", self._forward_ends, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        watch = self

        def seeding(generator: str):
            def make(original):
                def seed(*args, **kwargs):
                    with watch.bookkeeping:
                        watch._seeded(generator, args[0] if args else kwargs.get("seed", kwargs.get("a")))
                    return original(*args, **kwargs)

                return seed

            return make

        torch_seed = functools.wraps(torch.manual_seed)(seeding("torch")(torch.manual_seed))
        patches.replace(torch, "manual_seed", torch_seed)
        patches.replace(torch.random, "manual_seed", torch_seed)
        for name in ("manual_seed", "manual_seed_all"):  # the CUDA generators alone
            patches.wrap(torch.cuda, name, seeding("cuda"))
        patches.wrap(random, "seed", seeding("random"))
        try:
            import numpy
        except ImportError:  # no NumPy: no NumPy generator to watch
            return
        patches.wrap(numpy.random, "seed", seeding("numpy"))

    def _seeded(self, generator: str, value: Any) -> None:
        if len(self.seeds) < MAX_SEEDS:
            self.seeds.append({"generator": generator, "site": caller_location(), "after_ddp": bool(self.moments.models),
                               "forwards_before": self.moments.forwards, "value": repr(value)[:40]})

    def _forward_starts(self, ddp: Any, forward: dict[str, Any]) -> None:
        self.forwards.append({"site": forward["site"], "rng_before": generator_states()})

    def _forward_ends(self, ddp: Any, forward: dict[str, Any]) -> None:
        if self.forwards:
            self.forwards[-1]["rng_after"] = generator_states()

    def facts(self) -> DrawFacts:
        return {"seeds": self.seeds, "forwards": self.forwards}


GENERATORS = {"torch": "torch's CPU generator", "cuda": "the CUDA generator", "random": "Python's `random`",
              "numpy": "NumPy's global generator"}


def shared_random_draws(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    forwards = {rank: facts["forwards"] for rank, facts in recorded.items()}
    count = min(len(f) for f in forwards.values())
    findings = []
    for generator, label in GENERATORS.items():
        # torch.manual_seed seeds the CUDA generators too; torch.cuda.manual_seed(_all) only them.
        seeding = ("torch", "cuda") if generator == "cuda" else (generator,)
        after_ddp = {rank: [s for s in facts["seeds"] if s["generator"] in seeding and s["after_ddp"]]
                     for rank, facts in recorded.items()}
        if not all(after_ddp.values()):
            continue  # seeded alike only before the model was built (or not at all): the script's own choice
        # The draws since the seeding (the first after DDP on every rank): before it, they owe nothing to it.
        start = max(seeds[0]["forwards_before"] for seeds in after_ddp.values())
        draws = []  # per window where every rank drew from it: were the draws identical?
        for i in range(start, count):
            entries = {rank: f[i] for rank, f in forwards.items()}
            if not all("rng_before" in e and generator in e["rng_before"] and generator in e.get("rng_after", {})
                       for e in entries.values()):
                continue
            before = {r: e["rng_before"][generator] for r, e in entries.items()}
            after = {r: e["rng_after"][generator] for r, e in entries.items()}
            if all(before[r] != after[r] for r in entries):  # drew inside the forward (dropout)
                draws.append(len(set(before.values())) == 1)
            if i > start:  # drew between the previous forward and this one (augmentation, in this process)
                previous = {r: forwards[r][i - 1].get("rng_after", {}).get(generator) for r in entries}
                if None not in previous.values() and all(previous[r] != before[r] for r in entries):
                    draws.append(len(set(previous.values())) == 1)
        if not draws or not all(draws):
            continue
        last_seed = {rank: seeds[0] for rank, seeds in after_ddp.items()}
        ranks = sorted(checks)
        site = last_seed[ranks[0]]["site"] or "?"
        findings.append(Finding(
            "shared_random_draws",
            "warning",
            ranks,
            f"Every rank drew the same random numbers from {label} in each of the {len(draws)} training draws "
            f"compared: it was seeded with the same value ({last_seed[ranks[0]]['value']}) on every rank at {site}, "
            "after DDP was built. Dropout masks and random augmentation repeat on every rank, so the global batch "
            f"holds one rank's worth of random draws instead of {len(ranks)} independent ones.",
            "Seed alike before building the model (DDP needs identical initial weights, and broadcasts rank 0's "
            "anyway), then give each rank its own stream for training: torch.manual_seed(seed + rank), and the same "
            "for random.seed and numpy.random.seed.",
            locations={str(rank): seed["site"] or "?" for rank, seed in sorted(last_seed.items())},
            details={"generator": generator, "draws_compared": len(draws)},
        ))
    return findings


CHECK = Check(
    name="shared_random_draws",
    summary="the same random draws on every rank (seeded alike after DDP was built)",
    categories={
        "shared_random_draws": Category(
            ("warning",),
            "every rank drew the same random numbers in training (seeded alike after DDP was built)",
            "from the first seeding after DDP was built on every rank, every rank drew the same numbers from a "
            "generator (torch, CUDA, `random`, NumPy) inside or between training forwards: named at that seeding "
            "line (also a reseeding with the epoch inside the loop). Seeding alike only *before* building the "
            "model is DDP's usual start and is left alone",
        ),
    },
    rule=shared_random_draws,
    watch=DrawWatch,
    facts=DrawFacts,
)
