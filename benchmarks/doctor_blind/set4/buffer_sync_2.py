import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class RunningInputNorm(nn.Module):
    """Global input normalisation with running statistics (like a BN without affine)."""

    def __init__(self, dim, momentum=0.05, eps=1e-5):
        super().__init__()
        self.momentum = momentum
        self.eps = eps
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(x.mean(0), alpha=m)
                self.running_var.mul_(1 - m).add_(x.var(0, unbiased=False), alpha=m)
        return (x - self.running_mean) / torch.sqrt(self.running_var + self.eps)


class Regressor(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = RunningInputNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 48), nn.SiLU(), nn.Linear(48, 48), nn.SiLU(), nn.Linear(48, 1))

    def forward(self, x):
        return self.mlp(self.norm(x)).squeeze(-1)


def make_data(n=768, seed=31):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 5.0, 0.2, 10.0, 2.0, 1.0, 3.0, 0.5])
    offset = torch.tensor([0.0, 20.0, -3.0, 50.0, 1.0, -8.0, 4.0, 0.0])
    x = torch.randn(n, 8, generator=g) * scale + offset
    z = (x - offset) / scale
    y = z[:, 0] * z[:, 1] + torch.sin(z[:, 3]) + 0.5 * z[:, 6] + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=24, sampler=sampler, drop_last=True)

    model = DDP(Regressor())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        losses = []
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if rank == 0:
            print(f"epoch {epoch} train mse {sum(losses) / len(losses):.4f} ({len(losses)} steps)", flush=True)

    model.eval()
    with torch.no_grad():
        x_all, y_all = data.tensors
        mse = F.mse_loss(model.module(x_all), y_all).item()
    if rank == 0:
        print(f"final full-data mse {mse:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
