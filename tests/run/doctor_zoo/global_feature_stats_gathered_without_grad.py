"""Features whitened with statistics of the global batch, gathered without gradient.

Intent: normalise a projection head's output by the mean and standard deviation of the whole
global batch (as a cross-GPU batch norm would), to stabilise a redundancy-reduction loss.

What goes wrong: the statistics come from dist.all_gather, whose slots (this rank's own included)
are copies without gradient. The loss's gradient then ignores how each feature moves the mean and
the variance, which is most of what the whitening does to it; the training silently follows a
different loss than the one written.

Public report: https://github.com/facebookresearch/barlowtwins/issues/8 (statistics across GPUs
without gradient), https://discuss.pytorch.org/t/
how-to-all-gather-features-with-gradient-for-batch-statistics/ .

Expected verdict (ideal checker): the loss used a gathered copy of this rank's own features with
no gradient; cause: the all_gather (marked).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def global_whiten(features, world):
    copies = [torch.empty_like(features) for _ in range(world)]
    dist.all_gather(copies, features)  # doctor: cause
    every = torch.cat(copies)
    return (features - every.mean(0)) / (every.std(0) + 1e-5)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 6)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(20 + rank)
    for step in range(30):
        x = torch.randn(16, 10, generator=data)
        a = global_whiten(model(x), world)
        b = global_whiten(model(x + 0.1 * torch.randn(x.shape, generator=data)), world)
        c = a.T @ b / (len(x) * world)
        loss = (1 - torch.diagonal(c)).pow(2).sum() + 0.01 * (c - torch.diag(torch.diagonal(c))).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
