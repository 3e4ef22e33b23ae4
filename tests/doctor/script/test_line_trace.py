"""line_trace, the second pass: the watch traces the user's lines of one step window and notes after
which the requested part of the state changed (in this process); the rule names the first change the
ranks did not make alike."""

from __future__ import annotations

import torch

from gradsync.doctor.script import registry
from gradsync.doctor.script.line_trace import NAME, TraceWatch, request
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments


def _line(tag: str) -> str:
    number = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith(f"# line: {tag}"))
    return f"tests/doctor/script/test_line_trace.py:{number}"


def _rescale(optimizer: torch.optim.Optimizer, batch: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.1 * batch / 4  # line: lr


def test_the_watch_notes_the_line_after_which_the_settings_changed_inside_the_window_only():
    moments, patches = Moments(request(1, "hyperparameters")), Patches()
    watch = TraceWatch(moments, BookkeepingByKind())
    watch.install(patches)
    try:
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        _rescale(optimizer, 8)  # before the window: not traced
        moments.emit("step_starts", optimizer, 1)
        moments.emit("step_ends", optimizer, 1)  # the window opens
        _rescale(optimizer, 2)
        moments.emit("step_starts", optimizer, 2)  # and closes
        _rescale(optimizer, 4)
    finally:
        patches.undo()
    facts = watch.facts()
    assert [change["site"] for change in facts["changes"]] == [_line("lr")]
    assert "lr=0.05" in facts["changes"][0]["value"] and "lr=0.2" in facts["initial"]


def _traced(*changes: tuple[str, str], initial: str = "lr=0.1") -> dict:
    return {NAME: {"request": request(3, "hyperparameters")["trace"], "initial": initial, "lines": 40,
                   "changes": [{"site": site, "value": value} for site, value in changes]}}


def test_a_setting_changed_on_one_rank_only_is_named_at_that_line_with_the_values():
    checks = {0: _traced(), 1: _traced(("train.py:14", "lr=0.125"))}
    (finding,) = registry.findings(checks, [NAME])
    assert (finding.category, finding.ranks, finding.locations, finding.step) == (
        "state_parted_at_line", [1], {"1": "train.py:14"}, 4)
    assert "changed at train.py:14 on rank 1, and not on rank 0 (lr: rank 0 0.1, rank 1 0.125)" in finding.message


def test_changes_every_rank_made_alike_are_not_blamed():
    alike = _traced(("train.py:14", "lr=0.05"), ("train.py:20", "lr=0.025"))
    assert registry.findings({0: alike, 1: alike}, [NAME]) == []
    first_pass = {rank: {NAME: {"request": None, "initial": None, "changes": [], "lines": 0}} for rank in (0, 1)}
    assert registry.findings(first_pass, [NAME]) == []
