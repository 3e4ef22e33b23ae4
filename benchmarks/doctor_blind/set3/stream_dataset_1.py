"""MLP trained with DDP on records streamed from an IterableDataset."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


class RecordStream(IterableDataset):
    """Yields (features, label) records in file order, like reading a sharded log."""

    def __init__(self, rank, world_size, num_records=2560, dim=12, seed=17):
        self.rank = rank
        self.world_size = world_size
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(num_records, dim, generator=g)
        proj = torch.randn(dim, 3, generator=g)
        self.labels = (self.features @ proj).argmax(1)
        self.num_records = num_records

    def __iter__(self):
        for i in range(self.rank, self.num_records, self.world_size):
            yield self.features[i], self.labels[i]


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    stream = RecordStream(rank, world_size)
    loader = DataLoader(stream, batch_size=32)

    model = DDP(nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    seen = 0
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        seen += x.shape[0]
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    print(f"rank {rank} processed {seen} records")
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
