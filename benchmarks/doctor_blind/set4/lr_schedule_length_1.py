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

BATCH_SIZE = 32
EPOCHS = 5
MAX_LR = 0.1


def make_data(n=512, seed=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 6, 6, generator=g)
    y = (x[:, 0].mean((1, 2)) > x[:, 1].mean((1, 2))).long() + 2 * (x[:, 2, :3].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.classifier = nn.Linear(64, 4)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train_ds = make_data()
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_ds, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

    model = DDP(ConvNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=MAX_LR, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps_per_epoch = math.ceil(len(train_ds) / BATCH_SIZE)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=MAX_LR, total_steps=EPOCHS * steps_per_epoch, pct_start=0.25
    )

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        correct, seen = 0, 0
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            correct += (logits.argmax(1) == y).sum().item()
            seen += y.numel()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} acc {correct / seen:.3f} lr {scheduler.get_last_lr()[0]:.5f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
