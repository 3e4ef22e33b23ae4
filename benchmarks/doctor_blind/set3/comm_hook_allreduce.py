"""MLP regressor trained with DDP using a custom gradient communication hook registered on the DDP model."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def allreduce_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    model.register_comm_hook(state=None, hook=allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)

    gen = torch.Generator().manual_seed(123 + rank)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(5))
    for step in range(40):
        x = torch.randn(64, 8, generator=gen)
        y = x @ w + 0.1 * torch.randn(64, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
