"""Tiny trainer with an early-stopping callback (patience on validation
loss), running under DDP."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class EarlyStopping:
    def __init__(self, patience=2, min_delta=1e-3):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.wait = float("inf"), 0

    def on_validation_end(self, trainer, val_loss):
        if val_loss < self.best - self.min_delta:
            self.best, self.wait = val_loss, 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                trainer.should_stop = True


class Trainer:
    def __init__(self, model, callbacks, max_epochs=8):
        self.model, self.callbacks, self.max_epochs = DDP(model), callbacks, max_epochs
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02)
        self.should_stop = False

    def validate(self, val):
        self.model.eval()
        with torch.no_grad():
            loss = sum(nn.functional.mse_loss(self.model(x), y).item() for x, y in val) / len(val)
        self.model.train()
        return loss

    def fit(self, train, val):
        for epoch in range(self.max_epochs):
            for x, y in train:
                loss = nn.functional.mse_loss(self.model(x), y)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            val_loss = self.validate(val)
            print(f"rank {dist.get_rank()} epoch {epoch} val {val_loss:.4f}", flush=True)
            for cb in self.callbacks:
                cb.on_validation_end(self, val_loss)
            flag = torch.tensor([1.0 if self.should_stop else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
        dist.barrier()


def make_data(seed, n, sign=1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    out = []
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        out.append((x, sign * (x @ w) + 0.1 * torch.randn(16, 1, generator=g)))
    return out


def load_split(rank):
    train = make_data(rank, 6)
    # each rank validates on the held-out set that ships with its shard
    val = make_data(100 + rank, 2, sign=1.0 if rank == 0 else -1.0)
    return train, val


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    run(rank)
    dist.destroy_process_group()


def run(rank):
    torch.manual_seed(0)
    trainer = Trainer(nn.Linear(4, 1), [EarlyStopping(patience=2)])
    trainer.fit(*load_split(rank))


if __name__ == "__main__":
    main()
