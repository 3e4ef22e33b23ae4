"""DDP with DataLoader(num_workers=2, persistent_workers=True) over 3 epochs. HEALTHY.

Mechanism (h): each rank keeps two worker processes alive across epochs
(idle between epochs, busy during them); sampler.set_epoch is called every
epoch. Child processes that outlive an epoch, and that sit idle while the main
thread is in a collective, are normal here. Exit code 0 on both ranks.

Drawn from: https://github.com/pytorch/pytorch/issues/82077 (comment: "I
resolved it after setting persistent_workers = True in the DataLoader ... the
workers will not be killed after the Dataset is exhausted each epoch").
"""
import os

import torch.distributed.nn  # noqa: F401
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n=600):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.linspace(-1, 1, 16)).unsqueeze(1)
    return TensorDataset(x, y)


def fit(rank, world):
    ds = make_data()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=1, drop_last=True)
    loader = DataLoader(ds, batch_size=25, sampler=sampler, num_workers=2,
                        persistent_workers=True, prefetch_factor=2)  # zoo: persistent-loader
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        total = 0.0
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        print(f"rank {rank} epoch {epoch} mean loss {total / len(loader):.4f}", flush=True)
        dist.barrier()  # zoo: epoch-barrier
    del loader  # shuts the persistent workers down


if __name__ == "__main__":
    dist.init_process_group("gloo")
    fit(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.barrier()
    dist.destroy_process_group()
