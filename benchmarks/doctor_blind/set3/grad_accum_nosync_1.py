"""MLP classifier trained with DDP and gradient accumulation, skipping the all-reduce on micro-batches with no_sync()."""
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(n=768, dim=20, classes=5):
    g = torch.Generator().manual_seed(5)
    centers = 2.0 * torch.randn(classes, dim, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    feats = centers[labels] + torch.randn(n, dim, generator=g)
    return TensorDataset(feats, labels)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    accum_steps = 2
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True)

    model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    updates = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        for batch_idx, (x, y) in enumerate(loader):
            sync_this_step = batch_idx % accum_steps == 0
            ctx = contextlib.nullcontext() if sync_this_step else model.no_sync()
            with ctx:
                loss = F.cross_entropy(model(x), y) / accum_steps
                loss.backward()
            if (batch_idx + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
                updates += 1
        if rank == 0:
            print(f"epoch {epoch} last loss {loss.item() * accum_steps:.4f} updates {updates}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
