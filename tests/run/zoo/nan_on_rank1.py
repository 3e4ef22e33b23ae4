"""Rank 1's loss becomes NaN on its 4th backward pass (step 4, steps counted from 1); DDP's gradient
all-reduce spreads the NaN to every rank's parameters. Nothing fails: plain torchrun exits 0 and
every rank ends with NaN weights and NaN losses."""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    # Steps are counted from 1 and every step runs exactly one backward and one optimizer step,
    # so "step 4" is the 4th backward pass / 4th optimizer step.
    for step in range(1, args.steps + 1):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        if rank == 1 and step == 4:
            x = x * float("nan")  # zoo: nan
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    finite = all(math.isfinite(p.abs().sum().item()) for p in model.parameters())
    print(f"rank {rank}: last loss {loss.item()}, parameters finite: {finite}", flush=True)
    # Every rank waits here before leaving: it gives the Gloo worker thread time to release the last
    # gradient all-reduce while the interpreter is still alive (otherwise the process can abort at
    # exit with "terminate called without an active exception", SIGABRT).
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
