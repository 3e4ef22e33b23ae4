import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BATCH_SIZE = 16


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    centers = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    x = centers[y] + 1.2 * torch.randn(n, 2, generator=g)
    x = torch.cat([x, 0.5 * torch.randn(n, 6, generator=g)], dim=1)
    return TensorDataset(x, y)


def build_loader(ds, rank, world_size, train):
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=train)
    loader = DataLoader(ds, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)
    return loader, sampler


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    stats = torch.zeros(2)
    for x, y in loader:
        stats[0] += (model(x).argmax(1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), int(stats[1].item())


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train_ds, val_ds = make_split(640, seed=1), make_split(75, seed=2)
    train_loader, train_sampler = build_loader(train_ds, rank, world_size, train=True)
    val_loader, _ = build_loader(val_ds, rank, world_size, train=False)

    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    for epoch in range(4):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        acc, n_eval = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val acc {acc:.4f} on {n_eval} samples", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
