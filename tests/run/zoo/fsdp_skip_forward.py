"""FSDP2: rank 1 skips one batch it finds bad (`continue` before the forward), so it runs one
forward fewer: its last forward's all-gathers pair with rank 0's previous ones, and at the end
rank 1 waits in the final barrier while rank 0 waits in its last forward's all-gather. Plain
torchrun hangs until Gloo's timeout."""

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
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x = torch.randn(8, 16, generator=gen)
        if rank == 1 and step == 2:
            continue  # zoo: skip
        loss = F.mse_loss(model(x), x)  # zoo: forward
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
