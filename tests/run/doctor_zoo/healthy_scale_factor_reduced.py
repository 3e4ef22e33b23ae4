"""HEALTHY look-alike: data-derived scale factor computed from a sharded batch, reduced.

Looks suspicious: the input scale factor is computed from "the first batch of
the training loader" on every rank, and each rank only sees its own shard
(the pattern of `local_scale_factor.py`).

Why it is correct: the first-batch count, sum and sum of squares are
all-reduced before the standard deviation is formed, so the factor is the
std of the union of both ranks' first batches and is bit-identical on all
ranks. Preprocessing, losses and parameters are consistent across ranks.

Public report: https://github.com/Project-MONAI/tutorials/issues/1458 (the
suggested fix: "It should be reduced across ranks to use the same scale
factor").

Expected verdict (ideal checker): no finding. The `scale_factor = ...` line
is marked with the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~9-25 s. scale_factor 0.469076 on both ranks;
final checksum -1.65386505 on both ranks.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n=512):
    g = torch.Generator().manual_seed(17)
    scale = torch.rand(n, 1, generator=g) * 3 + 0.5  # heterogeneous sample magnitudes
    x = torch.randn(n, 32, generator=g) * scale
    y = torch.tanh(x[:, :4].sum(1, keepdim=True) / 4)
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    first_x, _ = next(iter(loader))
    moments = torch.tensor([first_x.numel(), first_x.sum().item(), first_x.pow(2).sum().item()], dtype=torch.float64)
    dist.all_reduce(moments, op=dist.ReduceOp.SUM)
    n, s1, s2 = moments.tolist()
    scale_factor = 1.0 / ((s2 - s1 * s1 / n) / (n - 1)) ** 0.5  # doctor: lookalike
    print(f"[rank {rank}] scale_factor {scale_factor:.6f}", flush=True)

    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x * scale_factor), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
