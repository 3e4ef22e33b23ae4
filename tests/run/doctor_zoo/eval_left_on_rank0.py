"""Every 4 steps rank 0 alone validates with model.eval() on the inner module and never calls
model.train() again: from the first validation on, rank 0 trains without dropout and with BatchNorm
in inference mode, rank 1 in training mode. The ranks compute different functions and DDP averages
their gradients anyway. Nothing fails."""

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
    val_x, val_y = torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(1000 + rank)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 4 == 0:
                model.eval()  # doctor: eval
                with torch.no_grad():
                    val_loss = F.mse_loss(model(val_x), val_y).item()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
