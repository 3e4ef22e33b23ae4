"""benchmarks/run_blind.py scores a `gradsync run` verdict against a blind set's manifest: right when its
first error places a cause line on a cause rank and names only cause ranks; a healthy look-alike right
only when it exits 0 with no error."""

from __future__ import annotations

from pathlib import Path

from benchmarks.run_blind import score

SCRIPT = Path("benchmarks/run_blind/set1/train.py")


def _error(category: str, ranks: list[int], lines: dict[int, int]) -> dict:
    return {"category": category, "severity": "error", "ranks": ranks,
            "locations": {str(r): f"train.py:{line}" for r, line in lines.items()}}


def test_a_failing_script_is_right_only_at_a_cause_line_on_the_ranks_at_fault():
    rank1 = {"kind": "failing", "cause_lines": [12, 14], "cause_ranks": [1]}
    assert score(SCRIPT, rank1, {"findings": [_error("x", [1], {0: 30, 1: 14})]}, 1, 1.0).verdict == "right"
    assert score(SCRIPT, rank1, {"findings": [_error("x", [1], {0: 14, 1: 30})]}, 1, 1.0).verdict == "rank right", \
        "the cause line on a rank not at fault"
    assert score(SCRIPT, rank1, {"findings": [_error("x", [0, 1], {1: 14})]}, 1, 1.0).verdict == "wrong"
    assert score(SCRIPT, rank1, {"findings": [{**_error("x", [1], {1: 14}), "severity": "warning"}]}, 0, 1.0).verdict == "missed"
    every = {"kind": "failing", "cause_lines": [12], "cause_ranks": []}
    assert score(SCRIPT, every, {"findings": [_error("x", [0, 1], {0: 12, 1: 40})]}, 1, 1.0).verdict == "right"


def test_a_healthy_look_alike_is_right_only_when_it_exits_0_without_an_error():
    healthy = {"kind": "healthy", "cause_lines": [], "cause_ranks": []}
    assert score(SCRIPT, healthy, {"findings": [{**_error("straggler", [1], {1: 3}), "severity": "warning"}]}, 0, 1.0).verdict == "right"
    assert score(SCRIPT, healthy, {"findings": [_error("rank_stuck", [1], {1: 3})]}, 1, 1.0).verdict == "stopped"
    assert score(SCRIPT, healthy, {"findings": []}, 1, 1.0).verdict == "stopped"
