"""DDP + a module full_backward_hook that all_reduces, registered on rank 1 only.

Mechanism (d), BROKEN. A "gradient-noise probe" is attached to the middle layer
of a DDP model on the last rank only (to keep the other ranks fast). During
rank 1's backward the hook fires before the first layer's gradients are ready,
i.e. before DDP launches its single gradient bucket, and calls all_reduce on
grad_output (16 x 128 floats). That all_reduce pairs with rank 0's DDP bucket
all-reduce (22026 floats) issued from loss.backward(): different collectives
paired at the same sequence number, different sizes. Gloo aborts on the rank
that receives more than it posted.

Drawn from: https://github.com/NVIDIA/TransformerEngine/pull/781 (a reduction
issued from a backward hook "is the suspected reason for hangs") and
https://github.com/pytorch/pytorch/pull/100773 (other collectives between DDP's
backward reduction and the next step get ranks stuck).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

noise_log = []


def grad_noise_probe(module, grad_input, grad_output):
    g = grad_output[0].detach().clone()
    dist.all_reduce(g)  # zoo: hook-allreduce
    noise_log.append((grad_output[0] - g / dist.get_world_size()).norm().item())


def build(rank, world):
    torch.manual_seed(1234)
    body = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(),
        nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )
    if rank == world - 1:
        body[2].register_full_backward_hook(grad_noise_probe)
    return DDP(body)


def train(rank, world):
    model = build(rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(rank)
    for it in range(4):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        print(f"rank {rank} it {it} loss {loss.item():.3f} noise {noise_log[-1:]}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.destroy_process_group()
