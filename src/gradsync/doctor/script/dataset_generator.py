"""dataset_generator: a generator stored on a dataset that DataLoader workers copy.

Each worker gets the same state at every pass, so workers, epochs (and ranks, when seeded alike)
repeat each other's random augmentation. A worker_init_fn may reseed the copies: then the script's
choice, left alone.

Each rank records, at each pass over a DataLoader with workers, the generators its dataset holds
(and the line that made each NumPy one), with a CRC of their states.
"""

from __future__ import annotations

import random
import sys
import zlib
from typing import Any, TypedDict

import torch
from torch import nn

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches, tensor_hash
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "dataset_generator"
MAX_COPIES = 64  # passes with workers kept per rank
MAX_SITES = 64  # NumPy generators whose line is kept


def generator_state(value: Any) -> int | None:
    """The state CRC of a generator object a dataset may hold (None when it is not one)."""
    numpy = sys.modules.get("numpy")
    if isinstance(value, torch.Generator):
        return tensor_hash(value.get_state())
    if isinstance(value, random.Random):
        return zlib.crc32(repr(value.getstate()).encode())
    if numpy is not None and isinstance(value, numpy.random.Generator):
        return zlib.crc32(repr(value.bit_generator.state).encode())
    if numpy is not None and isinstance(value, numpy.random.RandomState):
        return zlib.crc32(memoryview(value.get_state()[1]))
    return None


def dataset_generators(dataset: Any, depth: int = 2) -> dict[str, Any]:
    """attribute path -> the generators stored on a dataset (and on its attributes: a transform, a
    wrapped dataset), which DataLoader workers receive as copies."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            return
        for name, value in attributes.items():
            if generator_state(value) is not None:
                found[f"{path}.{name}" if path else name] = value
            elif not isinstance(value, (torch.Tensor, nn.Module, str, bytes, int, float, list, tuple, dict)):
                visit(value, f"{path}.{name}" if path else name, level + 1)

    visit(dataset, "", 0)
    return found


class CopyFacts(TypedDict):
    """What the watch records on one rank (under "dataset_generator" in its facts file)."""

    worker_copies: list[dict[str, Any]]  # {"loader", "site", "workers", "worker_init_fn", "generators", "created_at"}


class CopyWatch:
    """The generators each pass's workers copy from the dataset, on one rank."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.worker_copies: list[dict[str, Any]] = []
        self._generator_sites: dict[int, str | None] = {}  # id of a NumPy Generator -> the line that made it
        moments.on("loader_pass", self._loader_pass, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        try:
            import numpy
        except ImportError:  # no NumPy: torch's and Python's generators have no maker to watch
            return
        watch = self

        def make_default_rng(original):
            def default_rng(*args, **kwargs):
                generator = original(*args, **kwargs)
                with watch.bookkeeping:
                    if len(watch._generator_sites) < MAX_SITES:  # where a dataset's generator came from
                        watch._generator_sites[id(generator)] = caller_location()
                return generator

            return default_rng

        patches.wrap(numpy.random, "default_rng", make_default_rng)

    def _loader_pass(self, loader: Any, entry: dict[str, Any]) -> None:
        if not loader.num_workers or len(self.worker_copies) >= MAX_COPIES:
            return
        generators = dataset_generators(loader.dataset)
        if generators:
            self.worker_copies.append({
                "loader": entry["key"], "site": entry["site"], "workers": loader.num_workers,
                "worker_init_fn": loader.worker_init_fn is not None,
                "generators": {path: generator_state(g) for path, g in generators.items()},
                "created_at": {path: self._generator_sites.get(id(g)) for path, g in generators.items()},
            })

    def facts(self) -> CopyFacts:
        return {"worker_copies": self.worker_copies}


def dataset_generator_copied(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    reported: set[str] = set()
    findings = []
    for rank, facts in sorted(recorded.items()):
        for copy in facts["worker_copies"]:
            if copy["worker_init_fn"] or copy["site"] in reported:
                continue  # a worker_init_fn may reseed the copies: the script's choice
            same = {r: f for r, f in recorded.items()
                    if any(c["loader"] == copy["loader"] and c["generators"] == copy["generators"] for c in f["worker_copies"])}
            passes = [c for c in facts["worker_copies"] if c["loader"] == copy["loader"]]
            repeats = len(passes) > 1 and all(p["generators"] == copy["generators"] for p in passes)
            if copy["workers"] < 2 and len(same) < 2 and not repeats:
                continue
            reported.add(copy["site"])
            created = {path: site for path, site in copy.get("created_at", {}).items() if site}
            names = ", ".join(f"{path}, made at {created[path]}" if path in created else path
                              for path in sorted(copy["generators"]))
            where = next(iter(created.values()), None) or copy["site"] or "?"
            spread = [f"across its {copy['workers']} workers" if copy["workers"] > 1 else None,
                      "in every epoch" if repeats else None,
                      f"on {ranks_text(sorted(same))}" if len(same) > 1 else None]
            findings.append(Finding(
                "dataset_generator_copied",
                "warning",
                sorted(same) if len(same) > 1 else [rank],
                f"The dataset iterated at {copy['site'] or '?'} holds a random generator ({names}) and its DataLoader "
                f"starts {copy['workers']} worker process(es) at every pass without a worker_init_fn: each worker gets "
                f"a copy of the generator in the same state, so the same random augmentation repeats "
                f"{', '.join(s for s in spread if s)}.",
                "Reseed the dataset's generator inside each worker: DataLoader(..., worker_init_fn=fn) with fn setting "
                "dataset.rng = numpy.random.default_rng(torch.utils.data.get_worker_info().seed) (that seed differs "
                "per worker, epoch and rank when torch's generator does); or draw with torch's own generator, "
                "which DataLoader seeds per worker.",
                locations={str(r): where for r in (sorted(same) if len(same) > 1 else [rank])},
                details={"generators": sorted(copy["generators"]), "workers": copy["workers"]},
            ))
    return findings


CHECK = Check(
    name="dataset_generator",
    summary="a dataset's generator copied into every DataLoader worker",
    categories={
        "dataset_generator_copied": Category(
            ("warning",),
            "a generator stored on the dataset is copied unchanged into every DataLoader worker",
            "the dataset of a DataLoader with workers holds a generator (NumPy, `random.Random`, `torch.Generator`) "
            "and no `worker_init_fn` reseeds it: every worker (and epoch, and rank seeded alike) repeats the same "
            "augmentation",
        ),
    },
    rule=dataset_generator_copied,
    watch=CopyWatch,
    facts=CopyFacts,
)
