"""OneCycleLR sized from the dataset's length, as on one process.

Intent: a one-cycle schedule over the run, stepped after every optimizer step, ported from a
single-GPU script that computed the steps of an epoch from the dataset.

What goes wrong: under a DistributedSampler each rank's loader yields half the batches the
dataset makes (2 ranks), so the schedule is sized for twice the steps the run takes: training ends
at the peak of the cycle's first half-way point, the learning rate never anneals. Nothing fails.

Public report: https://discuss.pytorch.org/t/onecyclelr-with-distributeddataparallel/ (steps per
epoch counted from the whole dataset under DDP), https://github.com/Lightning-AI/pytorch-lightning/
issues/5449 (schedulers sized without the world size).

Expected verdict (ideal checker): the schedule counts the whole dataset's batches; cause: the line
that computed steps_per_epoch (marked).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 2
BATCH = 16


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(640, 12, generator=g)
    dataset = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    steps_per_epoch = len(dataset) // BATCH  # doctor: cause
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, epochs=EPOCHS,
                                                    steps_per_epoch=steps_per_epoch)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
