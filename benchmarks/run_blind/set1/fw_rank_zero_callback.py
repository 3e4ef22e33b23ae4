"""Callback-driven training loop modelled after common trainer libraries:
a strategy object wraps the collectives and a logging callback reports the
epoch metrics."""
import datetime
import functools

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def rank_zero_only(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if dist.get_rank() == 0:
            return fn(*args, **kwargs)
        return None
    return wrapped


class DDPStrategy:
    def reduce(self, value, op="mean"):
        t = torch.as_tensor(value, dtype=torch.float32).clone()
        dist.all_reduce(t)
        return t / dist.get_world_size() if op == "mean" else t


class EpochLogger:
    @rank_zero_only
    def on_train_epoch_end(self, trainer):
        loss = trainer.strategy.reduce(trainer.epoch_loss)
        print(f"epoch {trainer.epoch} mean loss {loss.item():.4f}", flush=True)


class Trainer:
    def __init__(self, model, callbacks):
        self.model = DDP(model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=5e-3)
        self.strategy, self.callbacks = DDPStrategy(), callbacks
        self.epoch, self.epoch_loss = 0, 0.0

    def fit(self, batches, epochs=3):
        for self.epoch in range(epochs):
            total = 0.0
            for x, y in batches:
                loss = nn.functional.cross_entropy(self.model(x), y)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                total += loss.item()
            self.epoch_loss = total / len(batches)
            for cb in self.callbacks:
                cb.on_train_epoch_end(self)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(6):
        x = torch.randn(16, 10, generator=g)
        batches.append((x, (x[:, 0] + x[:, 1] > 0).long()))
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    Trainer(model, [EpochLogger()]).fit(batches)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
