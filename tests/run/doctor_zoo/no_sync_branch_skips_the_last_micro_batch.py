"""Gradient accumulation whose no_sync() branch also covers the micro-batch that ends the window.

Intent: accumulate 4 micro-batches, communicating only on the last, in a loop written with an
explicit `if` around two backward calls.

What goes wrong: the branch test counts micro-batches from 1 in one place and from 0 in the other:
`if step_in_window < ACCUMULATION:` is true for every micro-batch of the window (0..3), so every
backward runs under no_sync() and the step applies each rank's own sum. Nothing fails; the
replicas drift apart from the first update.

Public report: https://github.com/Lightning-AI/pytorch-lightning/issues/7534 (accumulation that
never synchronised under DDP), https://discuss.pytorch.org/t/ddp-no-sync-gradient-accumulation/
(off-by-one accumulation counters).

Expected verdict (ideal checker): gradients not averaged going into the step; cause: the branch's
condition (marked).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ACCUMULATION = 4


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(70 + rank)
    for update in range(25):
        for step_in_window in range(ACCUMULATION):
            x = torch.randn(8, 8, generator=data)
            if step_in_window < ACCUMULATION:  # doctor: cause
                with model.no_sync():
                    loss = F.mse_loss(model(x), x.sum(1, keepdim=True)) / ACCUMULATION
                    loss.backward()
            else:
                loss = F.mse_loss(model(x), x.sum(1, keepdim=True)) / ACCUMULATION
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and update % 10 == 0:
            print(f"update {update} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
