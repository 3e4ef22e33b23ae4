"""Rank 0 alone validates after step 3 by switching the DDP wrapper itself to eval (ddp.eval()) and
never back: its later forwards run with dropout off while rank 1 trains with dropout, and DDP still
averages both ranks' gradients. Unlike model.eval() on the inner module, rank 0's forwards are no
longer training forwards at all, so the ranks are compared at their optimizer steps. Nothing fails."""

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
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(1000 + rank)
    gen = torch.Generator().manual_seed(rank)
    val_x, val_y = torch.randn(32, 16, generator=gen), torch.randn(32, 1, generator=gen)
    for step in range(1, 17):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step == 3:
            ddp.eval()  # doctor: eval
            with torch.no_grad():
                print(f"validation loss {F.mse_loss(ddp(val_x), val_y).item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
