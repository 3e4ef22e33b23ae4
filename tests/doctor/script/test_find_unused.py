"""find_unused on hand-made facts: needed as soon as one pass missed a gradient."""

from __future__ import annotations

from tests.doctor.script.facts import categories, model, script_facts


def test_find_unused_parameters_is_needed_when_a_pass_missed_a_gradient():
    def checks(incomplete: int) -> dict:
        built = model({}, find_unused_parameters=True, usage_checked_passes=4, incomplete_passes=incomplete)
        return {0: script_facts(models=[built]), 1: script_facts(models=[built])}

    assert categories(checks(0)) == ["find_unused_parameters_unneeded"]
    assert categories(checks(1)) == []
