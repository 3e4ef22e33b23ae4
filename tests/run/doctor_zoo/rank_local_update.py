"""After each optimizer step, rank 1 alone adds noise to the first layer's weight: the replicas drift
apart while DDP keeps averaging gradients as if nothing happened. Nothing fails."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)  # doctor: ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, 21):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # doctor: step
        if rank == 1:
            with torch.no_grad():
                model[0].weight.add_(1e-3 * torch.randn_like(model[0].weight))  # doctor: noise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
