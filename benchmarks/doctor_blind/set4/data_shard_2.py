import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset


def make_data(n=1024, seed=21):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x[:, 0, :4].mean((1, 2)) - x[:, 0, 4:].mean((1, 2)) > 0).long()
    y = y + 2 * (x[:, 0, :, :4].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 12, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(12, 24, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(24, 4)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(42)

    dataset = make_data()
    per_device_batch = 32
    shard_size = len(dataset) // world_size
    # scale the learning rate with the global batch size
    lr = 0.02 * (per_device_batch * world_size) / 32

    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    steps_per_epoch = shard_size // per_device_batch
    for epoch in range(3):
        perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(1000 + epoch))
        shard = perm[rank * shard_size:(rank + 1) * shard_size].tolist()
        loader = DataLoader(Subset(dataset, shard), batch_size=per_device_batch, shuffle=False, drop_last=True)
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} ({steps_per_epoch} steps) loss {loss.item():.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
