"""dist.all_gather of a per-rank statistics tensor whose length differs by rank: shape (4,) on
rank 0, (5,) on rank 1, each rank allocating the output list with its own shape. Gloo fails on
the rank that receives more bytes than it expected ("op.preamble.length <= op.nbytes")."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


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
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        if step == 3:
            stats = torch.arange(4 + rank, dtype=torch.float32)  # (4,) on rank 0, (5,) on rank 1
            out_list = [torch.empty_like(stats) for _ in range(world)]  # local shape
            dist.all_gather(out_list, stats)  # zoo: all_gather

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
