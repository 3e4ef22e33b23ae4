"""The launcher side of the doctor's consistency checks: what should agree across ranks, and who broke it.

Each rank recorded its own run (gradsync.run.consistency_facts); these pure functions compare
the ranks. Every rule reasons from what the ranks did, not from the script's text: states of
the random generators, the sample indices drawn, the modules in eval mode at a forward, the
parameter order DDP paired, the gradients and hyperparameters going into each step with the
calls that changed them, the loss's normalisation in the autograd graph, the paths written.
A finding names the ranks at fault where one is (the rank that clipped, the rank in eval mode)
and the line of the user's code that did it (the seeding call, the split, the scheduler.step),
not the DDP line where the symptom was seen.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from gradsync.doctor.script_findings import odd_ones_out, ranks_text
from gradsync.rundir.records import Finding

GENERATORS = {"torch": "torch's CPU generator", "cuda": "the CUDA generator", "random": "Python's `random`",
              "numpy": "NumPy's global generator"}
_SCALE_TOLERANCE = 1e-4  # relative: a loss scale equal to 1/world size up to float rounding


def consistency_findings(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """The consistency findings the ranks' facts (global rank -> facts) support."""
    if len(checks) < 2 or not all("steps_taken" in facts for facts in checks.values()):
        return []  # one rank has nothing to agree with; facts of an older gradsync have none of these
    split = _splits_differ(checks)
    return [
        *_shared_random_draws(checks),
        *_dataset_generator_copied(checks),
        *split,
        *_shares_overlap(checks, skip_subsets=bool(split)),
        *_loss_divided_by_world_size(checks),
        *_eval_mode_differs(checks),
        *_parameter_order_differs(checks),
        *_update_differs(checks),
        *_same_file_written(checks),
    ]


# -- randomness ----------------------------------------------------------------------------------


