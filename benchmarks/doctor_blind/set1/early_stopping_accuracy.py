"""Classifier training with per-epoch distributed validation and accuracy-based early stopping."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_split(n, dim=32, classes=6, seed=0):
    g = torch.Generator().manual_seed(1000)
    w = torch.randn(dim, classes, generator=g)
    g.manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x @ w + 1.0 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self, dim=32, hidden=128, classes=6):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        correct += (model(x).argmax(dim=1) == y).sum().item()
        total += y.numel()
    model.train()
    acc = torch.tensor(correct / max(total, 1))
    dist.all_reduce(acc)
    return acc.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--min-epochs", type=int, default=2)
    parser.add_argument("--target-acc", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    train_set, val_set = make_split(1024, seed=1), make_split(512, seed=2)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler)

    model = DDP(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
        val_acc = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} val_acc {val_acc:.3f}", flush=True)
        if epoch + 1 >= args.min_epochs and val_acc >= args.target_acc:
            if rank == 0:
                print(f"target accuracy reached, stopping at epoch {epoch}")
            break

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
