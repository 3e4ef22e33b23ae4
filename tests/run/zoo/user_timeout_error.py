"""At step 3 rank 1's data code gives up on a slow shard and raises the user's own
`TimeoutError("timed out reading shard 3 ...: connection reset")` outside any collective, while
rank 0 waits in the gradient all-reduce. The words sound like a network failure; the rank that
raised it is still the cause, and rank 0's "Connection closed by peer" the consequence."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def read_shard(rank: int, step: int, gen: torch.Generator):
    if rank == 1 and step == 3:
        raise TimeoutError("timed out reading shard 3 from /data/train (connection reset by peer)")  # zoo: raise
    return torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = read_shard(rank, step, gen)  # zoo: read
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
