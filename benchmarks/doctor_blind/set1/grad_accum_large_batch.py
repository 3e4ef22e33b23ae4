"""Emulate a large batch with gradient accumulation under DDP (no_sync on all but the last micro-batch)."""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(n=2048, dim=40, classes=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


class Classifier(nn.Module):
    def __init__(self, dim=40, hidden=128, classes=5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler, drop_last=True)

    model = DDP(Classifier())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(10 + rank)  # independent dropout masks per rank

    updates = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        for i, (x, y) in enumerate(loader):
            last_micro_batch = (i + 1) % args.accum_steps == 0
            ctx = contextlib.nullcontext() if last_micro_batch else model.no_sync()
            with ctx:
                loss = F.cross_entropy(model(x), y) / args.accum_steps
                loss.backward()
            if last_micro_batch:
                optimizer.step()
                optimizer.zero_grad()
                updates += 1
                if rank == 0 and updates % 8 == 0:
                    print(f"epoch {epoch} update {updates} loss {loss.item() * args.accum_steps:.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
