"""Mistake: rank 0 checkpoints `ddp.state_dict()`, whose keys carry DDP's `module.` prefix; the resume
loads that file into the bare model with `strict=False` before wrapping it again. No key matches, so
nothing is loaded (every key lands in the ignored missing/unexpected lists) and the "resumed" run
silently restarts from a fresh initialisation."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 4))


def batches(rank: int, steps: int, offset: int):
    gen = torch.Generator().manual_seed(71)
    x = torch.randn(2, 64, 16, 16, generator=gen)  # [rank, step, batch, feature]
    w = torch.randn(16, 4, generator=gen)
    for step in range(offset, offset + steps):
        xb = x[rank, step]
        yield xb, (xb @ w).argmax(dim=1)


def first_job(rank: int, ckpt: str) -> None:
    torch.manual_seed(0)
    ddp = DDP(build_model())
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    for x, y in batches(rank, 8, 0):
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save(ddp.state_dict(), ckpt)
    dist.barrier()


def resumed_job(rank: int, ckpt: str) -> None:
    torch.manual_seed(123)
    model = build_model()
    model.load_state_dict(torch.load(ckpt), strict=False)  # doctor: cause
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    for x, y in batches(rank, 16, 8):
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    shared = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    ckpt = os.path.join(shared[0], "last.pt")
    first_job(rank, ckpt)
    resumed_job(rank, ckpt)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
