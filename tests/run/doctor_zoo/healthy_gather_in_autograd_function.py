"""Healthy: a contrastive loss over the global batch, whose embeddings are gathered by an autograd
Function (all_gather forward; backward sums the gradients of every rank's copy and keeps this rank's
slice). The gathered list is built and filled inside the Function's forward and handed out as its
outputs."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 16


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        slots = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(slots, local)  # doctor: lookalike
        return tuple(slots)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> torch.Tensor:
        summed = torch.stack(grads)
        dist.all_reduce(summed)
        return summed[dist.get_rank()]


def train(rank: int) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(8, 16, generator=gen)
        a = F.normalize(model(x + 0.1 * torch.randn(8, 16, generator=gen)), dim=1)
        b = F.normalize(model(x + 0.1 * torch.randn(8, 16, generator=gen)), dim=1)
        everyone = torch.cat(Gather.apply(b))
        logits = a @ everyone.T / 0.1
        labels = torch.arange(8) + 8 * rank
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
