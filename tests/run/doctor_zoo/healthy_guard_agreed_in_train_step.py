"""HEALTHY look-alike: a non-finite/spike guard around `optimizer.step()`, decided on every rank together.

Looks suspicious: like `local_guard_in_train_step.py`, the loop steps the optimizer only when the
loss `train_step` returned looks sane, and that loss is the rank's own.

Why it is correct: the verdict is combined across ranks before anyone acts on it: the flag is
all-reduced with MIN (every rank sane), and the running average is kept from the all-reduced mean
loss. Either every rank steps or none does; the replicas stay identical.

Public report: https://github.com/ecmwf/WeatherGenerator/pull/2718 (the same guard, made global
with an all-reduce of the flag).

Expected verdict: no finding. The guard line is marked with the doctor lookalike marker.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n=512):
    g = torch.Generator().manual_seed(31)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :2].sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    bad = torch.randperm(n, generator=g)[:4]
    y[bad] += 40.0
    return TensorDataset(x, y)


def train_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    return loss.detach()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    running, steps = None, 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = train_step(model, opt, x, y)
            mean = loss.clone()
            dist.all_reduce(mean)
            mean = mean.item() / dist.get_world_size()
            sane = torch.tensor(float(torch.isfinite(loss).item() and (running is None or loss.item() < 4.0 * running)))
            dist.all_reduce(sane, op=dist.ReduceOp.MIN)
            if sane.item():  # doctor: lookalike
                opt.step()
                steps += 1
                running = mean if running is None else 0.9 * running + 0.1 * mean
        print(f"[rank {rank}] epoch {epoch}: {steps} steps, running loss {running:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
