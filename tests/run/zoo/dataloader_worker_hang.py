"""A DataLoader worker deadlocks on rank 1: at sample 40 its `__getitem__` waits forever (standing
in for a lock taken before fork, or a read from a hung file system), so rank 1's main process waits
for a batch that never comes while rank 0 waits in the gradient all-reduce. Plain torchrun hangs,
and stopping the ranks alone would leave the deadlocked worker process behind."""

import argparse
import os
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

STUCK_AT = 40


class Samples(Dataset):
    def __init__(self, rank: int):
        self.rank = rank
        self.never = threading.Event()

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int):
        if self.rank == 1 and index == STUCK_AT:
            self.never.wait()  # zoo: deadlock
        g = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loader = DataLoader(Samples(rank), batch_size=8, num_workers=2)
    for x, y in loader:  # zoo: next_batch
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
