"""The launcher side of `gradsync run --doctor-steps K`: compare what the ranks saw of their own runs.

Each rank left its facts in the attempt directory (gradsync.run.script_facts); these pure
functions turn them into findings of diagnosis.json, one rule per mistake. The rules only speak
when the facts can tell: forwards, loaders and models are compared where every rank has them,
replicas only when every rank hashed them after the same number of optimizer steps, and a loop
under `Join` or a sampler that only feeds evaluation is left alone, so a correct script gets no
error or warning.
"""

from __future__ import annotations

import statistics
from typing import Any

from gradsync.rundir.records import Finding

NAMES_SHOWN = 5  # differing parameter or buffer names spelled out in a message


def script_check_findings(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """Every finding the ranks' facts (`checks`: global rank -> facts) support."""
    from gradsync.doctor.consistency_findings import consistency_findings  # it uses this module's helpers

    consistency = consistency_findings(checks)
    # A parameter order or an update that differs across ranks is why the replicas diverged: said once.
    explained = any(f.category in ("parameter_order_differs", "update_differs") for f in consistency)
    identical = _identical_batches(checks)
    if identical:  # every rank drawing the same samples is that finding, not an overlap of shares
        consistency = [f for f in consistency if f.category != "sampler_overlap"]
    return [
        *identical,
        *_uneven_batches(checks),
        *_sampler_epoch_not_set(checks),
        *_accumulation_without_no_sync(checks),
        *([] if explained else _diverged_replicas(checks)),
        *_find_unused_parameters_unneeded(checks),
        *_tensor_parallel_inputs_differ(checks),
        *_fsdp_root_holds_most(checks),
        *consistency,
    ]


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(ranks))


