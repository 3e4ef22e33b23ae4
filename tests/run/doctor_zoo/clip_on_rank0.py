"""Gradient clipping (max_norm=0.1) inside `if rank == 0:`, between backward and opt.step(): the
gradients are already all-reduced, rank 0 alone scales them down and takes a smaller step than rank
1, and the replicas drift apart from the first step on. Nothing fails."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(256, 16, generator=gen), torch.randn(256, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            if rank == 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.1)  # doctor: clip
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
