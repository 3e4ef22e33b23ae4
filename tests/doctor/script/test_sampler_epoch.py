"""sampler_epoch on hand-made facts: a repeated order counts for a shuffling sampler feeding training,
passing again at the same line."""

from __future__ import annotations

from tests.doctor.script.facts import categories, findings, loader, script_facts


def test_a_repeated_epoch_counts_only_for_a_shuffling_sampler_that_feeds_training():
    passes = [{"sampler": 0, "epoch": 0, "shuffle": True, "site": "train.py:27"}] * 2
    assert categories({0: script_facts(sampler_passes=passes, loaders=[loader(4)])}) == ["sampler_epoch_not_set"]
    assert categories({0: script_facts(sampler_passes=passes)}) == ["sampler_epoch_not_set"]  # no DataLoader seen
    assert categories({0: script_facts(sampler_passes=passes, loaders=[loader(4, feeds_training=False)])}) == []
    unshuffled = [{**p, "shuffle": False} for p in passes]
    assert categories({0: script_facts(sampler_passes=unshuffled, loaders=[loader(4)])}) == []
    set_epoch = [passes[0], {**passes[0], "epoch": 1}, {**passes[0], "epoch": 2}]
    assert categories({0: script_facts(sampler_passes=set_epoch, loaders=[loader(4)])}) == []


def test_a_sampler_iterated_twice_in_one_epoch_at_two_lines_is_not_a_missing_set_epoch():
    # set_epoch(e), list(sampler) to warm a cache (one line), then the DataLoader's pass (another).
    def passes(epoch, calls):
        return [{"sampler": 0, "epoch": epoch, "shuffle": True, "site": site, "set_epoch_calls": calls}
                for site in ("train.py:40", "train.py:41")]

    warmed = passes(0, 1) + passes(1, 2)
    assert categories({0: script_facts(sampler_passes=warmed, loaders=[loader(4)])}) == []
    # The same line passing again with the same epoch and no set_epoch in between: the order repeats.
    repeated = passes(0, 1) + passes(0, 1)
    assert categories({0: script_facts(sampler_passes=repeated, loaders=[loader(4)])}) == ["sampler_epoch_not_set"]


def test_the_finding_is_named_at_the_epoch_loop_where_set_epoch_belongs():
    passes = [{"sampler": 0, "epoch": 0, "shuffle": True, "site": "train.py:27", "epoch_loop": "train.py:25"}] * 2
    (finding,) = findings({0: script_facts(sampler_passes=passes, loaders=[loader(4)])})
    assert finding.locations == {"0": "train.py:25"}
    assert "pass at train.py:27, in the loop at train.py:25" in finding.message
    assert "at the start of the loop at train.py:25" in finding.suggestion
    # A pass with no loop around it (facts of an older gradsync, or a single pass function): at the pass.
    (bare,) = findings({0: script_facts(sampler_passes=[{**p, "epoch_loop": None} for p in passes], loaders=[loader(4)])})
    assert bare.locations == {"0": "train.py:27"}
