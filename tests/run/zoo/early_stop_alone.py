"""Rank 0 decides alone to stop early (its local loss check) and breaks out of the loop at step 5,
then leaves the process group and exits 0; rank 1 keeps training and its next gradient all-reduce
has no partner (it fails with "Connection closed by peer", or hangs)."""

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
    parser.add_argument("--stop-at", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # steps counted from 1
        # "converged" according to this rank's own view (in this demo: rank 0 at step 5)
        if rank == 0 and step == args.stop_at:
            break  # zoo: break
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    dist.destroy_process_group()  # zoo: leave


if __name__ == "__main__":
    main()
