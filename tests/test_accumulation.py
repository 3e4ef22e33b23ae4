"""Gradient accumulation: one reduction per optimizer step, and the gradient of one big batch.

The distributed tests train a float64 model with plain SGD, record which samples every rank
applied in every optimizer step, and compare the final parameters with a single-process
reference that takes one big-batch SGD step per window over exactly those samples.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import Dataset

import gradsync
from gradsync.accumulation import AccumulationPlan, plan_window
from tests.harness import launch

PER_RANK_SAMPLES = 31  # with batch 3: 10 full batches and one of 1 sample
BATCH_SIZE = 3
ACCUMULATION = 4  # windows of 4, 4 and 3 batches: a short last window
LR = 0.1
EPOCHS = 2


def test_windows_are_anchored_to_batch_positions_and_weighted_by_samples():
    sizes = [3] * 10 + [1]
    windows = [plan_window(0, i, 11, 4, sizes.__getitem__) for i in (0, 5, 9, 10)]
    assert [(w.first_batch, w.last_batch, w.planned_samples) for w in windows] == [
        (0, 3, 12), (4, 7, 12), (8, 10, 7), (8, 10, 7),
    ]
    last = windows[-1]
    assert [last.weight(n) for n in (3, 3, 1)] == [3 / 7, 3 / 7, 1 / 7]
    last.applied_samples = 4
    assert last.correction() == 7 / 4


class Regression(Dataset):
    """Deterministic float64 regression samples that also return their own index."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 1, generator=g, dtype=torch.float64)
        self.bad = set()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] * float("nan") if i in self.bad else self.x[i]
        return x, self.y[i], i


def make_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def dataset_size(world_size):
    # Not a multiple of the world size (for world > 1): the sampler pads a sample or two.
    return PER_RANK_SAMPLES * world_size - (world_size - 1)


def _train(skip_batches=(), skip_mode="before", nan_samples=(), ddp=None, host_memory="auto"):
    """Train EPOCHS epochs; return final params, per-step applied samples and reduction log."""
    reductions_at = []  # (epoch, batch index) of every gradient reduction pass DDP ran
    state = {}

    def counting_hook(process_group, bucket):
        if bucket.is_last():
            reductions_at.append((state["loader"].epoch, state["loader"].position - 1))
        return default_hooks.allreduce_hook(process_group, bucket)

    trainer = gradsync.setup(
        accumulation_steps=ACCUMULATION, seed=0, ddp={"comm_hook": counting_hook, **(ddp or {})},
        metrics={"log_every": 3}, host_memory=host_memory,
    )
    dataset = Regression(dataset_size(trainer.world_size))
    if trainer.rank == trainer.world_size - 1:
        dataset.bad = set(nan_samples)  # one rank's data is corrupt
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=BATCH_SIZE)
    state["loader"] = loader
    applied, stepped_at = [], []
    for epoch in trainer.epochs(EPOCHS):
        for x, y, idx in loader:
            i = loader.position - 1
            if skip_mode == "before" and trainer.agree_any(i in skip_batches and trainer.rank == 0):
                continue
            with trainer.step() as step:
                loss = F.mse_loss(model(x), y)
                if trainer.agree_any(~torch.isfinite(loss)):
                    continue  # leaves the micro-step without backward: skipped on every rank
                step.backward(loss)
                applied.append((trainer.optimizer_steps, idx.tolist()))
            if step.stepped:
                stepped_at.append((epoch, i))
    params = [p.detach().reshape(-1).tolist() for p in trainer.unwrap(model).parameters()]
    summary = trainer.summary()
    trainer.close()
    return {
        "params": params, "applied": applied, "reductions_at": reductions_at,
        "stepped_at": stepped_at, "batches": len(loader), "summary": summary,
    }


