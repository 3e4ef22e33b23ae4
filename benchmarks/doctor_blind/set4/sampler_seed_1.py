import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BASE_SEED = 2024


class NoisyRegression(Dataset):
    def __init__(self, n=512, d=12, seed=5):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d, generator=g)
        w = torch.randn(d, 1, generator=g)
        self.y = torch.sin(self.x @ w) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        # light jitter augmentation
        x = x + 0.01 * torch.randn_like(x)
        return x, self.y[i]


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)

    seed = BASE_SEED + rank
    set_seed(seed)

    dataset = NoisyRegression()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, drop_last=True)

    model = nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    model = DDP(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    epochs = 5
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        epoch_loss, n = 0.0, 0
        for x, y in loader:
            pred = model(x)
            loss = F.mse_loss(pred, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item()
            n += 1
        if rank == 0:
            print(f"epoch {epoch} mse {epoch_loss / n:.4f} ({n} steps)", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
