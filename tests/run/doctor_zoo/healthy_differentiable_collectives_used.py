"""Healthy: a contrastive loss over the global batch with the differentiable collectives of
torch.distributed.nn, their results used: all_gather's tuple is concatenated, all_reduce's sum is
kept (torch hands them out through autograd, as tensors other than the ones it reduced into)."""

import os
import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(12):
        x = torch.randn(8, 16, generator=gen)
        z = F.normalize(model(x), dim=1)
        everyone = torch.cat(dist_nn.all_gather(z))  # doctor: lookalike
        total = dist_nn.all_reduce(z.sum())
        loss = F.cross_entropy(z @ everyone.T, torch.arange(8) + 8 * rank) + 1e-3 * total
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
