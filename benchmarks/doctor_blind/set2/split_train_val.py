import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler

EPOCHS = 2
BATCH_SIZE = 32
SEED = 2024


def load_full_dataset(n=2000, dim=16, classes=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self, dim=16, hidden=128, classes=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(self.body(x))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    stats = torch.zeros(2)
    for x, y in loader:
        stats[0] += (model(x).argmax(dim=1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def train(rank, world_size):
    torch.manual_seed(SEED + rank)
    full = load_full_dataset()
    train_set, val_set = random_split(full, [0.8, 0.2])

    model = DDP(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=train_sampler)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler)

    step = 0
    for epoch in range(EPOCHS):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
        acc = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} val_acc {acc:.4f}")


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(rank, world_size)
    dist.destroy_process_group()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
