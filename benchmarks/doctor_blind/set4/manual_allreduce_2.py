import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def average_gradients(model, world_size):
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size


def broadcast_parameters(model, src=0):
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=src)


def make_shard(rank, world_size, n=1024, seed=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = (torch.sin(x[:, 0]) + x[:, 1] * x[:, 2] > 0).long()
    idx = torch.arange(rank, n, world_size)
    return x[idx], y[idx]


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(1234 + rank)

    x_local, y_local = make_shard(rank, world_size)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    broadcast_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    batch_size = 32
    steps_per_epoch = len(x_local) // batch_size
    for epoch in range(3):
        perm = torch.randperm(len(x_local))
        for s in range(steps_per_epoch):
            idx = perm[s * batch_size:(s + 1) * batch_size]
            loss = F.cross_entropy(model(x_local[idx]), y_local[idx])
            optimizer.zero_grad()
            loss.backward()
            average_gradients(model, world_size)
            optimizer.step()
        loss_t = loss.detach().clone()
        dist.all_reduce(loss_t)
        if rank == 0:
            print(f"epoch {epoch} ({steps_per_epoch} steps) mean loss {loss_t.item() / world_size:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
