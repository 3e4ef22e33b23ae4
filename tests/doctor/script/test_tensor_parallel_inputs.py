"""tensor_parallel_inputs on hand-made facts: compared within each tensor-parallel group only."""

from __future__ import annotations

from tests.doctor.script.facts import findings, script_facts


def _tp_module(inputs, ranks=(0, 1), styles=("ColwiseParallel", "RowwiseParallel")) -> dict:
    return {"site": "train.py:12", "ranks": list(ranks), "styles": list(styles), "inputs": list(inputs)}


def test_tensor_parallel_inputs_are_compared_within_each_group_only():
    # Ranks 0-1 and 2-3 are two tensor-parallel groups (fsdp+tp): each group shares its batches,
    # the groups differ (they are data-parallel peers). Only a group whose ranks differ is wrong.
    same = {0: script_facts(tp_modules=[_tp_module([1, 2], (0, 1))]), 1: script_facts(tp_modules=[_tp_module([1, 2], (0, 1))]),
            2: script_facts(tp_modules=[_tp_module([7, 8], (2, 3))]), 3: script_facts(tp_modules=[_tp_module([7, 8], (2, 3))])}
    assert findings(same) == []
    same[3] = script_facts(tp_modules=[_tp_module([7, 9], (2, 3))])
    (finding,) = findings(same)
    assert finding.category == "tensor_parallel_inputs_differ" and finding.ranks == [2, 3]
    assert "in 1 of 2 training forwards (first: forward 2)" in finding.message
    # Sequence parallelism shards a module's inputs on purpose: not compared.
    sharded = {r: script_facts(tp_modules=[_tp_module([r], styles=("SequenceParallel",))]) for r in (0, 1)}
    assert findings(sharded) == []
