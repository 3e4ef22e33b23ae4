"""dataset_generator: a generator stored on a dataset that DataLoader workers copy.

Each worker gets the same state at every pass, so workers, epochs (and ranks, when seeded alike)
repeat each other's random augmentation. A worker_init_fn may reseed the copies: then the script's
choice, left alone.
"""

from __future__ import annotations

from gradsync.rundir.records import Finding
from gradsync.run.scriptcheck.compare import ranks_text
from gradsync.run.scriptcheck.shared_facts import consistency_recorded
from gradsync.run.scriptcheck.unit import Category, Check, RankFacts


def dataset_generator_copied(checks: RankFacts) -> list[Finding]:
    if not consistency_recorded(checks):
        return []
    reported: set[str] = set()
    findings = []
    for rank, facts in sorted(checks.items()):
        for copy in facts["worker_copies"]:
            if copy["worker_init_fn"] or copy["site"] in reported:
                continue  # a worker_init_fn may reseed the copies: the script's choice
            same = {r: f for r, f in checks.items()
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
)
