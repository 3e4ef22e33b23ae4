"""uneven_batches on hand-made facts: only loaders that feed training, outside Join."""

from __future__ import annotations

from tests.doctor.script.facts import categories, findings, loader, script_facts


def test_uneven_loaders_count_only_when_they_feed_training_outside_join():
    assert categories({0: script_facts(loaders=[loader(5)]), 1: script_facts(loaders=[loader(4)])}) == ["uneven_batches"]
    assert categories({0: script_facts(loaders=[loader(5)]), 1: script_facts(loaders=[loader(5)])}) == []
    evaluation = {0: script_facts(loaders=[loader(5, feeds_training=False)]),
                  1: script_facts(loaders=[loader(4, feeds_training=False)])}
    assert categories(evaluation) == []  # uneven evaluation runs no collective per batch
    joined = {0: script_facts(loaders=[loader(5, under_join=True)]), 1: script_facts(loaders=[loader(4, under_join=True)])}
    assert categories(joined) == []
    three = {0: script_facts(loaders=[loader(5)]), 1: script_facts(loaders=[loader(5)]), 2: script_facts(loaders=[loader(4)])}
    assert [f.ranks for f in findings(three)] == [[2]]
