"""Rank 1 is killed by SIGKILL at step 5 (as the OOM killer would do): no Python traceback on that
rank; torchrun reports exit code -9 (SIGKILL) for it and stops rank 0, which may first see
"Connection closed by peer" in its gradient all-reduce."""

import argparse
import os
import signal

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
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # zoo: kill
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
