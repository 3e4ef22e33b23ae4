"""Tabular classifier trained with DistributedDataParallel on synthetic data."""
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
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_dataset(n=2048, dim=32, classes=4, seed=1234):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, classes, generator=g)
    x = torch.randn(n, dim, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class MLP(nn.Module):
    def __init__(self, dim=32, hidden=128, classes=4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    # each worker gets its own stream for the input jitter below
    seed = args.seed + rank
    set_seed(seed)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x = x + 0.05 * torch.randn_like(x)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    if rank == 0:
        print(f"done after {step} steps")
    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
