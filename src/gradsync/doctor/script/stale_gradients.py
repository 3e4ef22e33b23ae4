"""stale_gradients: every backward pass starts from cleared gradients on every rank, or from carried ones on every rank.

A backward pass adds into `.grad`. Between updates the script clears it (`zero_grad`), so that each
step applies one batch's gradient; within an accumulation window it keeps it on purpose, on every
rank. DDP averages whatever each rank's buckets hold: a rank that skipped its clear (a `zero_grad`
inside a branch some ranks skip, or on rank 0 only) feeds the average its earlier gradients on top
of this batch's. The average is the same on every rank, so the replicas stay identical and nothing
fails: the updates are silently off.

So each rank records, entering each of its first backward passes, whether the gradients of its
wrapped models' parameters were clear (None, or zero in a sample of their values) or carried
values, and the lines that cleared gradients since the previous pass (read from the tensor-level
writes: `p.grad = None`, `zero_()`). The rule compares the ranks pass by pass: a pass some ranks
entered carrying gradients while the others had cleared theirs is named at the clearing line the
carrying ranks did not run.

Cost: per recorded backward pass, a sample of 256 values of each parameter's gradient.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from gradsync.callsite import caller_location
from gradsync.doctor.script.compare import ranks_text
from gradsync.doctor.script.shared_facts import own_facts, replica_groups
from gradsync.doctor.script.unit import Category, Check, RankFacts
from gradsync.run.check_primitives import FINGERPRINT_SAMPLES, Patches, dtensor_class, group_ranks
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.rundir.records import Finding

NAME = "stale_gradients"
MAX_PASSES = 64  # backward passes recorded per rank
_CLEARING = frozenset({"grad =", "zero_", "_foreach_zero_"})  # writes that clear a gradient


class StaleFacts(TypedDict):
    """What the watch records on one rank (under "stale_gradients" in its facts file)."""

    group: list[int] | None  # the ranks of the first DDP model's process group (its replicas)
    # per backward pass: {"step": counted steps before it, "carried": bool, "site": the backward's line,
    #  "cleared_at": the lines that cleared gradients since the previous pass}
    passes: list[dict[str, Any]]


def _holds_values(gradient: torch.Tensor) -> bool:
    flat = gradient.detach().reshape(-1)
    stride = max(1, flat.numel() // FINGERPRINT_SAMPLES)
    return bool(flat[::stride][:FINGERPRINT_SAMPLES].any())


class StaleWatch:
    """Entering each backward pass of one rank: whether its wrapped models' gradients carry values."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.passes: list[dict[str, Any]] = []
        self.group: list[int] | None = None
        self._cleared: list[str] = []  # lines that cleared gradients since the previous backward
        self._dtensor = dtensor_class()
        moments.on("backward", self._backward, self.bookkeeping)
        moments.on("state_written", self._written, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        """Nothing beyond the host's moments."""

    def _written(self, write: Any) -> None:
        if write.op in _CLEARING and "gradient" in write.kinds and write.site not in self._cleared and len(self._cleared) < 8:
            self._cleared.append(write.site)

    def _backward(self, tensors: Any) -> None:
        cleared, self._cleared = self._cleared, []
        if not self.moments.models or len(self.passes) >= MAX_PASSES:
            return
        if self.group is None:
            self.group = group_ranks(self.moments.models[0].process_group)
        gradients = [p.grad for ddp in self.moments.models for p in ddp.module.parameters()
                     if p.grad is not None and not (self._dtensor is not None and isinstance(p.grad, self._dtensor))]
        self.passes.append({"step": self.moments.steps, "carried": any(map(_holds_values, gradients)),
                            "site": caller_location(), "cleared_at": cleared})

    def facts(self) -> StaleFacts:
        return {"group": self.group, "passes": self.passes}


def stale_gradients(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    for members in replica_groups({rank: facts["group"] for rank, facts in recorded.items()}):
        found = _carried_on_some_ranks({rank: recorded[rank]["passes"] for rank in members})
        if found:
            return found
    return []


def _carried_on_some_ranks(passes: dict[int, list[dict[str, Any]]]) -> list[Finding]:
    for index in range(min(len(p) for p in passes.values())):
        entering = {rank: p[index] for rank, p in passes.items()}
        carrying = sorted(rank for rank, record in entering.items() if record["carried"])
        if not carrying or len(carrying) == len(entering):
            continue
        clean = sorted(set(entering) - set(carrying))
        skipped = [site for site in entering[clean[0]]["cleared_at"]
                   if all(site not in entering[rank]["cleared_at"] for rank in carrying)]
        record = entering[carrying[0]]
        where = f"cleared theirs at {skipped[0]}, a line {ranks_text(carrying)} did not run" if skipped else "had cleared theirs"
        return [Finding(
            "gradients_carried_on_some_ranks",
            "error",
            carrying,
            f"Entering backward pass {index + 1} (at {record['site'] or '?'}, after optimizer step {record['step']}), "
            f"{ranks_text(carrying)} still held gradients from before, while {ranks_text(clean)} {where}. DDP averages "
            "what every rank holds: the update now adds those earlier gradients on top of this batch's, on every rank "
            "alike, so the replicas agree and every step is silently off.",
            "Clear the gradients on every rank before each step's first backward (optimizer.zero_grad() outside any "
            "branch that only some ranks take); to accumulate, keep them on every rank alike (and use no_sync() for "
            "the passes that should not communicate).",
            locations={str(rank): skipped[0] if skipped else record["site"] or "?" for rank in carrying},
            step=record["step"] + 1,
            details={"backward_pass": index + 1, "cleared_at": skipped},
        )]
    return []


CHECK = Check(
    name=NAME,
    summary="gradients carried into a backward pass on some ranks only",
    categories={
        "gradients_carried_on_some_ranks": Category(
            ("error",),
            "some ranks entered a backward pass still holding earlier gradients while the others had cleared theirs",
            "entering a backward pass, some ranks' gradients still held earlier values (their `zero_grad` skipped: "
            "inside a branch only some ranks take) while the others had cleared theirs: DDP averages what every rank "
            "holds, so every update adds the stale gradients, on every rank alike. Named at the clearing line the "
            "carrying ranks did not run. Accumulation that carries gradients on every rank is left alone",
        ),
    },
    rule=stale_gradients,
    watch=StaleWatch,
    facts=StaleFacts,
)
