"""At step 3 the ranks take different branches: rank 0 calls dist.broadcast(t, src=0), rank 1 calls
dist.all_reduce(t) on a tensor of the same shape. Gloo pairs the two different collectives:
an error, a hang, or silently wrong values."""

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
            t = torch.full((16,), float(rank + 1))
            if rank == 0:
                dist.broadcast(t, src=0)  # zoo: broadcast
            else:
                dist.all_reduce(t)  # zoo: all_reduce
            print(f"rank {rank}: t[0] after step 3 collective = {t[0].item()}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
