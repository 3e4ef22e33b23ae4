"""Data-derived scale factor computed from each rank's own first batch.

Intent: as in latent-diffusion recipes, inputs are rescaled by
`scale_factor = 1 / std(first batch)` so that the model sees unit-variance
inputs. The factor is computed once, before training, from the first batch of
the (distributed) training loader and then applied to every batch.

What goes wrong: each rank computes the factor from its own first batch and
the value is never reduced or broadcast. Rank 0 and rank 1 therefore train
the *same* network (DDP keeps parameters in sync) on differently scaled
inputs: the per-rank losses are different functions, the averaged gradient
is a mixture of two objectives, and at inference time no single scale
matches what the model was trained with. Nothing diverges visibly;
parameters stay identical.

Public report: https://github.com/Project-MONAI/tutorials/issues/1458
("Currently, scale factor is computed for each rank for DDP in generative
model. It should be reduced across ranks to use the same scale factor.").

Expected verdict (ideal checker): a preprocessing constant that enters the
loss differs by rank (rank 0 and rank 1 scale factors differ, values printed),
so the per-rank training objectives differ from step 1; parameters remain
identical across ranks. Cause: the `scale_factor = ...` line marked with
the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~25 s. scale_factor rank 0 = 0.528259, rank 1 =
0.425996; final parameter checksum -1.65429042 on both ranks (identical).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n=512):
    g = torch.Generator().manual_seed(17)
    scale = torch.rand(n, 1, generator=g) * 3 + 0.5  # heterogeneous sample magnitudes
    x = torch.randn(n, 32, generator=g) * scale
    y = torch.tanh(x[:, :4].sum(1, keepdim=True) / 4)
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    first_x, _ = next(iter(loader))
    scale_factor = 1.0 / first_x.flatten().std().item()  # doctor: cause
    print(f"[rank {rank}] scale_factor {scale_factor:.6f}", flush=True)

    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x * scale_factor), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
