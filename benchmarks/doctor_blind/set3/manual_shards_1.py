"""MLP classifier trained with DDP; every epoch the dataset is shuffled and split into one contiguous shard per rank."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SEED = 31


def make_dataset(n=1024, dim=14):
    g = torch.Generator().manual_seed(77)
    x = torch.randn(n, dim, generator=g)
    y = ((x[:, 0] > 0).long() + 2 * (x[:, 1] * x[:, 2] > 0).long())
    return x, y


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(SEED + rank)

    x_all, y_all = make_dataset()
    n = x_all.shape[0]
    per_rank = n // world_size

    model = DDP(nn.Sequential(nn.Linear(14, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)

    batch_size = 32
    for epoch in range(3):
        perm = torch.randperm(n)
        my_idx = perm[rank * per_rank:(rank + 1) * per_rank]
        model.train()
        for start in range(0, per_rank - batch_size + 1, batch_size):
            idx = my_idx[start:start + batch_size]
            x = x_all[idx] + 0.05 * torch.randn(batch_size, 14)
            loss = F.cross_entropy(model(x), y_all[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
