"""schedule_length: a learning-rate schedule sized in steps counts the steps of the rank's own data.

A schedule stepped once per optimizer step (OneCycleLR, a cosine over T_max steps, a linear or
polynomial decay) is sized by the script from the data: epochs times the batches of an epoch.
Under a DistributedSampler each rank's DataLoader yields 1/N of the dataset's batches, so a size
computed from `len(dataset) / batch_size`, as on one process, is N times the steps the run will
take: training ends with the schedule at 1/N of its course (OneCycle still near its peak, a cosine
barely decayed). Nothing fails; the model is just trained at the wrong learning rates.

So each rank records every such scheduler its script builds (torch's, whose size arguments are
known), with the size it was given and the line that computed it, and how often it stepped; and,
for the DataLoader that feeds training, the dataset's length, the batch size, its own batches per
epoch and the epochs of the loop around it (read where that loop is a `range` of plain values).
The rule names a per-step schedule whose size is exactly the whole dataset's batches (per epoch,
or times the epochs) where the rank's loader yields fewer. A schedule sized from the loader, or
stepped once per epoch, is left alone; so is one the epochs of the loop cannot be read for.

Cost: per scheduler built, a look at the line that built it.
"""

from __future__ import annotations

import inspect
import math
import sys
import weakref
from typing import Any, TypedDict

from gradsync.callsite import entry_site
from gradsync.doctor.script.compare import ranks_text
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts
from gradsync.run.activity import argument_line
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.rundir.records import Finding

NAME = "schedule_length"
SCHEDULERS_KEPT = 8
# torch's schedulers sized in steps -> their arguments that carry the size: per epoch first (OneCycleLR
# takes epochs and steps_per_epoch, or total_steps), then the whole length.
SIZED = {"OneCycleLR": ("steps_per_epoch", "total_steps"), "CosineAnnealingLR": ("T_max",),
         "LinearLR": ("total_iters",), "PolynomialLR": ("total_iters",)}


class ScheduleFacts(TypedDict):
    """What the watch records on one rank (under "schedule_length" in its facts file)."""

    # per scheduler: {"kind", "site", "per_epoch": steps_per_epoch given (else None), "length": its
    #  whole length in steps, "counted_at": the line that computed the size given, "stepped": its steps}
    schedulers: list[dict[str, Any]]
    steps: int  # optimizer steps counted when the facts were written


