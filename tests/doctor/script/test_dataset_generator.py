"""dataset_generator: the generators found on a dataset, the rule on hand-made facts (a warning
unless a worker_init_fn reseeds the copies), and its watch's failure kept from the script."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.dataset_generator import CopyWatch, dataset_generators, generator_state
from gradsync.run.moments import Moments
from tests.doctor.script.facts import consistency_categories, consistency_facts, consistency_found


def test_a_dataset_generator_copied_into_workers_is_a_warning_unless_a_worker_init_fn_reseeds_it():
    copy = {"loader": "train.py:40#0", "site": "train.py:40", "workers": 2, "worker_init_fn": False,
            "generators": {"rng": 7}}
    (finding,) = consistency_found({r: consistency_facts(worker_copies=[copy]) for r in (0, 1)})
    assert finding.category == "dataset_generator_copied" and finding.ranks == [0, 1]
    reseeded = {**copy, "worker_init_fn": True}
    assert consistency_categories({r: consistency_facts(worker_copies=[reseeded]) for r in (0, 1)}) == []


def test_generators_stored_on_a_dataset_are_found_with_their_state():
    class Augment:
        def __init__(self):
            self.rng = random.Random(3)

    class Noisy(torch.utils.data.Dataset):
        def __init__(self):
            self.rng = np.random.default_rng(0)
            self.legacy = np.random.RandomState(0)
            self.torch_rng = torch.Generator().manual_seed(0)
            self.transform = Augment()
            self.data = torch.zeros(4)

    def states(dataset) -> dict[str, int]:
        return {path: generator_state(g) for path, g in dataset_generators(dataset).items()}

    dataset = Noisy()
    found = states(dataset)
    assert sorted(found) == ["legacy", "rng", "torch_rng", "transform.rng"]
    assert states(Noisy()) == found  # the same states
    dataset.rng.random()
    assert states(dataset)["rng"] != found["rng"]
    assert dataset_generators(torch.utils.data.TensorDataset(torch.zeros(3))) == {}


def test_a_watch_that_fails_says_so_once_and_never_raises_into_the_script(capsys):
    moments, bookkeeping = Moments(), BookkeepingByKind()
    watch = CopyWatch(moments, bookkeeping)
    broken_loader = SimpleNamespace()  # none of a DataLoader's attributes
    for _ in range(2):
        moments.emit("loader_pass", broken_loader, {"key": "train.py:3#0", "site": "train.py:3"})
    assert list(bookkeeping.failures()) == ["the dataset_generator check's watch"]
    assert capsys.readouterr().err.count("gradsync run: warning: the dataset_generator check's watch failed") == 1
    assert watch.facts() == {"worker_copies": []}
