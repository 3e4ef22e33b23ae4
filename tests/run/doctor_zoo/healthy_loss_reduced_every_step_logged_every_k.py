"""Healthy: every step all-reduces its detached loss for the log, and rank 0 prints it every fifth
step; on the other steps the reduced value is dropped unread, by design (a collective a step keeps
the ranks' logging in one rhythm)."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 16


def train(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 16, generator=gen)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        logged = loss.detach() / world
        dist.all_reduce(logged)  # doctor: lookalike
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {logged.item():.4f}")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
