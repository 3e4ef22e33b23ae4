"""ReduceLROnPlateau stepped with each rank's own validation loss.

Intent: validate every few steps on a validation set sharded with
DistributedSampler (to save time), and lower the learning rate when the
validation loss stops improving.

What goes wrong: the validation loss fed to `scheduler.step()` is the
rank-local mean over that rank's half of the validation set; it is never
all-reduced. The two schedulers see different numbers, so they decide to
reduce the learning rate at different evaluations. From the first such
evaluation the ranks run with different learning rates: DDP still averages
gradients, but the updates differ and the replicas drift apart.

Public report: https://github.com/rmchurch/disruptcnn/issues/3 ("the global
total_loss is only created in the logging, and the local total_loss does not
meet the criteria for ReduceLROnPlateau"); also horovod/horovod#42 ("make
sure that your validation loss will be the same for all the workers").

Expected verdict (ideal checker): LR scheduler state / optimizer lr differs
by rank after the first evaluation where the rank-local plateau decisions
disagree (measured: after step 12 rank 0's lr drops to 0.05 while rank
1 stays at 0.1, so lr differs from step 13), then parameters
differ across ranks. Cause: the `scheduler.step(val_loss)` line marked with
the zoo cause marker (metric not reduced across ranks).

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~25-30 s. lr history: rank 0 drops to 0.05 at
the evaluation after step 12, rank 1 stays 0.1 until after step 14 (lr differs
from step 13 on; final lr 9.8e-05 vs 0.000781). Final checksum rank 0 =
-1.33106293, rank 1 = -0.68477721; probe: parameters first differ after step
13.
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
    tot, n = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            tot += F.mse_loss(model(x), y, reduction="sum").item()
            n += len(x)
    model.train()
    return tot / n


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
                scheduler.step(val_loss)  # doctor: cause
                lrs.append((step, opt.param_groups[0]["lr"]))
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    print(f"[rank {rank}] lr history {[(s, round(lr, 6)) for s, lr in lrs]}", flush=True)
    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
