"""Mistake: the contrastive loss gathers the other ranks' embeddings into
`[torch.zeros_like(z)] * world_size`, a list holding ONE tensor world_size times. all_gather writes
every rank's slice into that same storage, so each slot ends up with the last rank's features:
rank 1 contrasts against two copies of its own batch and never sees rank 0's negatives. Shapes are
right and the loss stays finite, so nothing complains."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def info_nce(q: torch.Tensor, k: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    gathered = [torch.zeros_like(k)] * world_size  # doctor: cause
    dist.all_gather(gathered, k.detach())
    gathered[rank] = k  # keep the local slice in the graph
    all_k = torch.cat(gathered)
    logits = q @ all_k.t() / 0.1
    labels = torch.arange(q.shape[0]) + rank * q.shape[0]
    return F.cross_entropy(logits, labels)


def train(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(41)
    data = torch.randn(world_size, 20, 16, 32, generator=gen)  # [rank, step, batch, feature]
    noise = torch.Generator().manual_seed(42 + rank)

    torch.manual_seed(0)
    ddp = DDP(Encoder())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(20):
        x = data[rank, step]
        view_a = x + 0.1 * torch.randn(x.shape, generator=noise)
        view_b = x + 0.1 * torch.randn(x.shape, generator=noise)
        q, k = ddp(torch.cat([view_a, view_b])).chunk(2)
        loss = info_nce(q, k, rank, world_size)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(rank, dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
