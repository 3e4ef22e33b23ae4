"""loss_scale on hand-made facts: found unless the accumulation explains the factor."""

from __future__ import annotations

from tests.run.scriptcheck.facts import consistency_categories, consistency_facts


def _walk(scale: float) -> dict:
    return {"site": "train.py:33", "step": 1, "scale": scale, "reduction": "sum", "elements": 16, "factor": scale / 16}


def test_a_loss_divided_by_the_world_size_is_found_unless_accumulation_explains_the_factor():
    assert consistency_categories({r: consistency_facts(loss_walks=[_walk(0.5)]) for r in (0, 1)}) == ["loss_scaled_by_world_size"]
    assert consistency_categories({r: consistency_facts(loss_walks=[_walk(1.0)]) for r in (0, 1)}) == []
    # Two micro-steps on two ranks: 1/2 is the accumulation's own factor; nothing can be said.
    two = {r: consistency_facts(loss_walks=[_walk(0.5)], backwards_per_step=[2, 2]) for r in (0, 1)}
    assert consistency_categories(two) == []
    # Four ranks, two micro-steps, 1/8: divided by both.
    four = {r: consistency_facts(loss_walks=[_walk(0.125)], backwards_per_step=[2, 2]) for r in range(4)}
    assert consistency_categories(four) == ["loss_scaled_by_world_size"]
    by_accumulation = {r: consistency_facts(loss_walks=[_walk(0.5)], backwards_per_step=[2, 2]) for r in range(4)}
    assert consistency_categories(by_accumulation) == []  # 1/accumulation
