"""The host of moments: listeners called in turn, a failing one kept from the others and the
script, and what goes into a step read once per step for every watch that asks."""

from __future__ import annotations

import torch

from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments


def test_each_listener_hears_the_moment_and_one_that_fails_stops_no_other(capsys):
    moments, bookkeeping = Moments(), BookkeepingByKind()
    heard = []

    def broken(*args):
        raise KeyError("the watch's own bug")

    moments.on("backward", broken, bookkeeping["a broken watch"])
    moments.on("backward", lambda tensors: heard.append(tensors), bookkeeping["a working watch"])
    assert moments.listened("backward") and not moments.listened("drew")
    moments.emit("backward", "loss")
    assert heard == ["loss"] and list(bookkeeping.failures()) == ["a broken watch"]
    assert "a broken watch failed" in capsys.readouterr().err


def test_what_goes_into_a_step_is_read_once_per_step_whoever_asks():
    model = torch.nn.Linear(4, 2)
    outside = torch.nn.Parameter(torch.zeros(3))  # stepped too, but not a DDP model's: not fingerprinted
    optimizer = torch.optim.SGD([*model.parameters(), outside], lr=0.1)
    moments = Moments()
    moments.ddp_parameters.update(id(p) for p in model.parameters())
    assert moments.stepped_parameters(optimizer) == list(model.parameters())

    first = moments.going_in(optimizer)
    with torch.no_grad():
        model.weight.add_(1.0)  # changed within the same step: the reading made at its start stands
    assert moments.going_in(optimizer) is first
    moments.steps += 1  # the next step reads again
    second = moments.going_in(optimizer)
    assert second["parameters"] != first["parameters"] and second["hyperparameters"] == first["hyperparameters"]
