import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

EPOCHS = 1
BATCH_SIZE = 32


class RecordStream(IterableDataset):
    """Streams (features, label) records, e.g. from sharded record files."""

    def __init__(self, num_records=2048, dim=20, classes=4):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(num_records, dim, generator=g)
        w = torch.randn(dim, classes, generator=g)
        self.y = (self.x @ w).argmax(dim=1)

    def __iter__(self):
        info = get_worker_info()
        worker_id = 0 if info is None else info.id
        num_workers = 1 if info is None else info.num_workers
        for i in range(worker_id, len(self.x), num_workers):
            yield self.x[i], self.y[i]


def build_model():
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def train(rank, world_size):
    torch.manual_seed(0)
    model = DDP(build_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    stream = RecordStream()
    loader = DataLoader(stream, batch_size=BATCH_SIZE, num_workers=0)

    step = 0
    for epoch in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(rank, world_size)
    dist.destroy_process_group()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