def reference_params(results):
    """Single-process SGD: one step per window on the mean loss over all samples every rank applied."""
    steps = {}
    for result in results:
        for step, indices in result["applied"]:
            steps.setdefault(step, []).extend(indices)
    dataset = Regression(dataset_size(len(results)))
    model = make_model()
    for step in sorted(steps):
        idx = torch.tensor(steps[step])
        model.zero_grad()
        F.mse_loss(model(dataset.x[idx]), dataset.y[idx]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def assert_params_close(actual, expected):
    for a, e in zip(actual, expected):
        assert torch.allclose(torch.tensor(a), torch.tensor(e), rtol=0, atol=1e-12), (a[:3], e[:3])


@pytest.mark.launches
def test_one_gradient_reduction_per_optimizer_step(world_size):
    results = launch(_train, world_size)
    boundaries = [[e, b] for e in range(EPOCHS) for b in (3, 7, 10)]
    for result in results:
        assert result["batches"] == 11
        assert result["stepped_at"] == boundaries
        assert result["summary"]["steps"] == len(boundaries)
        if world_size > 1:
            # The counting hook saw exactly one reduction pass, at each window's last batch.
            assert result["reductions_at"] == boundaries
        else:
            assert result["reductions_at"] == [], "a lone process has nothing to reduce"


@pytest.mark.launches
def test_accumulated_gradients_equal_one_big_batch_including_the_short_last_window(world_size):
    results = launch(_train, world_size)
    for result in results:
        assert result["params"] == results[0]["params"], "replicas must stay bitwise identical"
    applied = [len(idx) for _, idx in results[0]["applied"]]
    assert applied[-1] == 1, "the partial last batch of the epoch is trained on, not dropped"
    assert_params_close(results[0]["params"], reference_params(results))


@pytest.mark.launches
@pytest.mark.parametrize("host_memory", ["auto", "release"])
def test_an_agreed_skip_never_hangs_and_keeps_the_big_batch_gradient(world_size, host_memory):
    # Batch 1 is inside a window, 4 starts one, 7 ends one (its gradients were never reduced by
    # DDP), 10 ends the epoch; only rank 0 decides, every rank skips. With host_memory="release"
    # the trainer frees each update's gradients at the next backward instead of at once
    # (gradsync.trainer): a window whose first micro-batch is skipped must still start from no
    # gradient.
    results = launch(_train, world_size, skip_batches=[1, 4, 7, 10], host_memory=host_memory)
    for result in results:
        assert result["params"] == results[0]["params"]
        assert result["summary"]["steps"] == EPOCHS * 3, "every window still steps"
    assert_params_close(results[0]["params"], reference_params(results))


@pytest.mark.launches
def test_a_nan_loss_on_one_rank_is_skipped_by_all(world_size):
    # Sample 0 is corrupt on the last rank only: wherever it lands, that micro-step is skipped
    # everywhere, and the run goes on with finite parameters.
    results = launch(_train, world_size, skip_mode="none", nan_samples=list(range(0, 200, 9)))
    for result in results:
        assert result["params"] == results[0]["params"]
        assert all(torch.isfinite(torch.tensor(p)).all() for p in result["params"])
    total_micro_steps = results[0]["batches"] * EPOCHS
    assert len(results[0]["applied"]) < total_micro_steps, "some micro-steps must have been skipped"
    assert_params_close(results[0]["params"], reference_params(results))


@pytest.mark.launches
def test_gradients_as_bucket_views_give_the_same_result():
    # DDP then aliases .grad to its buckets; zero_grad(set_to_none) and gradsync's own
    # reduction of a skipped boundary must not break that.
    results = launch(_train, 2, skip_batches=[7], ddp={"gradient_as_bucket_view": True})
    assert results[0]["params"] == results[1]["params"]
    assert_params_close(results[0]["params"], reference_params(results))


def test_a_raised_accumulation_starts_where_windows_of_both_counts_align():
    plan = AccumulationPlan(2)
    plan.raise_to(8, epoch=0, next_batch=10, batches=40)  # windows of 2 end at 9: the 8s start at 16
    assert (plan.from_epoch, plan.from_batch) == (0, 16)
    assert [plan.steps_at(0, b) for b in (0, 14, 15, 16, 39)] == [2, 2, 2, 8, 8]
    assert plan.steps_at(1, 0) == 8
    sizes = [3] * 40
    windows = [plan_window(0, b, 40, plan.steps_at(0, b), sizes.__getitem__) for b in (10, 15, 16, 39)]
    assert [(w.first_batch, w.last_batch) for w in windows] == [(10, 11), (14, 15), (16, 23), (32, 39)]
    assert plan.windows(0, 40) == 8 + 3 and plan.windows(1, 40) == 5
    # Too late in the epoch for a window of 8: the new count starts with the next epoch.
    late = AccumulationPlan(1)
    late.raise_to(4, epoch=2, next_batch=38, batches=40)
    assert (late.from_epoch, late.from_batch) == (3, 0) and late.windows(2, 40) == 40 and late.windows(3, 40) == 10
    restored = AccumulationPlan(1)
    restored.load_state_dict(plan.state_dict())
    assert restored == plan
    with pytest.raises(ValueError):
        AccumulationPlan(2).raise_to(3, epoch=0, next_batch=0, batches=10)


AUTO_BATCHES = 40  # per rank and epoch, batch 2
AUTO_MAX_ACCUMULATION = 4


def _train_with_auto_accumulation(run_dir, checkpoint_dir, epochs, save_after_epoch=None, resume=None):
    """Auto with accumulation allowed, its margin at zero so that it raises accumulation to the cap."""
    trainer = gradsync.setup(
        seed=0, run_dir=run_dir,
        ddp={"compression": {"name": "auto", "max_accumulation_steps": AUTO_MAX_ACCUMULATION}},
        metrics={"progress": False, "tensorboard": False, "system_every_s": None},
        checkpoint={"dir": checkpoint_dir, "resume": resume},
    )
    dataset = Regression(AUTO_BATCHES * 2 * trainer.world_size)
    model = make_model()
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), dataset, batch_size=2)
    trainer._strategy.compression.margin = 0.0  # every exposed share is "worth" hiding: accumulation goes to the cap
    stepped_at, steps_per_epoch, counts = [], [], set()
    for epoch in trainer.epochs(epochs):
        steps_per_epoch.append(trainer.steps_per_epoch)
        for x, y, _ in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
                counts.add((epoch, loader.position - 1, trainer.accumulation_steps))
            if step.stepped:
                stepped_at.append((epoch, loader.position - 1))
        if epoch == save_after_epoch:
            trainer.save_checkpoint()
    parameters = torch.cat([p.detach().reshape(-1) for p in trainer.unwrap(model).parameters()])
    result = {
        "stepped_at": stepped_at, "steps_per_epoch": steps_per_epoch, "parameters": parameters.tolist(),
        "total": trainer._metrics.progress.total_steps, "chosen": trainer.summary()["auto"],
        "plan": trainer._accumulation.state_dict(),
        "raised_at": min([epoch, batch] for epoch, batch, count in counts if count > 1),
    }
    trainer.close()
    return result


