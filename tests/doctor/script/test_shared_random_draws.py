"""shared_random_draws on hand-made facts: blamed on a seeding after DDP was built, judged from there."""

from __future__ import annotations

import random

import numpy as np
import torch

from gradsync.doctor.script.shared_random_draws import generator_states
from tests.doctor.script.facts import consistency_categories, consistency_facts, consistency_found, rng_forward


def _seed(after_ddp: bool, site: str = "train.py:20", forwards_before: int = 0) -> dict:
    return {"generator": "torch", "site": site, "after_ddp": after_ddp, "forwards_before": forwards_before, "value": "0"}


def test_identical_draws_are_blamed_on_a_seeding_after_ddp():
    same = [rng_forward(1, 2), rng_forward(2, 3)]
    checks = {r: consistency_facts(forwards=same, seeds=[_seed(False, "train.py:10"), _seed(True)]) for r in (0, 1)}
    (finding,) = consistency_found(checks)
    assert finding.category == "shared_random_draws" and finding.locations == {"0": "train.py:20", "1": "train.py:20"}
    # Seeded alike only before the model was built: DDP's usual start, left alone.
    assert consistency_categories({r: consistency_facts(forwards=same, seeds=[_seed(False)]) for r in (0, 1)}) == []
    # Per-rank seeds after DDP: the states differ.
    per_rank = {r: consistency_facts(forwards=[rng_forward(10 * r + 1, 10 * r + 2)], seeds=[_seed(True)]) for r in (0, 1)}
    assert consistency_categories(per_rank) == []
    # Seeded alike only from the 3rd forward on (an epoch loop reseeding with the epoch): judged from there.
    later = {r: consistency_facts(forwards=[rng_forward(10 * r + 1, 10 * r + 2), rng_forward(10 * r + 2, 10 * r + 3),
                                            rng_forward(5, 6), rng_forward(7, 8)],
                                  seeds=[_seed(True, forwards_before=2)]) for r in (0, 1)}
    (finding,) = consistency_found(later)
    assert finding.details["draws_compared"] == 3  # two forwards and the draw between them
    # No draws at all (no dropout): nothing was shared.
    assert consistency_categories({r: consistency_facts(forwards=[rng_forward(1, 1)], seeds=[_seed(True)]) for r in (0, 1)}) == []


def test_generator_states_change_when_drawn_from():
    before = generator_states()
    torch.rand(1)
    random.random()
    after = generator_states()
    assert before["torch"] != after["torch"] and before["random"] != after["random"]
    assert before["numpy"] == after["numpy"]
    np.random.random()
    assert generator_states()["numpy"] != after["numpy"]
