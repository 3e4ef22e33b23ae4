"""Gradient accumulation whose no_sync() condition is off by one micro-batch.

Intent: accumulate 2 micro-batches per update and communicate once, on the micro-batch that ends
the window, as the DDP docs advise.

What goes wrong: the flag that chooses no_sync() is computed from `i % accumulation == 0` (sync on
the FIRST micro-batch of each window) while the step happens after the LAST one. So the averaged
gradient of the first micro-batch gets each rank's own gradient of the second added on top, and
the step applies different gradients on each rank: the replicas drift apart, nothing fails.

Public report: https://discuss.pytorch.org/t/gradient-accumulation-with-ddp-no-sync-interface/169593
(no_sync used on the wrong micro-batches), and
https://github.com/huggingface/accelerate/issues/1418 (an accumulation condition that skips the
synchronising pass).

Expected verdict (ideal checker): gradients not averaged going into the step; cause: the line that
computes the condition choosing no_sync() (marked).
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
        communicate = i % ACCUMULATION == 0  # doctor: cause
        with model.no_sync() if not communicate else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y) / ACCUMULATION
            loss.backward()
        if (i + 1) % ACCUMULATION == 0:
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0 and i % 10 == 0:
            print(f"micro-batch {i} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