@pytest.mark.launches
def test_auto_raises_accumulation_when_allowed_and_a_resumed_run_keeps_it(tmp_path):
    from gradsync.comm.auto import DECISION_STEPS

    checkpoints = str(tmp_path / "checkpoints")
    first = launch(_train_with_auto_accumulation, 2, run_dir=str(tmp_path / "a"), checkpoint_dir=checkpoints,
                   epochs=3, save_after_epoch=1, timeout=180)
    # auto decides after its trials, one micro-batch per step; windows of 4 start at the next multiple of 4.
    switch = -(-DECISION_STEPS // AUTO_MAX_ACCUMULATION) * AUTO_MAX_ACCUMULATION
    later = [(epoch, b) for epoch in (1, 2) for b in range(3, AUTO_BATCHES, 4)]
    expected = [(0, b) for b in range(switch)] + [(0, b) for b in range(switch + 3, AUTO_BATCHES, 4)] + later
    for result in first:
        assert result["chosen"]["accumulation_steps"] == AUTO_MAX_ACCUMULATION
        assert [tuple(s) for s in result["stepped_at"]] == expected
        assert result["steps_per_epoch"] == [AUTO_BATCHES, AUTO_BATCHES // 4, AUTO_BATCHES // 4]
        assert result["total"] == len(expected)
        assert result["raised_at"] == [0, switch]  # trainer.accumulation_steps, inside each micro-step
        assert result["parameters"] == first[0]["parameters"]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reductions" in row]
    assert [row["samples"] for row in steps] == [2 * 2] * switch + [2 * 2 * 4] * (len(expected) - switch)
    assert all(row["reductions"] == 1 for row in steps)  # one all-reduce per window, however long
    # Resumed after epoch 1 (the plan and auto's choice come from the checkpoint), epoch 2 ends
    # bitwise where the uninterrupted run ended; with windows of 1 it would not.
    resumed = launch(_train_with_auto_accumulation, 2, run_dir=str(tmp_path / "b"), checkpoint_dir=checkpoints,
                     epochs=3, resume="auto", timeout=180)
    for result in resumed:
        assert [tuple(s) for s in result["stepped_at"]] == [s for s in expected if s[0] == 2]
        assert result["plan"] == first[0]["plan"] and result["total"] == len(expected)
        assert result["parameters"] == first[0]["parameters"], first[0]["chosen"]
