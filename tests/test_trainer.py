"""Errors a user can cause: raised as gradsync errors, on every rank, before anything can hang."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import gradsync
from gradsync import ConfigError, GradsyncError
from tests.harness import launch

pytestmark = pytest.mark.launches  # every test here starts processes


def data(n=16):
    return TensorDataset(torch.randn(n, 4), torch.randn(n, 1))


def _rank_dependent_mistake(kind):
    try:
        accumulation = 1 + gradsync_rank() if kind == "options_differ" else 1
        trainer = gradsync.setup(accumulation_steps=accumulation)
        last = trainer.rank == trainer.world_size - 1
        hidden = 8 + trainer.rank if kind == "model_differs" else 8
        model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))
        if kind == "wrong_device" and last:
            model = model.to("meta")
        dataset = data(2) if kind == "small_dataset" else data()
        trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, batch_size=4)
    except GradsyncError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    trainer.close()
    return {"error": None}


def gradsync_rank():
    import os

    return int(os.environ.get("RANK", 0))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_model_on_the_wrong_device_on_one_rank_fails_every_rank(world_size):
    results = launch(_rank_dependent_mistake, world_size, kind="wrong_device")
    assert results[-1]["error"] == "ConfigError"
    assert "is on meta but this rank trains on cpu; call model.to(trainer.device)" in results[-1]["message"]
    for other in results[:-1]:
        assert other["error"] == "PeerError" and f"rank {world_size - 1} stopped with" in other["message"]


def test_a_dataset_smaller_than_the_world_fails_every_rank():
    results = launch(_rank_dependent_mistake, 3, kind="small_dataset")
    for result in results:
        assert result["error"] == "ConfigError"
        assert "the dataset has 2 sample(s) but the world size is 3" in result["message"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_started_with_different_options_fail_together(world_size):
    results = launch(_rank_dependent_mistake, world_size, kind="options_differ")
    for result in results:
        assert result["error"] == "ConfigError"
        assert "accumulation_steps: rank 0=1, rank 1=2" in result["message"]


def test_a_model_built_differently_on_each_rank_is_named():
    results = launch(_rank_dependent_mistake, 2, kind="model_differs")
    for result in results:
        assert result["error"] == "ConfigError"
        assert "'0.weight' (8, 4)" in result["message"] and "(9, 4)" in result["message"]


def test_a_healthy_prepare_raises_nothing(world_size):
    assert launch(_rank_dependent_mistake, world_size, kind="none") == [{"error": None}] * world_size


@pytest.fixture
def trainer(tmp_path):
    trainer = gradsync.setup(run_dir=str(tmp_path))
    yield trainer
    trainer.close()


def test_a_failed_prepare_ends_the_trainer_with_a_clear_message(trainer):
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ConfigError, match="built for another copy"):
        trainer.prepare(model, torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1), data(), batch_size=4)
    with pytest.raises(GradsyncError, match="this trainer is closed"):
        trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), batch_size=4)


def test_misuse_of_the_loop_is_explained(trainer):
    model = torch.nn.Linear(4, 1)
    with pytest.raises(GradsyncError, match="before trainer.step"):
        trainer.step()
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), batch_size=4)
    with pytest.raises(GradsyncError, match="already called"):
        trainer.prepare(model, optimizer, data(), batch_size=4)
    with pytest.raises(GradsyncError, match="inside `for batch in loader:`"):
        trainer.step()
    with pytest.raises(GradsyncError, match="call it after trainer.step"):
        trainer.log(loss=1.0)
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                with pytest.raises(GradsyncError, match="scalar loss"):
                    step.backward(model(x) - y)
                step.backward(F.mse_loss(model(x), y))
                with pytest.raises(GradsyncError, match="called twice"):
                    step.backward(F.mse_loss(model(x), y))
            with pytest.raises(GradsyncError, match="opened twice for the same batch"):
                trainer.step()
            with pytest.raises(GradsyncError, match="'lr' is a metric gradsync writes itself"):
                trainer.log(lr=1.0)
            break


def test_nothing_to_train_is_refused(trainer):
    frozen = torch.nn.Linear(4, 1).requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameter that requires a gradient"):
        trainer.prepare(frozen, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), data(), batch_size=4)


def test_a_scheduler_of_another_optimizer_is_refused(trainer):
    model = torch.nn.Linear(4, 1)
    trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), batch_size=4)
    other = torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="does not drive the optimizer"):
        trainer.set_scheduler(torch.optim.lr_scheduler.StepLR(other, 1))


def test_scheduler_steps_once_per_applied_optimizer_step(trainer):
    model = torch.nn.Linear(4, 1)
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0), data(16), batch_size=4)
    trainer.set_scheduler(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1)))
    for _ in trainer.epochs(2):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
    assert trainer.optimizer_steps == 8 == trainer.steps_per_epoch * 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0 / 9)


def test_the_trainer_shows_users_only_its_api_and_says_what_it_chose_in_summary(trainer):
    model = torch.nn.Linear(4, 1)
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data(16), batch_size=4)
    assert [name for name in vars(trainer) if not name.startswith("_")] == [], "parts stay private behind properties"
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
    summary = trainer.summary()
    assert (summary["steps"], trainer.optimizer_steps) == (4, 4)
    assert (summary["compression"], summary["accumulation_steps"], summary["checkpoints_saved"]) == ("none", 1, 0)
    assert "auto" not in summary, "auto's measurements appear only when auto ran"
