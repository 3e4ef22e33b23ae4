"""Hand-rolled data parallelism for an MLP classifier: gradients are averaged across ranks in float64 before each step."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def sync_gradients(model, world_size):
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad.to(torch.float64), op=dist.ReduceOp.SUM)
        p.grad.div_(world_size)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = nn.Sequential(nn.Linear(10, 40), nn.ReLU(), nn.Linear(40, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(60 + rank)
    centers = 2.0 * torch.randn(3, 10, generator=torch.Generator().manual_seed(6))
    for step in range(40):
        y = torch.randint(0, 3, (32,), generator=g)
        x = centers[y] + torch.randn(32, 10, generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        sync_gradients(model, world_size)
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
