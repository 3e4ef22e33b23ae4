import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PER_DEVICE_BATCH = 16
GRAD_ACCUM = 2
EPOCHS = 4
LR = 2e-3
WARMUP_FRAC = 0.1


def make_data(n=1024, seed=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    y = torch.relu(x @ w).argmax(1)
    return TensorDataset(x, y)


def linear_warmup_decay(warmup, total):
    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return fn


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    ds = make_data()
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=PER_DEVICE_BATCH, sampler=sampler, drop_last=True)

    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 8)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    num_update_steps_per_epoch = math.ceil(len(loader) / GRAD_ACCUM)
    max_train_steps = EPOCHS * num_update_steps_per_epoch
    warmup_steps = int(WARMUP_FRAC * max_train_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(warmup_steps, max_train_steps))
    if rank == 0:
        print(f"{max_train_steps} optimizer steps, {warmup_steps} warmup", flush=True)

    completed = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / GRAD_ACCUM
            loss.backward()
            if (i + 1) % GRAD_ACCUM == 0 or i + 1 == len(loader):
                optimizer.step()
                optimizer.zero_grad()
                completed += 1
            scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} step {completed} loss {loss.item() * GRAD_ACCUM:.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
