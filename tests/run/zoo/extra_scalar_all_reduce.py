"""During evaluation rank 0 alone all-reduces a 0-d logging value (after eval batch 3). Every
rank all-reduces a 0-d loss per eval batch, so the extra one pairs silently with rank 1's next
eval all-reduce and each later one meets the other rank's previous; only the final 2-element
all-reduce of the totals no longer matches rank 0's last 0-d one, three collectives further on.
Plain torchrun: rank 0 aborts in Gloo (size mismatch) or the job hangs."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    with torch.no_grad():
        total = 0.0
        for batch in range(6):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            batch_loss = F.mse_loss(ddp.module(x), y)
            dist.all_reduce(batch_loss)  # zoo: eval_all_reduce
            total += batch_loss.item()
            if rank == 0 and batch == 2:
                halfway = torch.tensor(total)
                dist.all_reduce(halfway)  # zoo: log_all_reduce
        totals = torch.tensor([total, 6.0])
        dist.all_reduce(totals)  # zoo: totals
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
