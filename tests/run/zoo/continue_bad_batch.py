"""Rank 1 skips a "bad batch" at step 3 with `continue`, so it runs one backward (one gradient
all-reduce) fewer than rank 0. The all-reduces pair up off by one; rank 1 finishes first and
leaves, and rank 0's last all-reduce fails ("Connection closed by peer")."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def is_bad(step: int, rank: int) -> bool:
    return rank == 1 and step == 3  # a local decision, taken by one rank only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        if is_bad(step, rank):
            continue  # zoo: continue
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
