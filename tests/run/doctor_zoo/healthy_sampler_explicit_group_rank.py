"""Healthy: the sampler gets `num_replicas=dist.get_world_size()` and `rank=dist.get_rank()`
explicitly, with shuffle, a fixed seed shared by every rank, and `set_epoch` each epoch. The values
come from the process group itself, so the shares are disjoint and cover the dataset. Looks like the
hand-filled sampler arguments of the mistakes, but they are the right ones."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def train() -> None:
    gen = torch.Generator().manual_seed(151)
    x = torch.randn(384, 12, generator=gen)
    y = (x[:, :6].sum(dim=1) > 0).long()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=0)  # doctor: lookalike
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)  # 192 samples, 12 batches per rank

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 2)))
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
