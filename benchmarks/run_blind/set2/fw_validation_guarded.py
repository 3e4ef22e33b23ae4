"""Hand-rolled trainer with a fault-tolerant validation hook on 2 ranks: a DDP-wrapped
regressor trains on synthetic data; after each epoch an on_validation_end hook computes
each rank's relative error on its validation shard, averages it across ranks, and the
trainer logs it; problems inside the hook are logged instead of stopping the run."""
import datetime
import traceback

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def val_shard(rank):
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(48, 8, generator=g)
    y = x[:, :2].sum(dim=1, keepdim=True)
    if rank == 1:
        y[5] = 0.0
    return x, y


class RelErrorHook:
    def on_validation_end(self, model, rank):
        x, y = val_shard(rank)
        with torch.no_grad():
            pred = model.module(x)
        rel = ((pred - y).abs() / y.abs()).mean()
        if not torch.isfinite(rel):
            raise FloatingPointError(f"relative error is {rel.item()} on rank {rank}")
        t = torch.stack([rel, torch.tensor(1.0)])
        dist.all_reduce(t)
        return (t[0] / t[1]).item()


class Trainer:
    def __init__(self, hooks):
        self.hooks = hooks

    def run_hooks(self, model, rank):
        out = {}
        for h in self.hooks:
            try:
                out[type(h).__name__] = h.on_validation_end(model, rank)
            except Exception:
                print(f"[rank {rank}] hook {type(h).__name__} failed:\n{traceback.format_exc()}", flush=True)
        return out

    def fit(self, rank):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        g = torch.Generator().manual_seed(rank)
        for epoch in range(3):
            for _ in range(10):
                x = torch.randn(32, 8, generator=g)
                loss = nn.functional.mse_loss(model(x), x[:, :2].sum(dim=1, keepdim=True))
                opt.zero_grad()
                loss.backward()
                opt.step()
            metrics = self.run_hooks(model, rank)
            if rank == 0:
                print(f"epoch {epoch} loss {loss.item():.4f} {metrics}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    Trainer([RelErrorHook()]).fit(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
