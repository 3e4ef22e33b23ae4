"""HEALTHY look-alike: running-statistics buffers updated IN PLACE in `forward`.

Looks suspicious: an input normaliser writes its registered buffers
`running_mean`/`running_var` inside `forward` from each rank's own batch, as
in `buffer_reassigned_in_forward.py`.

Why it is correct: the update is in place (`mul_().add_()` under no_grad),
so the module keeps using the tensors DDP broadcasts into. DDP's default
buffer sync (`broadcast_buffers=True`) copies rank 0's buffers in at the start
of every forward, so each forward starts from identical statistics; between
forwards the ranks differ only by their last local update (as with
BatchNorm), and the final eval forward re-syncs them.

Expected verdict (ideal checker): no finding; buffers identical across ranks
at every forward entry; parameters identical. The in-place update line is
marked with the doctor lookalike marker.

Plain torchrun (measured, CPU, gloo, torch 2.13): exit 0, 32 steps/rank, ~22 s.
Buffers equal to rank 0's at all 33 forward entries on both ranks; param
checksum -3.74779911, buffer checksum 59.70542321 on both ranks.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class RunningNorm(nn.Module):
    def __init__(self, dim, momentum=0.05, eps=1e-5):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x):
        if self.training:
            m = self.momentum
            with torch.no_grad():
                self.running_mean.mul_(1 - m).add_(x.mean(0), alpha=m)  # doctor: lookalike
                self.running_var.mul_(1 - m).add_(x.var(0), alpha=m)
        return (x - self.running_mean) / torch.sqrt(self.running_var + self.eps)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 12, generator=g) * torch.linspace(0.5, 4, 12) + torch.linspace(-3, 3, 12)
    ds = TensorDataset(x, (x[:, :3].sum(1, keepdim=True) > 0).float())
    sampler = DistributedSampler(ds, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    net = nn.Sequential(RunningNorm(12), nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(net)  # broadcast_buffers=True (default)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.binary_cross_entropy_with_logits(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        val = F.binary_cross_entropy_with_logits(model.eval()(ds.tensors[0]), ds.tensors[1]).item()
    cp = sum(p.detach().double().sum().item() for p in net.parameters())
    cb = sum(b.double().sum().item() for b in net.buffers())
    print(f"[rank {rank}] val loss {val:.4f} param checksum {cp:.8f} buffer checksum {cb:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
