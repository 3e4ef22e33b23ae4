"""Rank 0 alone evaluates every 5 steps through the DDP wrapper (`ddp(x)`) of a BatchNorm model; that
forward broadcasts BatchNorm buffers, silently paired with rank 1's next *training* forward broadcast.
Nothing fails: plain torchrun exits 0 (with --steps a multiple of 5 the last eval has no partner: hang)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=18)
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
        if rank == 0 and step % args.eval_every == 0:
            ddp.eval()
            with torch.no_grad():
                val_loss = F.mse_loss(ddp(x_val), y_val)  # zoo: eval_forward
            ddp.train()
            print(f"step {step} val loss {val_loss.item():.4f}", flush=True)

    # Every rank waits here before leaving: it gives the Gloo worker thread time to release the last
    # gradient all-reduce while the interpreter is still alive (otherwise the process can abort at
    # exit with "terminate called without an active exception", SIGABRT).
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
