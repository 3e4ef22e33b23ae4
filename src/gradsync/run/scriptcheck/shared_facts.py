"""What several checks' rules read of the ranks' facts the same way: the DDP models every rank
built, and a check's own facts when every rank has them."""

from __future__ import annotations

from typing import Any

from gradsync.run.scriptcheck.unit import RankFacts


def common_models(checks: RankFacts) -> list[dict[int, Any]]:
    """For each DDP model every rank built (in construction order): rank -> its facts."""
    if len(checks) < 2:
        return []
    count = min(len(facts["models"]) for facts in checks.values())
    return [{rank: facts["models"][index] for rank, facts in checks.items()} for index in range(count)]


def own_facts(checks: RankFacts, name: str) -> dict[int, Any] | None:
    """rank -> the facts check `name`'s watch recorded there; None when they cannot be compared:
    one rank has nothing to agree with, and facts of an older gradsync (or of a rank whose watch
    failed) have none."""
    recorded = {rank: facts.get(name) for rank, facts in checks.items()}
    return None if len(recorded) < 2 or None in recorded.values() else recorded
