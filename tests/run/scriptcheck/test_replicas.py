"""replicas on hand-made facts: compared at the same step, buffers only where DDP does not sync them."""

from __future__ import annotations

from tests.run.scriptcheck.facts import categories, findings, model, script_facts


def test_replicas_are_compared_only_at_the_same_step_and_name_the_odd_rank():
    equal, other = {"w": 1, "b": 2}, {"w": 1, "b": 3}
    three = {0: script_facts(models=[model(equal)]), 1: script_facts(models=[model(equal)]),
             2: script_facts(models=[model(other)])}
    (finding,) = findings(three)
    assert (finding.category, finding.ranks, finding.details) == ("parameters_diverged", [2], {"parameters": ["b"]})
    assert "on rank 2 from the other ranks'" in finding.message
    different_steps = {0: script_facts(models=[model(equal)]), 1: script_facts(steps=3, models=[model(other)])}
    assert categories(different_steps) == []


def test_buffers_count_only_when_ddp_does_not_sync_them():
    synced = {0: script_facts(models=[model({}, {"bn.running_mean": 1})]),
              1: script_facts(models=[model({}, {"bn.running_mean": 2})])}
    assert categories(synced) == []  # the next forward starts from rank 0's buffers
    unsynced = {r: script_facts(models=[model({}, {"bn.running_mean": r}, buffers_synced=False)]) for r in (0, 1)}
    assert categories(unsynced) == ["buffers_diverged"]