def odd_ones_out(values: dict[int, Any]) -> list[int]:
    """The ranks outside the one largest group of equal values; every rank when no group is largest."""
    groups: dict[Any, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    sizes = sorted((len(ranks) for ranks in groups.values()), reverse=True)
    if len(sizes) > 1 and sizes[0] > sizes[1]:
        largest = max(groups.values(), key=len)
        return sorted(r for r in values if r not in largest)
    return sorted(values)


def _names_text(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


# -- the data -------------------------------------------------------------------------------


def _identical_batches(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    if len(checks) < 2:
        return []
    forwards = {rank: facts["forwards"] for rank, facts in checks.items()}
    compared = [
        index
        for index in range(min(len(f) for f in forwards.values()))
        if all(f[index]["fingerprint"] is not None for f in forwards.values())
    ]
    if not compared or any(len({f[i]["fingerprint"] for f in forwards.values()}) > 1 for i in compared):
        return []
    first = {rank: f[compared[0]] for rank, f in forwards.items()}
    loaders = sorted({forward["loader"] for forward in first.values() if forward["loader"]})
    source = f", batches from the DataLoader iterated at {', '.join(loaders)}" if loaders else ""
    ranks = sorted(checks)
    return [
        Finding(
            "no_distributed_sampler",
            "error",
            ranks,
            f"Every rank fed DDP the same inputs in each of the {len(compared)} training forwards compared "
            f"(at {first[ranks[0]]['site'] or '?'}{source}): the ranks train on identical batches, so the "
            f"{len(ranks)} processes do the work of one (every batch is computed {len(ranks)} times) and the run "
            "is no faster than on one process.",
            "Give each rank its own share of the data: DataLoader(dataset, sampler=DistributedSampler(dataset)) "
            "with sampler.set_epoch(epoch) at the start of each epoch, or gradsync's loader "
            "(trainer.prepare(model, optimizer, dataset, batch_size=...)). Data generated on each rank needs "
            "a different seed per rank.",
            locations={str(rank): forward["site"] or "?" for rank, forward in sorted(first.items())},
            details={"forwards_compared": len(compared)},
        )
    ]


def _uneven_batches(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    by_key: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        for loader in facts["loaders"]:
            by_key.setdefault(loader["key"], {})[rank] = loader
    findings = []
    reported_sites = set()
    for entries in by_key.values():
        site = next(iter(entries.values()))["site"]
        batches = {rank: loader["batches"] for rank, loader in entries.items()}
        if (
            len(entries) < 2
            or site in reported_sites
            or None in batches.values()
            or len(set(batches.values())) == 1
            or not any(loader["feeds_training"] for loader in entries.values())
            or any(loader["under_join"] for loader in entries.values())  # Join shadows the missing steps
        ):
            continue
        reported_sites.add(site)
        counts = ", ".join(
            f"rank {rank}: {n} batches" + (f" ({entries[rank]['samples']} samples)" if entries[rank]["samples"] is not None else "")
            for rank, n in sorted(batches.items())
        )
        findings.append(
            Finding(
                "uneven_batches",
                "error",
                odd_ones_out(batches),
                f"The ranks have different numbers of batches per epoch from the DataLoader iterated at {site} "
                f"({counts}). Every training batch all-reduces gradients, so when the ranks with fewer batches "
                "leave the loop, the others wait for partners that never come: the job will hang at the end of "
                "the epoch (or pair their gradients with a different collective).",
                "Give every rank the same number of batches: DistributedSampler (it pads every rank to the same "
                "number of samples, or trims with drop_last=True) or gradsync's loader instead of a hand-made "
                "shard; if uneven inputs are intended, train inside `with Join([ddp]):` "
                "(torch.distributed.algorithms.join).",
                locations={str(rank): site or "?" for rank in sorted(entries)},
                details={"batches": {str(r): n for r, n in sorted(batches.items())}},
            )
        )
    return findings


def _sampler_epoch_not_set(checks: dict[int, dict[str, Any]]) -> list[Finding]:
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
    return [
        Finding(
            "sampler_epoch_not_set",
            "warning",
            sorted(repeats),
            f"A shuffling DistributedSampler started another pass with the same epoch ({', '.join(map(str, epochs))}) "
            f"as its previous pass on {ranks_text(list(repeats))} (loop at "
            f"{', '.join(sorted({p['site'] or '?' for p in repeats.values()}))}): every epoch repeats the same "
            "order, because the sampler's shuffle is seeded by its epoch and set_epoch was not called.",
            "Call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader "
            "(gradsync's trainer.epochs() does it for its loader).",
            locations={str(rank): p["site"] or "?" for rank, p in sorted(repeats.items())},
            details={"epoch": epochs[0]},
        )
    ]


# -- gradient traffic ---------------------------------------------------------------------------


def _accumulation_without_no_sync(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    # The median per step ignores a few steps a GradScaler skipped (their passes synced, no step).
    affected = {
        rank: facts
        for rank, facts in sorted(checks.items())
        if facts["syncs_per_step"] and statistics.median(facts["syncs_per_step"]) >= 2
    }
    if not affected:
        return []
    ratios = {rank: sum(f["syncs_per_step"]) / len(f["syncs_per_step"]) for rank, f in affected.items()}
    ratio = max(ratios.values())
    facts = next(iter(affected.values()))
    return [
        Finding(
            "accumulation_without_no_sync",
            "warning",
            sorted(affected),
            f"Gradients were all-reduced on {ratio:.3g} backward passes per optimizer step "
            f"({sum(facts['syncs_per_step'])} synchronised passes for {len(facts['syncs_per_step'])} steps on "
            f"{ranks_text([next(iter(affected))])}): the micro-steps of an accumulation synchronise although only "
            f"the sum at the last one is used, {ratio:.3g}× the needed gradient traffic.",
            "Run the forward and backward of every micro-step but the last under `with ddp.no_sync():` (the "
            "summed gradient is the same), or let gradsync accumulate: gradsync.setup(accumulation_steps=N).",
            locations={str(rank): f["backward_site"] or "?" for rank, f in affected.items()},
            details={"syncs_per_step": {str(rank): round(r, 3) for rank, r in ratios.items()}},
        )
    ]


# -- the replicas -------------------------------------------------------------------------------


def _common_models(checks: dict[int, dict[str, Any]]) -> list[dict[int, dict[str, Any]]]:
    """For each DDP model every rank built (in construction order): rank -> its facts."""
    if len(checks) < 2:
        return []
    count = min(len(facts["models"]) for facts in checks.values())
    return [{rank: facts["models"][index] for rank, facts in checks.items()} for index in range(count)]


_DIVERGED_SUGGESTIONS = {
    "parameters": "Look for an update made on some ranks only: parameters changed after optimizer.step() under "
    "`if rank == ...`, a learning rate, clipping or loss scale decided per rank, or weights loaded on one rank "
    "after DDP was built; or a non-deterministic op in the update. Make such changes on every rank (or "
    "broadcast the parameters from rank 0 afterwards).",
    "buffers": "Keep DDP's buffer sync on (broadcast_buffers=True, forward_sync_buffers=True since torch 2.13: each "
    "forward starts from rank 0's buffers), or use nn.SyncBatchNorm.convert_sync_batchnorm(model) so the "
    "statistics are computed over all ranks; with buffer sync off on purpose, average the buffers before "
    "evaluating or saving. A non-deterministic op writing the buffers does this too.",
}


def _diverged_replicas(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    steps = {facts["steps"] for facts in checks.values()}
    if len(steps) != 1:
        return []  # ranks that stopped at different steps hold different models for that reason alone
    step = steps.pop()
    findings = []
    for models in _common_models(checks):
        site = next(iter(models.values()))["site"] or "?"
        for kind in ("parameters", "buffers"):
            if kind == "buffers" and any(model["buffers_synced"] for model in models.values()):
                continue  # the next forward replaces them with rank 0's
            hashes = {rank: model[kind] for rank, model in models.items()}
            names = [name for name in next(iter(hashes.values())) if all(name in h for h in hashes.values())]
            differing = [
                name
                for name in names
                if None not in {h[name] for h in hashes.values()} and len({h[name] for h in hashes.values()}) > 1
            ]
            if not differing:
                continue
            ranks = odd_ones_out({rank: tuple(h[name] for name in differing) for rank, h in hashes.items()})
            who = f"between {ranks_text(ranks)}" if len(ranks) == len(hashes) else f"on {ranks_text(ranks)} from the other ranks'"
            why = (
                "DDP keeps replicas equal only while every rank applies the same averaged gradient: from here on "
                "the ranks train different models, and a checkpoint saved by rank 0 holds only rank 0's."
                if kind == "parameters"
                else "DDP does not sync this model's buffers during training (broadcast_buffers / "
                "forward_sync_buffers off), so each rank's statistics follow its own data: evaluation and "
                "checkpoints depend on which rank produced them."
            )
            findings.append(
                Finding(
                    f"{kind}_diverged",
                    "error",
                    ranks,
                    f"After optimizer step {step} the replicas' {kind} differ {who}: {len(differing)} of "
                    f"{len(names)} ({_names_text(differing)}) of the model wrapped in DDP at {site}. {why}",
                    _DIVERGED_SUGGESTIONS[kind],
                    locations={str(rank): site for rank in ranks},
                    step=step,
                    details={kind: differing},
                )
            )
    return findings


def _find_unused_parameters_unneeded(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    findings = []
    for models in _common_models(checks):
        if not all(
            model["find_unused_parameters"] and model["usage_checked_passes"] > 0 and model["incomplete_passes"] == 0
            for model in models.values()
        ):
            continue
        site = next(iter(models.values()))["site"] or "?"
        passes = min(model["usage_checked_passes"] for model in models.values())
        findings.append(
            Finding(
                "find_unused_parameters_unneeded",
                "warning",
                sorted(models),
                f"DDP was built with find_unused_parameters=True at {site}, but every parameter got a gradient in "
                f"each of the {passes} synchronised backward passes checked on every rank. The flag makes DDP "
                "walk the autograd graph after every forward and costs overlap of gradient communication with "
                "the backward pass.",
                "Pass find_unused_parameters=False (the default), unless some parameters go unused only in "
                "later steps (a branch taken now and then): DDP then stops with an error that `gradsync run` "
                "turns into the names of those parameters. Frameworks set it for you: the Hugging Face Trainer "
                "turns it on unless TrainingArguments(ddp_find_unused_parameters=False); Lightning takes "
                "DDPStrategy(find_unused_parameters=False).",
                locations={str(rank): site for rank in sorted(models)},
            )
        )
    return findings


# -- FSDP2 and tensor parallelism ---------------------------------------------------------------

FSDP_ROOT_SHARE = 0.5  # above this share of the parameters in the root unit, sharding saves little


def _tensor_parallel_inputs_differ(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """The ranks of one tensor-parallel group fed a parallelized module different inputs.

    They compute one copy of the model together (each holds a slice of each split layer), so
    each forward must see the same batch on all of them; different batches give a model whose
    slices were trained on different data, and nothing fails. Modules whose plan shards their
    inputs on purpose (sequence parallelism) are not compared.
    """
    findings = []
    count = min((len(facts.get("tp_modules", [])) for facts in checks.values()), default=0)
    for index in range(count):
        modules = {rank: facts["tp_modules"][index] for rank, facts in checks.items()}
        if any(set(m["styles"]) & _SHARDED_INPUT_STYLES for m in modules.values()):
            continue
        groups: dict[tuple[int, ...], dict[int, dict[str, Any]]] = {}
        for rank, module in modules.items():
            if module["ranks"]:
                groups.setdefault(tuple(module["ranks"]), {})[rank] = module
        for group_ranks, members in sorted(groups.items()):
            if len(members) < 2 or len(members) != len(group_ranks):
                continue  # a rank of the group left no facts: nothing to compare it with
            inputs = {rank: m["inputs"] for rank, m in members.items()}
            length = min(len(i) for i in inputs.values())
            differing = [
                i for i in range(length)
                if None not in {f[i] for f in inputs.values()} and len({f[i] for f in inputs.values()}) > 1
            ]
            if not differing:
                continue
            site = next(iter(members.values()))["site"] or "?"
            ranks = sorted(members)
            findings.append(
                Finding(
                    "tensor_parallel_inputs_differ",
                    "error",
                    ranks,
                    f"The ranks of one tensor-parallel group ({ranks_text(ranks)}) fed the module parallelized at {site} "
                    f"different inputs in {len(differing)} of {length} training forwards (first: forward {differing[0] + 1}). "
                    "A tensor-parallel group computes one copy of the model together, each rank a slice of every split "
                    "layer, so every forward must see the same batch on all of them: with different batches each slice "
                    "learns from other data and the model is silently wrong.",
                    "Give the ranks of a tensor-parallel group the same batches: split the data by the data-parallel "
                    "rank (mesh['dp'].get_local_rank(), or rank // tp_size), not by the global rank, and seed their "
                    "random streams alike. gradsync's trainer does this with setup(parallel='tp' or 'fsdp+tp').",
                    locations={str(rank): site for rank in ranks},
                    details={"forwards": [i + 1 for i in differing[:NAMES_SHOWN]]},
                )
            )
    return findings


_SHARDED_INPUT_STYLES = frozenset({"SequenceParallel", "PrepareModuleInput", "PrepareModuleInputOutput"})


def _fsdp_root_holds_most(checks: dict[int, dict[str, Any]]) -> list[Finding]:
    """A model sharded with fully_shard whose root unit keeps most parameters: the root's are
    gathered at the first forward and kept to the end of backward, so the model sits whole on
    every rank for most of the step, while FSDP still sends 1.5x DDP's bytes."""
    if not checks:
        return []
    facts = checks[min(checks)]  # the same model on every rank
    findings = []
    for root in facts.get("fsdp_roots", []):
        total, kept = root["parameters"], root["in_root_unit"]
        if not total or kept / total <= FSDP_ROOT_SHARE:
            continue
        largest = root["largest_in_root"]
        where = f" (the largest part: '{largest[0]}', {largest[1] / total:.0%})" if largest and largest[0] != "(its own)" else ""
        findings.append(
            Finding(
                "fsdp_root_holds_most",
                "warning",
                sorted(checks),
                f"The {root['class']} sharded with fully_shard at {root['site'] or '?'} keeps {kept / total:.0%} of its "
                f"{total:,} parameters in its root unit{where}. FSDP gathers a unit's parameters for its forward and "
                "backward; the root's stay gathered from the first forward to the end of backward, so every rank holds "
                "most of the model anyway, and the gathers cost 1.5x DDP's traffic.",
                "Call fully_shard on each block (each transformer layer, each large embedding or head) before calling it "
                "on the root, as torch's FSDP2 examples do; or use DDP if the model fits.",
                locations={str(rank): root["site"] or "?" for rank in sorted(checks)},
                details={"in_root_unit": kept, "parameters": total},
            )
        )
    return findings
