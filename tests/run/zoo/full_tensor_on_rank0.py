"""FSDP2 training, then rank 0 alone gathers the full parameters to save them (`full_tensor()`
inside `if rank == 0:`), a DTensor all-gather that never passes through `torch.distributed`'s
functions; rank 1 goes on to the final barrier. Plain torchrun hangs or aborts."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x = torch.randn(8, 16, generator=gen)
        loss = F.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    if rank == 0:
        state = {name: p.full_tensor() for name, p in model.named_parameters()}  # zoo: full_tensor
        print(f"saving {len(state)} tensors", flush=True)
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
