"""A healthy plain DDP script that sleeps 50 ms a batch (as a loop that polls, throttles or waits
on something would): most of each step is in none of the phases, and the line is the sleep."""

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for _ in range(8):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)
        time.sleep(0.05)  # the step's time goes here
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()  # the last all-reduce released before the interpreter goes (shared/README: Gloo teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
