"""Feature-cache preparation and training on 2 ranks: the ranks share a feature cache
file on local disk guarded by an advisory file lock; the first rank to take the lock
computes normalisation statistics for the synthetic dataset and writes them, the ranks
synchronise, then each rank normalises its shard and trains a DDP-wrapped linear model."""
import datetime
import fcntl
import json
import os
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

CACHE_DIR = os.path.join(tempfile.gettempdir(), f"featcache_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")


@contextmanager
def file_lock(path):
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def dataset(n=256):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 12, generator=g) * 4 + 2
    y = (x[:, :3].sum(dim=1, keepdim=True) > 6).float()
    return x, y


def prepare_stats(x):
    os.makedirs(CACHE_DIR, exist_ok=True)
    stats_path = os.path.join(CACHE_DIR, "stats.json")
    with file_lock(os.path.join(CACHE_DIR, ".lock")):
        if not os.path.exists(stats_path):
            with open(stats_path, "w") as f:
                json.dump({"mean": x.mean(0).tolist(), "std": x.std(0).tolist()}, f)
    dist.barrier()
    with open(stats_path) as f:
        st = json.load(f)
    return torch.tensor(st["mean"]), torch.tensor(st["std"])


def train(rank, world):
    x, y = dataset()
    mean, std = prepare_stats(x)
    xs, ys = ((x - mean) / std)[rank::world], y[rank::world]
    torch.manual_seed(0)
    model = DDP(nn.Linear(12, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(5):
        for i in range(0, len(xs), 16):
            loss = nn.functional.binary_cross_entropy_with_logits(model(xs[i:i + 16]), ys[i:i + 16])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
