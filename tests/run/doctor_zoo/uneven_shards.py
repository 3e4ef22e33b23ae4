"""A hand-made shard per rank: rank 0 gets 80 samples (5 batches), rank 1 gets 64 (4 batches). The
first epoch's end pairs rank 1's next epoch with rank 0's last batch; the end of training hangs."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(144, 16, generator=gen), torch.randn(144, 1, generator=gen))
    shard = Subset(dataset, range(80) if rank == 0 else range(80, 144))  # doctor: shard
    loader = DataLoader(shard, batch_size=16, shuffle=False)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(4):
        for x, y in loader:  # doctor: loop
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
