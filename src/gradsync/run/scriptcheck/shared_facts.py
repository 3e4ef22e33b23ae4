"""What several checks' rules read of the ranks' facts the same way: the DDP models every rank
built, and a check's own facts when every rank has them."""

from __future__ import annotations

from typing import Any

from gradsync.run.scriptcheck.unit import RankFacts


def common_models(checks: RankFacts) -> list[dict[int, Any]]:
    """For each DDP model built in the same place of construction order by the ranks of its
    process group: rank -> its facts. A DDP over a subgroup (a pipeline stage's replicas, one
    dimension of a mesh) is compared among the ranks it spans, so the replicas of different stages,
    which hold different models, are never compared with each other. A model whose group is not
    known (facts of an older gradsync) is taken to span every rank."""
    if len(checks) < 2:
        return []
    count = min(len(facts["models"]) for facts in checks.values())
    compared = []
    for index in range(count):
        by_group: dict[tuple[int, ...], dict[int, Any]] = {}
        for rank, facts in checks.items():
            model = facts["models"][index]
            group = model.get("group")
            by_group.setdefault(tuple(group) if group is not None else tuple(sorted(checks)), {})[rank] = model
        compared += [models for _, models in sorted(by_group.items()) if len(models) >= 2]
    return compared


def own_facts(checks: RankFacts, name: str) -> dict[int, Any] | None:
    """rank -> the facts check `name`'s watch recorded there; None when they cannot be compared:
    one rank has nothing to agree with, and facts of an older gradsync (or of a rank whose watch
    failed) have none."""
    recorded = {rank: facts.get(name) for rank, facts in checks.items()}
    return None if len(recorded) < 2 or None in recorded.values() else recorded
