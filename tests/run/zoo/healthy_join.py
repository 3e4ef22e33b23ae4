"""Healthy uneven inputs: rank 1 has 3 fewer batches than rank 0, handled with the Join context
manager, which shadows the missing all-reduces and BatchNorm buffer broadcasts of ranks that ran out
of data. Exits 0 on every rank."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=13, help="batches of rank 0; rank 1 gets 3 fewer")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    num_batches = args.batches if rank == 0 else args.batches - 3  # zoo: uneven_shard
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(num_batches)]

    with Join([ddp]):  # zoo: join
        for x, y in batches:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()  # zoo: backward
            opt.step()

    dist.barrier()  # zoo: barrier
    print(f"rank {rank}: trained on {num_batches} batches", flush=True)
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
