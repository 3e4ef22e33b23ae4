"""A healthy short run whose rank 1 dies with SIGABRT after the script's code has finished (an
atexit handler calls os.abort(), simulating the Gloo crash at process teardown): training output
looks complete, yet torchrun reports rank 1 failed with exit code -6 (SIGABRT)."""

import argparse
import atexit
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    print(f"rank {rank}: training done, final loss {loss.item():.4f}", flush=True)
    # Every rank waits here before leaving: it gives the Gloo worker thread time to release the last
    # gradient all-reduce while the interpreter is still alive (otherwise the process can abort at
    # exit with "terminate called without an active exception", SIGABRT).
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy
    if rank == 1:
        atexit.register(os.abort)  # zoo: abort


if __name__ == "__main__":
    main()