class ScheduleWatch:
    """The step-sized schedulers one rank builds, and how often each stepped."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.schedulers: list[dict[str, Any]] = []
        self._built: list[tuple[weakref.ref, dict[str, Any]]] = []

    def install(self, patches: Patches) -> None:
        """Note each scheduler torch sizes in steps, where it was built and with what size."""
        from torch.optim import lr_scheduler

        watch = self
        for kind in SIZED:
            cls = getattr(lr_scheduler, kind, None)
            if cls is None:
                continue

            def make(original, kind=kind, cls=cls):
                def __init__(scheduler, *args, **kwargs):
                    original(scheduler, *args, **kwargs)
                    if type(scheduler) is cls:  # a subclass may give its arguments other meanings
                        with watch.bookkeeping:
                            watch._built_one(kind, scheduler, args, kwargs)

                return __init__

            patches.wrap(cls, "__init__", make)

    def _built_one(self, kind: str, scheduler: Any, args: tuple, kwargs: dict) -> None:
        if len(self.schedulers) >= SCHEDULERS_KEPT:
            return
        names = list(inspect.signature(type(scheduler).__init__).parameters)[1:]  # without self
        given = dict(zip(names, args)) | kwargs
        size = next((name for name in SIZED[kind] if isinstance(given.get(name), int)), None)
        if size is None:
            return
        per_epoch = given[size] if size == "steps_per_epoch" else None
        length = (given.get("epochs") or 0) * per_epoch if per_epoch is not None else given[size]
        entry = {"kind": kind, "site": entry_site(scheduler), "per_epoch": per_epoch, "length": length,
                 "counted_at": argument_line(sys._getframe(2), kind, size, names.index(size)), "stepped": 0}
        self.schedulers.append(entry)
        self._built.append((weakref.ref(scheduler), entry))

    def facts(self) -> ScheduleFacts:
        for ref, entry in self._built:
            scheduler = ref()
            if scheduler is not None:
                entry["stepped"] = int(getattr(scheduler, "last_epoch", 0))
        return {"schedulers": self.schedulers, "steps": self.moments.steps}


def _whole_batches(loader: dict[str, Any]) -> set[int]:
    """The batches an epoch of the whole dataset makes, with and without its last partial batch."""
    samples, size = loader["dataset_samples"], loader["batch_size"]
    return {math.ceil(samples / size), samples // size}


def schedule_counts_whole_dataset(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    found: dict[int, tuple[dict[str, Any], dict[str, Any], int]] = {}
    for rank, facts in sorted(recorded.items()):
        loader = next((entry for entry in checks[rank].get("loaders", []) if entry.get("feeds_training")
                       and entry.get("dataset_samples") and entry.get("batch_size") and entry.get("batches")), None)
        if loader is None or loader["batches"] >= min(_whole_batches(loader)):
            continue  # no loader read, or each rank's loader walks the whole of its dataset
        for scheduler in facts["schedulers"]:
            if facts["steps"] < 2 or scheduler["stepped"] < 0.8 * facts["steps"]:
                continue  # stepped once per epoch (or not yet): sized in epochs, not in steps
            whole = _whole_batches(loader)
            if scheduler["per_epoch"] is not None:
                if scheduler["per_epoch"] in whole:
                    found[rank] = (scheduler, loader, 1)
                    break
                continue
            epochs = loader.get("epochs")
            if epochs and scheduler["length"] in {epochs * batches for batches in whole}:
                found[rank] = (scheduler, loader, epochs)
                break
    if not found:
        return []
    ranks = sorted(found)
    scheduler, loader, epochs = found[ranks[0]]
    whole = scheduler["per_epoch"] or scheduler["length"] // epochs
    counted = scheduler["counted_at"] or scheduler["site"] or "?"
    share = loader["batches"] / whole
    sized = (f"steps_per_epoch={whole}" if scheduler["per_epoch"] is not None else
             f"{scheduler['length']} steps ({epochs} epochs of {whole} batches)")
    return [Finding(
        "schedule_counts_whole_dataset",
        "warning",
        ranks,
        f"The {scheduler['kind']} built at {scheduler['site'] or '?'} is sized {sized}, the batches of the whole dataset "
        f"({loader['dataset_samples']} samples in batches of {loader['batch_size']}; counted at {counted}). Under its "
        f"DistributedSampler each rank's DataLoader (iterated at {loader['site'] or '?'}) yields {loader['batches']} "
        f"batches per epoch, and the scheduler steps once per batch: on {ranks_text(ranks)} training ends with the "
        f"schedule at {share:.0%} of its course, so the learning rate never follows the planned curve.",
        "Size the schedule from the rank's own loader: steps_per_epoch=len(loader) (or total steps = epochs * "
        "len(loader), divided by the accumulation steps); len(loader) already counts only this rank's share.",
        locations={str(rank): found[rank][0]["counted_at"] or found[rank][0]["site"] or "?" for rank in ranks},
        details={"scheduler": scheduler["kind"], "batches_counted": whole, "batches_per_rank": loader["batches"]},
    )]


CHECK = Check(
    name=NAME,
    summary="a per-step LR schedule sized from the whole dataset, not the rank's share",
    categories={
        "schedule_counts_whole_dataset": Category(
            ("warning",),
            "a per-step learning-rate schedule is sized from the whole dataset's batches, not the rank's share",
            "a scheduler torch sizes in steps (OneCycleLR, CosineAnnealingLR, LinearLR, PolynomialLR), stepped once "
            "per optimizer step, was given exactly the whole dataset's batches per epoch (or times the epochs of the "
            "loop around the training DataLoader) while each rank's loader yields its share: the run ends with the "
            "schedule at 1/N of its course. Named at the line that computed the size. A schedule sized from "
            "`len(loader)`, stepped per epoch, or whose loop's epochs cannot be read is left alone",
        ),
    },
    rule=schedule_counts_whole_dataset,
    watch=ScheduleWatch,
    facts=ScheduleFacts,
)
