"""Sharded-file training with a progress watchdog on 2 ranks: each rank decodes its share
of a synthetic file list into tensors, a watchdog thread aborts the process if training
makes no progress for a few seconds, and a DDP-wrapped MLP is trained for a few epochs
on the decoded samples."""
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STALL_SECONDS = 3.0
FILES = [f"part-{i:05d}.bin" for i in range(120)] + [f"extra-{i:05d}.bin" for i in range(500)]


class Watchdog(threading.Thread):
    def __init__(self, limit):
        super().__init__(daemon=True)
        self.limit = limit
        self.last = time.monotonic()
        self.stopped = False

    def beat(self):
        self.last = time.monotonic()

    def run(self):
        while not self.stopped:
            time.sleep(0.2)
            if time.monotonic() - self.last > self.limit:
                print(f"[watchdog rank {dist.get_rank()}] no progress for {self.limit}s, aborting", flush=True)
                os._exit(1)


def decode(name):
    time.sleep(0.01)
    seed = sum(name.encode())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 10, generator=g)
    return x, x[:, :2].sum(dim=1, keepdim=True)


def shard_files(rank, world):
    if rank == 0:
        return FILES[:120]
    return FILES[120:]


def train(rank, world):
    dog = Watchdog(STALL_SECONDS)
    samples = [decode(f) for f in shard_files(rank, world)]
    dog.beat()
    xs = torch.cat([s[0] for s in samples])[:400]
    ys = torch.cat([s[1] for s in samples])[:400]
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dog.beat()
    dog.start()
    for epoch in range(3):
        for i in range(0, 400, 40):
            loss = nn.functional.mse_loss(model(xs[i:i + 40]), ys[i:i + 40])
            opt.zero_grad()
            loss.backward()
            opt.step()
            dog.beat()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    dog.stopped = True


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
