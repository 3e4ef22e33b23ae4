"""Data-parallel training of an MLP regressor with a hand-written gradient all-reduce (no DDP wrapper)."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

BASE_SEED = 2024


def average_gradients(model, world_size):
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)

    # each process draws its own stream of training batches
    torch.manual_seed(BASE_SEED + rank)

    model = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 1))
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    true_w = torch.linspace(-1.0, 1.0, 12).unsqueeze(1)

    for step in range(40):
        x = torch.randn(32, 12)
        y = x @ true_w + 0.1 * torch.randn(32, 1)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        average_gradients(model, world_size)
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
