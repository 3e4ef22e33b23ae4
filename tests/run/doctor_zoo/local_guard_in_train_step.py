"""A non-finite/spike guard around `optimizer.step()`, decided on the loss a helper returns.

Intent: the training step lives in a helper (`train_step` runs the forward and the backward and
returns the loss, as in many trainers); the loop steps the optimizer only when that loss looks
sane: finite and not far above its running average, so one bad batch cannot wreck the weights.

What goes wrong: the loss the helper returns is the rank's own. A bad batch on one rank makes
that rank leave out `optimizer.step()` while the others apply the gradient DDP averaged for all
of them (the bad batch included). From then on the replicas differ, and each rank's running
average, and so its later decisions, differ too. No error, no hang (`backward()` still runs on
every rank).

Public reports: https://github.com/ecmwf/WeatherGenerator/issues/2724 (guards on rank-local
losses), https://github.com/Lightning-AI/pytorch-lightning/issues/4956 ("skip the step on a nan
loss" diverging under DDP), https://discuss.pytorch.org/t/skipping-optimizer-step-on-some-ranks.

Expected verdict: one rank skips a step after a backward DDP averaged while the other steps;
named at the `if` around the step (the line marked with the doctor cause marker).
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
    y[bad] += 40.0  # a few corrupted labels
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
            sane = torch.isfinite(loss).item() and (running is None or loss.item() < 4.0 * running)
            if sane:  # doctor: cause
                opt.step()
                steps += 1
                running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        print(f"[rank {rank}] epoch {epoch}: {steps} steps, running loss {running:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
