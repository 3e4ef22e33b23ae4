"""skipped_step: the rule on hand-made facts, and the watch on real frames fed the host's moments
as the script check feeds them (a training forward, a synchronised backward's end, a step)."""

from __future__ import annotations

import sys
from pathlib import Path

from gradsync.callsite import short_path
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.doctor.script.skipped_step import SkipWatch
from tests.doctor.script.facts import consistency_facts, findings


def _skips(synced: int, *skipped: tuple[int, str]) -> dict:
    return {"synced_backwards": synced, "skipped": [{"backward": b, "site": site} for b, site in skipped]}


def test_a_step_skipped_on_some_ranks_is_named_where_they_went_on():
    checks = {0: consistency_facts(skipped_step=_skips(6)), 1: consistency_facts(skipped_step=_skips(7, (2, "train.py:71")))}
    (finding,) = [f for f in findings(checks) if f.category == "step_skipped_on_some_ranks"]
    assert finding.ranks == [1] and finding.locations == {"1": "train.py:71"} and finding.details["backward"] == 2


def test_a_skip_every_rank_makes_alike_or_beyond_what_all_compared_is_left_alone():
    alike = {r: consistency_facts(skipped_step=_skips(6, (2, "train.py:71"))) for r in (0, 1)}
    assert [f.category for f in findings(alike) if f.category == "step_skipped_on_some_ranks"] == []
    # Rank 0 stopped after 3 passes; rank 1's skip at its 5th has nothing to be compared with.
    beyond = {0: consistency_facts(skipped_step=_skips(3)), 1: consistency_facts(skipped_step=_skips(6, (5, "train.py:71")))}
    assert [f.category for f in findings(beyond) if f.category == "step_skipped_on_some_ranks"] == []


def _line(marker: str) -> str:
    number = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith(marker))
    return f"{short_path(__file__)}:{number}"


def _watched() -> tuple[Moments, SkipWatch]:
    moments = Moments()
    return moments, SkipWatch(moments, BookkeepingByKind())


def _loop_with_continue(moments: Moments, skip_at: int) -> None:
    for step in range(1, 4):
        moments.emit("forward_starts", None, {"site": "train.py:1"})
        moments.emit("backward_ends", True)  # loss.backward(), averaged by DDP
        if step == skip_at:
            continue  # went on: continue
        moments.emit("step_starts", None, step)


def _backward(moments: Moments) -> None:
    moments.emit("backward_ends", True)


def _loop_with_guarded_step(moments: Moments, skip_at: int) -> None:
    for step in range(1, 4):
        moments.emit("forward_starts", None, {"site": "train.py:1"})
        _backward(moments)  # the backward inside the user's train_step function
        if step != skip_at:  # went on: guard
            moments.emit("step_starts", None, step)


def test_the_watch_names_the_line_the_rank_went_on_at_and_leaves_the_thread_untraced():
    moments, watch = _watched()
    _loop_with_continue(moments, skip_at=2)
    assert watch.facts() == {"synced_backwards": 3, "skipped": [{"backward": 2, "site": _line("# went on: continue")}]}
    assert sys.gettrace() is None
    moments, watch = _watched()
    _loop_with_guarded_step(moments, skip_at=1)
    assert watch.facts() == {"synced_backwards": 3, "skipped": [{"backward": 1, "site": _line("# went on: guard")}]}
    assert sys.gettrace() is None
    moments, watch = _watched()
    _loop_with_continue(moments, skip_at=0)  # never skipped
    assert watch.facts() == {"synced_backwards": 3, "skipped": []}


def test_a_thread_someone_else_traces_is_left_to_them_and_the_skip_still_counts():
    def theirs(frame, event, arg):
        return None

    moments, watch = _watched()
    sys.settrace(theirs)
    try:
        _loop_with_continue(moments, skip_at=2)
        assert sys.gettrace() is theirs
    finally:
        sys.settrace(None)
    assert watch.facts() == {"synced_backwards": 3, "skipped": [{"backward": 2, "site": None}]}
