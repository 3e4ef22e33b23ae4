"""Healthy: torch.manual_seed(0) before building the model (the same initial weights everywhere), then
torch.manual_seed(1000 + rank) right after DDP, so each rank draws its own dropout masks. The Dataset's
NumPy augmentation generator is reseeded in worker_init_fn from the worker's torch seed, which differs
per worker, epoch and rank. DistributedSampler with set_epoch. Nothing to report."""

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler


class NoisyDataset(Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = self.rng.normal(0.0, 0.1, size=16).astype(np.float32)
        return self.x[i] + torch.from_numpy(noise), self.y[i]


def seed_worker(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    dataset = NoisyDataset(256)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2, worker_init_fn=seed_worker)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    ddp = DDP(model)
    torch.manual_seed(1000 + rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
