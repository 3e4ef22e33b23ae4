"""A masked language-model loss normalised by the number of real tokens in the global batch: each
rank counts its unmasked tokens (an integer tensor), all-reduces the count as a float, and divides
its summed loss by it (times the world size, since DDP averages the gradients). `n.float()` is a
copy: the all-reduce sums the copy, which is dropped, and each rank divides by its own count. Ranks
with shorter sequences weigh their tokens more; the loss is not the global batch's mean."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 16


def train(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, 32, (8, 12), generator=gen)
        lengths = torch.randint(3 + 6 * rank, 13, (8,), generator=gen)
        mask = torch.arange(12)[None, :] < lengths[:, None]
        n = mask.sum()
        dist.all_reduce(n.float())  # doctor: cause
        losses = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten(), reduction="none")
        loss = (losses * mask.flatten()).sum() / n * world
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
