"""HEALTHY look-alike: checkpoint (model + optimizer) read on rank 0 only, then broadcast.

Looks suspicious: only rank 0 opens the checkpoint file and calls
`opt.load_state_dict(...)` inside `if rank == 0:` on the first pass, like
`optim_state_rank0.py`.

Why it is correct: rank 0 reads the file and the whole checkpoint dict is
then shipped to every rank with `dist.broadcast_object_list`; all ranks load
the same model weights and the same AdamW state (lr, weight decay, moments,
step) before wrapping in DDP. Optimizer hyperparameters and state are
identical on all ranks, so the replicas stay identical.

Public report: https://github.com/horovod/horovod/pull/371 ("restoring
optimizer state on model load and broadcast": read on one worker,
broadcast the optimizer state, load on the others).

Expected verdict (ideal checker): no finding. The rank-0-only read is marked with
the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~12-27 s. lr 0.0002 / wd 0 on both ranks; final
checksum -17.26239829 on both ranks; probe: identical after every step.
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
    ckpt = os.path.join(tempfile.gettempdir(), f"redteam42_optb_{os.environ.get('MASTER_PORT', '0')}.pt")
    if rank == 0:
        write_previous_run_checkpoint(ckpt)
    dist.barrier()

    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    holder = [None]
    if rank == 0:
        holder[0] = torch.load(ckpt, map_location="cpu")  # doctor: lookalike
    dist.broadcast_object_list(holder, src=0)
    state = holder[0]
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    step = state["step"]
    ddp = DDP(model)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
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
