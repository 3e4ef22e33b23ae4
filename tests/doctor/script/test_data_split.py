"""data_split on hand-made facts: a split that differs across ranks is an error, named at the split."""

from __future__ import annotations

from tests.doctor.script.facts import consistency_categories, consistency_facts, consistency_found


def split(crcs, indices) -> dict:
    return {"site": "train.py:15", "generator_given": False, "lengths": [len(i) for i in indices], "crcs": crcs,
            "indices": indices}


def test_a_split_that_differs_across_ranks_is_an_error():
    checks = {0: consistency_facts(splits=[split([1, 2], [[0, 1, 2], [3]])]),
              1: consistency_facts(splits=[split([3, 4], [[1, 2, 3], [0]])])}
    (finding,) = consistency_found(checks)
    assert finding.category == "data_split_differs" and finding.locations == {"0": "train.py:15", "1": "train.py:15"}
    assert "1 of rank 0's 3 samples in the first split are in rank 1's second one" in finding.message
    assert consistency_categories({r: consistency_facts(splits=[split([1, 2], [[0, 1, 2], [3]])]) for r in (0, 1)}) == []


def test_the_watch_records_each_split_where_scripts_import_random_split_from():
    import inspect

    import torch
    from torch.utils.data import random_split

    from gradsync.run.check_primitives import Patches
    from gradsync.run.harmless import BookkeepingByKind
    from gradsync.doctor.script.data_split import SplitWatch
    from gradsync.run.moments import Moments

    watch, patches = SplitWatch(Moments(), BookkeepingByKind()), Patches()
    watch.install(patches)
    try:
        line = inspect.currentframe().f_lineno + 1
        torch.utils.data.random_split(range(10), [8, 2])
        seeded = torch.utils.data.dataset.random_split(range(10), [8, 2], generator=torch.Generator().manual_seed(1))
    finally:
        patches.undo()
    assert torch.utils.data.random_split is random_split  # put back
    first, second = watch.facts()["splits"]
    assert first["site"].endswith(f"test_data_split.py:{line}") and not first["generator_given"]
    assert second["generator_given"] and second["lengths"] == [8, 2] and second["indices"][0] == list(seeded[0].indices)
