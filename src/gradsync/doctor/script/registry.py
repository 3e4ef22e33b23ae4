"""The checks of the script check, in the order their findings are reported, and what they add up to.

`CHECKS` is the one list of checks (each one module of this package). From it come the
categories diagnosis.json may hold (registered with gradsync.rundir.records), the docs table of
docs/doctor.md, the names `--checks` selects, the watches each rank carries, and the findings of
a run: each selected check's rule, less the findings another finding explains.
"""

from __future__ import annotations

from collections.abc import Collection

from gradsync.errors import ConfigError
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments, Watch
from gradsync.rundir.records import Finding, register_categories
from gradsync.doctor.script import (
    accumulation, averaging, collective_arguments, comm_hook_average, data_split, dataset_generator, eval_mode, find_unused, fsdp_root,
    identical_batches, line_trace, loss_scale, parameter_order, pipeline_messages, replicas, same_file, sampler_epoch,
    sampler_overlap, schedule_length, shared_random_draws, skipped_step, stale_gradients, state_dict_keys, state_writes,
    tensor_parallel_inputs, uneven_batches, update_differs,
)
from gradsync.doctor.script.unit import Category, Check, RankFacts

# The order findings are reported in: the data, gradient traffic, the replicas, FSDP2 and tensor
# parallelism, then what should agree across ranks (randomness, samples, scale, mode, update, files).
CHECKS: tuple[Check, ...] = (
    identical_batches.CHECK,
    uneven_batches.CHECK,
    sampler_epoch.CHECK,
    accumulation.CHECK,
    replicas.CHECK,
    find_unused.CHECK,
    tensor_parallel_inputs.CHECK,
    pipeline_messages.CHECK,
    fsdp_root.CHECK,
    shared_random_draws.CHECK,
    dataset_generator.CHECK,
    data_split.CHECK,
    sampler_overlap.CHECK,
    loss_scale.CHECK,
    eval_mode.CHECK,
    parameter_order.CHECK,
    averaging.CHECK,
    comm_hook_average.CHECK,
    skipped_step.CHECK,
    stale_gradients.CHECK,
    state_writes.CHECK,
    state_dict_keys.CHECK,
    update_differs.CHECK,
    schedule_length.CHECK,
    line_trace.CHECK,
    collective_arguments.CHECK,
    same_file.CHECK,
)

register_categories({name: (category.severities, category.meaning)
                     for check in CHECKS for name, category in check.categories.items()})


def check_names() -> list[str]:
    return [check.name for check in CHECKS]


def selected_checks(names: Collection[str] | None, option: str = "--checks") -> list[Check]:
    """The checks `--checks` names (every check for None), in CHECKS' order; an unknown name is the
    user's mistake (`option`: how the command line spells the option, for the message)."""
    if names is None:
        return list(CHECKS)
    unknown = sorted(set(names) - set(check_names()))
    if unknown:
        raise ConfigError(f"{option} {','.join(unknown)}: no such check; choose among {', '.join(check_names())}.")
    return [check for check in CHECKS if check.name in names]


def parse_names(text: str, option: str = "--checks") -> list[str]:
    """The check names of an option's value (NAME,NAME,...), checked, in CHECKS' order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(f"{option} {text!r}: name at least one check among {', '.join(check_names())}.")
    return [check.name for check in selected_checks(names, option)]


def watches(moments: Moments, bookkeeping: BookkeepingByKind, names: Collection[str] | None) -> dict[str, Watch]:
    """On a rank: the watches of the checks `names` selects (None: all) that record facts of their
    own, by check name, listening to `moments`."""
    return {check.name: check.watch(moments, bookkeeping) for check in selected_checks(names) if check.watch is not None}


def findings(facts: RankFacts, names: Collection[str] | None = None) -> list[Finding]:
    """Every finding the ranks' facts (global rank -> facts) support, by the checks `names` selects;
    None: those `--doctor-checks` selected, as the ranks recorded it (their "checks": absent or None
    for every check; a name this gradsync no longer has, in facts kept by another version, is passed over)."""
    if names is None and facts:
        recorded = facts[min(facts)].get("checks")
        names = None if recorded is None else [name for name in recorded if name in check_names()]
    found = [finding for check in selected_checks(names) for finding in check.rule(facts)]
    explained = explained_by(found)
    return [finding for finding in found if finding.category not in explained]


def explained_by(found: list[Finding]) -> set[str]:
    """The categories (of a check, or of `gradsync run` itself) that these findings explain."""
    explaining = {category: explained for check in CHECKS for category, explained in check.explains.items()}
    return {category for finding in found for category in explaining.get(finding.category, ())}


def categories() -> dict[str, Category]:
    return {name: category for check in CHECKS for name, category in check.categories.items()}


def docs_table() -> str:
    """The categories table of docs/doctor.md, one row per category, in the checks' order."""
    rows = ["| category | check | severity | what happened |", "|---|---|---|---|"]
    for check in CHECKS:
        for name, category in check.categories.items():
            rows.append(f"| `{name}` | {check.name} | {' / '.join(category.severities)} | {category.doc} |")
    return "\n".join(rows)
