"""HEALTHY look-alike: classifier head replaced (with per-rank random init) before DDP.

Looks suspicious: the "pretrained" model's head is swapped for a fresh
`nn.Linear` whose initial weights come from a per-rank seed
(`100 + rank`), i.e. rank 0 and rank 1 build different heads, as in
`head_swapped_after_wrap.py`.

Why it is correct: the replacement happens on the plain module *before*
`DDP(model)` is constructed. DDP's constructor broadcasts rank 0's
parameters (including the new head) to all ranks and registers its gradient
hooks on the current parameters, so the new head is synchronised and its
gradients are averaged. No `find_unused_parameters` is needed because every
parameter is used.

Public report: https://github.com/pytorch/pytorch/issues/12603 (the
explanation in that thread: DDP registers its hooks on the parameters that
exist at construction, so modify the model before wrapping).

Expected verdict (ideal checker): no finding. The head replacement is marked with
the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 30 steps/rank, ~11-24 s. Backbone checksum -4.91359243 and head
checksum 0.55846059 on both ranks.
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


def setup_model(rank, num_classes):
    torch.manual_seed(100 + rank)  # per-rank seed; DDP syncs the initial weights anyway
    model = Classifier(num_classes=10)
    model.head = nn.Linear(48, num_classes)  # doctor: lookalike
    return DDP(model)


def make_data(n=480):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 24, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])

    ddp = setup_model(rank, num_classes=3)
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
