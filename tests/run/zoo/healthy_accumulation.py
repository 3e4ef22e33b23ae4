"""Healthy gradient accumulation: 4 micro-batches per optimizer step, `ddp.no_sync()` on the first 3,
so gradients are all-reduced once per optimizer step. Exits 0 on every rank."""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # optimizer steps counted from 1
        opt.zero_grad()
        for micro in range(args.accumulation):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            last = micro == args.accumulation - 1
            sync_context = contextlib.nullcontext() if last else ddp.no_sync()  # zoo: no_sync
            with sync_context:
                loss = F.mse_loss(ddp(x), y) / args.accumulation
                loss.backward()  # zoo: backward
        opt.step()  # zoo: optimizer_step

    # Every rank waits here before leaving: it gives the Gloo worker thread time to release the last
    # gradient all-reduce while the interpreter is still alive (otherwise the process can abort at
    # exit with "terminate called without an active exception", SIGABRT).
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
