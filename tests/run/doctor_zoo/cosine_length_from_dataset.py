"""A cosine schedule over "all the training steps", counted from the dataset.

Intent: decay the learning rate to zero over the run with CosineAnnealingLR stepped per batch,
T_max being the number of training steps, computed once from a config.

What goes wrong: the count is `epochs * len(train_set) // batch_size`, the steps of one process
reading the whole dataset. Each rank's DistributedSampler gives it half of those batches, so the
run ends with the cosine at half its course (the learning rate still at half its peak).

Public report: https://github.com/huggingface/transformers/issues/11485 (num_training_steps
computed without dividing by the number of processes), https://discuss.pytorch.org/t/
lr-scheduler-and-ddp-total-steps/ .

Expected verdict (ideal checker): the schedule counts the whole dataset's batches; cause: the line
that computed the total (marked).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(400, 10, generator=g)
    train_set = TensorDataset(x, x @ torch.randn(10, 1, generator=g))
    sampler = DistributedSampler(train_set, shuffle=True, seed=1)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    total_steps = args.epochs * len(train_set) // args.batch_size  # doctor: cause
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    for epoch in range(args.epochs):
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
