"""What one check of the script check is: its categories, its rule, and the findings it explains.

A check is one module of this package that ends with `CHECK = Check(...)`, listed in
`registry.CHECKS`. Everything about one mistake lives in that module: the facts it reads (and,
for a check with a `Watch`, what it records on each rank from the host's moments), the rule
that compares them across ranks, the categories its findings may have (with the line the docs
table shows), and the other categories its findings explain, so that a consequence (the
replicas diverged) is not reported beside its cause (the update differed) by a rule written
somewhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gradsync.rundir.records import SEVERITIES, Finding
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments, Watch

# global rank -> the facts that rank recorded (gradsync.run.script_facts): what every rule reads.
RankFacts = Mapping[int, Mapping[str, Any]]


@dataclass(frozen=True)
class Category:
    """One category of diagnosis.json that a check may report."""

    severities: tuple[str, ...]
    meaning: str  # one line, diagnosis.json's vocabulary (gradsync.rundir.records.CATEGORIES)
    doc: str  # the docs table's "what happened" (docs/doctor.md): when it is said, and when not

    def __post_init__(self) -> None:
        if not self.severities or not set(self.severities) <= set(SEVERITIES):
            raise ValueError(f"a category's severities are some of {SEVERITIES}, not {self.severities!r}")


@dataclass(frozen=True)
class Check:
    """One check: `--checks NAME` selects it."""

    name: str
    summary: str  # what it checks, in a few words (`--checks` help, the docs)
    categories: Mapping[str, Category]
    rule: Callable[[RankFacts], list[Finding]]
    # category this check found -> the categories (of any check) it explains: those are dropped.
    explains: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Its own watch on each rank, made with the host of moments and the script check's bookkeeping
    # (which says a failure once and keeps it from the script); None: the rule reads only the
    # facts the script check records for every check.
    watch: Callable[[Moments, BookkeepingByKind], Watch] | None = None
    # The TypedDict of what its watch records: the record that crosses from each rank to the launcher.
    facts: type | None = None

    def __post_init__(self) -> None:
        unknown = set(self.explains) - set(self.categories)
        if unknown:
            raise ValueError(f"check {self.name!r} explains findings of categories it does not have: {sorted(unknown)}")
        if (self.watch is None) != (self.facts is None):
            raise ValueError(f"check {self.name!r}: a watch and the type of its facts go together")
