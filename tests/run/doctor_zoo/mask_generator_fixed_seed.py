"""Masked-feature model draws its masks from a module-owned generator with a fixed seed.

Intent: a small masked-autoencoder-style regressor hides half of the input
features and reconstructs them. For reproducibility the model owns a
`torch.Generator` seeded with a constant, so runs are repeatable and the
global RNG (used for dropout / data order) is left alone.

What goes wrong: every rank constructs the same generator with the same
seed and draws from it the same number of times per step, so rank 0 and rank
1 apply *identical* masks at every step (DDP never touches generators). With
2 ranks the global batch contains only half as many distinct mask patterns as
intended; with N ranks, 1/N. The augmentation diversity that data parallelism
should add is silently lost. Parameters stay identical; nothing errors.

Public report: https://github.com/huggingface/transformers/issues/37932 ("when
working with distributed training ... different ranks will shared the same
seed. If there are random data augmentation, they will be the same across
different ranks"); see also https://github.com/facebookresearch/deit/issues/150 .

Expected verdict (ideal checker): randomness that should differ across ranks
is identical: the masks drawn on rank 0 and rank 1 are equal at every step
from step 1 (per-rank mask checksums identical); parameters identical.
Cause: the generator-seeding line marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~18-29 s. Per-epoch mask checksums identical on
both ranks (2274995 and 2197617); parameter checksum 17.29934194 on both
ranks.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class MaskedFeatureModel(nn.Module):
    def __init__(self, d=16, hidden=64, mask_ratio=0.5, seed=0):
        super().__init__()
        self.mask_ratio = mask_ratio
        self.mask_gen = torch.Generator().manual_seed(seed)  # doctor: cause
        self.enc = nn.Sequential(nn.Linear(2 * d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        mask = (torch.rand(x.shape, generator=self.mask_gen) < self.mask_ratio).float()
        pred = self.enc(torch.cat([x * (1 - mask), mask], dim=-1))
        loss = ((pred - x) ** 2 * mask).sum() / mask.sum().clamp(min=1)
        return loss, mask


def make_data(n=512):
    g = torch.Generator().manual_seed(9)
    z = torch.randn(n, 4, generator=g)
    x = z @ torch.randn(4, 16, generator=g) + 0.05 * torch.randn(n, 16, generator=g)
    return TensorDataset(x)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(MaskedFeatureModel())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        mask_cs = 0.0
        for i, (x,) in enumerate(loader):
            loss, mask = model(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mask_cs += float((mask * torch.arange(mask.numel()).view_as(mask)).sum()) * (i + 1)
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f} mask checksum {mask_cs:.0f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
