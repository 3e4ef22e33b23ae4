"""Classifier head replaced after the model was wrapped in DDP.

Intent: fine-tune a (pretend) pretrained backbone on a new 3-class task. The
user wraps the model in DDP first (the wrapper is built by a shared
`setup_model()` helper), then swaps in a fresh head for the new label set via
`ddp.module.head = nn.Linear(...)`. The first attempt crashed with "Expected
to have finished reduction in the prior iteration" (the old head never gets a
gradient), so `find_unused_parameters=True` was added and the job now runs.

What goes wrong: DDP registered its gradient hooks on the parameters that
existed at construction. The new head's weight and bias are not known to the
reducer: their gradients are never all-reduced, and they were also initialised
differently on each rank (per-rank seed, taken after DDP's one-time
broadcast). Backbone gradients are averaged, the head is trained purely on
local data, so `head.weight`/`head.bias` differ across ranks from the start
and keep drifting. The old head is silently reported as "unused" every step.

Public report: https://github.com/pytorch/pytorch/issues/12603 (assigning a new
parameter after the DDP constructor: "the gradient reduction function is not
triggered" for it).

Expected verdict (ideal checker): module/parameters replaced after wrapping;
gradients of `head.weight` and `head.bias` are never averaged across ranks,
and these two parameters differ between rank 0 and rank 1 from step 0 (before
the first step) onwards; backbone parameters stay identical. Cause: the
`ddp.module.head = ...` line marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 30 steps/rank, ~30 s. Backbone checksum -3.96388745 on both
ranks; head checksum rank 0 = 0.55846118, rank 1 = -1.27775347; probe: the
gradient sum over all params differs from step 1 (head grads are local).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Classifier(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU())
        self.head = nn.Linear(48, num_classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def setup_model(rank):
    torch.manual_seed(100 + rank)  # per-rank seed; DDP syncs the initial weights anyway
    model = Classifier(num_classes=10)
    return DDP(model, find_unused_parameters=True)


def make_data(n=480):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 24, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])

    ddp = setup_model(rank)
    ddp.module.head = nn.Linear(48, 3)  # doctor: cause
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    m = ddp.module
    bb = sum(p.detach().double().sum().item() for p in m.backbone.parameters())
    hd = sum(p.detach().double().sum().item() for p in m.head.parameters())
    print(f"[rank {rank}] backbone checksum {bb:.8f} head checksum {hd:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
