"""GradScaler state restored on rank 0 only.

Intent: mixed-precision training resumed from a checkpoint. Model and
optimizer are restored on every rank from the same file, but the AMP block
(`scaler.load_state_dict`) sits inside the `if is_main_process():` branch that
also prints the resume banner.

What goes wrong: the loss scale is rank-local state. Rank 0 resumes with the
checkpoint's scale (256), rank 1 starts from the constructor's 65536. DDP
averages the *scaled* gradients, then each rank unscales with its own factor:
rank 0 effectively applies (g0 + 256*g1)/2 and rank 1 (g0/256 + g1)/2. The
optimizer updates differ from the first step and the replicas drift apart;
no inf/NaN ever appears, so nothing is reported. (CPU stand-in: bf16 autocast
+ `torch.amp.GradScaler("cpu")`.)

Public report: https://github.com/pytorch/pytorch/issues/136009 ("when the
GradScaler has different scaling factors across processes, the unscaled
gradients become inconsistent after synchronization, leading to diverging
model parameters"); also https://github.com/pytorch/pytorch/issues/90057 .

Expected verdict (ideal checker): GradScaler state differs by rank (scale 256
on rank 0 vs 65536 on rank 1) before step 1; unscaled gradients and then
parameters differ across ranks from step 1. Cause: the
`scaler.load_state_dict(...)` line marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~18-29 s. Scale rank 0 = 256, rank 1 = 65536
throughout; last-epoch loss rank 0 = 942.25 (blows up), rank 1 = 0.6427; final
checksum rank 0 = -108.86998551, rank 1 = 0.39051144; probe: gradients and
parameters differ from step 1.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))


def make_data(n=512):
    g = torch.Generator().manual_seed(44)
    x = torch.randn(n, 16, generator=g)
    y = torch.bucketize(x[:, 0] + 0.5 * x[:, 1], torch.tensor([-0.5, 0.5]))
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    is_main_process = lambda: rank == 0
    ckpt = os.path.join(tempfile.gettempdir(), f"redteam42_amp_{os.environ.get('MASTER_PORT', '0')}.pt")
    if rank == 0:  # checkpoint of an earlier run
        torch.manual_seed(1)
        m = build()
        o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        s = torch.amp.GradScaler("cpu", init_scale=256.0)
        torch.save({"model": m.state_dict(), "optim": o.state_dict(), "scaler": s.state_dict(), "epoch": 4}, ckpt)
    dist.barrier()

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    state = torch.load(ckpt, map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    if is_main_process():
        print(f"resuming from epoch {state['epoch']}", flush=True)
        scaler.load_state_dict(state["scaler"])  # doctor: cause
    model = DDP(model)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f} scale {scaler.get_scale():g}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.barrier()
    if rank == 0:
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
