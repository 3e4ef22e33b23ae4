"""Hand-written LoRA adapter added to a model that is already wrapped in DDP.

Intent: LoRA fine-tuning. The model (seeded alike) is wrapped in DDP, then
`ddp.module.block.proj` is replaced by a `LoRALinear` (original linear frozen,
trainable `A` random, `B` zeros); the optimizer takes the trainable params.
`find_unused_parameters=True` is there because without it the frozen `proj`
crashes step 2 ("Expected to have finished reduction in the prior iteration").

What goes wrong: DDP reduces only the parameters present at construction. `A`
and `B` were never broadcast (per-rank generators) and their gradients are
never all-reduced: each rank trains its own adapter on its own data, while
`block.fc` and `head` are averaged and stay identical. Nothing fails.
Public report: https://github.com/pytorch/pytorch/issues/12603 (params added
after the DDP constructor are not reduced); PEFT adapter attached after the
(FSDP2) wrap, "N ranks train N different adapters":
https://github.com/huggingface/transformers/pull/48792 .

Expected verdict (ideal checker): module replaced after wrapping; `block.proj.A`
and `block.proj.B` are in no DDP bucket, never averaged, and differ across ranks
from step 0; other params identical. Cause: the line with the doctor cause marker.
Plain torchrun (measured, CPU, gloo, torch 2.13): exit 0, 32 steps/rank, ~13 s;
adapter checksum rank 0 -0.93226776, rank 1 0.19188940; rest -2.34960616 on both.
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
    ddp = DDP(nn.Sequential(OrderedDict(block=block, head=nn.Linear(32, 3))), find_unused_parameters=True)
    torch.manual_seed(1 + rank)  # adapter init: the ranks' generators differ
    ddp.module.block.proj = LoRALinear(ddp.module.block.proj, rank=4)  # doctor: cause
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
