"""MLP regressor sharded with FSDP2 (fully_shard) and trained with gradient-norm clipping."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def clip_grad_norm(parameters, max_norm):
    params = [p for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(total_norm, "full_tensor"):
        total_norm = total_norm.full_tensor()
    return total_norm


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    gen = torch.Generator().manual_seed(40 + rank)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    for step in range(30):
        x = torch.randn(32, 16, generator=gen)
        y = 3.0 * (x @ w) + 0.1 * torch.randn(32, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = clip_grad_norm(model.parameters(), max_norm=0.5)
        optimizer.step()
        if step % 10 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f} grad_norm {float(grad_norm):.3f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
