"""Healthy rank-0 evaluation of a BatchNorm model: rank 0 evaluates through `ddp.module` (the plain
module, no collective) every 5 steps, then every rank meets at dist.barrier(). Exits 0 on every rank."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)  # broadcast_buffers=True (the default)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    x_val, y_val = torch.randn(32, 16, generator=gen), torch.randn(32, 1, generator=gen)

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)  # zoo: train_forward
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        if step % args.eval_every == 0:
            if rank == 0:
                ddp.module.eval()
                with torch.no_grad():
                    val_loss = F.mse_loss(ddp.module(x_val), y_val)  # zoo: eval_forward
                ddp.module.train()
                print(f"step {step} val loss {val_loss.item():.4f}", flush=True)
            dist.barrier()  # zoo: barrier

    # Every rank waits here before leaving: it gives the Gloo worker thread time to release the last
    # gradient all-reduce while the interpreter is still alive (otherwise the process can abort at
    # exit with "terminate called without an active exception", SIGABRT).
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
