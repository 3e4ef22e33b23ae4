"""loss_scale: the loss's normalisation read from the autograd graph, and the rule on hand-made
facts (found unless the accumulation explains the factor)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradsync.doctor.script.loss_scale import loss_normalisation
from tests.doctor.script.facts import consistency_categories, consistency_facts


def _walk(scale: float) -> dict:
    return {"site": "train.py:33", "step": 1, "scale": scale, "reduction": "sum", "elements": 16, "factor": scale / 16}


def test_a_loss_divided_by_the_world_size_is_found_unless_accumulation_explains_the_factor():
    assert consistency_categories({r: consistency_facts(loss_walks=[_walk(0.5)]) for r in (0, 1)}) == ["loss_scaled_by_world_size"]
    assert consistency_categories({r: consistency_facts(loss_walks=[_walk(1.0)]) for r in (0, 1)}) == []
    # Two micro-steps on two ranks: 1/2 is the accumulation's own factor; nothing can be said.
    two = {r: consistency_facts(loss_walks=[_walk(0.5)], backwards_per_step=[2, 2]) for r in (0, 1)}
    assert consistency_categories(two) == []
    # Four ranks, two micro-steps, 1/8: divided by both.
    four = {r: consistency_facts(loss_walks=[_walk(0.125)], backwards_per_step=[2, 2]) for r in range(4)}
    assert consistency_categories(four) == ["loss_scaled_by_world_size"]
    by_accumulation = {r: consistency_facts(loss_walks=[_walk(0.5)], backwards_per_step=[2, 2]) for r in range(4)}
    assert consistency_categories(by_accumulation) == []  # 1/accumulation


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


def test_the_line_of_a_constant_factor_is_read_when_anomaly_mode_kept_the_tracebacks(logits):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=False):
            loss = F.cross_entropy(logits, TARGET) / 4  # the factor's line
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# the factor's line"))
    assert loss_normalisation(loss)["factor_site"].endswith(f"{Path(__file__).name}:{line}")
    assert loss_normalisation(F.cross_entropy(logits, TARGET) / 4)["factor_site"] is None  # no tracebacks kept
