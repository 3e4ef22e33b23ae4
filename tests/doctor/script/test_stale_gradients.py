"""stale_gradients: the watch reads, entering each backward pass, whether the wrapped model's gradients
carry values and which lines cleared them (in this process, on a real model); the rule, on hand-made
facts, names the clearing line the carrying ranks skipped, and leaves accumulation on every rank alone."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from gradsync.doctor.script import registry
from gradsync.doctor.script.stale_gradients import NAME, StaleWatch
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.run.tensor_writes import StateWrite


def test_the_watch_tells_cleared_gradients_from_carried_ones_and_notes_the_clearing_lines():
    moments = Moments()
    watch = StaleWatch(moments, BookkeepingByKind())
    model = nn.Linear(3, 1)
    moments.models.append(SimpleNamespace(module=model, process_group=None))

    def backward() -> None:
        moments.emit("backward", None)
        model(torch.ones(2, 3)).sum().backward()

    backward()  # no gradient yet: clean
    backward()  # the first pass's gradient is still there: carried
    model.zero_grad()
    moments.emit("state_written", StateWrite("grad =", ("gradient",), ("weight",), "train.py:40", (), False))
    backward()
    passes = watch.facts()["passes"]
    assert [p["carried"] for p in passes] == [False, True, False]
    assert passes[2]["cleared_at"] == ["train.py:40"] and passes[1]["cleared_at"] == []


def _facts(*carried_and_cleared) -> dict:
    return {NAME: {"group": [0, 1], "passes": [{"step": i, "carried": carried, "site": "train.py:30", "cleared_at": cleared}
                                             for i, (carried, cleared) in enumerate(carried_and_cleared)]}}


def test_a_zero_grad_one_rank_skipped_is_named_at_that_line():
    checks = {0: _facts((False, []), (False, ["train.py:40"]), (False, ["train.py:40"])),
              1: _facts((False, []), (False, ["train.py:40"]), (True, []))}
    (finding,) = registry.findings(checks, [NAME])
    assert (finding.category, finding.ranks, finding.locations, finding.step) == (
        "gradients_carried_on_some_ranks", [1], {"1": "train.py:40"}, 3)
    assert "rank 0 cleared theirs at train.py:40, a line rank 1 did not run" in finding.message


def test_gradients_carried_on_every_rank_alike_are_accumulation():
    alike = _facts((False, ["train.py:40"]), (True, []), (True, []), (False, ["train.py:40"]))
    assert registry.findings({0: alike, 1: alike}, [NAME]) == []
