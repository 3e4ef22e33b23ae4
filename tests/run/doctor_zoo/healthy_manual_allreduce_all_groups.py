"""HEALTHY look-alike: hand-written gradient averaging without DDP, done right.

Looks suspicious: no DDP at all; parameters are broadcast by hand from rank 0;
gradients are all-reduced in a manual loop over optimizer param groups (two
groups with different weight decay, like `manual_sync_first_group.py`).

Why it is correct: the initial weights are broadcast from rank 0 before the
optimizer is built, and the loop visits *every* parameter of *every* param
group, SUMs over ranks and divides by the world size, before `opt.step()`.
All ranks therefore apply the same averaged gradient with the same optimizer
state; replicas stay bit-identical.

Public report (pattern): https://github.com/pytorch/examples/issues/483 and
https://github.com/pytorch/pytorch/issues/4406 (the `average_gradients`
recipe).

Expected verdict (ideal checker): no finding. The suspicious line (manual
all_reduce loop) is marked with the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~10-23 s. Final checksum 64.40719421 on both
ranks; probe: parameters identical after every step.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n=512):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :8].sum(1) > 0).long()
    return TensorDataset(x, y)


def average_gradients(optimizer, world):
    for group in optimizer.param_groups:
        for p in group["params"]:  # doctor: lookalike
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world = dist.get_world_size()

    torch.manual_seed(rank)  # init differs per rank; broadcast below
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 2))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([
        {"params": decay, "weight_decay": 0.05},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=2e-3)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            average_gradients(opt, world)
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
