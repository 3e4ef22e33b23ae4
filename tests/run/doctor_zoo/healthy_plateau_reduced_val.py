"""HEALTHY look-alike: ReduceLROnPlateau on a sharded validation set, reduced.

Looks suspicious: validation runs on a DistributedSampler shard (each rank
sees a different half of the validation set) and every rank steps its own
ReduceLROnPlateau with the value it computed, exactly like
`plateau_local_val.py`.

Why it is correct: `evaluate()` all-reduces the (sum of losses, count) pair
before dividing, so every rank passes the same global validation loss to its
scheduler. The schedulers make identical decisions; learning rates and
parameters stay identical on all ranks.

Public report: https://github.com/rmchurch/disruptcnn/issues/3 (the fix the
issue asks for: feed the globally averaged loss to ReduceLROnPlateau).

Expected verdict (ideal checker): no finding. The `scheduler.step(val_loss)`
line is marked with the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~10-35 s. Identical lr histories on both ranks
(0.1 -> 0.05 after step 12 -> ... 9.8e-05); final checksum -1.21779488 on both
ranks.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 2.0 - x[:, 1:2] + 0.8 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def evaluate(model, loader):
    model.eval()
    stats = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            stats[0] += F.mse_loss(model(x), y, reduction="sum").item()
            stats[1] += len(x)
    model.train()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)

    train, val = make_split(512, 1), make_split(64, 2)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=16, sampler=sampler)
    val_loader = DataLoader(val, batch_size=32, sampler=DistributedSampler(val, shuffle=False))

    step, lrs = 0, []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 2 == 0:
                val_loss = evaluate(model, val_loader)
                scheduler.step(val_loss)  # doctor: lookalike
                lrs.append((step, opt.param_groups[0]["lr"]))
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    print(f"[rank {rank}] lr history {[(s, round(lr, 6)) for s, lr in lrs]}", flush=True)
    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
