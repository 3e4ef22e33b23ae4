"""Regression on observations normalised by running statistics (as in RL and tabular pipelines):
a module keeps a running mean and variance in buffers, updated from every batch before it
normalises it. Each rank updates it from its own batches only, so each rank's normaliser holds
its own statistics: the model DDP keeps in sync sees inputs scaled differently on each rank, and
rank 0's checkpoint pairs the weights with rank 0's statistics alone."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 16


class RunningNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(1e-4))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        n = x.shape[0]
        total = self.count + n
        delta = x.mean(0) - self.mean
        self.var.copy_((self.var * self.count + x.var(0, unbiased=False) * n + delta**2 * self.count * n / total) / total)
        self.mean.add_(delta * n / total)
        self.count.fill_(float(total))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.var + 1e-8).sqrt()


def train(rank: int) -> None:
    torch.manual_seed(0)
    norm = RunningNorm(8)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(32, 8, generator=gen) * (1 + rank) + rank
        y = x.sum(1, keepdim=True)
        norm.update(x)  # doctor: cause
        loss = F.mse_loss(model(norm(x)), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
