"""Agreed control flow: one rank's decision becomes every rank's, with one small all-reduce."""

import pytest
import torch

import gradsync
from gradsync import PeerError
from gradsync.agreement import raise_if_any_rank_failed
from tests.harness import launch

pytestmark = pytest.mark.launches  # every test here starts processes


def _votes():
    trainer = gradsync.setup()
    r, last = trainer.rank, trainer.world_size - 1
    results = {
        "any_only_last": trainer.agree_any(r == last),
        "any_none": trainer.agree_any(False),
        "all_everyone": trainer.agree_all(True),
        "all_but_last": trainer.agree_all(r != last),
        "tensor_nan_on_last": trainer.agree_any(~torch.isfinite(torch.tensor(float("nan") if r == last else 1.0))),
        "module_level": gradsync.agree_any(r == 0),
    }
    trainer.close()
    return results


def test_any_and_all_semantics(world_size):
    results = launch(_votes, world_size)
    for votes in results:
        assert votes == {
            "any_only_last": True,
            "any_none": False,
            "all_everyone": True,
            "all_but_last": False,
            "tensor_nan_on_last": True,
            "module_level": True,
        }


def _one_rank_fails():
    trainer = gradsync.setup()
    error = ValueError("bad input on this rank") if trainer.rank == trainer.world_size - 1 else None
    try:
        raise_if_any_rank_failed(error)
    except PeerError as exc:
        outcome = {"peer_error": str(exc)}
    except ValueError as exc:
        outcome = {"own_error": str(exc)}
    else:
        outcome = {}
    trainer.close()
    return outcome


def test_an_error_on_one_rank_is_raised_on_every_rank(world_size):
    results = launch(_one_rank_fails, world_size)
    assert results[-1] == {"own_error": "bad input on this rank"}
    for outcome in results[:-1]:
        assert outcome == {"peer_error": f"rank {world_size - 1} stopped with: bad input on this rank"}
