"""Healthy: the loss is summed over the local batch and divided by len(y) (DDP averages over the
ranks), then by accum_steps for gradient accumulation over 2 micro-batches, the first one under
ddp.no_sync(). Nothing to report."""

import contextlib

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
    accum_steps = 2
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(512, 16, generator=gen), torch.randint(0, 4, (512,), generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 256 samples, 16 micro-batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for epoch in range(2):  # 8 optimizer steps per epoch
        sampler.set_epoch(epoch)
        opt.zero_grad()
        for micro, (x, y) in enumerate(loader, 1):
            sync = micro % accum_steps == 0
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = F.cross_entropy(ddp(x), y, reduction="sum") / len(y)
                (loss / accum_steps).backward()
            if sync:
                opt.step()
                opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
