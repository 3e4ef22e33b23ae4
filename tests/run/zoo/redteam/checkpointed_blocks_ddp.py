"""Activation checkpointing (torch.utils.checkpoint) inside a DDP model. HEALTHY.

Mechanism (h): the backward pass re-runs each block's forward (recomputation)
while DDP's gradient hooks fire; every block is checkpointed exactly once with
use_reentrant=False, the supported combination. A stack sampler sees forward
code executing inside loss.backward(), which may look odd, but nothing is
wrong. Exit code 0 on both ranks.

Drawn from: https://github.com/pytorch/pytorch/issues/24005 (checkpoint +
DDP breaks with reentrant backward) and https://github.com/pytorch/pytorch/pull/106985
(DDP docs: with use_reentrant=False, checkpointing works with DDP).
"""
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init_process_group)
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Tower(nn.Module):
    def __init__(self, d=32, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)  # zoo: checkpoint
        return self.head(x).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(Tower())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(30):
        x = torch.randn(16, 32, generator=g)
        target = x.mean(-1)
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # zoo: backward
        opt.step()
    print(f"rank {rank}: final loss {loss.item():.4f}", flush=True)
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
