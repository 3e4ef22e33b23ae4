"""Hand-made facts of the ranks (what gradsync.run.script_facts records), for the checks' tests,
and the findings the checks draw from them."""

from __future__ import annotations

from gradsync.rundir.records import Finding
from gradsync.doctor.script import registry

# The checks that compare what should agree across ranks: silent unless every rank has their own
# facts, which `script_facts` below leaves out.
CONSISTENCY = ["shared_random_draws", "dataset_generator", "data_split", "sampler_overlap", "loss_scale", "eval_mode",
               "parameter_order", "update_differs", "same_file"]


def script_facts(**overrides) -> dict:
    """A rank's facts of the data, gradient-traffic, replica, FSDP2 and tensor-parallel checks."""
    facts = {
        "doctor_steps": 4,
        "steps": 4,
        "syncs_per_step": [1, 1, 1, 1],
        "backward_site": "train.py:30",
        "forwards": [],
        "loaders": [],
        "sampler_passes": [],
        "models": [],
    }
    return {**facts, **overrides}


def consistency_facts(writes: list[dict] | None = None, host: str = "node0", splits: list[dict] | None = None, *,
                      forwards: list[dict] = (), seeds: list[dict] = (), steps_taken: list[dict] = (),
                      loss_walks: list[dict] = (), backwards_per_step: list[int] = (1, 1, 1, 1),
                      worker_copies: list[dict] = (), loader_draws: list[dict] = (), **overrides) -> dict:
    """A rank's facts with each consistency check's own, under its name, made from the records a
    rank keeps: `forwards` (rng_forward: the generators' states and the eval-mode submodules
    around each training forward) go to shared_random_draws and eval_mode; `steps_taken`
    (step_taken) to update_differs, and their `modes` to eval_mode; `writes` (on `host`) to
    same_file; `splits` to data_split."""
    facts = {
        "steps": 4, "syncs_per_step": [1, 1, 1, 1], "forwards": list(forwards), "models": [], "loaders": [],
        "sampler_passes": [],
        "shared_random_draws": {
            "seeds": list(seeds),
            "forwards": [{key: f[key] for key in ("site", "rng_before", "rng_after") if key in f} for f in forwards],
        },
        "dataset_generator": {"worker_copies": list(worker_copies)},
        "sampler_overlap": {"loader_draws": list(loader_draws)},
        "loss_scale": {"loss_walks": list(loss_walks), "backwards_per_step": list(backwards_per_step)},
        "eval_mode": {
            "forwards": [{key: f[key] for key in ("site", "eval_modules", "eval_count", "eval_site") if key in f}
                         for f in forwards],
            "steps": [{"step": s["step"], "site": s["site"], **s["modes"][0]} for s in steps_taken if s.get("modes")],
        },
        "update_differs": {"steps": [{key: value for key, value in s.items() if key != "modes"} for s in steps_taken]},
        "same_file": {"host": host, "writes": writes or []},
        "data_split": {"splits": splits or []},
    }
    return {**facts, **overrides}


def findings(checks: dict[int, dict]) -> list[Finding]:
    """What every check finds."""
    return registry.findings(checks)


def categories(checks: dict[int, dict]) -> list[str]:
    return [finding.category for finding in findings(checks)]


def consistency_found(checks: dict[int, dict]) -> list[Finding]:
    """What the consistency checks find (the others read facts these tests do not make)."""
    return registry.findings(checks, CONSISTENCY)


def consistency_categories(checks: dict[int, dict]) -> list[str]:
    return [finding.category for finding in consistency_found(checks)]


def loader(batches: int, **overrides) -> dict:
    """A DataLoader a rank iterated, with its length."""
    entry = {"key": "train.py:27#0", "site": "train.py:27", "batches": batches, "samples": None, "sampler": 0,
             "feeds_training": True, "under_join": False}
    return {**entry, **overrides}


def model(parameters: dict, buffers: dict | None = None, **overrides) -> dict:
    """A DDP model a rank built, with the hashes of its parameters and buffers."""
    entry = {"site": "train.py:20", "find_unused_parameters": False, "usage_checked_passes": 0, "incomplete_passes": 0,
             "buffers_synced": True, "parameters": parameters, "buffers": buffers or {}}
    return {**entry, **overrides}


def rng_forward(before: int, after: int, evals=(), eval_site=None) -> dict:
    """A training forward with torch's generator state around it and the submodules in eval mode."""
    return {"site": "train.py:30", "rng_before": {"torch": before}, "rng_after": {"torch": after},
            "eval_modules": list(evals), "eval_count": len(evals), "eval_site": eval_site}


def step_taken(step: int, grads: int = 1, hyper: str = "lr=0.1", calls=(), before: int = 10, after: int = 11,
               replicas: list[int] | None = None) -> dict:
    """An optimizer step as a rank recorded it going in (gradients, settings, parameters) and out;
    `replicas`: the ranks of the stepped DDP's group (None: unknown, every rank)."""
    return {"step": step, "optimizer": 0, "site": "train.py:40", "hyperparameters": hyper, "grads": grads,
            "params_before": before, "params_after": after, "calls": list(calls), "replicas": replicas}


TRAIN_LOADER = {"key": "train.py:30#0", "site": "train.py:30", "feeds_training": True}


def draw(indices, seed=0, sampler_rank=0, dataset_size=8, total_size=8, distributed=True, complete=True) -> dict:
    """The sample indices one rank's training DataLoader drew in one pass, and its sampler."""
    sampler = {"site": "train.py:25", "epoch": 0, "seed": seed, "rank": sampler_rank, "num_replicas": 2,
               "total_size": total_size} if distributed else None
    return {"loader": "train.py:30#0", "site": "train.py:30", "pass": 1, "dataset_size": dataset_size,
            "over_subset": False, "complete": complete, "indices": list(indices), "sampler": sampler}


def drawing(*draws) -> dict[int, dict]:
    """Ranks 0, 1, ... that drew `draws`, one each."""
    return {rank: consistency_facts(loader_draws=[d], loaders=[TRAIN_LOADER]) for rank, d in enumerate(draws)}
