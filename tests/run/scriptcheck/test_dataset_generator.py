"""dataset_generator on hand-made facts: a warning unless a worker_init_fn reseeds the copies."""

from __future__ import annotations

from tests.run.scriptcheck.facts import consistency_categories, consistency_facts, consistency_found


def test_a_dataset_generator_copied_into_workers_is_a_warning_unless_a_worker_init_fn_reseeds_it():
    copy = {"loader": "train.py:40#0", "site": "train.py:40", "workers": 2, "worker_init_fn": False,
            "generators": {"rng": 7}}
    (finding,) = consistency_found({r: consistency_facts(worker_copies=[copy]) for r in (0, 1)})
    assert finding.category == "dataset_generator_copied" and finding.ranks == [0, 1]
    reseeded = {**copy, "worker_init_fn": True}
    assert consistency_categories({r: consistency_facts(worker_copies=[reseeded]) for r in (0, 1)}) == []
