"""Per-parameter `dist.reduce(p.grad, dst=0)` after backward, on top of DDP.

Intent: a helper meant to "collect the gradients on rank 0 for logging"
(gradient norms for a dashboard) runs between `loss.backward()` and
`opt.step()`. Its author forgot that `dist.reduce` works in place: it
overwrites the destination rank's tensor with the sum.

What goes wrong: DDP has already averaged the gradients during backward. The
reduce then makes rank 0's gradients the SUM of the two (identical) averages,
2x the true average. Rank 1's tensors are not the result (gloo even leaves a
partial sum there: about half of each gradient's elements doubled, NCCL would
leave them unchanged), so the ranks step differently from step 1 on and the
replicas part; nothing fails.

Expected verdict (ideal checker): parameters differ across ranks after step 1;
gradients identical after DDP's backward, then changed by the helper: rank 0's
= 2x the cross-rank mean, rank 1's different from rank 0's. Cause: the
`dist.reduce(...)` line marked with the doctor cause marker.

Plain torchrun (measured, CPU, gloo, torch 2.13): exit 0, 32 steps/rank, ~21 s.
Final checksum rank 0 = 8.17261501, rank 1 = 7.18591635.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def log_grad_norms(model, rank, step):
    for p in model.parameters():
        dist.reduce(p.grad, dst=0)  # doctor: cause
    if rank == 0 and step % 8 == 0:
        norm = sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5
        print(f"[rank 0] step {step} summed grad norm {norm.item():.4f}", flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 12, generator=g)
    ds = TensorDataset(x, x[:, :4].sum(1, keepdim=True) - x[:, 4:6].prod(1, keepdim=True))
    sampler = DistributedSampler(ds, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            log_grad_norms(model, rank, step)
            opt.step()
            step += 1
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] {step} steps, final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
