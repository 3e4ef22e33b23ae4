"""Healthy collectives inside `torch.compile`: a module whose forward all-reduces a statistic,
compiled once with `fullgraph=True` and once without, trained with DDP. Under a recorder that
Dynamo traced into, fullgraph fails and the other gets a graph break per collective. Exits 0."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class GlobalNorm(nn.Module):
    """Normalises by the mean over every rank's batch (the all-reduce is inside the graph)."""

    def forward(self, x):
        mean = x.mean(dim=0, keepdim=True)
        dist.all_reduce(mean)  # zoo: compiled_all_reduce
        return x - mean / dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for fullgraph in (True, False):
        norm = torch.compile(GlobalNorm(), fullgraph=fullgraph, backend="eager")
        for step in range(1, args.steps + 1):  # steps counted from 1
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            loss = F.mse_loss(ddp(norm(x)), y)
            opt.zero_grad()
            loss.backward()  # zoo: backward
            opt.step()
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
