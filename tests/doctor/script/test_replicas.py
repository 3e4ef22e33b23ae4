"""replicas on hand-made facts: compared at the same step, buffers only where DDP does not sync them."""

from __future__ import annotations

from tests.doctor.script.facts import categories, findings, model, script_facts


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


def test_the_replicas_of_a_pipeline_stage_are_compared_among_the_ranks_of_its_data_parallel_group():
    # Two stages x two replicas: ranks 0 and 2 hold stage 0, ranks 1 and 3 stage 1, each stage in a
    # DDP over its own replicas. The stages hold different models under the same names.
    stage0, stage1, drifted = {"0.weight": 1, "0.bias": 2}, {"0.weight": 7, "0.bias": 8}, {"0.weight": 1, "0.bias": 5}
    groups = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    held = {0: stage0, 2: stage0, 1: stage1, 3: stage1}
    healthy = {rank: script_facts(models=[model(held[rank], group=groups[rank])]) for rank in range(4)}
    assert categories(healthy) == []
    healthy[2] = script_facts(models=[model(drifted, group=[0, 2])])
    (finding,) = findings(healthy)
    assert (finding.category, finding.ranks, finding.details) == ("parameters_diverged", [0, 2], {"parameters": ["0.bias"]})
    # Without the groups (an older gradsync's facts), every rank is one group, as before.
    assert categories({rank: script_facts(models=[model(held[rank])]) for rank in range(4)}) == ["parameters_diverged"]
