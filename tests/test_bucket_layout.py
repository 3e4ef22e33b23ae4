"""DDP's bucket layout across a resume (gradsync.bucket_layout), on real Gloo process groups.

The layout is what decides the order in which the ring all-reduce adds gradients, so these tests
look at the layout itself (which parameters each bucket holds, as the communication hook sees
them), not only at the bits it leads to.
"""

from __future__ import annotations

import random

import pytest

from tests.harness import launch


def _deep_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1),
    )


def replayed_order_becomes_the_layout(seed: int) -> dict:
    """Replay a shuffled gradient-ready order, then record which parameters each bucket of the
    next real backward holds, in bucket order."""
    import torch
    import torch.distributed as dist

    from gradsync.bucket_layout import ReadyOrder, replay
    from gradsync.metrics import Clock, CommTimer

    dist.init_process_group("gloo")
    model = _deep_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    names = {id(p): name for name, p in model.named_parameters()}
    buckets: list[list[str]] = []

    def observing(state, bucket):
        buckets.append([names[id(p)] for p in bucket.parameters()])
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    timer = CommTimer(Clock(torch.device("cpu")), observing)
    timer.register(ddp, process_group=None)
    order = [name for name, _ in model.named_parameters()]
    random.Random(seed).shuffle(order)
    grads_before = [p.grad for p in model.parameters()]
    recorded = ReadyOrder(model)
    recorded.load_state_dict({"names": order, "synced_backwards": 1})
    followed = replay(ddp, recorded, timer.silent)
    untouched = all(p.grad is g for p, g in zip(model.parameters(), grads_before))
    silent = buckets == [] and timer.buckets == 0  # nothing reduced, nothing counted
    ddp(torch.randn(3, 4)).sum().backward()
    dist.destroy_process_group()
    return {"followed": followed, "untouched": untouched, "silent": silent, "order": order, "buckets": buckets}


@pytest.mark.launches
def test_a_replayed_order_is_the_layout_of_the_next_backward():
    # Any order, not only the model's natural one: the buckets of the first real step are cut
    # from the replayed order (one dtype, so the concatenated buckets give the order back).
    # Two ranks: DDP does not rebuild its buckets in a process group of one.
    for seed in (1, 2):
        result = launch(replayed_order_becomes_the_layout, 2, seed=seed)[0]
        assert result["followed"] and result["untouched"] and result["silent"], result
        assert len(result["buckets"]) > 1
        assert [name for bucket in result["buckets"] for name in bucket] == result["order"]


def layouts_around_a_resume(run_dir: str, checkpoint_dir: str, ddp: dict, save_at: int | None = None) -> dict:
    """The trainer with a bucket-observing comm hook: every step's buckets, and the final bits.
    With `save_at`, it saves after that step and stops; otherwise it resumes from the newest
    checkpoint, if any, and trains 7 steps in all."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import gradsync

    seen: list[list[tuple[int, ...]]] = [[]]

    def observing(state, bucket):
        seen[-1].append(tuple(int(p.numel()) for p in bucket.parameters()))
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    trainer = gradsync.setup(
        seed=0, run_dir=run_dir,
        ddp={"comm_hook": observing, "bucket_cap_mb": 0.01, **ddp},
        metrics={"progress": False, "tensorboard": False, "system_every_s": None},
        checkpoint={"dir": checkpoint_dir, "resume": None if save_at else "auto"},
    )
    generator = torch.Generator().manual_seed(7)
    dataset = torch.utils.data.TensorDataset(torch.randn(60, 4, generator=generator), torch.randn(60, 1, generator=generator))
    model = _deep_model()
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), dataset, batch_size=2)
    first_step = trainer.optimizer_steps + 1
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
            seen.append([])
            if trainer.optimizer_steps == save_at:
                trainer.save_checkpoint()
            if trainer.optimizer_steps == (save_at or 7):
                break
    parameters = torch.cat([p.detach().reshape(-1) for p in trainer.unwrap(model).parameters()]).tolist()
    trainer.close()
    return {"first_step": first_step, "layouts": seen[:-1], "parameters": parameters}


@pytest.mark.launches
@pytest.mark.parametrize("ddp", [{}, {"static_graph": True}], ids=["default", "static_graph"])
def test_the_first_step_after_a_resume_reduces_in_the_uninterrupted_runs_layout(tmp_path, ddp):
    # Three ranks, so that another layout would also give other bits. DDP's first layout is one
    # bucket; it rebuilds after the first synced backward (under static_graph, which learns the
    # graph first, after the second), and a resumed run must be in the layout the uninterrupted
    # run had at that step: right after step 1 (a rebuild pending, or static_graph's graph
    # learned) and later.
    whole = launch(layouts_around_a_resume, 3, run_dir=str(tmp_path / "whole"), checkpoint_dir=str(tmp_path / "none"), ddp=ddp)
    rebuilt_at = 2 if ddp.get("static_graph") else 1  # index of the first step in the rebuilt layout
    assert len(whole[0]["layouts"][rebuilt_at - 1]) == 1 and len(whole[0]["layouts"][rebuilt_at]) > 1
    for save_at in (1, 4):
        checkpoints = str(tmp_path / f"ckpt{save_at}")
        launch(layouts_around_a_resume, 3, run_dir=str(tmp_path / f"a{save_at}"), checkpoint_dir=checkpoints, ddp=ddp,
               save_at=save_at)
        resumed = launch(layouts_around_a_resume, 3, run_dir=str(tmp_path / f"b{save_at}"), checkpoint_dir=checkpoints,
                         ddp=ddp)
        assert resumed[0]["first_step"] == save_at + 1
        assert resumed[0]["layouts"] == whole[0]["layouts"][save_at:], save_at
        assert [r["parameters"] for r in resumed] == [r["parameters"] for r in whole], save_at


def test_an_order_of_other_parameters_is_not_replayed():
    from types import SimpleNamespace

    from gradsync.bucket_layout import replay_problem

    ddp = SimpleNamespace(module=_deep_model(), static_graph=False)
    names = [name for name, _ in ddp.module.named_parameters()]
    assert replay_problem(ddp, list(reversed(names))) is None
    assert "other parameters" in replay_problem(ddp, names[:-1])
    ddp.module[6].weight.requires_grad_(False)  # frozen since the checkpoint
    assert "other parameters" in replay_problem(ddp, names)
