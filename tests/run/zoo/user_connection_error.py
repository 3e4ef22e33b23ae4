"""At step 3 rank 0's data code cannot reach its feature store and raises the user's own
`ConnectionError("connection refused by feature store at 10.0.0.5:6379")` outside any collective,
while rank 1 waits in the gradient all-reduce. The words sound like a network failure between the
ranks; the rank that raised it is still the cause, and rank 1's "Connection closed by peer" inside
the all-reduce the consequence."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class FeatureStore:
    """Stands in for a key-value client (Redis, say) that serves each step's input features."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.gen = torch.Generator().manual_seed(1000 + rank)

    def fetch(self, step: int):
        if self.rank == 0 and step == 3:  # the store went away under rank 0
            raise ConnectionError("connection refused by feature store at 10.0.0.5:6379")  # zoo: raise
        return torch.randn(8, 16, generator=self.gen), torch.randn(8, 1, generator=self.gen)


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
    store = FeatureStore(rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = store.fetch(step)  # zoo: fetch
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
