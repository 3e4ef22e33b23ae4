"""tensor_parallel_inputs: the ranks of one tensor-parallel group fed a parallelized module different inputs.

They compute one copy of the model together (each holds a slice of each split layer), so each
forward must see the same batch on all of them; different batches give a model whose slices were
trained on different data, and nothing fails. Compared within each group, never across
data-parallel groups; modules whose plan shards their inputs on purpose (sequence parallelism)
are not compared.
"""

from __future__ import annotations

from typing import Any

from gradsync.rundir.records import Finding
from gradsync.doctor.script.compare import NAMES_SHOWN, ranks_text
from gradsync.doctor.script.unit import Category, Check, RankFacts


_SHARDED_INPUT_STYLES = frozenset({"SequenceParallel", "PrepareModuleInput", "PrepareModuleInputOutput"})


def tensor_parallel_inputs_differ(checks: RankFacts) -> list[Finding]:
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


CHECK = Check(
    name="tensor_parallel_inputs",
    summary="ranks of one tensor-parallel group fed different batches",
    categories={
        "tensor_parallel_inputs_differ": Category(
            ("error",),
            "the ranks of one tensor-parallel group fed a parallelized module different inputs",
            "the ranks of one tensor-parallel group fed a `parallelize_module`d module different inputs (data split "
            "by the global rank, as for DDP): each slice of every split layer learns from other data. Compared "
            "within each group, never across data-parallel groups; modules whose plan shards inputs on purpose "
            "(sequence parallelism) are left alone",
        ),
    },
    rule=tensor_parallel_inputs_differ,
)
