"""What several checks' rules read of the ranks' facts the same way: the DDP models every rank
built, and whether the ranks recorded the consistency facts at all."""

from __future__ import annotations

from typing import Any

from gradsync.run.scriptcheck.unit import RankFacts


def common_models(checks: RankFacts) -> list[dict[int, Any]]:
    """For each DDP model every rank built (in construction order): rank -> its facts."""
    if len(checks) < 2:
        return []
    count = min(len(facts["models"]) for facts in checks.values())
    return [{rank: facts["models"][index] for rank, facts in checks.items()} for index in range(count)]


def consistency_recorded(checks: RankFacts) -> bool:
    """Whether the consistency checks (what should agree across ranks: random draws, splits, shares,
    modes, updates, files) can judge: one rank has nothing to agree with, and the facts of a
    gradsync older than these checks have none of theirs (no `steps_taken`)."""
    return len(checks) >= 2 and all("steps_taken" in facts for facts in checks.values())
