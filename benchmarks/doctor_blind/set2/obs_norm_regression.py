import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 60
BATCH_SIZE = 64
OBS_DIM = 12


class RunningMeanStd(nn.Module):
    """Empirical observation normalizer (running mean / variance)."""

    def __init__(self, dim, eps=1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(eps))

    @torch.no_grad()
    def update(self, x):
        batch_mean = x.mean(dim=0)
        batch_var = x.var(dim=0, unbiased=False)
        batch_count = torch.tensor(float(x.size(0)))
        delta = batch_mean - self.mean
        total = self.count + batch_count
        new_mean = self.mean + delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta.pow(2) * self.count * batch_count / total
        self.mean.copy_(new_mean)
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, x):
        return ((x - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-5, 5)


class EnvSampler:
    """Each worker collects transitions from its own simulator instances."""

    def __init__(self, rank):
        self.gen = torch.Generator().manual_seed(100 + rank)
        g = torch.Generator().manual_seed(0)
        self.scale = torch.rand(OBS_DIM, generator=g) * 10 + 0.5
        self.offset = torch.randn(OBS_DIM, generator=g) * 5
        self.w = torch.randn(OBS_DIM, 1, generator=g)

    def sample(self, n):
        z = torch.randn(n, OBS_DIM, generator=self.gen)
        obs = z * self.scale + self.offset
        target = torch.tanh(z @ self.w) + 0.05 * torch.randn(n, 1, generator=self.gen)
        return obs, target


def train(rank, world_size):
    torch.manual_seed(0)
    normalizer = RunningMeanStd(OBS_DIM)
    model = DDP(nn.Sequential(nn.Linear(OBS_DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    env = EnvSampler(rank)

    for step in range(STEPS):
        obs, target = env.sample(BATCH_SIZE)
        normalizer.update(obs)
        pred = model(normalizer(obs))
        loss = F.mse_loss(pred, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(rank, world_size)
    dist.destroy_process_group()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
