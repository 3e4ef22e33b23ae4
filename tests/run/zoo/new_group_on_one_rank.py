"""Rank 0 alone builds its evaluation group lazily (`dist.new_group([0])` inside `if rank == 0:`);
then every rank creates a group for its metrics. torch names groups by counting the ones created,
so the two ranks now give the metrics group different names, and its creation waits for good on
both (Gloo's connection through the store under a name the other never uses). Plain torchrun hangs
until the group's timeout."""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    eval_group = None
    for step in range(4):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step == 1 and eval_group is None:
            eval_group = dist.new_group([0])  # zoo: eval_group
    metrics_group = dist.new_group([0, 1])  # zoo: metrics_group
    total = torch.tensor([loss.item()])
    dist.all_reduce(total, group=metrics_group)
    print(f"rank {rank}: mean loss {total.item() / 2:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
