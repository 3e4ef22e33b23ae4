"""FSDP2: optimizer constructed before `fully_shard`.

Intent: port a single-GPU script to FSDP2. The existing
`build_model_and_optimizer()` helper returns the model and its AdamW; the
user then applies `fully_shard` to each block and to the root, as in the
FSDP2 tutorial, and trains.

What goes wrong: `fully_shard` replaces every registered parameter with a new
DTensor parameter. The optimizer still holds the *old* plain tensors, which
never receive a gradient (the gradients land on the new DTensor parameters),
so `opt.step()` skips them all. The model never changes: loss stays flat,
both ranks stay bit-identical, no error or warning is raised.

Public report: https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
(user contract: "the optimizer must be initialized with the DTensor
model.parameters()"); see also https://github.com/mosaicml/composer/pull/3822
("update optimizer params to point to dtensors instead of regular model
tensors").

Expected verdict (ideal checker): the optimizer's parameters are not the
module's parameters after wrapping (all 6 params replaced by `fully_shard`);
no parameter is updated by any optimizer step (parameters unchanged after
step 1 on both ranks). Cause: the `fully_shard(model, ...)` line marked with
the zoo cause marker (root wrap after the optimizer was built).

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 24 steps/rank, ~9-21 s. Initial and final parameter checksum
-0.86852960 on both ranks (no parameter ever changes); loss first/last rank 0
= 2.1912/3.9732, rank 1 = 2.6897/2.5833 (no learning).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


class Model(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def build_model_and_optimizer():
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    model, opt = build_model_and_optimizer()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # doctor: cause

    def checksum():
        return sum(p.full_tensor().double().sum().item() for p in model.parameters())

    print(f"[rank {rank}] initial checksum {checksum():.8f}", flush=True)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(24):
        x = torch.randn(16, 32, generator=g)
        y = x[:, :1] - x[:, 1:2]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"[rank {rank}] loss first {losses[0]:.4f} last {losses[-1]:.4f}", flush=True)
    print(f"[rank {rank}] final param checksum {checksum():.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
