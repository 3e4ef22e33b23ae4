"""MLP regressor trained with DDP; the loss averaged over all processes is logged every few steps."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(n=1024):
    g = torch.Generator().manual_seed(13)
    x = torch.rand(n, 6, generator=g) * 4 - 2
    y = (x[:, :1] * x[:, 1:2] - x[:, 2:3].cos()) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(6, 64), nn.SiLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.MSELoss()

    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            logged = loss.detach() / world_size
            dist.all_reduce(logged, op=dist.ReduceOp.SUM)
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} global loss {logged.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
