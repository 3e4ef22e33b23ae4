"""HEALTHY on torch >= 1.10: a running-statistics buffer updated by reassignment inside `forward`.

Written for the red team of issue 42 as a mistake; measured healthy. DDP collects the module's
buffers anew before every sync (`_assign_modules_buffers` in `_sync_buffers`, the fix of the
report below), so the reassigned buffers are broadcast from rank 0 at each forward like any
other. The final checksums below differ only by the last step's own update, made after the last
sync on each rank's own batch, as with BatchNorm. Kept as a look-alike: a checker must not
report a buffer assigned anew. The text below is the red team's original premise.

Intent: an input normaliser (like an RL observation normaliser) keeps running
mean/variance as registered buffers and normalises every input with them.
The user relies on DDP's default `broadcast_buffers=True` to keep the
statistics identical on all ranks ("rank 0's buffers are broadcast before
each forward").

What goes wrong: the buffers are updated with `self.running_mean = ...`
(out-of-place) instead of `.mul_().add_()`. DDP collected references to the
buffer tensors when it was constructed; after the first reassignment it
broadcasts into the stale tensors that the module no longer uses, and each
rank's live statistics follow its own data. From step 1 on, rank 0 and rank 1
normalise inputs differently (the per-rank losses are different functions);
parameters stay identical because gradients are averaged, but the
checkpointed statistics (rank 0's) do not match what rank 1 trained with.

Public report: https://github.com/pytorch/pytorch/issues/63916 ("Issues when
using buffers with DDP": with `self.buffer = ...` reassignment "module buffers
across the 2 ranks are not actually synchronized").

Expected verdict (ideal checker): buffers `norm.running_mean` and
`norm.running_var` differ across ranks after step 1 (despite
broadcast_buffers=True); parameters identical. Cause: the reassignment line
marked with the zoo cause marker (a buffer written outside DDP's view).

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~9-19 s. Parameter checksum -3.74779911 on both
ranks; buffer checksum rank 0 = 59.70541872, rank 1 = 59.91801140 (differ).
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
            self.running_mean = (1 - m) * self.running_mean + m * x.mean(0).detach()  # doctor: lookalike
            self.running_var = (1 - m) * self.running_var + m * x.var(0).detach()
        return (x - self.running_mean) / torch.sqrt(self.running_var + self.eps)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RunningNorm(12)
        self.mlp = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.mlp(self.norm(x))


def make_data(n=512):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 12, generator=g) * torch.linspace(0.5, 4, 12) + torch.linspace(-3, 3, 12)
    y = (x[:, :3].sum(1, keepdim=True) > 0).float()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(Net())  # broadcast_buffers=True (default)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    net = model.module
    cp = sum(p.detach().double().sum().item() for p in net.parameters())
    cb = sum(b.double().sum().item() for b in net.buffers())
    print(f"[rank {rank}] final param checksum {cp:.8f} buffer checksum {cb:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
