"""Training step calls a custom method on `ddp.module`, bypassing DDP.

Intent: the model owns its loss (`compute_loss(batch)`, a common pattern in
research code). Because `DistributedDataParallel` does not expose custom
methods, the user calls `model.module.compute_loss(batch)` in the training
loop; the DDP wrapper is still passed to the optimizer and used for eval, so
the script "uses DDP".

What goes wrong: gradient all-reduce is armed by DDP's `forward()`. A forward
through `ddp.module.compute_loss` never calls it, so the reducer's autograd
hooks are inert and backward produces purely local gradients. Each rank trains
its own model on its own shard; replicas diverge from the first optimizer
step. No error, no warning.

Public report: https://github.com/intel/e2eAIOK/pull/198 ("the forward pass and
backward pass function is not wrapped by DDP, so end up with n node training
their own model without communication"); also
https://github.com/rosinality/swapping-autoencoder-pytorch/issues/22 .

Expected verdict (ideal checker): gradients are never averaged across ranks
(no gradient all-reduce at all during backward); parameters differ across
ranks after step 1, for every parameter. Cause: the
`ddp.module.compute_loss(...)` line marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~19-25 s. Final checksum rank 0 = -1.99053594,
rank 1 = -2.34827822; probe: gradients and parameters differ from step 1.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def compute_loss(self, batch):
        x, y = batch
        return F.smooth_l1_loss(self(x), y)


def make_data(n=512):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 12, generator=g)
    y = torch.sin(x[:, :3].sum(1, keepdim=True)) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(Regressor())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            loss = model.module.compute_loss(batch)  # doctor: cause
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            x, y = ds[:64]
            val = F.smooth_l1_loss(model(x), y).item()
        print(f"[rank {rank}] epoch {epoch} train {loss.item():.4f} val {val:.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
