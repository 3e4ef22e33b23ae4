"""StepLR(step_size=2, gamma=0.5) stepped only inside rank 0's logging block: from step 3 on rank 0
updates with half, then a quarter, ... of rank 1's learning rate, and the replicas drift apart.
Nothing fails."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
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
    scheduler = StepLR(opt, step_size=2, gamma=0.5)
    history = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0:
                history.append((loss.item(), scheduler.get_last_lr()[0]))
                scheduler.step()  # doctor: scheduler
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
