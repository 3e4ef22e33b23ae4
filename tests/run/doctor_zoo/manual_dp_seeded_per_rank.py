"""Hand-written data parallelism (no DDP): gradients all-reduced and divided by the world size before
each step, but the model is built after seeding each rank with its own seed and its parameters are
never broadcast, so every rank starts from its own initialisation: the same averaged gradient keeps
the replicas apart for good."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS = 16


def train(rank: int, world: int) -> None:
    torch.manual_seed(1234 + rank)  # augmentation and dropout per rank
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))  # doctor: cause
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 1, generator=gen)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        optimizer.step()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
