"""Healthy FSDP2 and tensor parallelism on CPU Gloo: a small MLP sharded with `fully_shard` trains
a few steps and gathers its full state dict on every rank (DTensor `full_tensor()`), then a
second MLP runs column- then row-wise parallel (`parallelize_module` on a 1-D device mesh).
Collectives reach the process group through FSDP2's own calls, DTensor and functional
collectives, not only through `torch.distributed`'s functions. Exits 0."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1000 + rank)

    torch.manual_seed(0)
    sharded = mlp()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.05)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x = torch.randn(8, 16, generator=gen)
        loss = F.mse_loss(sharded(x), x)
        opt.zero_grad()
        loss.backward()  # zoo: fsdp_backward
        opt.step()
    full = {name: p.full_tensor() for name, p in sharded.named_parameters()}  # zoo: full_tensor

    torch.manual_seed(0)
    parallel = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(parallel.parameters(), lr=0.05)
    for step in range(1, args.steps + 1):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))  # the same input on every rank
        loss = F.mse_loss(parallel(x), x)
        opt.zero_grad()
        loss.backward()  # zoo: tp_backward
        opt.step()
    if rank == 0:
        print(f"gathered {len(full)} FSDP2 tensors; tensor-parallel loss {loss.item():.4f}", flush=True)
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
