"""HEALTHY look-alike: DDP backward under `no_sync()`, gradients averaged by hand.

Looks suspicious: a manual `dist.all_reduce(p.grad)` over every parameter
after `backward()` of a DDP model, like the double reduction in
`double_grad_allreduce.py`.

Why it is correct: every backward runs inside `with ddp.no_sync():`, so DDP's
own gradient all-reduce never happens; the loop is the only reduction, and it
divides the sum by the world size. Each step applies the cross-rank mean of
the local gradients, exactly what DDP would have done, and the replicas stay
identical.

Expected verdict (ideal checker): no finding; gradients reduced once, equal to
the cross-rank mean on both ranks; parameters identical across ranks. The
`dist.all_reduce` line is marked with the doctor lookalike marker.

Plain torchrun (measured, CPU, gloo, torch 2.13): exit 0, 32 steps/rank, ~24 s.
Local gradients differ across ranks before the manual all-reduce (DDP did not
reduce); final checksum -1.45308204 on both ranks.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def average_gradients(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)  # doctor: lookalike
        p.grad /= world_size


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = int(os.environ["RANK"]), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(512, 10, generator=g)
    ds = TensorDataset(x, (x[:, 0] * x[:, 1] + x[:, 2] > 0).long())
    sampler = DistributedSampler(ds, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            with ddp.no_sync():
                loss = F.cross_entropy(ddp(xb), yb)
                loss.backward()
            average_gradients(ddp, world_size)
            opt.step()
            step += 1
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in ddp.parameters())
    print(f"[rank {rank}] {step} steps, final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
