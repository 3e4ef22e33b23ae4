"""No DistributedSampler: every rank builds the same seeded DataLoader over the same dataset, so every
rank trains on the same batches and 2 processes do the work of one. Nothing fails."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(128, 16, generator=gen), torch.randn(128, 1, generator=gen))
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))  # doctor: loader

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(3):
        for x, y in loader:  # doctor: loop
            loss = F.mse_loss(ddp(x), y)  # doctor: forward
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
