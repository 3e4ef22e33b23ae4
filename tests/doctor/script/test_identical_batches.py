"""identical_batches on hand-made facts: only forwards every rank fingerprinted are compared."""

from __future__ import annotations

from tests.doctor.script.facts import categories, script_facts


def _forward(fingerprint: int | None) -> dict:
    return {"fingerprint": fingerprint, "site": "train.py:28", "loader": None}


def test_identical_inputs_count_only_when_every_compared_forward_agrees():
    same = [_forward(1), _forward(2)]
    assert categories({0: script_facts(forwards=same), 1: script_facts(forwards=same)}) == ["no_distributed_sampler"]
    assert categories({0: script_facts(forwards=same), 1: script_facts(forwards=[_forward(1), _forward(3)])}) == []
    # Forwards without comparable tensors are left out; with none left there is nothing to say.
    assert categories({0: script_facts(forwards=[_forward(None)]), 1: script_facts(forwards=[_forward(None)])}) == []
    assert categories({0: script_facts(forwards=same)}) == []  # one rank: nothing to compare with
