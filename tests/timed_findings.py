"""`gradsync run`'s findings judged from timings measured on the machine, which end-to-end tests leave out.

A straggler is a rank typically late to its collectives by more than a share of the step: on a
loaded machine any run can have one (one rank starved of CPU for a while is late). Its rule is
tested on given timings (tests/run/test_analysis.py); an end-to-end test that expects no finding,
or exactly one other, must not fail because the machine was busy. The zoo's straggler script,
late by a 0.3 s sleep per step, is the one run that must show it.
"""

from __future__ import annotations

from typing import Any

TIMED_CATEGORIES = frozenset({"straggler"})


def untimed(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The findings, but those judged from timings."""
    return [f for f in findings if f["category"] not in TIMED_CATEGORIES]


def untimed_warning_lines(output: str, word: str = "warning:") -> list[str]:
    """The lines of `gradsync run`'s output holding `word`, but those of findings judged from
    timings and the verdict line counting them ("ok: 2 ranks finished, 1 warning")."""
    return [
        line for line in output.splitlines()
        if word in line
        and not any(f"warning: {category}" in line for category in TIMED_CATEGORIES)
        and not line.startswith("gradsync run: ok: ")
    ]
