"""schedule_length: the watch notes torch's step-sized schedulers with their size and the line that
computed it (in this process, on real schedulers); the rule, on hand-made facts, names a per-step
schedule sized from the whole dataset's batches, and leaves one sized from the loader, one stepped
per epoch, and one whose loop's epochs are unknown alone."""

from __future__ import annotations

import torch

from gradsync.doctor.script import registry
from gradsync.doctor.script.schedule_length import NAME, ScheduleWatch
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments


def test_the_watch_notes_each_step_sized_scheduler_its_size_and_where_it_was_counted():
    moments = Moments()
    watch = ScheduleWatch(moments, BookkeepingByKind())
    patches = Patches()
    watch.install(patches)
    try:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        per_epoch = 40
        one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, epochs=2, steps_per_epoch=per_epoch)
        total = 70
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, total)
        torch.optim.lr_scheduler.StepLR(optimizer, 5)  # sized in nothing the rule reads
        for _ in range(3):
            optimizer.step()
            one_cycle.step()
        moments.steps = 3
    finally:
        patches.undo()
    cycle, cosine = watch.facts()["schedulers"]
    assert (cycle["kind"], cycle["per_epoch"], cycle["length"], cycle["stepped"]) == ("OneCycleLR", 40, 80, 3)
    assert (cosine["kind"], cosine["per_epoch"], cosine["length"], cosine["stepped"]) == ("CosineAnnealingLR", None, 70, 0)
    here = __file__.rsplit("/", 1)[1]
    assert cycle["counted_at"].endswith(f"{here}:{_line_of('per_epoch = 40')}")  # the name's assignment
    assert cosine["counted_at"].endswith(f"{here}:{_line_of('total = 70')}")  # given by position
    assert cycle["site"].endswith(f"{here}:{_line_of('one_cycle = torch')}")


def _line_of(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip().startswith(text))


def _facts(scheduler: dict, *, epochs: int | None = 3, batches: int = 10, steps: int = 12) -> dict:
    loader = {"site": "train.py:48", "feeds_training": True, "dataset_samples": 400, "batch_size": 20,
              "batches": batches, "epochs": epochs}
    return {"loaders": [loader], NAME: {"steps": steps, "schedulers": [
        {"kind": "CosineAnnealingLR", "site": "train.py:45", "per_epoch": None, "counted_at": "train.py:44",
         "stepped": steps, **scheduler}]}}


def _findings(**kwargs) -> list:
    facts = _facts(**kwargs)
    return registry.findings({0: facts, 1: facts}, [NAME])


def test_a_per_step_schedule_sized_from_the_whole_dataset_is_named_where_it_was_counted():
    (finding,) = _findings(scheduler={"length": 60})  # 3 epochs x 400 / 20, where each rank walks 10 batches
    assert (finding.category, finding.severity, finding.locations) == (
        "schedule_counts_whole_dataset", "warning", {"0": "train.py:44", "1": "train.py:44"})
    assert "60 steps (3 epochs of 20 batches)" in finding.message and "at 50% of its course" in finding.message
    (per_epoch,) = _findings(scheduler={"kind": "OneCycleLR", "per_epoch": 20, "length": 60})
    assert "steps_per_epoch=20" in per_epoch.message


def test_a_schedule_sized_from_the_rank_s_loader_is_left_alone_even_where_the_counts_divide():
    assert _findings(scheduler={"length": 30}) == []  # 3 epochs x len(loader)
    # 4 epochs of the rank's 10 batches = 2 epochs of the whole dataset's 20: the loop's epochs decide.
    assert _findings(scheduler={"length": 40}, epochs=4) == []


def test_a_schedule_stepped_per_epoch_or_with_unknown_epochs_is_left_alone():
    assert _findings(scheduler={"length": 60, "stepped": 1}) == []
    assert _findings(scheduler={"length": 60}, epochs=None) == []
    assert _findings(scheduler={"length": 60}, batches=20) == []  # the loader walks the whole dataset itself
