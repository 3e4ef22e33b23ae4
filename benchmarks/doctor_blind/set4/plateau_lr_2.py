import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x[:, 0] ** 2 - x[:, 1] + 0.5 * x[:, 2] * x[:, 3] + 0.3 * torch.randn(n, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        total += F.mse_loss(model(x), y, reduction="sum").item()
        count += y.numel()
    stats = torch.tensor([total, float(count)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train_ds = make_split(256, seed=10)
    val_ds = make_split(96, seed=11)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=32, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=48, sampler=val_sampler)

    model = DDP(nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0, threshold=0.02)

    for epoch in range(10):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_loss = evaluate(model, val_loader)
        scheduler.step(val_loss)
        if rank == 0:
            print(f"epoch {epoch} train {loss.item():.4f} val {val_loss:.4f} lr {optimizer.param_groups[0]['lr']:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
