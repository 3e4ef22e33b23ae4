"""Optimizer built before the classifier head is replaced.

Intent: adapt a 10-class model to 3 classes: the model and its optimizer are
built, then `model.head` is swapped for a fresh `nn.Linear`, the model is
wrapped in DDP (after the swap, as recommended) and trained.

What goes wrong: the optimizer holds the OLD head's parameters, which are no
longer in the model and never get a gradient; the NEW head's parameters get
gradients (averaged by DDP, identical on both ranks) that no optimizer
applies. The head stays at its random init for the whole run while the
backbone adapts around it. Both ranks stay identical; nothing fails.

Expected verdict (ideal checker): parameters `head.weight` and `head.bias`
have gradients but are in no optimizer param group and never change; the
optimizer holds 2 tensors that are not module parameters. Cause: the optimizer
built from the parameters before the model was final (marked with the doctor
cause marker; the head replacement one line below is what it missed).

Plain torchrun (measured, CPU, gloo, torch 2.13): exit 0, 32 steps/rank, ~24 s.
Both ranks: backbone checksum 0.01758996, head checksum 0.82699215 before and
after training.
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
        self.backbone = nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU())
        self.head = nn.Linear(48, num_classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 20, generator=g)
    ds = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())
    sampler = DistributedSampler(ds, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # doctor: cause
    model.head = nn.Linear(48, 3)
    ddp = DDP(model)
    head0, step = sum(p.detach().double().sum().item() for p in model.head.parameters()), 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    bb = sum(p.detach().double().sum().item() for p in model.backbone.parameters())
    hd = sum(p.detach().double().sum().item() for p in model.head.parameters())
    print(f"[rank {rank}] {step} steps, backbone checksum {bb:.8f} head checksum {head0:.8f} -> {hd:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
