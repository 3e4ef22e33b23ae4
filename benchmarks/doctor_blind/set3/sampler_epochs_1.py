"""Small CNN classifier on synthetic 8x8 images, trained with DDP and a DistributedSampler for several epochs."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class SmallCNN(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def make_dataset(n=384):
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 4, (n,), generator=g)
    images = 0.5 * torch.randn(n, 1, 8, 8, generator=g)
    for c in range(4):
        r, col = divmod(c, 2)
        images[labels == c, :, r * 4:(r + 1) * 4, col * 4:(col + 1) * 4] += 1.0
    return TensorDataset(images, labels)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(42)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=24, sampler=sampler, drop_last=True)

    model = DDP(SmallCNN())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    for epoch in range(4):
        sampler.set_epoch(epoch)
        running, steps = 0.0, 0
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            running += loss.item()
            steps += 1
        if rank == 0:
            print(f"epoch {epoch}: mean loss {running / steps:.4f} over {steps} steps")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