def _shared_random_draws(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """Every rank drew the same random numbers in training, from a generator seeded alike after
    DDP was built. Seeding alike before building the model is how DDP scripts start (identical
    initial weights); seeding alike afterwards only makes dropout and augmentation repeat on
    every rank, so the global batch holds one rank's worth of random draws."""
    forwards = {rank: facts["forwards"] for rank, facts in checks.items()}
    count = min(len(f) for f in forwards.values())
    findings = []
    for generator, label in GENERATORS.items():
        # torch.manual_seed seeds the CUDA generators too; torch.cuda.manual_seed(_all) only them.
        seeding = ("torch", "cuda") if generator == "cuda" else (generator,)
        after_ddp = {rank: [s for s in facts["seeds"] if s["generator"] in seeding and s["after_ddp"]]
                     for rank, facts in checks.items()}
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


def _dataset_generator_copied(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """A generator stored on a dataset that DataLoader workers copy: each worker gets the same
    state at every pass, so workers, epochs (and ranks, when seeded alike) repeat each other's draws."""
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


# -- which samples each rank trains on -----------------------------------------------------------


def _splits_differ(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    count = min(len(facts["splits"]) for facts in checks.values())
    findings = []
    for index in range(count):
        splits = {rank: facts["splits"][index] for rank, facts in checks.items()}
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


def _shares_overlap(checks: dict[int, dict[str, Any]], skip_subsets: bool) -> list[Finding]:
    """In one pass of a training DataLoader, the ranks' shares of the dataset must not overlap
    (beyond a DistributedSampler's padding), and a whole pass must cover the dataset (beyond what
    drop_last trims). Read from the indices each rank drew, mapped through Subset to the dataset.
    Ranks that drew exactly the same indices draw one share together (the tensor-parallel ranks
    of one data-parallel rank) and count once; when every rank drew the same, that is
    no_distributed_sampler's finding, not this one."""
    passes: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        training = {loader["key"] for loader in facts["loaders"] if loader["feeds_training"]}
        for draw in facts.get("loader_draws", []):
            if draw["loader"] in training and draw["indices"] is not None:
                passes.setdefault((draw["loader"], draw["pass"]), {})[rank] = draw
    for key in sorted(passes):
        draws = passes[key]
        if len(draws) != len(checks) or (skip_subsets and any(d["over_subset"] for d in draws.values())):
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


# -- the gradient's scale ------------------------------------------------------------------------


def _close(value: float, target: float) -> bool:
    return abs(value - target) <= _SCALE_TOLERANCE * abs(target)


def _loss_divided_by_world_size(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """DDP averages gradients over the ranks; a loss that also divides by the world size makes
    every update 1/world of the one-process update, and the learning rate falls as ranks are added."""
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


# -- the replicas' training -----------------------------------------------------------------------


def _eval_mode_differs(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """Some ranks trained submodules in eval mode that the others trained in train mode. Compared
    at each training forward, then at each optimizer step (a rank that switched the DDP wrapper
    itself to eval has no training forwards left to compare, but it still steps)."""
    forwards = {rank: facts["forwards"] for rank, facts in checks.items()}
    for i in range(min(len(f) for f in forwards.values())):
        found = _modes_differ({rank: f[i] for rank, f in forwards.items()}, f"training forward {i + 1}",
                              {"forward": i + 1})
        if found:
            return found
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        for record in facts["steps_taken"]:
            if record.get("modes"):  # the first DDP model's
                steps.setdefault(record["step"], {})[rank] = {**record["modes"][0], "site": record["site"]}
    for step in sorted(steps):
        if len(steps[step]) == len(checks):
            found = _modes_differ(steps[step], f"optimizer step {step}", {"step": step})
            if found:
                return found
    return []


def _modes_differ(modes: dict[int, dict[str, Any]], when: str, detail: dict[str, int]) -> list[Finding]:
    if not all("eval_count" in m for m in modes.values()):
        return []
    sets = {rank: (m["eval_count"], tuple(m["eval_modules"])) for rank, m in modes.items()}
    if len(set(sets.values())) == 1:
        return []
    fewest = min(s[0] for s in sets.values())
    ranks = sorted(r for r, s in sets.items() if s[0] > fewest) or odd_ones_out(sets)
    culprit = modes[ranks[0]]
    names = ", ".join(culprit["eval_modules"]) + (" and more" if culprit["eval_count"] > len(culprit["eval_modules"]) else "")
    where = f", put in eval mode at {culprit['eval_site']} and not back with train()" if culprit["eval_site"] else ""
    return [Finding(
        "eval_mode_differs",
        "error",
        ranks,
        f"From {when} on, {ranks_text(ranks)} ran {culprit['eval_count']} submodule(s) in eval mode ({names}){where}, "
        "while the other ranks trained them: dropout is off and BatchNorm uses frozen statistics on those ranks only, "
        "so the ranks compute gradients of different models, and nothing warns.",
        "Put the model back in training mode after evaluating (model.train() right after the evaluation), or "
        "evaluate on every rank; switch the DDP wrapper (ddp.eval() / ddp.train()), which switches every submodule.",
        locations={str(rank): modes[rank]["eval_site"] or modes[rank]["site"] or "?" for rank in ranks},
        details={**detail, "eval_modules": culprit["eval_modules"]},
    )]


def _parameter_order_differs(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    findings = []
    count = min(len(facts["models"]) for facts in checks.values())
    for index in range(count):
        models = {rank: facts["models"][index] for rank, facts in checks.items()}
        orders = {rank: tuple(m.get("parameter_order") or ()) for rank, m in models.items()}
        if not all(orders.values()) or len(set(orders.values())) == 1:
            continue
        ranks = odd_ones_out(orders)
        reference = next(r for r in sorted(orders) if r not in ranks) if len(ranks) < len(orders) else min(orders)
        other = next(r for r in ranks if r != reference)
        position = next((i for i, (a, b) in enumerate(zip(orders[reference], orders[other])) if a != b),
                        min(len(orders[reference]), len(orders[other])))
        same_names = sorted(orders[reference]) == sorted(orders[other])
        at = lambda r: orders[r][position] if position < len(orders[r]) else "nothing"  # noqa: E731
        site = models[reference]["site"] or "?"
        findings.append(Finding(
            "parameter_order_differs",
            "error",
            ranks,
            f"DDP at {site} was given the parameters in a different order on {ranks_text(ranks)}: parameter "
            f"{position} is '{at(reference)}' on rank {reference} and '{at(other)}' on rank {other}"
            f"{' (the same names, ordered differently)' if same_names else ''}. DDP pairs parameters across ranks by "
            "position: its first broadcast copied rank 0's weights into other layers, and every step averages "
            "gradients of different layers. Shapes match, so nothing fails.",
            "Build submodules in an order every process agrees on: iterate sorted(names), or a list, never a set "
            "(a set of strings is ordered by hashes, which Python seeds per process: PYTHONHASHSEED).",
            locations={str(rank): models[rank]["site"] or "?" for rank in ranks},
            details={"position": position, "names": {str(r): at(r) for r in sorted(orders)}},
        ))
    return findings


def _calls_key(calls: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    return tuple((c["what"], c["site"] or "?") for c in calls)


def _update_differs(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """The same averaged gradient must go into the same update on every rank. The first step
    where the gradients (after a synchronised backward) or the hyperparameters differ is blamed
    on the ranks that made calls the others did not (clipping, a scheduler step), at their line;
    parameters changed between two steps on some ranks only are blamed on those ranks."""
    records: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        for record in facts["steps_taken"]:
            records.setdefault((record["optimizer"], record["step"]), {})[rank] = record
    for (optimizer, step), by_rank in sorted(records.items(), key=lambda item: (item[0][1], item[0][0])):
        if len(by_rank) != len(checks):
            continue
        synced = all(step <= len(checks[r]["syncs_per_step"]) and checks[r]["syncs_per_step"][step - 1] > 0 for r in by_rank)
        grads = {r: rec["grads"] for r, rec in by_rank.items()}
        hyper = {r: rec["hyperparameters"] for r, rec in by_rank.items()}
        grads_differ = synced and None not in grads.values() and len(set(grads.values())) > 1
        hyper_differ = len(set(hyper.values())) > 1
        moved = _moved_between_steps(records, optimizer, step)
        if not (grads_differ or hyper_differ or moved):
            continue
        what = "gradients" if grads_differ else "hyperparameters" if hyper_differ else "parameters"
        blamed = _blame_calls(records, len(checks), optimizer, step)
        if what == "parameters":
            ranks = moved
            previous = records.get((optimizer, step - 1), {})
            locations = {str(r): (previous.get(r) or by_rank[r])["site"] or "?" for r in ranks}
            cause = (f"changed them after optimizer step {step - 1} (at {locations[str(ranks[0])]}) and before step {step}, "
                     "outside the optimizer")
        elif blamed:
            ranks = sorted(blamed)
            locations = {str(r): blamed[r]["site"] or "?" for r in ranks}
            call = blamed[ranks[0]]
            cause = f"called {call['what']} at {call['site'] or '?'}, which the other ranks did not call"
        else:
            ranks = odd_ones_out(grads if grads_differ else hyper)
            locations = {str(r): by_rank[r]["site"] or "?" for r in ranks}
            cause = ("changed them between the backward pass and the step" if grads_differ
                     else "changed the optimizer's settings (a param_group assignment)")
        detail = f" ({_settings_differ(hyper)})" if hyper_differ else ""
        return [Finding(
            "update_differs",
            "error",
            ranks,
            f"Going into optimizer step {step}, the {what} of the DDP model differ across ranks{detail}: {ranks_text(ranks)} "
            f"{cause}. DDP gave every rank the same averaged gradient; an update changed on some ranks only makes the "
            "replicas diverge, and a checkpoint saved by rank 0 holds only rank 0's model.",
            _UPDATE_SUGGESTIONS[what],
            locations=locations,
            step=step,
            details={"differs": what, "optimizer": optimizer},
        )]
    return []


def _settings_differ(hyper: dict[int, str]) -> str:
    """'lr: rank 0 0.025, rank 1 0.05' for the settings that differ (the text: groups ' | ', items '; ')."""
    parsed = {rank: [dict(item.split("=", 1) for item in group.split("; ") if "=" in item) for group in text.split(" | ")]
              for rank, text in hyper.items()}
    parts = []
    for index in range(min(len(groups) for groups in parsed.values())):
        keys = sorted(set().union(*(groups[index] for groups in parsed.values())))
        for key in keys:
            values = {rank: groups[index].get(key, "-") for rank, groups in parsed.items()}
            if len(set(values.values())) > 1:
                group = f" (group {index})" if len(next(iter(parsed.values()))) > 1 else ""
                parts.append(f"{key}{group}: " + ", ".join(f"rank {r} {v}" for r, v in sorted(values.items())))
    return "; ".join(parts[:4]) or "their settings"


_UPDATE_SUGGESTIONS = {
    "gradients": "Do everything that shapes the update on every rank: clip_grad_norm_, gradient scaling and masking "
    "belong outside `if rank == 0:` (only logging and saving belong inside).",
    "hyperparameters": "Change the optimizer's settings on every rank: scheduler.step() and learning-rate or "
    "momentum assignments belong outside `if rank == 0:` (only logging and saving belong inside).",
    "parameters": "Change parameters on every rank alike, or inside the optimizer; after a change made on one rank "
    "on purpose (weights loaded on rank 0), broadcast them from rank 0 (dist.broadcast for each, or rebuild DDP).",
}


def _blame_calls(records: dict[tuple[int, int], dict[int, dict[str, Any]]], world: int, optimizer: int,
                 step: int) -> dict[int, dict[str, Any]]:
    """rank -> the first update-changing call it made, in the latest window up to `step` where the
    ranks' calls differ, that not every rank made."""
    for window in range(step, 0, -1):
        by_rank = records.get((optimizer, window), {})
        if len(by_rank) != world:
            return {}
        keys = {rank: _calls_key(record["calls"]) for rank, record in by_rank.items()}
        if len(set(keys.values())) == 1:
            continue
        everyone = set.intersection(*(set(k) for k in keys.values()))
        return {rank: next(c for c in record["calls"] if (c["what"], c["site"] or "?") not in everyone)
                for rank, record in by_rank.items() if set(keys[rank]) - everyone}
    return {}


def _moved_between_steps(records: dict[tuple[int, int], dict[int, dict[str, Any]]], optimizer: int,
                         step: int) -> list[int]:
    """The ranks whose DDP parameters changed between the previous step's end and this step,
    when the ranks did not all change them alike."""
    before, now = records.get((optimizer, step - 1), {}), records[(optimizer, step)]
    if set(before) != set(now) or any(before[r].get("params_after") is None or now[r]["params_before"] is None
                                      for r in now):
        return []
    previous = {rank: before[rank]["params_after"] for rank in now}
    if len(set(previous.values())) > 1:
        return []  # they differed already: an earlier finding's consequence
    current = {rank: now[rank]["params_before"] for rank in now}
    if len(set(current.values())) == 1:
        return []
    moved = [rank for rank in sorted(current) if current[rank] != previous[rank]]
    return moved if len(moved) < len(current) else odd_ones_out(current)


# -- files ---------------------------------------------------------------------------------------


def _same_file_written(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    writers: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        for write in facts["writes"]:
            writers.setdefault((facts["host"], write["path"]), {}).setdefault(rank, write)
    findings = []
    for (host, path), by_rank in sorted(writers.items()):
        if len(by_rank) < 2:
            continue
        ranks = sorted(by_rank)
        saves = any(w["how"] == "torch.save" for w in by_rank.values())
        together = Counter(w["step"] for w in by_rank.values()).most_common(1)[0][1] > 1
        site = by_rank[ranks[0]]["site"] or "?"
        findings.append(Finding(
            "same_file_written",
            "error" if saves else "warning",
            ranks,
            f"{ranks_text(ranks).capitalize()} on host {host} all wrote {path} (with {by_rank[ranks[0]]['how']} at {site})"
            f"{', at the same step' if together else ''}: the writes overlap, and the file that survives holds one "
            "random rank's data, or a mix of several" + (" (a torn checkpoint)." if saves else "."),
            "Write from one rank (`if dist.get_rank() == 0:` and a barrier before others read it), or give each rank "
            "its own path (f'...rank{rank}.pt'); for sharded state use torch.distributed.checkpoint, "
            "which writes one file per rank by design.",
            locations={str(r): by_rank[r]["site"] or "?" for r in ranks},
            details={"path": path},
        ))
        if len(findings) >= 3:
            break
    return findings
