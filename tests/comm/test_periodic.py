"""Periodic synchronisation (local SGD, DiLoCo) on real Gloo groups: the agreement's arithmetic,
the trainer's periods, and exact resume with each rank's own optimizer state."""

import json

import pytest
import torch
import torch.distributed as dist

from gradsync.comm.periodic import PeriodicSync, PeriodicSyncConfig
from gradsync.config import TrainerConfig
from gradsync.ddp import DDPConfig
from gradsync.errors import ConfigError
from tests.harness import launch

EVERY = 3


def _agree_by_hand(method, lr, momentum):
    """Each rank moves its parameters by its own amount; the agreements every EVERY steps."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
    sync = PeriodicSync(PeriodicSyncConfig(every=EVERY, method=method, outer_lr=lr, outer_momentum=momentum), model)
    agreed, after, identical = [], [], []
    for period in range(2):
        for step in range(EVERY):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (rank + 1) * (step + 1) * (period + 1))
                model[1].running_mean.add_(rank + 1)
            agreed.append(sync.step_done())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()] + [model[1].running_mean])
        everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, flat)
        identical.append(all(torch.equal(everyone[0], other) for other in everyone))
        after.append(flat.tolist())
    return {"agreed": agreed, "after": after, "identical": identical, "synchronisations": sync.synchronisations}


def _reference(method, lr, momentum, world=2):
    """The agreed offsets from the initial parameters after each period, computed from the papers' rules."""
    anchor, velocity, offsets = 0.0, 0.0, []
    for period in range(2):
        moved = [sum(0.01 * (r + 1) * (s + 1) * (period + 1) for s in range(EVERY)) for r in range(world)]
        mean = anchor + sum(moved) / world
        if method == "average":
            anchor = mean
        else:  # SGD with Nesterov momentum on the pseudo-gradient anchor - mean
            gradient = anchor - mean
            velocity = momentum * velocity + gradient if period else gradient
            anchor -= lr * (gradient + momentum * velocity)
        offsets.append(anchor)
    return offsets


@pytest.mark.launches
@pytest.mark.parametrize("method, lr, momentum", [("average", 0.7, 0.9), ("diloco", 0.7, 0.9), ("diloco", 1.0, 0.0)])
def test_ranks_agree_every_period_on_the_average_or_on_diloco_s_outer_step(method, lr, momentum):
    results = launch(_agree_by_hand, 2, method=method, lr=lr, momentum=momentum)
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
    initial = torch.cat([p.detach().reshape(-1) for p in start.parameters()]).tolist()
    for result in results:
        assert result["agreed"] == [False, False, True] * 2
        assert result["identical"] == [True, True] and result["synchronisations"] == 2
        for period, offset in enumerate(_reference(method, lr, momentum)):
            parameters, running_mean = result["after"][period][:-3], result["after"][period][-3:]
            assert parameters == pytest.approx([value + offset for value in initial], abs=1e-12)
            # Buffers are averaged: each rank added its rank + 1 at every step (1.5 a step on average).
            assert running_mean == pytest.approx([1.5 * EVERY * (period + 1)] * 3)
    if (method, lr, momentum) == ("diloco", 1.0, 0.0):  # the outer step without momentum, at lr 1, is the average
        assert _reference("diloco", 1.0, 0.0) == pytest.approx(_reference("average", 1.0, 0.0))


def _train(run_dir, epochs, method="average", checkpoint_dir=None, save_after_epoch=None, resume=None):
    import gradsync

    trainer = gradsync.setup(
        seed=0, run_dir=run_dir,
        ddp={"periodic": {"every": EVERY, "method": method}},
        metrics={"progress": False, "tensorboard": False, "system_every_s": None},
        checkpoint={"dir": checkpoint_dir, "resume": resume} if checkpoint_dir else {},
    )
    generator = torch.Generator().manual_seed(7)
    batches = 5  # per rank and epoch: an epoch's end cuts the second period short
    dataset = torch.utils.data.TensorDataset(
        torch.randn(2 * batches * trainer.world_size, 4, generator=generator, dtype=torch.float64),
        torch.randn(2 * batches * trainer.world_size, 1, generator=generator, dtype=torch.float64),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # each rank's momentum is its own
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=2)
    differs_mid_period = None
    for epoch in trainer.epochs(epochs):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(torch.nn.functional.mse_loss(model(x), y))
            if trainer.optimizer_steps == 4:
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                everyone = [torch.empty_like(flat) for _ in range(trainer.world_size)]
                dist.all_gather(everyone, flat)
                differs_mid_period = not torch.equal(everyone[0], everyone[1])
        if epoch == save_after_epoch:
            trainer.save_checkpoint()
    parameters = torch.cat([p.detach().reshape(-1) for p in trainer.unwrap(model).parameters()])
    everyone = [torch.empty_like(parameters) for _ in range(trainer.world_size)]
    dist.all_gather(everyone, parameters)
    trainer.close()
    return {"parameters": parameters.tolist(), "identical": all(torch.equal(everyone[0], p) for p in everyone),
            "differs_mid_period": differs_mid_period}


@pytest.mark.launches
def test_the_trainer_steps_alone_and_agrees_every_period_and_at_each_epoch_s_end(tmp_path):
    results = launch(_train, 2, run_dir=str(tmp_path), epochs=2)
    for result in results:
        assert result["identical"], "the ranks must hold one model after the last epoch"
        assert result["differs_mid_period"], "between agreements each rank trains on its own data"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reductions = {row["step"]: row["reductions"] for row in rows if "reductions" in row}
    # 5 steps per epoch: agreements after steps 3 and 5 (the epoch's end), then 8 and 10; no gradient all-reduce.
    assert reductions == {step: int(step in (3, 5, 8, 10)) for step in range(1, 11)}, reductions


@pytest.mark.launches
@pytest.mark.parametrize("method", ["average", "diloco"])
def test_a_resumed_periodic_run_ends_bitwise_where_the_uninterrupted_one_did(tmp_path, method):
    checkpoints = str(tmp_path / "ckpt")
    uninterrupted = launch(_train, 2, run_dir=str(tmp_path / "a"), epochs=3, method=method, checkpoint_dir=checkpoints,
                           save_after_epoch=1)
    resumed = launch(_train, 2, run_dir=str(tmp_path / "b"), epochs=3, method=method, checkpoint_dir=checkpoints,
                     resume="auto")
    # Each rank's own momentum came back from its own part of the checkpoint.
    assert [r["parameters"] for r in resumed] == [r["parameters"] for r in uninterrupted]


def test_periodic_synchronisation_is_checked():
    assert DDPConfig(periodic={"every": 8}).periodic == PeriodicSyncConfig(every=8)
    for bad, message in [({"every": 0}, "integer >= 1"), ({"every": 4, "method": "gossip"}, "average, diloco"),
                         ({"every": 4, "outer_lr": 0}, "positive"), ({"every": 4, "outer_momentum": 1.0}, r"\[0, 1\)")]:
        with pytest.raises(ConfigError, match=message):
            DDPConfig(periodic=bad)
    with pytest.raises(ConfigError, match="sends no gradients"):
        DDPConfig(periodic={"every": 4}, compression="powersgd")
    with pytest.raises(ConfigError, match="ddp.periodic set with parallel='fsdp'"):
        TrainerConfig(parallel="fsdp", ddp={"periodic": {"every": 4}})
