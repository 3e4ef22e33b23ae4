"""A module backward hook all-reduces a gradient on rank 1 only, inside DDP's backward pass. On
rank 1 that all_reduce reaches Gloo before DDP's gradient bucket and pairs with rank 0's bucket
(float32[16, 32] against float32[1617]); Gloo aborts rank 1 (SIGABRT). gradsync's records alone
number the hook's all_reduce after the backward pass, so only the abort's words show the pairing."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def log_gradient_noise(module, grad_input, grad_output):
    gradient = grad_output[0].detach().clone()
    dist.all_reduce(gradient)  # zoo: hook_all_reduce


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    if rank == 1:
        body[2].register_full_backward_hook(log_gradient_noise)
    model = DDP(body)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, 4):  # steps counted from 1
        loss = model(torch.randn(16, 8, generator=gen)).square().mean()
        loss.backward()  # zoo: backward
        print(f"rank {rank} step {step}", flush=True)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
