"""Random-feature projection stored as a plain tensor attribute, per-rank seeds.

Intent: a random-Fourier-feature regressor. The projection matrix `B` is
fixed (not trained), so the user stores it as an ordinary attribute. Seeds
are set to `seed + rank` on purpose so that the noise augmentation differs on
each rank, relying on "DDP broadcasts the model from rank 0 at construction"
to make the initial model identical.

What goes wrong: DDP's construction-time broadcast covers parameters and
registered buffers only. `self.B` is neither, so every rank keeps the matrix
drawn from its own seed. The ranks run the same trainable head on top of
*different* feature maps: per-rank losses are different functions, the
averaged gradient of the head mixes two incompatible feature spaces, and the
saved model (rank 0's `B` is not in the state_dict at all) cannot reproduce
what was trained. Parameters stay identical across ranks; nothing errors.

Public report: https://github.com/pytorch/pytorch/issues/10534 (a tensor not
registered on the module is not synced by DDP: "register the w1 in the Model
class as self.w1, in that way it's synced"); per-rank seeding pattern as in
https://github.com/karpathy/nanoGPT/issues/22 , and
https://github.com/speechbrain/speechbrain/pull/2814 ("each GPU will get a
different Quantizer" for a random-projection module DDP never broadcast).

Expected verdict (ideal checker): model state outside parameters/buffers
differs by rank: module attribute tensor `B` differs between rank 0 and rank
1 from construction (step 0), so forward outputs for the same input differ by
rank; trainable parameters stay identical. Cause: the `self.B = ...` line
marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~24-29 s. B checksum rank 0 = 0.066983, rank 1 =
19.187958; parameter checksum 0.42973501 on both ranks (identical).
"""
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class RFFRegressor(nn.Module):
    def __init__(self, in_dim=6, n_features=64, sigma=1.0):
        super().__init__()
        self.B = torch.randn(in_dim, n_features) * sigma  # doctor: cause
        self.head = nn.Linear(2 * n_features, 1)

    def forward(self, x):
        z = 2 * math.pi * x @ self.B
        return self.head(torch.cat([torch.sin(z), torch.cos(z)], dim=-1))


def make_data(n=512):
    g = torch.Generator().manual_seed(8)
    x = torch.rand(n, 6, generator=g)
    y = torch.sin(3 * x[:, :1]) * torch.cos(2 * x[:, 1:2])
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(1000 + rank)  # different augmentation noise on each rank

    model = DDP(RFFRegressor())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x + 0.01 * torch.randn_like(x)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.5f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f} B checksum {model.module.B.double().sum().item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
