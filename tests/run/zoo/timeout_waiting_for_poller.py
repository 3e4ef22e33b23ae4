"""An explicit `init_process_group(..., timeout=timedelta(seconds=4))`. After 3 steps rank 1 polls
for a file that never appears (a marker another job should write), busy in Python but outside any
collective, while rank 0 waits in `dist.barrier()` until Gloo gives up ("Timed out waiting
4000ms"). The rank that timed out only waited; the poller is the one to look at."""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def wait_for_marker(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)  # zoo: poll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=4))
    rank = int(os.environ["RANK"])
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
    if rank == 1:
        wait_for_marker("/nonexistent/gradsync-zoo-marker")  # zoo: wait_for_marker
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
