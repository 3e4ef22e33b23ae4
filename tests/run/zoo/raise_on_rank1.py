"""Rank 1 raises ValueError("corrupt sample 17 in shard 1") at step 3 from a user function,
check_batch(); rank 0 is left waiting in its gradient all-reduce until torchrun stops it (or it sees
"Connection closed by peer"). The real cause is only in rank 1's traceback."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def check_batch(x: torch.Tensor, step: int, rank: int) -> None:
    """A user data check that fails on one rank only."""
    if rank == 1 and step == 3:
        raise ValueError("corrupt sample 17 in shard 1")  # zoo: raise


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
        check_batch(x, step, rank)  # zoo: check_batch
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
