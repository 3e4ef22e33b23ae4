"""A cosine schedule over the run's steps, counted from the rank's own loader: correct.

The twin of cosine_length_from_dataset.py: T_max is `epochs * len(loader)`, and len(loader)
already counts only this rank's share of the batches, so the cosine ends with the run. Two epochs
of a loader whose batches the other count would also make a multiple of: the rule must tell them
apart by the epochs the loop runs, not by divisibility.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 2


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(400, 10, generator=g)
    train_set = TensorDataset(x, x @ torch.randn(10, 1, generator=g))
    sampler = DistributedSampler(train_set, shuffle=True, seed=1)
    loader = DataLoader(train_set, batch_size=20, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    total_steps = EPOCHS * len(loader)  # doctor: lookalike
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
