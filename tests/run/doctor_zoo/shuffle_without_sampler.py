"""No DistributedSampler, but `shuffle=True` and a seed per rank: the batches differ across ranks, so
nothing looks duplicated, yet every rank walks the whole dataset each epoch. The ranks train on
overlapping samples, and one "epoch" of the job is world-size epochs of data. Nothing fails."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(320, 16, generator=gen), torch.randn(320, 1, generator=gen))
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(100 + rank)  # "a different shuffle on each rank"
    loader = DataLoader(dataset, batch_size=20, shuffle=True)
    for epoch in range(2):
        for x, y in loader:  # doctor: loop
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
