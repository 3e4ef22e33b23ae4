"""update_differs: the gradients, settings or parameters going into an optimizer step differ across ranks.

The same averaged gradient must go into the same update on every rank: an update changed on some
ranks only makes the replicas diverge. The first step where the gradients (after a synchronised
backward) or the hyperparameters differ is blamed on the ranks that made calls the others did not
(clipping, a scheduler step), at their line; parameters changed between two steps on some ranks
only are blamed on those ranks. The replicas' divergence it causes is explained by it, and not
reported again.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, TypedDict

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches, tensors_fingerprint
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import odd_ones_out, ranks_text, settings_differ
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts, replica_groups
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "update_differs"
MAX_STEPS = 64  # optimizer steps recorded per rank
CALLS_PER_STEP = 16  # update-changing calls kept between two optimizer steps


class UpdateFacts(TypedDict):
    """What the watch records on one rank (under "update_differs" in its facts file)."""

    # {"step", "optimizer", "site", "hyperparameters", "grads", "params_before", "params_after", "calls",
    #  "replicas": the ranks of the stepped DDP's process group, or None}
    steps: list[dict[str, Any]]


class UpdateWatch:
    """What goes into each optimizer step on one rank: a fingerprint of the DDP parameters'
    gradients and of the parameters, the optimizer's settings, and the calls since the previous
    step that change an update after DDP averaged it (clipping, schedulers), with their lines; and
    the parameters' fingerprint as the step returns."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.steps: list[dict[str, Any]] = []
        self._calls: list[dict[str, Any]] = []  # update-changing calls since the last step
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> index
        self._open_step: dict[int, dict[str, Any]] = {}  # optimizer index -> its step's record, until it returns
        moments.on("step_starts", self._step_starts, self.bookkeeping)
        moments.on("step_ends", self._step_ends, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_grad
        from torch.optim import lr_scheduler

        watch = self

        def noting(what: str):
            def make(original):
                def call(*args, **kwargs):
                    with watch.bookkeeping:
                        if len(watch._calls) < CALLS_PER_STEP:
                            watch._calls.append({"what": what, "site": caller_location()})
                    return original(*args, **kwargs)

                return call

            return make

        for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
            original = getattr(clip_grad, name, None)
            if original is None:
                continue
            wrapped = functools.wraps(original)(noting(name)(original))
            for owner in (nn_utils, clip_grad):
                if getattr(owner, name, None) is original:
                    patches.replace(owner, name, wrapped)
        patches.wrap(lr_scheduler.LRScheduler, "step", noting("scheduler.step"))
        if "step" in vars(lr_scheduler.ReduceLROnPlateau):  # its own step, not LRScheduler's
            patches.wrap(lr_scheduler.ReduceLROnPlateau, "step", noting("scheduler.step"))

    def _step_starts(self, optimizer: Any, step: int) -> None:
        index = self._optimizers.setdefault(optimizer, len(self._optimizers))
        calls, self._calls = self._calls, []
        if len(self.steps) >= MAX_STEPS:
            return
        going_in = self.moments.going_in(optimizer)
        record = {
            "step": step,
            "optimizer": index,
            "site": caller_location(),
            "hyperparameters": going_in["hyperparameters"],
            "grads": tensors_fingerprint(p.grad for p in self.moments.stepped_parameters(optimizer) if p.grad is not None),
            "params_before": going_in["parameters"],
            "calls": calls,
            "replicas": self.moments.replicas(optimizer),
        }
        self.steps.append(record)
        self._open_step[index] = record

    def _step_ends(self, optimizer: Any, step: int) -> None:
        record = self._open_step.pop(self._optimizers.get(optimizer, -1), None)
        if record is not None:
            record["params_after"] = tensors_fingerprint(self.moments.stepped_parameters(optimizer))

    def facts(self) -> UpdateFacts:
        return {"steps": self.steps}


def _calls_key(calls: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    return tuple((c["what"], c["site"] or "?") for c in calls)


def update_differs(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    # Compared among the replicas of one model: under pipeline (or hybrid) parallelism a DDP spans
    # only the ranks holding the same stage, whose gradients and parameters are another model's.
    replicas = {rank: next((step.get("replicas") for step in facts["steps"] if step.get("replicas")), None)
                for rank, facts in recorded.items()}
    for members in replica_groups(replicas):
        findings = _differs_among({rank: checks[rank] for rank in members}, {rank: recorded[rank] for rank in members})
        if findings:
            return findings
    return []


def _differs_among(checks: RankFacts, recorded: dict[int, Any]) -> list[Finding]:
    records: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for rank, facts in recorded.items():
        for record in facts["steps"]:
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
        details: dict[str, Any] = {"differs": what, "optimizer": optimizer}
        if not blamed:
            # No recorded call explains it: `gradsync doctor` traces that window line by line in a second run.
            details["localise"] = {"window": step - 1, "part": what}
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
        detail = f" ({settings_differ(hyper)})" if hyper_differ else ""
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
            details=details,
        )]
    return []


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


CHECK = Check(
    name="update_differs",
    summary="an optimizer step's update changed on some ranks only",
    categories={
        "update_differs": Category(
            ("error",),
            "the gradients, settings or parameters going into a step differ across ranks: who changed them",
            "going into an optimizer step after a synchronised backward, the DDP parameters' gradients, the "
            "optimizer's settings or the parameters themselves differ across ranks: blamed on the rank that made "
            "a call the others did not (`clip_grad_norm_`, `clip_grad_value_`, `scheduler.step`) at its line, or "
            "on the rank whose parameters moved between two steps",
        ),
    },
    rule=update_differs,
    watch=UpdateWatch,
    facts=UpdateFacts,
    explains={"update_differs": ("parameters_diverged", "buffers_diverged")},
)
