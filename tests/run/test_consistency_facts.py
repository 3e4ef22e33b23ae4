"""The consistency checks' readings of one process: loss normalisation from the autograd graph,
generators on a dataset, optimizer settings. (The real multi-rank runs are in test_doctor_script.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradsync.run.consistency_facts import (
    dataset_generators,
    generator_state,
    generator_states,
    hyperparameters,
    loss_normalisation,
)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(8, 5, requires_grad=True)


TARGET = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])


@pytest.mark.parametrize(
    ("make_loss", "scale"),
    [
        (lambda x: F.cross_entropy(x, TARGET), 1.0),  # a plain mean
        (lambda x: F.cross_entropy(x, TARGET, reduction="sum") / len(TARGET), 1.0),  # a sum over the local batch
        (lambda x: F.cross_entropy(x, TARGET) / 2, 0.5),  # an accumulation over 2 micro-steps, or 1/world
        (lambda x: F.cross_entropy(x, TARGET, reduction="sum") / (len(TARGET) * 4), 0.25),  # the "global batch"
        (lambda x: F.mse_loss(x, torch.zeros(8, 5)) * 0.5, 0.5),
        (lambda x: x.sum(), 40.0),  # a sum of 40 elements: 40 times their mean
        (lambda x: x.reshape(-1).mean() / torch.tensor(4.0), 0.25),  # a 0-dim tensor constant
    ],
)
def test_loss_normalisation_reads_constant_factors_down_to_the_reduction(logits, make_loss, scale):
    reading = loss_normalisation(make_loss(logits))
    assert reading is not None and reading["scale"] == pytest.approx(scale)


def test_cross_entropy_counts_its_targets_not_its_logits(logits):
    reading = loss_normalisation(F.cross_entropy(logits, TARGET, reduction="sum"))
    assert (reading["reduction"], reading["elements"]) == ("sum", 8)


@pytest.mark.parametrize(
    "make_loss",
    [
        lambda x: (F.cross_entropy(x, TARGET) + x.pow(2).mean()) / 2,  # terms added: their weights are a choice
        lambda x: x.max(),  # not a mean or a sum
        lambda x: F.cross_entropy(x, TARGET) * x.detach().norm().requires_grad_(),  # a factor with a gradient
    ],
)
def test_loss_normalisation_says_nothing_when_the_graph_is_not_certain(logits, make_loss):
    assert loss_normalisation(make_loss(logits)) is None


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


def test_generator_states_change_when_drawn_from():
    before = generator_states()
    torch.rand(1)
    random.random()
    after = generator_states()
    assert before["torch"] != after["torch"] and before["random"] != after["random"]
    assert before["numpy"] == after["numpy"]


def test_hyperparameters_cover_every_group_and_see_a_change():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=0.01)
    text = hyperparameters(optimizer)
    assert "lr=0.01" in text and "lr=0.1" in text and "betas=(0.9, 0.999)" in text
    optimizer.param_groups[1]["lr"] = 0.05
    assert hyperparameters(optimizer) != text


def test_the_line_of_a_constant_factor_is_read_when_anomaly_mode_kept_the_tracebacks(logits):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=False):
            loss = F.cross_entropy(logits, TARGET) / 4  # the factor's line
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# the factor's line"))
    assert loss_normalisation(loss)["factor_site"].endswith(f"test_consistency_facts.py:{line}")
    assert loss_normalisation(F.cross_entropy(logits, TARGET) / 4)["factor_site"] is None  # no tracebacks kept


def test_a_watch_that_fails_says_so_once_and_never_raises_into_the_script(capsys):
    from types import SimpleNamespace

    from gradsync.run.consistency_facts import ConsistencyWatch
    from gradsync.run.harmless import BookkeepingByKind

    watch = ConsistencyWatch(SimpleNamespace(models=[], forwards=[], steps=0), BookkeepingByKind())
    broken_loader = SimpleNamespace()  # none of a DataLoader's attributes
    watch.loader_pass(broken_loader, {"key": "train.py:3#0", "site": "train.py:3"})
    watch.loader_pass(broken_loader, {"key": "train.py:3#0", "site": "train.py:3"})
    assert list(watch.facts()["watch_failures"]) == ["the script check's loader_pass"]
    assert capsys.readouterr().err.count("[gradsync rank 0] gradsync run: warning: the script check's loader_pass failed") == 1
    assert watch.forward_starts(None) == {}  # the forward's entry gets no extra fields
