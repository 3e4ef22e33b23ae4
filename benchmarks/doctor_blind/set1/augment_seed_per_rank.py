"""DDP training with per-rank augmentation randomness and a shared-seed DistributedSampler."""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class NoisyPoints(Dataset):
    """Synthetic classification set with on-the-fly augmentation drawn from numpy's global RNG."""

    def __init__(self, n=2048, dim=32, classes=4, seed=43):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, classes, generator=g)
        self.y = (self.x @ w).argmax(dim=1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, idx):
        scale = np.random.uniform(0.8, 1.2)
        jitter = torch.from_numpy(np.random.normal(0, 0.05, size=self.x.shape[1]).astype("float32"))
        return self.x[idx] * scale + jitter, self.y[idx]


class Net(nn.Module):
    def __init__(self, dim=32, hidden=128, classes=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    torch.manual_seed(args.seed)
    model = DDP(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # augmentation / dropout randomness differs per rank; the shard permutation must not
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    dataset = NoisyPoints()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
