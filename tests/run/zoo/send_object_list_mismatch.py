"""Rank 0 plans the curriculum and each step sends rank 1 the names of the shards to read with
`dist.send_object_list`; after the loop it sends `[None]` to say "done". Rank 1 receives each
step's plan with `dist.recv_object_list` but ends its loop by counting steps, so it never
receives the "done" message and goes on to the final barrier, while rank 0 waits in its send.
Plain torchrun hangs."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        plan = [{"step": step, "shards": [f"shard-{step:03d}-{r}" for r in range(2)]}]
        if rank == 0:
            dist.send_object_list(plan, dst=1)  # zoo: send_plan
        else:
            dist.recv_object_list(plan, src=0)  # zoo: recv_plan
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    if rank == 0:
        dist.send_object_list([None], dst=1)  # zoo: send_done
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
