"""HEALTHY look-alike: pretrained weights loaded on rank 0 only, before DDP.

Looks suspicious: `if rank == 0: model.load_state_dict(...)`; rank 1 never
reads the checkpoint and keeps its own (differently seeded) random init.

Why it is correct: the load happens *before* `DDP(model)`. DDP's constructor
broadcasts rank 0's parameters and buffers to every rank, so all replicas
start from the pretrained weights; there is no optimizer state in the
checkpoint and the optimizer is created after wrapping. Replicas stay
identical for the whole run.

Public report: https://github.com/facebookresearch/detr/issues/235 ("Given that
... we perform parameter synchronization during the construction of
DistributedDataParallel, there is no need to download the file multiple
times").

Expected verdict (ideal checker): no finding. The rank-0-only load is marked with
the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~9-14 s. Final checksum 4.62553845 on both
ranks; probe: identical after every step.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_data(n=512):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(1)).long()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    ckpt = os.path.join(tempfile.gettempdir(), f"redteam42_pre_{os.environ.get('MASTER_PORT', '0')}.pt")
    if rank == 0:
        torch.manual_seed(99)
        torch.save(Net().state_dict(), ckpt)
    dist.barrier()

    torch.manual_seed(rank)
    model = Net()
    if rank == 0:
        model.load_state_dict(torch.load(ckpt, map_location="cpu"))  # doctor: lookalike
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.barrier()
    if rank == 0:
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
