"""What several checks' rules read of the ranks' facts the same way: which ranks hold replicas of
one DDP model, the DDP models they built, and a check's own facts when every rank has them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradsync.doctor.script.unit import RankFacts


def replica_groups(groups: Mapping[int, Sequence[int] | None]) -> list[list[int]]:
    """The ranks grouped by the process group each says its DDP model spans (rank -> that
    group's ranks), the groups of two ranks or more. Under pipeline (or any hybrid) parallelism a
    DDP spans only the ranks holding the same stage; the other stages hold other models under the
    same parameter names, so they are never compared. A rank whose group is not known (facts of an
    older gradsync) is taken to span every rank."""
    everyone = tuple(sorted(groups))
    by_group: dict[tuple[int, ...], list[int]] = {}
    for rank, group in sorted(groups.items()):
        by_group.setdefault(tuple(group) if group else everyone, []).append(rank)
    return [members for _, members in sorted(by_group.items()) if len(members) >= 2]


def common_models(checks: RankFacts) -> list[dict[int, Any]]:
    """For each DDP model built in the same place of construction order, by the ranks of its
    process group (`replica_groups`): rank -> its facts."""
    if len(checks) < 2:
        return []
    count = min(len(facts["models"]) for facts in checks.values())
    compared = []
    for index in range(count):
        models = {rank: facts["models"][index] for rank, facts in checks.items()}
        compared += [{rank: models[rank] for rank in members}
                     for members in replica_groups({rank: model.get("group") for rank, model in models.items()})]
    return compared


def own_facts(checks: RankFacts, name: str) -> dict[int, Any] | None:
    """rank -> the facts check `name`'s watch recorded there; None when they cannot be compared:
    one rank has nothing to agree with, and facts of an older gradsync (or of a rank whose watch
    failed) have none."""
    recorded = {rank: facts.get(name) for rank, facts in checks.items()}
    return None if len(recorded) < 2 or None in recorded.values() else recorded
