"""Gradient accumulation with no_sync() on every micro-batch but the one that ends the window: correct.

The twin of no_sync_on_the_stepping_micro_batch.py: one flag chooses both no_sync() and the step,
so the last backward of each window averages the accumulated gradients and every rank steps with
the same average.
"""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ACCUMULATION = 2


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(40 + rank)
    optimizer.zero_grad()
    for i in range(40):
        x = torch.randn(16, 10, generator=data)
        y = (x[:, 0] > 0).long()
        communicate = (i + 1) % ACCUMULATION == 0  # doctor: lookalike
        with model.no_sync() if not communicate else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y) / ACCUMULATION
            loss.backward()
        if communicate:
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0 and i % 10 == 0:
            print(f"micro-batch {i} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
