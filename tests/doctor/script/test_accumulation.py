"""accumulation on hand-made facts: judged on the typical step."""

from __future__ import annotations

from tests.doctor.script.facts import categories, script_facts


def test_accumulation_is_judged_on_the_typical_step():
    assert categories({0: script_facts(syncs_per_step=[4, 4, 4])}) == ["accumulation_without_no_sync"]
    # A GradScaler that skipped a step leaves one step with two synchronised passes: not accumulation.
    assert categories({0: script_facts(syncs_per_step=[1, 2, 1, 1])}) == []
    # Two optimizers stepping after one backward: half a pass per step.
    assert categories({0: script_facts(syncs_per_step=[1, 0, 1, 0])}) == []
