"""Regression MLP trained with DDP; the learning rate is reduced when the validation loss plateaus."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build_datasets():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(768, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.tanh(x @ w) + 0.3 * torch.randn(768, 1, generator=g)
    return TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train_ds, val_ds = build_datasets()
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=32, sampler=train_sampler)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler)

    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=0.5, patience=0, threshold=0.02
    )

    for epoch in range(8):
        train_sampler.set_epoch(epoch)
        model.train()
        for xb, yb in train_loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()

        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for xb, yb in val_loader:
                total += loss_fn(model(xb), yb).item() * xb.shape[0]
                count += xb.shape[0]
        val_loss = total / count
        scheduler.step(val_loss)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} lr {optimizer.param_groups[0]['lr']:.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
