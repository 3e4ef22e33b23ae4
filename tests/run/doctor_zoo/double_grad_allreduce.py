"""Leftover manual gradient all-reduce on top of DDP (sum, not average).

Intent: the script started life without DDP and had its own
`all_reduce_gradients()` helper after `backward()`. When it was moved to
`DistributedDataParallel`, the helper call stayed "to be safe".

What goes wrong: DDP has already averaged the gradients during backward. The
helper then SUMs those (identical) averages over the 2 ranks, so every
gradient the optimizer sees is world_size x the true average (2x here). The
replicas stay bit-identical, so nothing looks wrong; the job silently trains
with an effective learning rate doubled (and the factor changes with the
number of GPUs). It is the gradient scaling that is wrong, not the sync.

Public report: https://github.com/kubeflow/pytorch-operator/issues/122 ("Double
gradient reduction in examples?": a DIY gradient all-reduce used in addition
to DistributedDataParallel).

Expected verdict (ideal checker): gradients are reduced twice; after the
manual `dist.all_reduce` the gradient of every parameter equals 2x the
cross-rank mean of local gradients (summed, not averaged); identical on both
ranks, parameters remain identical across ranks. Cause: the
`dist.all_reduce(p.grad)` line marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~26-28 s. Final checksum -1.68136547 on both
ranks (identical). A probe that wraps dist.all_reduce measured |grad after
helper| / |DDP grad| = 2.0 for every parameter on both ranks.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def all_reduce_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # doctor: cause


def make_data(n=512):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(n, 10, generator=g)
    y = (x.pow(2).sum(1) > 10).long()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            all_reduce_gradients(model)
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
