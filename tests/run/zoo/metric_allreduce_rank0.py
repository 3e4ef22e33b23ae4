"""Only rank 0 all-reduces a 1-element metric at step 4; Gloo pairs it with rank 1's next gradient
all-reduce (577 floats). Plain torchrun: Gloo "enforce fail ... op.preamble.length <= op.nbytes"
(or a hang)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

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
        if step == 4 and rank == 0:  # "log the mean loss" -- but only rank 0 joins the all-reduce
            metric = loss.detach().reshape(1)
            dist.all_reduce(metric)  # zoo: metric_all_reduce
            print(f"step {step} mean loss {metric.item() / world:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
