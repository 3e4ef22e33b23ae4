"""Tensor parallelism: the two ranks of a tensor-parallel pair must run every forward together
(each row-wise layer all-reduces its output), but rank 1 skips one step. Its next forward's
all-reduces pair with rank 0's current ones; at the end rank 1 waits in the final barrier while
rank 0 waits in a DTensor all-reduce that never passes through `torch.distributed`'s functions.
Plain torchrun hangs until Gloo's timeout."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = parallelize_module(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))  # the pair's shared batch
        if rank == 1 and step == 3:
            continue  # zoo: skip
        loss = F.mse_loss(model(x), x)  # zoo: forward
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
