"""benchmarks/doctor_blind.py scores a diagnosis against a blind set's manifest: named at a cause line (on
a cause rank, naming only cause ranks), flagged elsewhere, or missed; a healthy look-alike clean or not."""

from __future__ import annotations

from pathlib import Path

from benchmarks.doctor_blind import score

SCRIPT = Path("benchmarks/doctor_blind/set1/train.py")


def _finding(category: str, ranks: list[int], line: int) -> dict:
    return {"category": category, "ranks": ranks, "locations": {str(r): f"/any/where/train.py:{line}" for r in ranks}}


def test_a_mistake_is_named_only_at_a_cause_line_on_the_ranks_at_fault():
    one_rank = {"kind": "mistake", "cause_lines": [12, 14], "cause_ranks": [1]}
    assert score(SCRIPT, one_rank, {"findings": [_finding("x", [1], 14)]}, 1.0).verdict == "named"
    assert score(SCRIPT, one_rank, {"findings": [_finding("x", [0, 1], 14)]}, 1.0).verdict == "line, rank wrong"
    assert score(SCRIPT, one_rank, {"findings": [_finding("x", [1], 30)]}, 1.0).verdict == "flagged"
    assert score(SCRIPT, one_rank, {"findings": []}, 1.0).verdict == "missed"
    every_rank = {"kind": "mistake", "cause_lines": [12], "cause_ranks": []}
    assert score(SCRIPT, every_rank, {"findings": [_finding("x", [0, 1], 12)]}, 1.0).verdict == "named"


def test_a_healthy_look_alike_is_clean_only_without_findings():
    healthy = {"kind": "healthy", "cause_lines": [], "cause_ranks": []}
    assert score(SCRIPT, healthy, {"findings": []}, 1.0).verdict == "clean"
    assert score(SCRIPT, healthy, {"findings": [_finding("x", [0], 3)]}, 1.0).verdict == "flagged healthy"
    assert score(SCRIPT, healthy, {"findings": [_finding("script_failed", [0, 1], 3)]}, 1.0).verdict == "failed"
