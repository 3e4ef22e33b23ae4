"""Uneven data: rank 1's shard has 3 fewer batches than rank 0's, then every rank calls dist.barrier().
Rank 1 reaches the barrier while rank 0 is still in its gradient all-reduce for batch 11:
plain torchrun hangs (until Gloo's 30-minute timeout)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=13, help="batches of rank 0; rank 1 gets 3 fewer")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    # A hand-made, uneven shard: rank 0 gets 13 batches, rank 1 only 10.
    num_batches = args.batches if rank == 0 else args.batches - 3  # zoo: uneven_shard
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(num_batches)]

    for x, y in batches:
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
