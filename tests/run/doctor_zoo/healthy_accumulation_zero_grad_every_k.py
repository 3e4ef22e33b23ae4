"""Healthy: gradient accumulation over 4 micro-batches. The first 3 backwards run under
`ddp.no_sync()`, the 4th all-reduces the accumulated sum; `opt.zero_grad()` sits after `opt.step()`,
so it too runs only every 4th micro-batch, but on every rank alike, right after the synchronised step.
Gradients are accumulated on purpose and cleared at the same point everywhere."""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

ACCUM = 4


def train(rank: int) -> None:
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(1024, 20, generator=gen)
    y = torch.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 512 samples, 64 micro-batches per rank
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 1)))
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-3)
    opt.zero_grad()
    for epoch in range(1):
        sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            last_micro = (i + 1) % ACCUM == 0
            ctx = contextlib.nullcontext() if last_micro else ddp.no_sync()
            with ctx:
                loss = F.mse_loss(ddp(xb), yb) / ACCUM
                loss.backward()
            if last_micro:
                opt.step()
                opt.zero_grad()  # doctor: lookalike
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
