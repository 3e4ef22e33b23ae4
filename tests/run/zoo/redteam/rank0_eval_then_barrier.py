"""Rank-0-only evaluation through model.module, then a barrier. HEALTHY.

Mechanism (h): looks like the classic "eval on rank 0 only" desync, but the
evaluation uses the unwrapped `model.module` under torch.no_grad(), so it issues
no collective at all (no DDP buffer broadcast, no gradient all-reduce). Rank 1
waits ~4 s in the barrier each epoch. The model has BatchNorm, so DDP
broadcasts buffers in every *training* forward -- on both ranks alike.
Exit code 0 on both ranks.

Drawn from: https://github.com/pytorch/pytorch/issues/54059 ("Run the
validation step on just one GPU, and use torch.distributed.barrier() to make the
other processes wait until validation is done").
"""
import os
import time

import torch.distributed.nn  # noqa: F401
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EVAL_SECONDS = 4.0


def evaluate(net):
    net.eval()
    g = torch.Generator().manual_seed(99)
    deadline = time.monotonic() + EVAL_SECONDS
    correct = total = 0
    with torch.no_grad():
        while time.monotonic() < deadline:
            x = torch.randn(256, 20, generator=g)
            y = (x[:, :3].sum(1) > 0).long()
            correct += int((net(x).argmax(1) == y).sum())
            total += len(y)
    net.train()
    return correct / max(total, 1)


def train_and_eval(rank, world):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for epoch in range(3):
        for _ in range(25):
            x = torch.randn(64, 20, generator=g)
            y = (x[:, :3].sum(1) > 0).long()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            acc = evaluate(model.module)  # zoo: rank0-eval
            print(f"epoch {epoch}: loss {loss.item():.3f} val acc {acc:.3f}", flush=True)
        dist.barrier()  # zoo: barrier-after-eval


def main():
    dist.init_process_group("gloo")
    train_and_eval(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
