"""A shuffling DistributedSampler iterated for 3 epochs without sampler.set_epoch(epoch): every epoch
repeats the first epoch's order. Nothing fails."""

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
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 32 samples, 2 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(3):  # doctor: epochs
        for x, y in loader:  # doctor: loop
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
