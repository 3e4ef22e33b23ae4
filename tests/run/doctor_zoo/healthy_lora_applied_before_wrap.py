"""HEALTHY look-alike: hand-written LoRA adapter (per-rank random init) added before DDP.

Looks suspicious: `block.proj` is replaced by a `LoRALinear` (original linear
frozen, trainable `A` random, `B` zeros) whose `A` comes from a per-rank seed
(`1 + rank`), exactly as in `lora_applied_after_wrap.py`; the optimizer takes
only the trainable parameters.

Why it is correct: the replacement happens on the plain module *before*
`DDP(model)`. The constructor broadcasts rank 0's parameters (so both ranks
start from rank 0's adapter) and puts `A` and `B` in its buckets; the frozen
`proj` is left out of the reducer, so every reduced parameter gets a gradient
and no `find_unused_parameters` is needed. Adapter gradients are averaged and
the adapters stay identical.
Public report: https://github.com/pytorch/pytorch/issues/12603 (modify the
model, e.g. add adapters, before wrapping); PEFT-after-wrap variant:
https://github.com/huggingface/transformers/pull/48792 .

Expected verdict (ideal checker): no finding. The adapter replacement line is
marked with the doctor lookalike marker.
Plain torchrun (measured, CPU, gloo, torch 2.13): exit 0, 32 steps/rank, ~13 s;
adapter checksum -0.90827457 and rest -2.34827752 on both ranks.
"""
import os
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class LoRALinear(nn.Module):
    def __init__(self, base, rank=4, alpha=8.0):
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), alpha / rank
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.A.t() @ self.B.t())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(7))
    ds = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] * x[:, 2] > 0.3).long())
    sampler = DistributedSampler(ds, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    block = nn.Sequential(OrderedDict(fc=nn.Linear(16, 32), act=nn.ReLU(), proj=nn.Linear(32, 32), act2=nn.ReLU()))
    model = nn.Sequential(OrderedDict(block=block, head=nn.Linear(32, 3)))
    torch.manual_seed(1 + rank)  # adapter init differs per rank; DDP's broadcast below fixes it
    model.block.proj = LoRALinear(model.block.proj, rank=4)  # doctor: lookalike
    ddp = DDP(model)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.05)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    ad = sum(p.detach().double().sum().item() for p in (ddp.module.block.proj.A, ddp.module.block.proj.B))
    rest = sum(p.detach().double().sum().item() for p in ddp.parameters()) - ad
    print(f"[rank {rank}] {step} steps, adapter checksum {ad:.8f} rest checksum {rest:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
