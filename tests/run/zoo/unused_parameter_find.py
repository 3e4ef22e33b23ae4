"""The same model as unused_parameter.py (a head, `unused_head`, that forward never uses), wrapped
with find_unused_parameters=True: training works and exits 0, but every backward pays for a graph
traversal and all-reduces the unused head's zero gradients."""

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
    ddp = DDP(Net(), find_unused_parameters=True)  # zoo: ddp_wrap
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)  # zoo: forward
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    # Every rank waits here before leaving: it gives the Gloo worker thread time to release the last
    # gradient all-reduce while the interpreter is still alive (otherwise the process can abort at
    # exit with "terminate called without an active exception", SIGABRT).
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
