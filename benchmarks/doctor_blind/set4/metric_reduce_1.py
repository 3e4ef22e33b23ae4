import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PATIENCE = 2
MIN_DELTA = 0.01


W_TRUE = torch.randn(14, 5, generator=torch.Generator().manual_seed(1000))


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 14, generator=g)
    y = (x @ W_TRUE + 0.8 * torch.randn(n, 5, generator=g)).argmax(1)
    return TensorDataset(x, y)


def validate(model, loader):
    model.eval()
    loss_sum, n = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            loss_sum += F.cross_entropy(model(x), y, reduction="sum").item()
            n += y.numel()
    model.train()
    val_loss = torch.tensor(loss_sum / n)
    dist.all_reduce(val_loss, op=dist.ReduceOp.SUM)
    return val_loss.item()


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train_ds, val_ds = make_split(512, seed=3), make_split(128, seed=4)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=32, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler)

    model = DDP(nn.Sequential(nn.Linear(14, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    best, bad_epochs, history = float("inf"), 0, []
    for epoch in range(6):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_loss = validate(model, val_loader)
        history.append(val_loss)
        if val_loss < best - MIN_DELTA:
            best, bad_epochs = val_loss, 0
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch} train loss {loss.item():.4f} val loss {val_loss:.4f} best {best:.4f}", flush=True)
        if bad_epochs >= PATIENCE:
            if rank == 0:
                print("early stopping", flush=True)
            break

    if rank == 0:
        print(f"best val loss {best:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
