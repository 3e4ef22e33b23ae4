"""Healthy `torch.multiprocessing.spawn` under a launcher with one process per node: the launched
process starts 2 children that train with their own process group, and sits in `join()` for the
whole run (longer than the zoo's stall timeout), using no CPU itself. Exits 0."""

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world: int, rendezvous: str, seconds: float) -> None:
    torch.set_num_threads(1)
    # A file rendezvous of their own: the launcher's store is for the launched process only.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    start, done, steps = time.monotonic(), torch.zeros(1), 0
    while not done.item():
        x, y = torch.randn(64, 64, generator=gen), torch.randn(64, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        steps += 1
        # Rank 0's clock decides for both, so they stop at the same step.
        done = torch.tensor([float(time.monotonic() - start > seconds)])
        dist.broadcast(done, src=0)
    if rank == 0:
        print(f"children trained {steps} steps", flush=True)
    dist.barrier()
    # Leave without the interpreter's teardown: a child tearing down Gloo while its peer still
    # does can abort with "terminate called without an active exception" (../shared/README.md;
    # seen once in CI here), which would make this healthy script fail under any launcher.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=6.5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(train, args=(2, os.path.join(folder, "rendezvous"), args.seconds), nprocs=2, join=True)  # zoo: join


if __name__ == "__main__":
    main()
