"""Optimizer state restored on rank 0 only (model restored correctly).

Intent: resume training. The user knows that DDP broadcasts rank 0's weights
at construction, so they read the checkpoint on rank 0 only, load the model
weights *before* wrapping (this part is fine), and in the same `if rank == 0`
block also restore the AdamW state and schedule position.

What goes wrong: nothing broadcasts optimizer state. Rank 0 resumes with the
checkpoint's param_groups (lr=2e-4, weight_decay=0.0) and its Adam moments /
step counters, rank 1 starts a fresh AdamW (lr=1e-3, weight_decay=0.01, empty
moments). Gradients are averaged by DDP, but each rank turns the same
averaged gradient into a different update, so the replicas drift apart from
the first optimizer step on.

Public report: https://github.com/horovod/horovod/pull/371 (restoring optimizer
state on one worker must be followed by a broadcast of the optimizer state);
see also https://github.com/pytorch/pytorch/issues/125177 .

Expected verdict (ideal checker): optimizer hyperparameters differ by rank
(rank 1's param_group lr=1e-3 / weight_decay=0.01 vs rank 0's lr=2e-4 /
weight_decay=0.0) and optimizer state (exp_avg, exp_avg_sq, step) differs
from before step 1; as a consequence parameters differ across ranks after
step 1. Cause: the `opt.load_state_dict(...)` line marked with the zoo cause marker
(rank 0 only).

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~30 s. Printed lr/wd: rank 0 lr 0.0002 wd 0,
rank 1 lr 0.001 wd 0.01 (every epoch). Final checksum rank 0 = -16.69906810,
rank 1 = -13.06006867; probe: parameters and lr differ from step 1.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build_model():
    return nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def make_data(n=512):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def write_previous_run_checkpoint(path):
    # stands in for the checkpoint of an earlier job
    torch.manual_seed(5)
    m = build_model()
    o = torch.optim.AdamW(m.parameters(), lr=2e-4, weight_decay=0.0)
    ds = make_data()
    for i in range(5):
        x, y = ds[i * 16:(i + 1) * 16]
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    torch.save({"model": m.state_dict(), "optim": o.state_dict(), "step": 5}, path)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    ckpt = os.path.join(tempfile.gettempdir(), f"redteam42_optim_{os.environ.get('MASTER_PORT', '0')}.pt")
    if rank == 0:
        write_previous_run_checkpoint(ckpt)
    dist.barrier()

    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    start_step = 0
    if rank == 0:
        state = torch.load(ckpt, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])  # doctor: cause
        start_step = state["step"]
    ddp = DDP(model)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    step = start_step
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:g} "
              f"wd {opt.param_groups[0]['weight_decay']:g}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.barrier()
    if rank == 0:
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
