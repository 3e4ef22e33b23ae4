"""The model has a head, `unused_head`, that forward never uses, and DDP runs with the default
find_unused_parameters=False: its gradient bucket never becomes ready, and the 2nd forward raises
RuntimeError "Expected to have finished reduction in the prior iteration ..." on every rank."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.unused_head = nn.Linear(32, 4)  # zoo: unused_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # self.unused_head is never called


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(Net())  # zoo: ddp_wrap
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)  # zoo: forward
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
