"""HEALTHY look-alike: loss-spike guard that skips the step, decided globally.

Looks suspicious: `continue` before `optimizer.step()` depending on the loss
value, with a rank-local running average (like `local_spike_skip.py`).

Why it is correct: each rank evaluates the spike test on its local loss, but
the flag is combined with `all_reduce(MAX)` (logical OR) before anyone acts
on it, so either every rank skips the step or none does. The running average
is updated from the all-reduced mean loss, so it is identical on all ranks.
Replicas stay identical; optimizer step counts stay equal.

Public report: https://github.com/ecmwf/WeatherGenerator/pull/2718 ("the
flags are combined with an all-reduce MAX (logical OR), so an anomaly on any
rank skips the batch on all ranks").

Expected verdict (ideal checker): no finding. The skip line is marked with
the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, ~10-29 s. Skipped steps [2, 6, 13, 16, 17, 25, 28] on both
ranks (25 optimizer steps each); final checksum -4.68298163 on both ranks.
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


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    running, step, skipped = None, 0, []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            step += 1
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            local = loss.item()
            flag = torch.tensor([0.0 if running is None else float(not torch.isfinite(loss) or local > 4.0 * running)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
            mean_loss = mean_loss.item() / world
            if flag.item() > 0:
                skipped.append(step)
                continue  # doctor: lookalike
            opt.step()
            running = mean_loss if running is None else 0.9 * running + 0.1 * mean_loss
        print(f"[rank {rank}] epoch {epoch} running loss {running:.4f}", flush=True)

    print(f"[rank {rank}] skipped steps {skipped}", flush=True)
    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
