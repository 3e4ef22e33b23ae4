"""DistributedSampler(dataset, shuffle=True, seed=base_seed + rank): each rank shuffles with its own
seed and takes its slice of a different permutation, so the slices are no longer a partition of the
dataset. In every epoch about a quarter of the samples are drawn twice and another quarter never.
Nothing fails."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BASE_SEED = 17


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(320, 16, generator=gen), torch.randn(320, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=BASE_SEED + rank)  # doctor: sampler
    loader = DataLoader(dataset, batch_size=20, sampler=sampler)  # 160 samples, 8 batches per rank

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
