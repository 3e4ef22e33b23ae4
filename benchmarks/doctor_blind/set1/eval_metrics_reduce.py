"""Classifier training with distributed validation, rank-0 logging/checkpointing and plateau LR decay."""
import argparse
import os
import shutil
import tempfile
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
    stats = torch.zeros(3)  # loss sum, correct, count
    for x, y in loader:
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(dim=1) == y).sum()
        stats[2] += y.numel()
    model.train()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
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
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)

    outdir = tempfile.mkdtemp(prefix="ckpt_") if rank == 0 else None
    best_acc = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        val_loss, val_acc = evaluate(model, val_loader)
        scheduler.step(val_loss)  # global metric, identical on all ranks
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.3f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(outdir, "best.pt"))
        dist.barrier()

    if rank == 0:
        shutil.rmtree(outdir, ignore_errors=True)
    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
